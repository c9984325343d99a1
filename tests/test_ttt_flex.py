"""EAGLE-3's TTT attention through FlexAttention (kernels/ttt_attention.py) against the plain-torch reference.

On the CPU, FlexAttention runs eagerly and without a backward pass: its values are checked here (causal, packed doc
masks, grouped-query heads, several TTT steps, lengths across block edges), and the gradients of the way the
diagonal keys join it (through its log-sum-exp) with a plain-torch stand-in for the kernel. The compiled kernel's
values and gradients are checked on the GPU (tests marked `gpu`), in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from draftsmith import device as dev
from draftsmith.kernels import ttt_attention as attention
from draftsmith.kernels.ttt_attention import (
    flex_block_mask,
    resolve_backend,
    ttt_attention,
    ttt_attention_flex,
    ttt_attention_reference,
)

# eager FlexAttention on the CPU says it materializes the scores: the CPU tests mean it to
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def inputs(b=2, h=4, kv=2, s=37, hd=16, steps=3, seed=0, dtype=torch.float32, device="cpu", grad=False):
    """q (B, h, S, hd); keys0, values0 and `steps` diagonal keys and values (B, kv, S, hd)."""
    g = torch.Generator().manual_seed(seed)

    def t(heads):
        return torch.randn(b, heads, s, hd, generator=g).to(device, dtype).requires_grad_(grad)

    return t(h), t(kv), t(kv), [t(kv) for _ in range(steps)], [t(kv) for _ in range(steps)]


def packed_docs(b, s, seed=0):
    """(B, S) sample ids of packed rows: runs of random lengths (four samples a row; with B > 1 the first row is one
    sample)."""
    g = torch.Generator().manual_seed(seed)
    docs = torch.zeros(b, s, dtype=torch.long)
    for row in range(1 if b > 1 else 0, b):
        cuts = torch.randint(1, s, (3,), generator=g).sort().values
        for cut in cuts:
            docs[row, cut:] += 1
    return docs


def dense_flex_with_lse(q, k, v, block_mask, scale, doc_ids=None):
    """What FlexAttention computes, in plain torch with autograd: (out, log-sum-exp) of the causal (and doc-masked)
    part alone."""
    s = q.shape[-2]
    k, v = attention._repeat_kv(k, q.shape[1]), attention._repeat_kv(v, q.shape[1])
    visible = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
    if doc_ids is not None:
        visible = visible & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
    scores = ((q @ k.transpose(-1, -2)) * scale).float().masked_fill(~visible, float("-inf"))
    return (torch.softmax(scores, -1).to(q.dtype) @ v), torch.logsumexp(scores, -1)


# ---- the grid ------------------------------------------------------------------------------------------------
def test_the_attention_definition_written_as_a_grid():
    """S = 3, one earlier step, one head of dimension 1 with q = k = 1 and scale 0 (every visible score is 0, so the
    output is the mean of the visible values). Step-0 values 1, 2, 4 and diagonal values 10, 20, 40; position 2 of
    a packed row starts a second sample:

        query  sees step-0 keys   and its diagonal key   mean (one sample)   mean (docs 0 0 1)
        t=0    k0_0               k1_0                   (1 + 10) / 2        (1 + 10) / 2
        t=1    k0_0 k0_1          k1_1                   (1 + 2 + 20) / 3    (1 + 2 + 20) / 3
        t=2    k0_0 k0_1 k0_2     k1_2                   (7 + 40) / 4        (4 + 40) / 2
    """
    ones = torch.ones(1, 1, 3, 1)
    values0 = torch.tensor([1.0, 2.0, 4.0]).view(1, 1, 3, 1)
    diag_values = torch.tensor([10.0, 20.0, 40.0]).view(1, 1, 3, 1)
    one_sample = torch.tensor([11 / 2, 23 / 3, 47 / 4]).view(1, 1, 3, 1)
    packed = torch.tensor([11 / 2, 23 / 3, 44 / 2]).view(1, 1, 3, 1)
    docs = torch.tensor([[0, 0, 1]])
    for doc_ids, want in ((None, one_sample), (docs, packed)):
        got = ttt_attention_reference(ones, ones, values0, [ones], [diag_values], 0.0, doc_ids)
        torch.testing.assert_close(got, want)
        mask = flex_block_mask(doc_ids, 1, 3, "cpu")
        torch.testing.assert_close(ttt_attention_flex(ones, ones, values0, [ones], [diag_values], 0.0, mask), want)


# ---- FlexAttention's values on the CPU (eager, no backward there) -------------------------------------------------
@pytest.mark.parametrize("steps", [0, 1, 3])
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
@pytest.mark.parametrize("heads, kv, s", [(4, 4, 37), (4, 2, 37), (6, 2, 200), (4, 1, 129)],
                         ids=["mha", "gqa", "gqa-2-blocks", "mqa-block-edge"])
def test_flex_attention_equals_the_reference_on_the_cpu(steps, packed, heads, kv, s):
    q, k0, v0, dks, dvs = inputs(b=2, h=heads, kv=kv, s=s, steps=steps)
    docs = packed_docs(2, s) if packed else None
    want = ttt_attention_reference(q, k0, v0, dks, dvs, 0.3, docs)
    got = ttt_attention_flex(q, k0, v0, dks, dvs, 0.3, flex_block_mask(docs, 2, s, "cpu"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_every_step_hands_on_one_layout():
    """The unroll's compiled second half guards on its input's strides: FlexAttention's output takes q's layout
    (RoPE'd projections are (B, S, h, hd) transposed), the joined steps' a contiguous one. Step 0 differing
    recompiled that half in the first training step (the recompile log on an H100)."""
    def as_projected(x):  # (B, h, S, hd) laid out as (B, S, h, hd), as a projection's view is
        return x.transpose(1, 2).contiguous().transpose(1, 2)

    q, k0, v0, dks, dvs = inputs(steps=2)
    q, k0, v0, dks, dvs = as_projected(q), as_projected(k0), as_projected(v0), dks, dvs
    mask = flex_block_mask(None, 2, q.shape[2], "cpu")
    layouts = {ttt_attention_flex(q, k0, v0, dks[:n], dvs[:n], 0.3, mask).stride() for n in range(3)}
    layouts.add(ttt_attention_reference(q, k0, v0, dks, dvs, 0.3).stride())
    assert len(layouts) == 1, layouts


def test_the_kernel_takes_autocasts_mixed_dtypes_in_the_reference_dtype(monkeypatch):
    """Under autocast q and k leave RoPE in float32 and v its Linear in bfloat16; FlexAttention's backward refuses
    mixed dtypes (seen on the GPU), so all three enter the kernel in the autocast dtype, as the reference's
    matmuls run."""
    seen = []

    def kernel(q, k, v, block_mask, scale):
        seen.append((q.dtype, k.dtype, v.dtype))
        return dense_flex_with_lse(q, k, v, block_mask, scale)

    monkeypatch.setattr(attention, "_flex_with_lse", kernel)
    q, k, v, _, _ = inputs(steps=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention.flex_with_lse(q, k, v.bfloat16(), None, 0.25)
    assert seen == [(torch.bfloat16,) * 3] and out.dtype == torch.bfloat16
    out32, _ = attention.flex_with_lse(q, k, v, None, 0.25)  # no autocast: q's dtype, as given
    assert seen[-1] == (torch.float32,) * 3
    torch.testing.assert_close(out.float(), out32, atol=3e-2, rtol=3e-2)


def test_the_blocked_reference_takes_grouped_keys():
    """Keys and values of kv < h heads give what the same keys repeated to h heads give, blocked or not."""
    q, k0, v0, dks, dvs = inputs(h=6, kv=2, s=40, steps=2)
    rep = attention._repeat_kv
    want = ttt_attention_reference(q, rep(k0, 6), rep(v0, 6), [rep(k, 6) for k in dks], [rep(v, 6) for v in dvs], 0.4)
    torch.testing.assert_close(ttt_attention_reference(q, k0, v0, dks, dvs, 0.4), want)
    torch.testing.assert_close(ttt_attention(q, k0, v0, dks, dvs, 0.4, query_block=16), want)


# ---- the join through the log-sum-exp: gradients on the CPU ------------------------------------------------------
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_diagonal_join_has_the_reference_gradients(packed, dtype, monkeypatch):
    """ttt_attention_flex with a plain-torch (out, lse) in place of the kernel: values and gradients of every input
    (the kernel's part reaches q, keys0 and values0 through both its output and its log-sum-exp)."""
    q, k0, v0, dks, dvs = inputs(h=6, kv=2, s=45, steps=3, grad=True, dtype=dtype)
    docs = packed_docs(2, 45, seed=3) if packed else None
    monkeypatch.setattr(attention, "flex_with_lse",
                        lambda q, k, v, mask, scale: dense_flex_with_lse(q, k, v, mask, scale, docs))
    leaves = [q, k0, v0, *dks, *dvs]
    weights = torch.randn(2, 6, 45, 16, generator=torch.Generator().manual_seed(5)).to(dtype)
    want = ttt_attention_reference(q, k0, v0, dks, dvs, 0.3, docs)
    want_grads = torch.autograd.grad((want.float() * weights).sum(), leaves)
    got = ttt_attention_flex(q, k0, v0, dks, dvs, 0.3, None)
    got_grads = torch.autograd.grad((got.float() * weights).sum(), leaves)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got, want, **tol)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, **tol)


def test_the_kernel_call_traces_as_one_graph():
    """What the GPU compiles (`_flex_with_lse` under torch.compile, fullgraph: no eager fallback that would keep
    S x S scores) traces whole on the CPU too, and the traced call computes what the eager one does."""
    torch._dynamo.reset()
    traced = torch.compile(attention._flex_with_lse, fullgraph=True, backend="eager")
    for s, docs in ((37, None), (200, packed_docs(2, 200))):
        q, k0, v0, _, _ = inputs(h=6, kv=2, s=s, steps=0)
        mask = flex_block_mask(docs, 2, s, "cpu")
        for got, want in zip(traced(q, k0, v0, mask, 0.3), attention._flex_with_lse(q, k0, v0, mask, 0.3)):
            torch.testing.assert_close(got, want)


# ---- selection -----------------------------------------------------------------------------------------------
def test_the_backend_is_chosen_by_the_device_and_forced_by_the_key(monkeypatch):
    assert resolve_backend("auto", "cpu", 64) == "reference"
    assert resolve_backend("reference", "cpu", 64) == "reference"
    with pytest.raises(ValueError, match="training.ttt_attention=auto or reference"):
        resolve_backend("flex", "cpu", 64)
    with pytest.raises(ValueError, match="one of auto, flex, reference"):
        resolve_backend("triton", "cpu", 64)
    monkeypatch.setattr(dev.importlib.util, "find_spec", lambda name: object())  # Triton "installed"
    assert dev.compiled_flex_attention("cuda") and not dev.compiled_flex_attention("npu")
    assert resolve_backend("auto", "cuda", 64) == "flex" == resolve_backend("flex", "cuda:0", 128)
    assert resolve_backend("reference", "cuda", 64) == "reference"
    assert resolve_backend("auto", "cuda", 8) == "reference"  # too narrow for Triton's matrix products
    monkeypatch.setenv("DRAFTSMITH_FLEX_ATTENTION", "0")
    assert resolve_backend("auto", "cuda", 64) == "reference"
    monkeypatch.delenv("DRAFTSMITH_FLEX_ATTENTION")
    monkeypatch.setattr(dev.importlib.util, "find_spec", lambda name: None)  # no Triton
    assert resolve_backend("auto", "cuda", 64) == "reference"


def test_the_training_key_reaches_the_drafter(fixture_target_dir):
    from draftsmith.config import recipe_from_dict
    from draftsmith.models.eagle3.training import Eagle3Method
    from draftsmith.models.target import TargetModel

    target = TargetModel.from_pretrained(fixture_target_dir, dtype="float32", device="cpu")

    def recipe(value):
        return recipe_from_dict({"model": {"target": str(fixture_target_dir)}, "data": {"path": "x.jsonl"},
                                 "output_dir": "unused", "training": {"ttt_attention": value}})

    method = Eagle3Method(recipe("auto"), target)
    vocab = target.vocab_size
    d2t = torch.zeros(method.draft_vocab_size, dtype=torch.long)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[: method.draft_vocab_size] = True
    drafter = method.build_drafter(d2t, t2d)
    method.apply_training_options(drafter)
    assert drafter.ttt_kernels.options.attention == "reference"  # the CPU
    with pytest.raises(ValueError, match="ttt_attention=flex needs a CUDA or ROCm GPU"):
        Eagle3Method(recipe("flex"), target)


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
def test_the_drafter_unrolls_the_same_with_either_backend(packed):
    """forward_ttt with ttt_attention "flex" (eager on the CPU, no gradient) gives the reference's step logits."""
    from draftsmith.models.eagle3.training import TTTOptions, apply_training_options
    from test_ttt_memory import tiny_drafter, ttt_batch

    drafter = tiny_drafter(norm_before_fc=True)
    aux, embeds, *_ = ttt_batch(s=40)
    docs = packed_docs(3, 40, seed=1) if packed else None
    with torch.no_grad():
        want = drafter.forward_ttt(aux, embeds, 4, doc_ids=docs)
        apply_training_options(drafter, TTTOptions(attention="flex"))
        got = drafter.forward_ttt(aux, embeds, 4, doc_ids=docs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ---- the compiled kernel on the GPU ---------------------------------------------------------------------------
@pytest.fixture
def compiles(monkeypatch):
    """Room for one compiled kernel per dtype, head size and mask kind these tests try (a training run needs one or
    two: the first shape, then one for every length), and a failure rather than eager FlexAttention past it."""
    import torch._dynamo.config as dynamo_config

    monkeypatch.setattr(dynamo_config, "recompile_limit", 64)
    if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):
        monkeypatch.setattr(dynamo_config, "fail_on_recompile_limit_hit", True)


def relative_error(got, want):
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))


def values_and_grads(fn, leaves, weights):
    out = fn()
    return [out.detach(), *torch.autograd.grad((out.float() * weights).sum(), leaves)]


@pytest.mark.gpu
@pytest.mark.parametrize("b, h, kv, s, hd, steps, packed, dtype", [
    (2, 8, 2, 300, 64, 3, False, torch.float32),  # GQA, a length across block edges
    (2, 8, 2, 300, 64, 3, False, torch.bfloat16),
    (1, 6, 6, 1000, 64, 6, True, torch.float32),  # the fixture's heads, a packed row, TTT 7's last step
    (1, 6, 6, 1000, 64, 6, True, torch.bfloat16),
    (2, 32, 8, 2048, 128, 6, False, torch.bfloat16),  # the 8B shape's drafter
    (3, 4, 2, 129, 16, 0, True, torch.bfloat16),  # step 0 alone, the narrowest head
], ids=["gqa-300-fp32", "gqa-300-bf16", "packed-1000-fp32", "packed-1000-bf16", "8b-2048-bf16", "step0-129-bf16"])
def test_compiled_flex_attention_equals_the_reference_on_gpu(b, h, kv, s, hd, steps, packed, dtype, compiles):
    """Values and gradients of every input. float32: within 5e-3 of the reference (relative norm; TF32, if it is
    on, stays inside it). bfloat16: no further from the float32 reference than the bf16 reference itself is (times
    2, plus 1e-2)."""
    device = dev.get_device("cuda")
    q, k0, v0, dks, dvs = inputs(b, h, kv, s, hd, steps, seed=1, dtype=dtype, device=device, grad=True)
    leaves = [q, k0, v0, *dks, *dvs]
    docs = packed_docs(b, s, seed=2).to(device) if packed else None
    weights = torch.randn(b, h, s, hd, generator=torch.Generator().manual_seed(3)).to(device)
    scale = hd ** -0.5
    mask = flex_block_mask(docs, b, s, device)
    got = values_and_grads(lambda: ttt_attention_flex(q, k0, v0, dks, dvs, scale, mask), leaves, weights)
    ref = values_and_grads(lambda: ttt_attention_reference(q, k0, v0, dks, dvs, scale, docs), leaves, weights)
    if dtype == torch.float32:
        for name, a, r in zip(["out", "q", "k0", "v0", *["diag"] * 2 * steps], got, ref):
            assert relative_error(a, r) < 5e-3, name
        return
    exact_leaves = [x.detach().float().requires_grad_() for x in leaves]
    q32, k32, v32 = exact_leaves[:3]
    d32 = exact_leaves[3:]
    exact = values_and_grads(lambda: ttt_attention_reference(q32, k32, v32, d32[:steps], d32[steps:], scale, docs),
                             exact_leaves, weights)
    for name, a, r, e in zip(["out", "q", "k0", "v0", *["diag"] * 2 * steps], got, ref, exact):
        assert relative_error(a, e) <= 2 * relative_error(r, e) + 1e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
def test_training_with_flex_attention_equals_the_reference_on_gpu(packed, compiles):
    """The fused training forward (TTT 4, loss and every parameter's gradient) under bf16 autocast, as training runs
    it: FlexAttention against the blocked reference, within bf16 tolerance."""
    from draftsmith.models.eagle3.training import TTTOptions, apply_training_options
    from test_ttt_memory import teacher_targets, tiny_drafter, ttt_batch

    drafter = tiny_drafter(norm_before_fc=True, head_dim=16).cuda()  # Triton's products need 16
    aux, embeds, last_hidden, head, loss_mask = (x.cuda() for x in ttt_batch(s=300))
    docs = packed_docs(3, 300, seed=4).cuda() if packed else None
    teacher, in_draft = teacher_targets(last_hidden, head, drafter.t2d)
    targets = dict(teacher_draft_logits=teacher, teacher_in_draft=in_draft, loss_mask=loss_mask, chunk_size=128)
    results = {}
    for backend in ("reference", "flex"):
        drafter.zero_grad()
        apply_training_options(drafter, TTTOptions(attention=backend, query_block=128))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = drafter(aux, embeds, 4, loss_targets=targets, doc_ids=docs)
        loss.backward()
        results[backend] = loss.detach(), [p.grad.clone() for p in drafter.parameters() if p.grad is not None]
    (ref_loss, ref_grads), (got_loss, got_grads) = results["reference"], results["flex"]
    torch.testing.assert_close(got_loss, ref_loss, rtol=2e-2, atol=2e-2)
    assert len(got_grads) == len(ref_grads)
    for got, ref in zip(got_grads, ref_grads):
        assert (got - ref).norm() <= 5e-2 * ref.norm() + 1e-6


@pytest.mark.gpu
def test_the_compiled_drafter_trains_as_the_eager_one_on_gpu(compiles):
    """training.compile_drafter (auto on CUDA): the TTT steps' elementwise work compiled by inductor gives the eager
    loss and gradients, with FlexAttention under bf16 autocast as training runs it, at two batch lengths (the
    second is a recompile, as every new length of a training run is)."""
    from draftsmith.models.eagle3.training import TTTOptions, apply_training_options
    from test_ttt_memory import teacher_targets, tiny_drafter, ttt_batch

    eager = tiny_drafter(norm_before_fc=True, head_dim=16).cuda()
    compiled = tiny_drafter(norm_before_fc=True, head_dim=16).cuda()
    compiled.load_state_dict(eager.state_dict())
    apply_training_options(eager, TTTOptions(attention="flex"))
    apply_training_options(compiled, TTTOptions(attention="flex", compile=True))
    for s in (300, 173):
        aux, embeds, last_hidden, head, loss_mask = (x.cuda() for x in ttt_batch(s=s))
        teacher, in_draft = teacher_targets(last_hidden, head, eager.t2d)
        targets = dict(teacher_draft_logits=teacher, teacher_in_draft=in_draft, loss_mask=loss_mask, chunk_size=128)
        results = []
        for drafter in (eager, compiled):
            drafter.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, _ = drafter(aux, embeds, 4, loss_targets=targets)
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in drafter.parameters() if p.grad is not None]))
        (ref_loss, ref_grads), (got_loss, got_grads) = results
        torch.testing.assert_close(got_loss, ref_loss, rtol=1e-2, atol=1e-2)
        assert len(got_grads) == len(ref_grads) > 0
        for got, ref in zip(got_grads, ref_grads):
            assert (got - ref).norm() <= 3e-2 * ref.norm() + 1e-6
