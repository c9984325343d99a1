"""The head losses' Triton kernel (kernels/fused_head_loss.py) against the plain-torch losses it replaces, on the CPU
through Triton's interpreter: values, argmaxes and the gradients of the states and of a trainable head, float32 and
bfloat16, row counts and vocabularies off the kernel's blocks, masked rows, each loss (soft CE, KL, LK with its eta,
hard CE), then every method's loss with the kernel against the same loss without it. The compiled kernel is checked
the same way on the GPU (tests/test_fused_head_loss_gpu.py).

Skipped where Triton is not installed (the `dev` extra installs it on x86-64 Linux, as CI runs) or where it runs its
compiler (a GPU machine: tests/conftest.py sets TRITON_INTERPRET=1 on CPU machines only, before Triton is imported).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from draftsmith import device as dev
from draftsmith.kernels import fused_head_loss as fhl
from draftsmith.kernels.fused_head_loss import head_loss_chunk, head_loss_rows, head_loss_sum, resolve_backend

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install triton runs these tests)")
interpreting = pytest.mark.skipif(not triton.knobs.runtime.interpret,
                                  reason="Triton runs its compiler here: tests/test_fused_head_loss_gpu.py covers it")


def reference_rows(z, kind, teacher=None, labels=None, lk_eta=3.0):
    """Per-row losses of logits z (c, V) as the plain-torch losses compute them (eagle3.loss.position_loss for soft
    CE and LK, KL as LK's term, F.cross_entropy for CE)."""
    from draftsmith.models.eagle3.loss import position_loss

    if kind == "ce":
        return F.cross_entropy(z.float(), labels, reduction="none")
    if kind == "kl":
        log_q, log_p = z.float().log_softmax(-1), teacher.float().log_softmax(-1)
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    return position_loss(z, teacher, kind, lk_eta)


def case(c, h, v, dtype, seed=0, teacher_scale=2.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(c, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h ** 0.5).to(dtype)
    teacher = (teacher_scale * torch.randn(c, v, generator=g)).float()
    labels = torch.randint(0, v, (c,), generator=g)
    row_weight = torch.rand(c, generator=g)
    row_weight[::3] = 0.0  # masked rows
    return x, weight, teacher, labels, row_weight


def relative_error(got, want):
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))


# ---- the kernel on one chunk ----------------------------------------------------------------------------------
@interpreting
def test_the_kernel_runs_under_the_interpreter_on_cpu_tensors(monkeypatch):
    """The CPU call goes through Triton's interpreter (not a torch fallback): the launch is the interpreted
    kernel's, once per chunk, over one program per row."""
    from triton.runtime.interpreter import InterpretedFunction

    kernel = fhl._kernel(True)
    assert isinstance(kernel, InterpretedFunction)
    grids = []
    real = kernel.run
    monkeypatch.setattr(kernel, "run", lambda *a, grid, **k: grids.append(grid) or real(*a, grid=grid, **k))
    x, weight, teacher, *_ = case(5, 16, 40, torch.float32)
    head_loss_chunk(x, weight, kind="soft_ce", teacher_logits=teacher, need_x_grad=True)
    assert grids == [(5,)]


@interpreting
@pytest.mark.parametrize("kind", ["soft_ce", "kl", "lk", "ce"])
@pytest.mark.parametrize("c, v, block", [(7, 77, 32), (4, 64, 32), (3, 5, 8), (9, 130, 128)],
                         ids=["v77-block32", "v64-two-blocks", "v5-one-short-block", "v130-block128"])
def test_one_chunk_equals_the_plain_loss_in_float32(kind, c, v, block):
    """Per-row loss, argmaxes and the gradients of sum_r w_r loss_r for x and the head, vocabularies that end
    inside a block, on a block edge and in a block shorter than one, rows of weight 0 included."""
    x, weight, teacher, labels, row_weight = case(c, 16, v, torch.float32, seed=c + v)
    soft = kind != "ce"
    loss, student_arg, teacher_arg, grad_x, grad_weight = head_loss_chunk(
        x, weight, kind=kind, teacher_logits=teacher if soft else None, labels=None if soft else labels,
        row_weight=row_weight, lk_eta=2.5, need_x_grad=True, need_weight_grad=True, block=block)

    xr, wr = x.clone().requires_grad_(), weight.clone().requires_grad_()
    z = xr @ wr.t()
    want = reference_rows(z, kind, teacher, labels, lk_eta=2.5)
    want_x, want_w = torch.autograd.grad((want * row_weight).sum(), [xr, wr])
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_x, want_x, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grad_weight, want_w, rtol=1e-4, atol=1e-6)
    assert torch.equal(student_arg, z.argmax(-1))
    if soft:
        assert torch.equal(teacher_arg, teacher.argmax(-1))
    else:
        assert teacher_arg is None
    assert not grad_x[row_weight == 0].any()  # a masked row takes no gradient


@interpreting
@pytest.mark.parametrize("kind", ["soft_ce", "lk", "ce"])
def test_one_chunk_in_bfloat16_stays_within_the_plain_losss_own_rounding(kind):
    """bf16 states and head (logits and their gradient in bf16, as under autocast): no further from the float32
    loss than the plain bf16 loss is (times 2, plus 1e-2)."""
    x, weight, teacher, labels, row_weight = case(11, 32, 100, torch.bfloat16, seed=3)
    soft = kind != "ce"
    loss, _, _, grad_x, grad_weight = head_loss_chunk(
        x, weight, kind=kind, teacher_logits=teacher if soft else None, labels=None if soft else labels,
        row_weight=row_weight, need_x_grad=True, need_weight_grad=True, block=64)
    assert grad_x.dtype == torch.bfloat16

    def plain(dtype):
        xr, wr = x.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()
        rows = reference_rows(xr @ wr.t(), kind, teacher, labels)
        return [rows.detach(), *torch.autograd.grad((rows * row_weight).sum(), [xr, wr])]

    exact, rounded = plain(torch.float32), plain(torch.bfloat16)
    for name, got, r, e in zip(["loss", "x", "weight"], [loss, grad_x, grad_weight], rounded, exact):
        assert relative_error(got, e) <= 2 * relative_error(r, e) + 1e-2, name


@interpreting
def test_ties_and_non_finite_rows():
    """argmax is the first maximum (torch's); a row holding a non-finite student logit has argmax -1, a
    non-finite teacher -2, so neither ever agrees; a masked row's gradient is 0 even when its loss is NaN."""
    x = torch.zeros(3, 4)
    x[0, 0] = 1.0
    weight = torch.zeros(6, 4)
    weight[2, 0] = weight[4, 0] = 1.0  # logits of row 0 tie at columns 2 and 4
    teacher = torch.zeros(3, 6)
    teacher[0, 3] = teacher[0, 5] = 2.0
    teacher[2, 1] = float("nan")
    x[1, 1] = float("inf")
    weight[:, 1] = 1.0
    row_weight = torch.tensor([1.0, 0.0, 1.0])
    loss, student_arg, teacher_arg, grad_x, _ = head_loss_chunk(x, weight, kind="soft_ce", teacher_logits=teacher,
                                                                row_weight=row_weight, need_x_grad=True, block=4)
    assert student_arg.tolist()[0::2] == [2, 0] and student_arg[1] == -1
    assert teacher_arg[0] == 3 and teacher_arg[2] == -2
    assert not loss[1].isfinite() and torch.equal(grad_x[1], torch.zeros(4))


@interpreting
def test_the_teacher_read_out_by_the_same_head_equals_its_logits():
    """teacher_x (MTP, DFlash): the head reads the teacher's states; the same loss as its logits given."""
    x, weight, _, _, _ = case(6, 16, 50, torch.float32, seed=5)
    teacher_x = torch.randn(6, 16, generator=torch.Generator().manual_seed(6))
    by_states = head_loss_chunk(x, weight, kind="lk", teacher_x=teacher_x, need_x_grad=True, block=16)
    by_logits = head_loss_chunk(x, weight, kind="lk", teacher_logits=teacher_x @ weight.t(), need_x_grad=True,
                                block=16)
    for a, b in zip(by_states[:4], by_logits[:4]):
        torch.testing.assert_close(a, b)


@interpreting
def test_the_autograd_nodes_scale_by_the_upstream_gradient():
    """head_loss_sum: the scalar's gradient for x and the head, times the upstream one; head_loss_rows: each row's
    by its own upstream gradient; a head that trains is refused per row."""
    x, weight, teacher, _, row_weight = case(7, 16, 45, torch.float32, seed=8)
    xr, wr = x.clone().requires_grad_(), weight.clone().requires_grad_()
    total, rows, *_ = head_loss_sum(xr, wr, row_weight, kind="soft_ce", teacher_logits=teacher, block=16)
    got = torch.autograd.grad(3.0 * total, [xr, wr])
    want_rows = reference_rows(xr @ wr.t(), "soft_ce", teacher)
    torch.testing.assert_close(total, (want_rows * row_weight).sum())
    for a, b in zip(got, torch.autograd.grad(3.0 * (want_rows * row_weight).sum(), [xr, wr])):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)

    upstream = torch.randn(7, generator=torch.Generator().manual_seed(9))
    rows, student_arg, teacher_arg = head_loss_rows(xr, weight, kind="soft_ce", teacher_logits=teacher, block=16)
    got, = torch.autograd.grad((rows * upstream).sum(), xr)
    want, = torch.autograd.grad((reference_rows(xr @ weight.t(), "soft_ce", teacher) * upstream).sum(), xr)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="head_loss_sum"):
        head_loss_rows(xr, wr, kind="soft_ce", teacher_logits=teacher)


# ---- every method's loss with the kernel -------------------------------------------------------------------------
@pytest.fixture
def launches(monkeypatch):
    """The number of chunks the kernel computed (so a method test cannot pass by never reaching it)."""
    calls = []
    real = fhl.head_loss_chunk
    monkeypatch.setattr(fhl, "head_loss_chunk", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@interpreting
@pytest.mark.parametrize("kind, norm_output, train_head", [("soft_ce", False, True), ("lk", True, True),
                                                           ("soft_ce", True, False)],
                         ids=["soft_ce-norm-in-loss", "lk", "frozen-head"])
def test_eagle3_fused_loss_equals_the_reference(kind, norm_output, train_head, launches):
    """EAGLE-3's TTT loss over its draft head (and its final norm, trained inside the loss), in chunks that do not
    divide the rows, packed rows: loss, metrics and every parameter's gradient as the plain-torch chunks give."""
    from test_ttt_memory import teacher_targets, tiny_drafter, ttt_batch

    drafter = tiny_drafter(norm_before_fc=True, norm_output=norm_output)
    drafter.lm_head.weight.requires_grad_(train_head)
    aux, embeds, last_hidden, head, loss_mask = ttt_batch()
    teacher, in_draft = teacher_targets(last_hidden, head, drafter.t2d)
    docs = torch.zeros(3, 29, dtype=torch.long)
    docs[:, 15:] = 1
    params = [p for p in drafter.parameters() if p.requires_grad]
    results = {}
    for backend in ("reference", "fused"):
        loss, metrics = drafter(aux, embeds, 3, doc_ids=docs, loss_targets=dict(
            teacher_draft_logits=teacher, teacher_in_draft=in_draft, loss_mask=loss_mask, chunk_size=11, kind=kind,
            lk_eta=2.0, loss_kernel=backend))
        results[backend] = loss, metrics, torch.autograd.grad(loss, params)
    (want, want_metrics, want_grads), (got, got_metrics, got_grads) = results["reference"], results["fused"]
    assert len(launches) == 3 * 8  # 3 steps of 86 or fewer rows in chunks of 11
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for key in want_metrics:
        torch.testing.assert_close(got_metrics[key].float(), want_metrics[key].float(), rtol=1e-5, atol=1e-6)
    names = [n for n, p in drafter.named_parameters() if p.requires_grad]
    for name, a, b in zip(names, got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


@interpreting
def test_eagle3_fused_loss_under_bf16_autocast():
    """Under CPU bf16 autocast (the head's product in bf16, as training runs it on a GPU), within bf16 tolerance of
    the plain-torch chunks."""
    from test_ttt_memory import bf16_loss_and_grads

    want, want_grads = bf16_loss_and_grads(chunk_size=16, loss_kernel="reference")
    got, got_grads = bf16_loss_and_grads(chunk_size=16, loss_kernel="fused")
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    for a, b in zip(got_grads, want_grads):
        assert (a - b).norm() <= 5e-2 * b.norm() + 1e-6


@interpreting
@pytest.mark.parametrize("name", ["mtp", "eagle", "dflash_ce", "dflash_soft_ce"])
def test_frozen_head_losses_with_the_kernel_equal_the_reference(name, launches):
    """MTP's and EAGLE-1's soft CE, DFlash's hard and soft CE over the target's frozen head (the teacher read out
    of its states by the same head), chunks that do not divide the rows: loss, metrics and gradients."""
    from draftsmith.models.dflash.loss import dflash_loss
    from draftsmith.models.eagle.loss import eagle_loss
    from draftsmith.models.mtp.loss import mtp_loss

    g = torch.Generator().manual_seed(4)
    head = torch.nn.Linear(16, 70, bias=False).requires_grad_(False)
    torch.nn.init.normal_(head.weight, generator=g)
    last_hidden = torch.randn(2, 13, 16, generator=g)
    loss_mask = (torch.rand(2, 13, generator=g) > 0.2).long()
    if name == "mtp":
        inputs = [torch.randn(2, 13, 16, generator=g, requires_grad=True) for _ in range(2)]
        run = lambda backend: mtp_loss(inputs, last_hidden, loss_mask, head, chunk_size=7,  # noqa: E731
                                       loss_kernel=backend)
    elif name == "eagle":
        inputs = [torch.randn(2, 13, 16, generator=g, requires_grad=True)]
        run = lambda backend: eagle_loss(inputs[0], last_hidden, loss_mask, head, chunk_size=7,  # noqa: E731
                                         loss_kernel=backend)
    else:
        inputs = [torch.randn(2, 3, 4, 16, generator=g, requires_grad=True)]  # (B, N, B_k, H)
        valid = torch.rand(2, 3, 3, generator=g) > 0.3
        labels = torch.randint(0, 70, (2, 3, 3), generator=g)
        teacher = torch.randn(int(valid.sum()), 16, generator=g) if name == "dflash_soft_ce" else None
        run = lambda backend: dflash_loss(inputs[0], head.weight, labels, valid, 2.0, teacher,  # noqa: E731
                                          chunk_size=5, loss_kernel=backend)
    (want, want_metrics), (got, got_metrics) = run("reference"), run("fused")
    assert launches
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for key in want_metrics:
        torch.testing.assert_close(got_metrics[key].float(), want_metrics[key].float(), rtol=1e-5, atol=1e-6)
    for a, b in zip(torch.autograd.grad(got, inputs), torch.autograd.grad(want, inputs)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@interpreting
@pytest.mark.parametrize("markov_head, confidence_head", [("vanilla", True), ("gated", True), ("vanilla", False)])
def test_dspark_loss_with_the_kernel_equals_the_reference(markov_head, confidence_head, monkeypatch):
    """DSpark's CE + L1 through the kernel (the Markov head's bias inside the logits), the confidence term beside it,
    chunks that do not divide the rows: loss, metrics and the gradients of the states, both Markov tables, the gate
    and the confidence head equal the plain-torch chunks', each term alone and all three."""
    from test_dspark import V, tiny_config, tiny_drafter

    from draftsmith.models.dspark.loss import dspark_loss

    calls = []
    real = fhl._kernel
    monkeypatch.setattr(fhl, "_kernel", lambda interpreted: calls.append(1) or real(interpreted))
    cfg = tiny_config(markov_head=markov_head, confidence_head=confidence_head)
    drafter = tiny_drafter(cfg).train()
    g = torch.Generator().manual_seed(5)
    head = torch.randn(V, cfg.hidden_size, generator=g)
    b, n, bk = 2, 3, cfg.block_size
    hidden = torch.randn(b, n, bk, cfg.hidden_size, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (b, n, bk), generator=g)
    prev = torch.randint(0, V, (b, n, bk), generator=g)
    valid = (torch.rand(b, n, bk, generator=g) > 0.2).int().cumprod(-1).bool()
    teacher = torch.randn(int(valid.sum()), cfg.hidden_size, generator=g)
    params = [hidden] + [p for p in drafter.parameters() if p.requires_grad]
    names = ["hidden"] + [n for n, p in drafter.named_parameters() if p.requires_grad]
    for terms in ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0), (0.1, 0.9, 1.0)):
        options = dict(zip(("ce_weight", "l1_weight", "confidence_weight"), terms), gamma=4.0, chunk_size=5)
        results = {}
        for backend in ("reference", "fused"):
            loss, metrics = dspark_loss(hidden, head, drafter.markov_head, drafter.confidence_head, labels, prev,
                                        valid, teacher, loss_kernel=backend, **options)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            results[backend] = loss, metrics, grads
        (want, want_metrics, want_grads), (got, got_metrics, got_grads) = results["reference"], results["fused"]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert set(got_metrics) == set(want_metrics)
        for key in want_metrics:
            torch.testing.assert_close(got_metrics[key].float(), want_metrics[key].float(), rtol=1e-5, atol=1e-6,
                                       msg=key)
        for name, a, b in zip(names, got_grads, want_grads):
            if b is None:
                assert a is None or not a.any(), name
            else:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
    assert calls  # the kernel ran


def test_dspark_keeps_a_zero3_markov_head_on_the_reference(monkeypatch):
    """A DeepSpeed ZeRO-3 Markov head (its parameters partitioned outside the module's forward) is never read by the
    kernel: the loss takes the plain-torch chunks and equals them."""
    from test_dspark import V, tiny_config, tiny_drafter

    from draftsmith.models.dspark.loss import dspark_loss

    monkeypatch.setattr(fhl, "_kernel", lambda interpreted: pytest.fail("the kernel read a partitioned table"))
    cfg = tiny_config()
    drafter = tiny_drafter(cfg).train()
    drafter.markov_head.markov_w2.weight.ds_id = 0  # what ZeRO-3 marks its partitioned parameters with
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(1, 2, cfg.block_size, cfg.hidden_size, generator=g)
    labels = torch.randint(0, V, (1, 2, cfg.block_size), generator=g)
    valid = torch.ones(1, 2, cfg.block_size, dtype=torch.bool)
    teacher = torch.randn(int(valid.sum()), cfg.hidden_size, generator=g)
    head = torch.randn(V, cfg.hidden_size, generator=g)
    losses = [dspark_loss(hidden, head, drafter.markov_head, drafter.confidence_head, labels, labels, valid, teacher,
                          ce_weight=0.1, l1_weight=0.9, confidence_weight=1.0, gamma=4.0, loss_kernel=kernel)[0]
              for kernel in ("fused", "reference")]
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)


@interpreting
def test_dsparks_kernel_rows_with_ties_and_the_gradient_of_l1():
    """Per row, the kernel's L1 and CE equal the plain ones, a row whose draft equals its teacher has L1 0 and
    the CE gradient alone (torch.abs's gradient is 0 at 0), and the gradient of L1 equals autograd's."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(6, 8, generator=g)
    weight = torch.randn(37, 8, generator=g)
    teacher_x = torch.randn(6, 8, generator=g)
    teacher_x[2] = x[2]  # identical distributions: L1 0
    u = torch.zeros(6, 3)
    bias_weight = torch.zeros(37, 3)
    labels = torch.randint(0, 37, (6,), generator=g)
    row_weight = torch.rand(6, generator=g) + 0.5
    xr = x.clone().requires_grad_(True)
    total, l1, ce, pred, teacher_pred = fhl.ce_l1_head_loss(xr, u, bias_weight, weight, teacher_x, labels,
                                                            row_weight, ce_weight=0.3, l1_weight=0.7, chunk_rows=4)
    xw = x.clone().requires_grad_(True)
    q, p = (xw @ weight.t()).softmax(-1), (teacher_x @ weight.t()).softmax(-1)
    want_l1 = (q - p).abs().sum(-1)
    want_ce = F.cross_entropy(xw @ weight.t(), labels, reduction="none")
    want = (row_weight * (0.3 * want_ce + 0.7 * want_l1)).sum()
    torch.testing.assert_close(l1, want_l1.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ce, want_ce.detach(), rtol=1e-5, atol=1e-6)
    assert l1[2] < 1e-6 and pred[2] == teacher_pred[2]
    torch.testing.assert_close(total, want.detach(), rtol=1e-5, atol=1e-6)
    got_grad, = torch.autograd.grad(total, xr)
    want_grad, = torch.autograd.grad(want, xw)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-6)
    assert torch.equal(teacher_pred, (teacher_x @ weight.t()).argmax(-1))


# ---- selection -------------------------------------------------------------------------------------------------
def test_the_backend_is_chosen_by_the_device_and_forced_by_the_key(monkeypatch):
    """auto takes the kernel on a GPU only where the method says it was measured (EAGLE-3's training); fused
    runs on CUDA and ROCm with Triton and is refused elsewhere; recompute always takes the reference."""
    assert resolve_backend("auto", "cpu") == "reference" == resolve_backend("reference", "cpu")
    with pytest.raises(ValueError, match="training.loss_kernel=auto or reference"):
        resolve_backend("fused", "cpu")
    with pytest.raises(ValueError, match="one of auto, fused, reference"):
        resolve_backend("triton", "cpu")
    monkeypatch.setattr(dev.importlib.util, "find_spec", lambda name: object())  # Triton "installed"
    assert dev.fused_loss_kernel("cuda") and not dev.fused_loss_kernel("npu")
    assert resolve_backend("fused", "cuda:0") == "fused"
    assert resolve_backend("auto", "cuda") == "reference"  # not measured
    assert resolve_backend("fused", "cuda", "recompute") == "reference"
    assert resolve_backend("auto", "cuda", measured=True) == "fused"
    assert resolve_backend("auto", "cuda", "recompute", measured=True) == "reference"
    assert resolve_backend("auto", "cpu", measured=True) == "reference"
    monkeypatch.setenv("DRAFTSMITH_FUSED_LOSS", "0")
    assert resolve_backend("auto", "cuda", measured=True) == "reference"
    monkeypatch.delenv("DRAFTSMITH_FUSED_LOSS")
    monkeypatch.setattr(dev.importlib.util, "find_spec", lambda name: None)  # no Triton
    assert resolve_backend("auto", "cuda", measured=True) == "reference"



def test_the_key_is_checked_and_reaches_every_method(fixture_target_dir):
    """training.loss_kernel: fused with recompute is refused in one line; each method resolves the key once."""
    from draftsmith.config import recipe_from_dict
    from draftsmith.models.target import TargetModel
    from draftsmith.train.setup import method_class

    def recipe(method, **training):
        return recipe_from_dict({"model": {"target": str(fixture_target_dir), "method": method},
                                 "data": {"path": "x.jsonl"}, "output_dir": "unused", "training": training})

    with pytest.raises(ValueError, match="set training.loss_grad=in_forward"):
        recipe("eagle3", loss_kernel="fused", loss_grad="recompute")
    target = TargetModel.from_pretrained(fixture_target_dir, dtype="float32", device="cpu")
    for method in ("eagle3", "mtp", "eagle", "dflash", "dspark"):
        built = method_class(method)(recipe(method, loss_kernel="auto"), target)
        chosen = getattr(built, "loss_kernel", None) or built.loss_options["loss_kernel"]
        assert chosen == "reference", method
        with pytest.raises(ValueError, match="loss_kernel=fused needs a CUDA or ROCm GPU"):
            method_class(method)(recipe(method, loss_kernel="fused"), target)
    pruned = recipe("dspark", loss_kernel="fused").model_copy(deep=True)
    pruned.model.draft_vocab_size = 64  # DSpark's kernel reads out over the whole vocabulary only
    with pytest.raises(ValueError, match="with model.draft_vocab_size set use training.loss_kernel=reference"):
        method_class("dspark")(pruned, target)
