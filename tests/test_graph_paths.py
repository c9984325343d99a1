"""The CUDA-graph code paths, run on the CPU with a stand-in recorder whose replay re-runs the step into the
recorded output tensors: the shape-static steps, the buffers, the pooled caches kept across requests and the
graph keys must give token-for-token the eager outputs (tests/test_gpu.py runs real graphs on a GPU)."""

from __future__ import annotations

import pytest
import torch

from draftsmith import device as dev
from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.spec_config import build_proposer, parse_spec_config
from draftsmith.models.target import TargetModel


def _tensors(outputs):
    return [o for o in (outputs if isinstance(outputs, tuple) else (outputs,)) if o is not None]


def stand_in_capture(fn, warmup: int = 2):
    outputs = fn()

    def replay():
        for recorded, fresh in zip(_tensors(outputs), _tensors(fn())):
            recorded.copy_(fresh)

    return replay, outputs


@pytest.fixture
def recorded_graphs(monkeypatch):
    """Turn the graph paths on, on the CPU; yields the list of captures made."""
    captures = []

    def capture(fn, warmup=2):
        captures.append(fn)
        return stand_in_capture(fn, warmup)

    monkeypatch.setattr(dev, "graphs_supported", lambda device: True)
    monkeypatch.setattr(dev, "capture_graph", capture)
    return captures


def _drafter(method, folder, target):
    """A drafter folder whose weights are noisy enough that its drafts depend on every input (a freshly
    initialised DFlash drafter drafts nearly the same block wherever it stands)."""
    from safetensors.torch import load_file, save_file

    if method == "eagle3":
        from test_eagle3_runtime import untrained_checkpoint

        folder = untrained_checkpoint(folder, target)[0]
    elif method == "dflash":
        from test_dflash import untrained_checkpoint

        folder = untrained_checkpoint(folder, target, learned_mask=True)[0]
    else:
        from test_mtp import random_drafter, save_checkpoint

        folder = save_checkpoint(random_drafter(target, num_depths=3), folder)
    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    noise = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if t.is_floating_point():
            tensors[name] = t + 0.2 * torch.randn(t.shape, generator=noise)
    save_file(tensors, weights)
    return folder


@pytest.mark.parametrize("method, extra, k", [
    ("eagle3", {}, 3),
    ("eagle3", {"dynamic_tree": {"depth": 3, "top_k": 2}}, 6),  # tree verification: a graph with a tree mask
    ("dflash", {}, 3),
    ("mtp", {}, 3),
], ids=["eagle3-chain", "eagle3-tree", "dflash", "mtp"])
def test_graph_paths_decode_what_the_eager_paths_decode(method, extra, k, tmp_path, fixture_target_dir,
                                                        mt_bench_path, recorded_graphs):
    from transformers import AutoTokenizer

    from draftsmith.inference.eval import load_prompts

    with pytest.MonkeyPatch.context() as eager_only:
        eager_only.setattr(dev, "graphs_supported", lambda device: False)
        eager_target = TargetModel.from_pretrained(fixture_target_dir, dtype="float32", device="cpu")
    graphed_target = TargetModel.from_pretrained(fixture_target_dir, dtype="float32", device="cpu")
    assert graphed_target._graphs_on and not eager_target._graphs_on
    folder = _drafter(method, tmp_path / method, graphed_target)
    spec = parse_spec_config({"method": method, "model": str(folder), "num_speculative_tokens": k, **extra}, "cpu")
    graphed = SpeculativeGenerator(graphed_target, build_proposer(spec, graphed_target), k)
    with pytest.MonkeyPatch.context() as eager_only:
        eager_only.setattr(dev, "graphs_supported", lambda device: False)
        eager = SpeculativeGenerator(eager_target, build_proposer(spec, eager_target), k)
    plain = SpeculativeGenerator(eager_target, None, 0)
    drafts = {"graphed": [], "eager": []}  # every proposal: untrained drafters are rarely accepted, so outputs and
    for name, generator in (("graphed", graphed), ("eager", eager)):  # metrics alone would hide wrong drafts
        def recording(num_tokens, propose=generator.proposer.propose, seen=drafts[name]):
            proposal = propose(num_tokens)
            seen.append(proposal.token_ids.tolist())
            return proposal

        generator.proposer.propose = recording
    tokenizer = AutoTokenizer.from_pretrained(fixture_target_dir)
    for ids in load_prompts(mt_bench_path, tokenizer, limit=2):  # two requests: pooled caches are reused
        prompt = torch.tensor([ids])
        a, b = graphed.generate(prompt, 24), eager.generate(prompt, 24)
        assert a.token_ids == b.token_ids == plain.generate(prompt, 24).token_ids
        assert a.metrics.to_dict() == b.metrics.to_dict()
    assert drafts["graphed"] == drafts["eager"] and len(drafts["eager"]) > 10
    captured = len(recorded_graphs)
    assert graphed_target._graphs and captured > len(graphed_target._graphs), "the proposer recorded no graph"
    graphed.generate(torch.tensor([load_prompts(mt_bench_path, tokenizer, limit=1)[0]]), 24)
    assert len(recorded_graphs) == captured, "a repeated request recorded its graphs again"


def test_sampled_draft_chain_graph_equals_the_eager_chain(tmp_path, fixture_target_dir, mt_bench_path,
                                                          recorded_graphs):
    """draft_sample_method probabilistic: the graphed chain samples from Exp(1) draws made outside the graph, the
    eager chain from the same draws, so one seed gives the same drafts, draft distributions and outputs."""
    from transformers import AutoTokenizer

    from draftsmith.inference.eval import load_prompts
    from draftsmith.runtime.sampling import SamplingParams

    target = TargetModel.from_pretrained(fixture_target_dir, dtype="float32", device="cpu")
    folder = _drafter("eagle3", tmp_path / "eagle3", target)
    spec = parse_spec_config({"method": "eagle3", "model": str(folder), "num_speculative_tokens": 3,
                              "draft_sample_method": "probabilistic"}, "cpu")
    graphed = build_proposer(spec, target)
    with pytest.MonkeyPatch.context() as eager_only:
        eager_only.setattr(dev, "graphs_supported", lambda device: False)
        eager = build_proposer(spec, target)
    seen = {"graphed": [], "eager": []}
    for name, proposer in (("graphed", graphed), ("eager", eager)):
        def recording(num_tokens, propose=proposer.propose, seen=seen[name]):
            proposal = propose(num_tokens)
            seen.append((proposal.token_ids.clone(), proposal.draft_probs.clone()))
            return proposal

        proposer.propose = recording
    tokenizer = AutoTokenizer.from_pretrained(fixture_target_dir)
    sampling = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=5)
    for ids in load_prompts(mt_bench_path, tokenizer, limit=2):
        prompt = torch.tensor([ids])
        a = SpeculativeGenerator(target, graphed, 3).generate(prompt, 24, sampling=sampling)
        b = SpeculativeGenerator(target, eager, 3).generate(prompt, 24, sampling=sampling)
        assert a.token_ids == b.token_ids
        assert a.metrics.to_dict() == b.metrics.to_dict()
    assert len(seen["graphed"]) == len(seen["eager"]) > 10
    for (tokens_a, probs_a), (tokens_b, probs_b) in zip(seen["graphed"], seen["eager"]):
        assert torch.equal(tokens_a, tokens_b)
        torch.testing.assert_close(probs_a, probs_b)
    assert all(torch.allclose(p.sum(-1), torch.ones(())) for _, p in seen["graphed"])  # distributions
    assert any(key[0] == "chain" and key[2] == (0.8, 40, 0.9) for key in graphed._graphs._entries)


@pytest.mark.slow
def test_compiled_decoder_layers_decode_what_the_module_path_decodes(fixture_target_dir, mt_bench_path,
                                                                     recorded_graphs):
    """DRAFTSMITH_COMPILE=1 runs the graphed step's layers through one torch.compile'd function (Inductor's CPU
    backend here): plain and speculative decoding give the module path's tokens, and its logits to float32
    rounding."""
    from transformers import AutoTokenizer

    from draftsmith.inference.eval import load_prompts

    modules = TargetModel.from_pretrained(fixture_target_dir, dtype="float32", device="cpu")
    compiled = TargetModel(modules.model, compile_layers=True)
    assert compiled._compiled_layer is not None and modules._compiled_layer is None
    tokenizer = AutoTokenizer.from_pretrained(fixture_target_dir)
    prompt = torch.tensor([load_prompts(mt_bench_path, tokenizer, limit=1)[0]])
    spec = parse_spec_config({"method": "ngram", "prompt_lookup_max": 4, "num_speculative_tokens": 3}, "cpu")
    for target in (modules, compiled):
        target.outputs = [SpeculativeGenerator(target, None, 0).generate(prompt, 12).token_ids,
                          SpeculativeGenerator(target, build_proposer(spec, target), 3).generate(prompt, 12).token_ids]
    assert compiled.outputs == modules.outputs and compiled.outputs[0] == compiled.outputs[1]
    calls = []
    real = compiled._compiled_layer
    compiled._compiled_layer = lambda *args: calls.append(1) or real(*args)
    cache_a, cache_b = modules.new_cache(1, 64), compiled.new_cache(1, 64)
    for target, cache in ((modules, cache_a), (compiled, cache_b)):
        target.step(prompt[:, :5], cache)  # eager prefill, then a graphed (static) step of width 3
    logits_a = modules.step(prompt[:, 5:8], cache_a).logits
    logits_b = compiled.step(prompt[:, 5:8], cache_b).logits
    torch.testing.assert_close(logits_b, logits_a, rtol=1e-4, atol=1e-4)
    assert len(calls) >= compiled.num_layers


def test_a_failing_compile_falls_back_to_the_module_path(fixture_target_dir, mt_bench_path, recorded_graphs):
    """torch.compile can fail on a user's stack (Triton missing or mismatched): decoding warns once, drops the
    compiled layers and gives the module path's tokens."""
    from transformers import AutoTokenizer

    from draftsmith.inference.eval import load_prompts

    modules = TargetModel.from_pretrained(fixture_target_dir, dtype="float32", device="cpu")
    compiled = TargetModel(modules.model, compile_layers=True)

    def broken(*args):
        raise RuntimeError("triton: no such kernel\nmore detail")

    compiled._compiled_layer = broken
    prompt = torch.tensor([load_prompts(mt_bench_path, AutoTokenizer.from_pretrained(fixture_target_dir), limit=1)[0]])
    want = SpeculativeGenerator(modules, None, 0).generate(prompt, 10).token_ids
    with pytest.warns(UserWarning, match=r"DRAFTSMITH_COMPILE: torch.compile of the decoder layers failed "
                                         r"\(RuntimeError: triton: no such kernel\); continuing without it"):
        got = SpeculativeGenerator(compiled, None, 0).generate(prompt, 10).token_ids
    assert got == want and compiled._compiled_layer is None
