"""GPU-only checks (marked `gpu`, skipped on CPU): the CUDA-graph steps of the target and of each drafter compute what
the eager steps do (tests/test_graph_paths.py runs the same code paths on the CPU with a stand-in recorder)."""

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


@pytest.mark.parametrize("method, extra, k", [
    ("eagle3", {}, 3), ("eagle3", {"dynamic_tree": {"depth": 3, "top_k": 2}}, 6), ("dflash", {}, 3), ("mtp", {}, 3),
], ids=["eagle3-chain", "eagle3-tree", "dflash", "mtp"])
def test_graphed_drafter_steps_equal_eager_and_stay_lossless(method, extra, k, tmp_path, fixture_target_dir,
                                                             mt_bench_path, monkeypatch):
    from transformers import AutoTokenizer

    from draftsmith import device as dev
    from draftsmith.inference.eval import load_prompts
    from test_graph_paths import _drafter

    captures = []
    real_capture = dev.capture_graph
    monkeypatch.setattr(dev, "capture_graph", lambda fn, warmup=2: captures.append(fn) or real_capture(fn, warmup))
    tokenizer = AutoTokenizer.from_pretrained(fixture_target_dir)
    target = TargetModel.from_pretrained(fixture_target_dir, dtype="float32", device="cuda")
    folder = _drafter(method, tmp_path / method, target)
    spec = parse_spec_config({"method": method, "model": str(folder), "num_speculative_tokens": k, **extra})
    graphed = build_proposer(spec, target)
    monkeypatch.setenv("DRAFTSMITH_CUDA_GRAPHS", "0")
    eager = build_proposer(spec, target)
    assert graphed._graphs_on and not eager._graphs_on
    for ids in load_prompts(mt_bench_path, tokenizer, limit=3):
        prompt = torch.tensor([ids], device="cuda")
        plain = SpeculativeGenerator(target, None, 0).generate(prompt, 48)
        a = SpeculativeGenerator(target, graphed, k).generate(prompt, 48)
        b = SpeculativeGenerator(target, eager, k).generate(prompt, 48)
        assert a.token_ids == b.token_ids == plain.token_ids
        assert a.metrics.to_dict() == b.metrics.to_dict()
    assert len(captures) > len(target._graphs), "the proposer recorded no graph"


def test_graphed_sampled_draft_chain_equals_eager_on_gpu(tmp_path, fixture_target_dir, mt_bench_path, monkeypatch):
    """draft_sample_method probabilistic at temperature 0.8: the chain replayed as a CUDA graph (sampler's
    processing recorded in it) samples what the eager chain samples from the same seed."""
    from transformers import AutoTokenizer

    from draftsmith.inference.eval import load_prompts
    from draftsmith.runtime.sampling import SamplingParams
    from test_graph_paths import _drafter

    tokenizer = AutoTokenizer.from_pretrained(fixture_target_dir)
    target = TargetModel.from_pretrained(fixture_target_dir, dtype="float32", device="cuda")
    folder = _drafter("eagle3", tmp_path / "eagle3", target)
    spec = parse_spec_config({"method": "eagle3", "model": str(folder), "num_speculative_tokens": 3,
                              "draft_sample_method": "probabilistic"})
    graphed = build_proposer(spec, target)
    monkeypatch.setenv("DRAFTSMITH_CUDA_GRAPHS", "0")
    eager = build_proposer(spec, target)
    assert graphed._graphs_on and not eager._graphs_on
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=1)
    for ids in load_prompts(mt_bench_path, tokenizer, limit=3):
        prompt = torch.tensor([ids], device="cuda")
        a = SpeculativeGenerator(target, graphed, 3).generate(prompt, 48, sampling=sampling)
        b = SpeculativeGenerator(target, eager, 3).generate(prompt, 48, sampling=sampling)
        assert a.token_ids == b.token_ids
        assert a.metrics.to_dict() == b.metrics.to_dict()
    assert any(key[0] == "chain" for key in graphed._graphs._entries), "the sampled chain recorded no graph"


def test_compiled_decoder_layers_in_graphs_decode_like_the_module_path(fixture_target_dir, mt_bench_path):
    from transformers import AutoTokenizer

    from draftsmith.inference.eval import load_prompts

    modules = TargetModel.from_pretrained(fixture_target_dir, dtype="float32", device="cuda")
    compiled = TargetModel(modules.model, compile_layers=True)
    tokenizer = AutoTokenizer.from_pretrained(fixture_target_dir)
    spec = parse_spec_config({"method": "ngram", "prompt_lookup_max": 4, "num_speculative_tokens": 3})
    for ids in load_prompts(mt_bench_path, tokenizer, limit=2):
        prompt = torch.tensor([ids], device="cuda")
        want = SpeculativeGenerator(modules, None, 0).generate(prompt, 48).token_ids
        assert SpeculativeGenerator(compiled, None, 0).generate(prompt, 48).token_ids == want
        assert SpeculativeGenerator(compiled, build_proposer(spec, compiled), 3).generate(prompt, 48).token_ids == want
    assert compiled._graphs, "the compiled target recorded no graph"


def test_host_to_device_queues_the_copy_behind_running_kernels():
    """A plain host-to-device copy waits for every queued kernel (a host sync in the decode loop);
    `host_to_device` returns while they still run, and the copy still lands."""
    from draftsmith import device as dev

    a = torch.randn(8192, 8192, device="cuda")
    src = torch.arange(1000)
    drained = {}
    for name, copy in (("plain", lambda: src.to("cuda")), ("queued", lambda: dev.host_to_device(src, "cuda"))):
        for _ in range(20):  # a few hundred milliseconds of queued work
            a @ a
        copied = copy()
        drained[name] = torch.cuda.current_stream().query()  # the queue had run dry when the copy returned
        assert torch.equal(copied.cpu(), src)
    assert drained == {"plain": True, "queued": False}


@pytest.mark.xfail(reason="measured on three H200 machines over two sessions (torch 2.11): the values land, "
                          "but the call returns only once the queued kernels have run; the cause is not found", strict=False)
def test_device_to_host_async_returns_before_queued_kernels_and_lands_after_wait():
    """The collector's copies: queued behind running kernels (no host sync), correct once `wait()` returns."""
    from draftsmith import device as dev

    a = torch.randn(8192, 8192, device="cuda")
    src = torch.arange(100_000, device="cuda", dtype=torch.float32)
    dev.device_to_host_async([src])[1]()  # the first pinned block is an allocation that waits for the device
    for _ in range(20):
        a @ a
    (host,), wait = dev.device_to_host_async([src * 2])
    still_running = not torch.cuda.current_stream().query()
    wait()
    assert host.is_pinned() and torch.equal(host, torch.arange(100_000.0) * 2)
    assert still_running, "the copy waited for the queued kernels"


def test_blocked_ttt_attention_and_fused_loss_equal_the_reference_on_gpu():
    """The memory-linear EAGLE-3 training path on the accelerator, under bf16 autocast as training runs it: loss and
    gradients within bf16 tolerance of the reference path (whole S x S scores and logits), at 2 query blocks."""
    from test_ttt_memory import teacher_targets, tiny_drafter, ttt_batch, ttt_loss

    drafter = tiny_drafter(norm_before_fc=True, norm_output=True).cuda()
    aux, embeds, last_hidden, head, loss_mask = (x.cuda() for x in ttt_batch(s=64))
    teacher, in_draft = teacher_targets(last_hidden, head, drafter.t2d)
    results = []
    for blocked in (False, True):
        drafter.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if blocked:
                from draftsmith.models.eagle3.training import TTTOptions, apply_training_options

                apply_training_options(drafter, TTTOptions(query_block=32))
                loss, _ = drafter(aux, embeds, 4, loss_targets=dict(
                    teacher_draft_logits=teacher, teacher_in_draft=in_draft, loss_mask=loss_mask, chunk_size=50))
            else:
                loss, _ = ttt_loss(drafter.forward_ttt(aux, embeds, 4, query_block=64), teacher, in_draft, loss_mask)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in drafter.parameters() if p.grad is not None]))
    (ref_loss, ref_grads), (got_loss, got_grads) = results
    torch.testing.assert_close(got_loss, ref_loss, rtol=2e-2, atol=2e-2)
    assert len(got_grads) == len(ref_grads)
    for got, ref in zip(got_grads, ref_grads):
        assert (got - ref).norm() <= 5e-2 * ref.norm() + 1e-6
