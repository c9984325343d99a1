"""DSpark exports against SGLang 0.5.23's own DSpark loader (`make interop-sglang`, .venv-sglang).

Three tiny drafters are built here (random weights, every tensor distinct), each exported with `export_dspark` as a
user would (bf16): vanilla Markov head, gated Markov head, and no confidence head, with different block sizes,
layer ids, ranks and mask tokens so that a mix-up shows. For each of SGLang's verify modes (SGLANG_RAGGED_VERIFY_MODE
static, its default; cap-accept; compact) one process (sglang_dspark_job.py) reads every export with SGLang's code:
config reader, model registry, `Qwen3DSparkModel` and its `load_weights`, DSpark config parser and runtime resolver.
The tests then assert that

- SGLang resolves the architecture to its DSpark model and reads back our settings: gamma (the block size, also from
  the `--speculative-num-draft-tokens` our serve command gives), mask token, target layer ids (and the layers a Qwen3
  target captures: draftsmith's capture ids), Markov rank and head type, sample_from_anchor;
- every SGLang parameter equals the training checkpoint's tensor in bf16 (fused qkv_proj = cat(q, k, v),
  gate_up_proj = cat(gate, up)), none is left unloaded (all were NaN before loading), and every tensor of ours is
  used, the confidence head's only where SGLang builds it (not in static mode);
- outside static mode SGLang refuses the export without a confidence head, with the message our exporter's warning
  announces.

Not proven: a forward pass or generation (SGLang's attention needs GPU backends; its CPU engine needs sgl_kernel).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("DRAFTSMITH_INTEROP_SGLANG") != "1",
                                reason="SGLang interop: `make interop-sglang` (its own venv, .venv-sglang)")

V, H, TARGET_LAYERS = 256, 64, 6
VARIANTS = {  # name -> DsparkDrafterConfig.from_target keywords
    "vanilla": dict(block_size=4, target_layer_ids=[0, 2, 4], mask_token_id=7, markov_rank=8,
                    markov_head="vanilla", confidence_head=True),
    "gated": dict(block_size=6, target_layer_ids=[1, 4], mask_token_id=11, markov_rank=12,
                  markov_head="gated", confidence_head=True),
    "no_confidence": dict(block_size=3, target_layer_ids=[1, 2, 3], mask_token_id=5, markov_rank=8,
                          markov_head="vanilla", confidence_head=False),
}
MODES = ("static", "cap-accept", "compact")
SGLANG_REFUSAL = "DSpark confidence head is enabled but the checkpoint is missing"
FUSED = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                       "self_attn.v_proj.weight"),
         "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}
MATRIX: list[dict] = []  # printed by conftest.py after the run


def _drafter_checkpoint(folder: Path, name: str, seed: int):
    """A draftsmith training checkpoint (config.json + model.safetensors) with seeded random weights."""
    from transformers import Qwen3Config

    from draftsmith.models.checkpoint import save_safetensors_atomic, write_json_atomic
    from draftsmith.models.dspark.config import DsparkDrafterConfig
    from draftsmith.models.dspark.model import DsparkDrafter

    target = Qwen3Config(vocab_size=V, hidden_size=H, num_hidden_layers=TARGET_LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, head_dim=16)
    config = DsparkDrafterConfig.from_target(target, num_layers=2, target_name_or_path="org/target",
                                             **VARIANTS[name])
    g = torch.Generator().manual_seed(seed)
    tensors = {k: (torch.randn(v.shape, generator=g) * 0.5 + 1.0 if k.endswith("norm.weight")
                   else torch.randn(v.shape, generator=g) * 0.1)
               for k, v in DsparkDrafter(config).state_dict().items() if not k.startswith("rotary_emb.")}
    folder.mkdir(parents=True)
    save_safetensors_atomic(tensors, folder / "model.safetensors")
    write_json_atomic(config.to_dict(), folder / "config.json")
    return config, tensors


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """name -> (draftsmith config, checkpoint tensors, ExportResult)."""
    from draftsmith.models.dspark.export import export_dspark

    root = tmp_path_factory.mktemp("dspark")
    out = {}
    for seed, name in enumerate(VARIANTS):
        config, tensors = _drafter_checkpoint(root / f"{name}-ckpt", name, seed)
        out[name] = (config, tensors, export_dspark(root / f"{name}-ckpt", root / name))  # bf16, as shipped
    return out


@pytest.fixture(scope="module")
def sglang(exports, tmp_path_factory):
    """mode -> (result.json of the job, its folder); one SGLang process per mode, run once."""
    runs = {}

    def run(mode: str):
        if mode not in runs:
            folder = tmp_path_factory.mktemp(f"sglang-{mode}")
            tokens = {}
            for name, (_, _, result) in exports.items():
                command = result.serve_commands["SGLang"]  # what our export tells a user to run
                tokens[name] = int(re.search(r"--speculative-num-draft-tokens (\d+)", command).group(1))
            job = {"mode": mode, "exports": {n: str(r.out_dir) for n, (_, _, r) in exports.items()},
                   "num_draft_tokens": tokens, "target_vocab_size": V, "target_num_layers": TARGET_LAYERS}
            (folder / "job.json").write_text(json.dumps(job))
            proc = subprocess.run([sys.executable, str(Path(__file__).with_name("sglang_dspark_job.py")),
                                   str(folder / "job.json"), str(folder)], capture_output=True, text=True,
                                  timeout=600)
            assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
            runs[mode] = json.loads((folder / "result.json").read_text()), folder
            for name, row in runs[mode][0].items():
                MATRIX.append({"mode": mode, "export": name, "loads": row["load_error"] is None,
                               "confidence_head": row["confidence_head"] is not None,
                               "refused": (row["load_error"] or "")[:160] or None})
        return runs[mode]

    return run


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("mode", MODES)
def test_sglang_reads_our_runtime_settings(sglang, exports, mode, name):
    config, _, result = exports[name]
    row = sglang(mode)[0][name]
    assert row["verify_mode"] == mode
    assert row["architecture"] == "Qwen3DSparkModel"
    assert row["model_class"] == "sglang.srt.models.dspark.Qwen3DSparkModel"
    assert row["num_hidden_layers"] == config.num_hidden_layers
    b = config.block_size
    assert row["block_size"] == row["gamma"] == row["parsed"]["gamma"] == b
    assert row["runtime"] == {"gamma": b, "verify_num_draft_tokens": b + 1, "mask_token_id": config.mask_token_id}
    assert row["served"] == {"num_draft_tokens": b + 1, "gamma": b}  # our serve command, as SGLang resolves it
    assert row["parsed"]["mask_token_id"] == config.mask_token_id
    assert row["parsed"]["target_layer_ids"] == row["target_layer_ids"] == config.target_layer_ids
    assert row["num_context_features"] == len(config.target_layer_ids)
    assert row["layers_to_capture"] == config.aux_layer_ids  # a Qwen3 target captures what the drafter trained on
    assert row["parsed"]["markov_rank"] == row["markov_rank"] == config.markov_rank
    assert row["parsed"]["markov_head_type"] == config.markov_head
    assert row["markov_class"] == {"vanilla": "VanillaMarkov", "gated": "GatedMarkovHead"}[config.markov_head]
    assert row["sample_from_anchor"] is True  # draftsmith's slot convention
    if mode == "static":
        assert row["confidence_head"] is None  # SGLang's default builds none, whatever the config says
    elif config.confidence_head:  # over [h; markov_w1[x]], as ours
        assert row["confidence_head"] == {"with_markov": True, "in_features": H + config.markov_rank}
    else:  # built anyway, from h alone (our confidence_head_with_markov: false); then refused (test below)
        assert row["confidence_head"] == {"with_markov": False, "in_features": H}


# Outside static mode SGLang refuses the export without a confidence head (the last test).
@pytest.mark.parametrize("mode,name", [(m, n) for m in MODES for n in VARIANTS
                                       if m == "static" or VARIANTS[n]["confidence_head"]])
def test_sglang_loads_every_tensor_as_ours(sglang, exports, mode, name):
    from safetensors.torch import load_file

    config, ours, _ = exports[name]
    result, folder = sglang(mode)
    row = result[name]
    assert row["load_error"] is None, row["load_error"]
    theirs = load_file(str(folder / f"{name}.safetensors"))
    unloaded = sorted(n for n, t in theirs.items() if torch.isnan(t).any())
    assert not unloaded, f"SGLang parameters load_weights left unset: {unloaded}"
    used = set()
    for param, value in theirs.items():
        prefix, fused = next(((param.removesuffix(k), parts) for k, parts in FUSED.items() if param.endswith(k)),
                             (None, None))
        sources = [prefix + p for p in fused] if fused else [param]
        missing = [s for s in sources if s not in ours]
        assert not missing, f"SGLang parameter {param} has no tensor in our export ({missing})"
        expected = torch.cat([ours[s] for s in sources]).to(torch.bfloat16).float()  # the export's bf16
        assert value.shape == expected.shape and torch.equal(value, expected), param
        used.update(sources)
    ignored = set(ours) - used
    if mode == "static":  # no confidence head built: its tensors are skipped (SGLang's load_weights)
        assert ignored == {n for n in ours if n.startswith("confidence_head.")}
    else:
        assert not ignored, f"tensors of ours SGLang does not load: {sorted(ignored)}"
    # built as SGLang's loader builds a bf16 model; its confidence head is float32 by design
    assert {d for n, d in row["param_dtypes"].items() if not n.startswith("confidence_head.")} == {"torch.bfloat16"}


@pytest.mark.parametrize("mode", [m for m in MODES if m != "static"])
def test_sglang_refuses_no_confidence_head_outside_static_mode(sglang, exports, mode):
    """What our exporter warns about (check_dspark_export) is what SGLang does."""
    config, ours, result = exports["no_confidence"]
    assert not any(n.startswith("confidence_head.") for n in ours)
    error = sglang(mode)[0]["no_confidence"]["load_error"]
    assert error is not None and SGLANG_REFUSAL in error, error
    missing = re.search(r"missing (\[.*?\])", error).group(1)
    assert all(n.startswith("confidence_head.proj.") for n in ast.literal_eval(missing)), missing
    warning = [w for w in result.warnings if "SGLANG_RAGGED_VERIFY_MODE" in w]
    assert warning and "confidence_head.proj.*" in warning[0] and "static" in warning[0], result.warnings
    for name in ("vanilla", "gated"):  # the exports with a head neither warn nor are refused
        assert not [w for w in exports[name][2].warnings if "SGLANG_RAGGED_VERIFY_MODE" in w]
        assert sglang(mode)[0][name]["load_error"] is None
