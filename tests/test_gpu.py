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
