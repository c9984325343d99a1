"""One SGLang verify mode against draftsmith's DSpark exports, in its own process (test_sglang_dspark.py runs it).

    python sglang_dspark_job.py JOB.json OUT_DIR

JOB.json: {"mode": "static" | "cap-accept" | "compact", "exports": {name: folder}, "num_draft_tokens": {name: n},
"target_vocab_size": V, "target_num_layers": L}. For each export, SGLang 0.5.23's own code on a CPU: its HF config
reader (`get_config`), its model registry (architecture -> class), the model built as its loader builds it (default
dtype bf16), every parameter first filled with NaN, then `load_weights` on the export's tensors; its DSpark config
parser and runtime resolver (gamma, verify width, mask token), the layers a Qwen3 target would capture, and the
built heads. Writes OUT_DIR/result.json (per export: those settings, and the error `load_weights` raised, if any)
and OUT_DIR/<name>.safetensors (every SGLang parameter after loading, float32).

SGLANG_RAGGED_VERIFY_MODE is set before sglang is imported: `static` (SGLang's default) leaves the variable unset.
No forward pass: SGLang's attention needs GPU backends (and sgl_kernel for its CPU engine, not installed).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace


def main(job_path: str, out_dir: str) -> None:
    job = json.loads(Path(job_path).read_text())
    out = Path(out_dir)
    os.environ.pop("SGLANG_RAGGED_VERIFY_MODE", None)
    if job["mode"] != "static":
        os.environ["SGLANG_RAGGED_VERIFY_MODE"] = job["mode"]

    import torch
    from safetensors.torch import load_file, save_file

    # SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1) needs sgl_kernel, which has no CPU wheel here; without it the
    # rotary embedding picks vLLM's kernel. Its torch-native rotary is what the CPU engine would run.
    import sglang.srt.layers.rotary_embedding.base as rotary_base
    from sglang.srt.server_args import ServerArgs
    from sglang.test.parallel_groups import publish

    rotary_base._is_cpu = True
    first = next(iter(job["exports"].values()))
    publish(ServerArgs(model_path=first, device="cpu", skip_tokenizer_init=True), role="test")

    from sglang.srt.models.qwen3 import Qwen3ForCausalLM
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.speculative.dspark_components.dspark_config import (
        parse_dspark_draft_config,
        resolve_runtime_config,
    )
    from sglang.srt.speculative.ragged_verify import read_ragged_verify_mode
    from sglang.srt.utils.hf_transformers_utils import get_config

    torch.set_default_dtype(torch.bfloat16)
    results = {}
    for name, folder in job["exports"].items():
        cfg = get_config(folder, trust_remote_code=False)
        model_cls, arch = ModelRegistry.resolve_model_cls(cfg.architectures)
        model = model_cls(cfg)
        for param in model.parameters():
            param.data.fill_(float("nan"))  # what load_weights leaves alone stays NaN
        try:
            model.load_weights(list(load_file(str(Path(folder) / "model.safetensors")).items()))
            error = None
        except Exception as e:  # noqa: BLE001 - reported to the test, which asserts on it
            error = f"{type(e).__name__}: {e}"
        save_file({n: p.detach().float().contiguous() for n, p in model.named_parameters()},
                  str(out / f"{name}.safetensors"))

        parsed = parse_dspark_draft_config(draft_hf_config=cfg)
        runtime = resolve_runtime_config(draft_hf_config=cfg, speculative_num_draft_tokens=None,
                                         target_vocab_size=job["target_vocab_size"])
        served = resolve_runtime_config(draft_hf_config=cfg,
                                        speculative_num_draft_tokens=job["num_draft_tokens"][name],
                                        target_vocab_size=job["target_vocab_size"])
        # The runtime (spec_aux_hidden_state.py) resolves DFlash's ids, then takes DSpark's own when it has them,
        # and hands them to the target's set_dflash_layers_to_capture: SGLang's Qwen3 method, on a stand-in target.
        layer_ids = model.draft_config.resolve_target_layer_ids(target_num_layers=job["target_num_layers"],
                                                                draft_num_layers=cfg.num_hidden_layers)
        if parsed.target_layer_ids is not None:
            layer_ids = list(parsed.target_layer_ids)
        target = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True), model=SimpleNamespace())
        Qwen3ForCausalLM.set_dflash_layers_to_capture(target, layer_ids)
        head = model.confidence_head
        results[name] = {
            "verify_mode": read_ragged_verify_mode().value,
            "architecture": arch,
            "model_class": f"{model_cls.__module__}.{model_cls.__name__}",
            "load_error": error,
            "param_dtypes": {n: str(p.dtype) for n, p in model.named_parameters()},
            "num_hidden_layers": len(model.layers),
            "block_size": model.block_size,
            "gamma": model.gamma,
            "sample_from_anchor": model.sample_from_anchor,
            "num_context_features": model.num_context_features,
            "parsed": {"gamma": parsed.gamma, "target_layer_ids": parsed.target_layer_ids,
                       "mask_token_id": parsed.mask_token_id, "markov_rank": parsed.markov_rank,
                       "markov_head_type": parsed.markov_head_type},
            "runtime": {"gamma": runtime.gamma, "verify_num_draft_tokens": runtime.verify_num_draft_tokens,
                        "mask_token_id": runtime.mask_token_id},
            "served": {"num_draft_tokens": job["num_draft_tokens"][name], "gamma": served.gamma},
            "target_layer_ids": layer_ids,
            "layers_to_capture": target.model.layers_to_capture,
            "markov_class": type(model.markov_head).__name__,
            "markov_rank": model.markov_head.markov_rank,
            "confidence_head": None if head is None else {"with_markov": head.with_markov,
                                                          "in_features": head.proj.in_features},
        }
    (out / "result.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
