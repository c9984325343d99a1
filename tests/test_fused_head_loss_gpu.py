"""The head losses' compiled Triton kernel (kernels/fused_head_loss.py) against the plain-torch losses on the GPU:
values and gradients at the 8B drafter's shape (hidden 4,096, draft vocabulary 32,000, 16k rows in bf16, in the
trainer's chunks), the fixture drafter's shape, a full 128k head read out for MTP and DFlash, and the EAGLE-3
training step under bf16 autocast. The same kernel runs through Triton's interpreter in tests/test_fused_head_loss.py
on the CPU. Kept apart from that file: its Triton runs interpreted, this one's compiled, and Triton chooses once per
process."""

from __future__ import annotations

import pytest
import torch

from draftsmith import device as dev
from draftsmith.kernels.chunked_loss import loss_chunk_rows
from draftsmith.kernels.fused_head_loss import head_loss_rows, head_loss_sum
from draftsmith.models.eagle3.loss import position_loss

pytestmark = pytest.mark.gpu


def relative_error(got, want):
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))


def plain(x, weight, kind, teacher=None, teacher_x=None, labels=None, row_weight=None, dtype=torch.float32):
    """The plain-torch loss sum, per-row losses and gradients (x, weight) with the head's product in `dtype`."""
    xr, wr = x.detach().to(dtype).requires_grad_(), weight.detach().to(dtype).requires_grad_()
    z = xr @ wr.t()
    if teacher_x is not None:
        teacher = (teacher_x.to(dtype) @ wr.detach().t()).float()
    rows = (torch.nn.functional.cross_entropy(z.float(), labels, reduction="none") if kind == "ce"
            else position_loss(z, teacher, kind, 3.0))
    total = (rows * row_weight).sum() if row_weight is not None else rows.sum()
    return [total.detach(), *torch.autograd.grad(total, [xr, wr])]


def assert_close_in(dtype, got, rounded, exact, names):
    """float32: within 5e-3 of the reference (relative norm; TF32 stays inside it). bfloat16: no further from the
    float32 loss than the plain bf16 loss is (times 2, plus 1e-2)."""
    for name, a, r, e in zip(names, got, rounded, exact):
        if dtype == torch.float32:
            assert relative_error(a, e) < 5e-3, name
        else:
            assert relative_error(a, e) <= 2 * relative_error(r, e) + 1e-2, name


@pytest.mark.parametrize("rows, hidden, vocab, dtype, kind", [
    (16384, 4096, 32000, torch.bfloat16, "soft_ce"),  # the 8B drafter's head, a 16 x 1,024 step, in 4,194-row chunks
    (16384, 4096, 32000, torch.bfloat16, "lk"),
    (8192, 384, 12000, torch.float32, "soft_ce"),  # the fixture drafter's head
    (8192, 384, 12000, torch.bfloat16, "lk"),
    (1000, 384, 12000, torch.bfloat16, "soft_ce"),  # rows off the chunk and the kernel's block
], ids=["8b-32k-bf16-soft_ce", "8b-32k-bf16-lk", "fixture-fp32-soft_ce", "fixture-bf16-lk", "fixture-1000-bf16"])
def test_a_trainable_head_on_gpu(rows, hidden, vocab, dtype, kind):
    """EAGLE-3's case: teacher logits given, masked rows, the loss sum's gradients for the states and the head,
    chunk by chunk as the trainer reads them."""
    device = dev.get_device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, hidden, device=device, generator=g).to(dtype)
    weight = (torch.randn(vocab, hidden, device=device, generator=g) / hidden ** 0.5).to(dtype)
    teacher = 3.0 * torch.randn(rows, vocab, device=device, generator=g)
    row_weight = (torch.rand(rows, device=device, generator=g) > 0.2).float() / rows
    chunk = loss_chunk_rows(vocab, None)
    sums = {key: [torch.zeros((), device=device), torch.zeros_like(x, dtype=torch.float32),
                  torch.zeros_like(weight, dtype=torch.float32)] for key in ("got", "rounded", "exact")}
    for start in range(0, rows, chunk):
        part = slice(start, start + chunk)
        xr, wr = x[part].clone().requires_grad_(), weight.clone().requires_grad_()
        total, *_ = head_loss_sum(xr, wr, row_weight[part], kind=kind, teacher_logits=teacher[part])
        for key, (loss, grad_x, grad_weight) in {
                "got": [total.detach(), *torch.autograd.grad(total, [xr, wr])],
                "rounded": plain(x[part], weight, kind, teacher[part], row_weight=row_weight[part], dtype=dtype),
                "exact": plain(x[part], weight, kind, teacher[part], row_weight=row_weight[part])}.items():
            sums[key][0] += loss.float()
            sums[key][1][part] += grad_x.float()
            sums[key][2] += grad_weight.float()
    got, rounded, exact = sums["got"], sums["rounded"], sums["exact"]
    assert_close_in(dtype, got, rounded, exact, ["loss", "x", "weight"])


@pytest.mark.parametrize("kind", ["soft_ce", "ce"])
def test_a_frozen_128k_head_on_gpu(kind):
    """MTP's and DFlash's case: a Llama-3 sized head (128,256 x 4,096, bf16) reads the teacher out of its states
    (soft CE) or takes labels (CE); per-row losses under a later weighting of the rows."""
    device = dev.get_device("cuda")
    g = torch.Generator(device=device).manual_seed(1)
    rows, hidden, vocab = 1046, 4096, 128256  # one chunk of loss_chunk_rows(128,256)
    x = torch.randn(rows, hidden, device=device, generator=g).to(torch.bfloat16)
    weight = (torch.randn(vocab, hidden, device=device, generator=g) / hidden ** 0.5).to(torch.bfloat16)
    teacher_x = torch.randn(rows, hidden, device=device, generator=g).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (rows,), device=device, generator=g)
    row_weight = torch.rand(rows, device=device, generator=g)
    xr = x.clone().requires_grad_()
    losses, *_ = head_loss_rows(xr, weight, kind=kind, teacher_x=teacher_x if kind != "ce" else None,
                                labels=labels if kind == "ce" else None)
    total = (losses * row_weight).sum()
    got = [total.detach(), torch.autograd.grad(total, xr)[0]]
    options = dict(teacher_x=teacher_x if kind != "ce" else None, labels=labels, row_weight=row_weight)
    rounded = plain(x, weight, kind, dtype=torch.bfloat16, **options)[:2]
    exact = plain(x, weight, kind, dtype=torch.float32, **options)[:2]
    assert_close_in(torch.bfloat16, got, rounded, exact, ["loss", "x"])


@pytest.mark.parametrize("kind", ["soft_ce", "lk"])
def test_the_eagle3_training_step_with_the_kernel_on_gpu(kind):
    """The fused TTT loss (TTT 4, packed rows, loss and every parameter's gradient, the head and its final norm
    training inside it) under bf16 autocast, as training runs it: the kernel against the plain-torch chunks."""
    from test_ttt_memory import teacher_targets, tiny_drafter, ttt_batch

    drafter = tiny_drafter(norm_before_fc=True, norm_output=False, head_dim=16).cuda()
    aux, embeds, last_hidden, head, loss_mask = (x.cuda() for x in ttt_batch(s=300))
    teacher, in_draft = teacher_targets(last_hidden, head, drafter.t2d)
    docs = torch.zeros(3, 300, dtype=torch.long, device="cuda")
    docs[:, 170:] = 1
    results = {}
    for backend in ("reference", "fused"):
        drafter.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, metrics = drafter(aux, embeds, 4, doc_ids=docs, loss_targets=dict(
                teacher_draft_logits=teacher, teacher_in_draft=in_draft, loss_mask=loss_mask, chunk_size=128,
                kind=kind, loss_kernel=backend))
        loss.backward()
        results[backend] = loss.detach(), metrics, [p.grad.clone() for p in drafter.parameters()
                                                    if p.grad is not None]
    (ref_loss, ref_metrics, ref_grads), (got_loss, got_metrics, got_grads) = results["reference"], results["fused"]
    torch.testing.assert_close(got_loss, ref_loss, rtol=2e-2, atol=2e-2)
    assert abs(float(got_metrics["acc_0"]) - float(ref_metrics["acc_0"])) <= 0.02
    assert len(got_grads) == len(ref_grads)
    for got, ref in zip(got_grads, ref_grads):
        assert (got - ref).norm() <= 5e-2 * ref.norm() + 1e-6


@pytest.mark.parametrize("vocab, hidden, rank, dtype", [(16000, 384, 256, torch.float32),
                                                        (16000, 384, 256, torch.bfloat16),
                                                        (128256, 4096, 256, torch.bfloat16)],
                         ids=["fixture-fp32", "fixture-bf16", "8b-128k-bf16"])
def test_dsparks_ce_l1_with_the_markov_bias_on_gpu(vocab, hidden, rank, dtype):
    """DSpark's case: the target's frozen head plus the Markov head's rank-r bias, CE + L1 against the teacher read
    out by the same head: the loss and the gradients of the states, the bias input and W2, in the trainer's chunks,
    against plain torch with the products in the same dtype and in float32."""
    from draftsmith.kernels.fused_head_loss import ce_l1_head_loss

    device = dev.get_device("cuda")
    g = torch.Generator(device=device).manual_seed(2)
    rows = 2 * loss_chunk_rows(vocab, None) + 37
    x = torch.randn(rows, hidden, device=device, generator=g).to(dtype)
    weight = (torch.randn(vocab, hidden, device=device, generator=g) / hidden ** 0.5).to(dtype)
    teacher_x = (x.float() + 0.5 * torch.randn(rows, hidden, device=device, generator=g)).to(dtype)
    u = 0.3 * torch.randn(rows, rank, device=device, generator=g)
    w2 = 0.1 * torch.randn(vocab, rank, device=device, generator=g)
    labels = torch.randint(0, vocab, (rows,), device=device, generator=g)
    row_weight = torch.rand(rows, device=device, generator=g) / rows

    def plain_loss(compute):
        xr, ur, wr = (t.detach().clone().requires_grad_() for t in (x, u, w2))
        z = (xr.to(compute) @ weight.to(compute).t()).float() + (ur.to(compute) @ wr.to(compute).t()).float()
        with torch.no_grad():
            p = (teacher_x.to(compute) @ weight.to(compute).t()).float().softmax(-1)
        rows_loss = 0.1 * torch.nn.functional.cross_entropy(z, labels, reduction="none") \
            + 0.9 * (z.softmax(-1) - p).abs().sum(-1)
        total = (row_weight * rows_loss).sum()
        return [total.detach(), *torch.autograd.grad(total, [xr, ur, wr])]

    xr, ur, wr = (t.detach().clone().requires_grad_() for t in (x, u, w2))
    total, *_ = ce_l1_head_loss(xr, ur.to(dtype), wr, weight, teacher_x, labels, row_weight, ce_weight=0.1,
                                l1_weight=0.9, chunk_rows=loss_chunk_rows(vocab, None))
    got = [total.detach(), *torch.autograd.grad(total, [xr, ur, wr])]
    assert_close_in(dtype, got, plain_loss(dtype), plain_loss(torch.float32), ["loss", "x", "bias_x", "w2"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eagle1s_loss_with_the_kernel_on_gpu(dtype):
    """EAGLE-1's case (models/eagle/loss.py): smooth-L1 to the next state plus soft CE to the target's next-token
    distribution through its frozen head, the teacher read out of the next state by the same head: the fused
    kernel against the plain-torch chunks, the loss, its terms and the gradient of the drafter's outputs, at the
    fixture's shape (hidden 384, vocabulary 16,000) with rows off the chunk."""
    from draftsmith.models.eagle.loss import eagle_loss

    device = dev.get_device("cuda")
    g = torch.Generator(device=device).manual_seed(3)
    batch, seq, hidden, vocab = 3, 700, 384, 16000
    head = torch.nn.Linear(hidden, vocab, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, device=device, generator=g) / hidden ** 0.5)
    head.requires_grad_(False)
    last_hidden = torch.randn(batch, seq, hidden, device=device, generator=g).to(dtype)
    out = (last_hidden.roll(-1, 1).float() + 0.5 * torch.randn(batch, seq, hidden, device=device, generator=g))
    loss_mask = (torch.rand(batch, seq, device=device, generator=g) < 0.8).long()
    results = {}
    for backend in ("reference", "fused"):
        x = out.detach().to(dtype).requires_grad_()
        loss, metrics = eagle_loss(x, last_hidden, loss_mask, head, chunk_size=None, loss_kernel=backend)
        results[backend] = (loss.detach(), metrics, torch.autograd.grad(loss, x)[0])
    (ref_loss, ref_metrics, ref_grad), (got_loss, got_metrics, got_grad) = results["reference"], results["fused"]
    tolerance = 5e-3 if dtype == torch.float32 else 3e-2
    for key in ("regression_loss", "ce_loss"):
        assert abs(float(got_metrics[key]) - float(ref_metrics[key])) <= tolerance * abs(float(ref_metrics[key])), key
    assert relative_error(got_loss, ref_loss) <= tolerance
    assert abs(float(got_metrics["acc_0"]) - float(ref_metrics["acc_0"])) <= 0.01
    assert relative_error(got_grad, ref_grad) <= tolerance
