"""GPU-only checks (marked `gpu`, skipped on CPU): the CUDA-graph target step computes what the eager step does."""

import pytest
import torch

from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.spec_config import build_proposer, parse_spec_config
from draftsmith.models.target import TargetModel

pytestmark = pytest.mark.gpu


def test_graphed_steps_equal_eager_steps_on_fixture(fixture_target_dir, mt_bench_path, monkeypatch):
    from transformers import AutoTokenizer

    from draftsmith.inference.eval import load_prompts

    tokenizer = AutoTokenizer.from_pretrained(fixture_target_dir)
    graphed = TargetModel.from_pretrained(fixture_target_dir, dtype="float32", device="cuda")
    monkeypatch.setenv("DRAFTSMITH_CUDA_GRAPHS", "0")
    eager = TargetModel.from_pretrained(fixture_target_dir, dtype="float32", device="cuda")
    assert graphed._graphs_on and not eager._graphs_on
    prompts = load_prompts(mt_bench_path, tokenizer, limit=3)
    spec = parse_spec_config({"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 1,
                              "num_speculative_tokens": 3})
    for ids in prompts:
        prompt = torch.tensor([ids], device="cuda")
        outs = []
        for target in (graphed, eager):
            plain = SpeculativeGenerator(target, None, 0).generate(prompt, 64).token_ids
            spec_out = SpeculativeGenerator(target, build_proposer(spec, target), 3).generate(prompt, 64).token_ids
            assert plain == spec_out
            outs.append(plain)
        assert outs[0] == outs[1]
    assert graphed._graphs, "the graphed target captured no graph"


def test_graphed_eagle3_chain_equals_eager_and_stays_lossless(tmp_path, fixture_target_dir, mt_bench_path,
                                                              monkeypatch):
    from transformers import AutoTokenizer

    from draftsmith.inference.eval import load_prompts
    from test_eagle3_runtime import untrained_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(fixture_target_dir)
    target = TargetModel.from_pretrained(fixture_target_dir, dtype="float32", device="cuda")
    folder, _ = untrained_checkpoint(tmp_path / "drafter", target)
    spec = parse_spec_config({"method": "eagle3", "model": str(folder), "num_speculative_tokens": 3})
    graphed = build_proposer(spec, target)
    monkeypatch.setenv("DRAFTSMITH_CUDA_GRAPHS", "0")
    eager = build_proposer(spec, target)
    assert graphed._graphs_on and not eager._graphs_on
    for ids in load_prompts(mt_bench_path, tokenizer, limit=3):
        prompt = torch.tensor([ids], device="cuda")
        plain = SpeculativeGenerator(target, None, 0).generate(prompt, 48)
        a = SpeculativeGenerator(target, graphed, 3).generate(prompt, 48)
        b = SpeculativeGenerator(target, eager, 3).generate(prompt, 48)
        assert a.token_ids == b.token_ids == plain.token_ids
        assert a.metrics.to_dict() == b.metrics.to_dict()
    assert graphed._graphs, "the chain was never replayed as a graph"


def test_graphed_dflash_block_equals_eager_and_stays_lossless(tmp_path, fixture_target_dir, mt_bench_path,
                                                              monkeypatch):
    from transformers import AutoTokenizer

    from draftsmith.inference.eval import load_prompts
    from test_dflash import untrained_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(fixture_target_dir)
    target = TargetModel.from_pretrained(fixture_target_dir, dtype="float32", device="cuda")
    folder, _ = untrained_checkpoint(tmp_path / "drafter", target, learned_mask=True)
    spec = parse_spec_config({"method": "dflash", "model": str(folder), "num_speculative_tokens": 3})
    graphed = build_proposer(spec, target)
    monkeypatch.setenv("DRAFTSMITH_CUDA_GRAPHS", "0")
    eager = build_proposer(spec, target)
    assert graphed._graphs_on and not eager._graphs_on
    for ids in load_prompts(mt_bench_path, tokenizer, limit=3):
        prompt = torch.tensor([ids], device="cuda")
        plain = SpeculativeGenerator(target, None, 0).generate(prompt, 48)
        a = SpeculativeGenerator(target, graphed, 3).generate(prompt, 48)
        b = SpeculativeGenerator(target, eager, 3).generate(prompt, 48)
        assert a.token_ids == b.token_ids == plain.token_ids
        assert a.metrics.to_dict() == b.metrics.to_dict()
    assert graphed._graph is not None, "the graphed proposer captured no graph"
