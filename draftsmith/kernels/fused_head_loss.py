"""Head losses through a Triton kernel: the loss and its gradients over a chunk of rows of a vocabulary head in one
pass over each row's logits, which become their own gradient in place (issue 28).

What it computes is kernels/chunked_loss.py's, which stays the reference and the fallback (NPU, CPU, the `recompute`
path, DeepSpeed ZeRO-3 heads, DSpark with a pruned vocabulary): per row of student states x (H,) read out by a head W (V, H),
z = W x, against a teacher distribution p = softmax(t) whose logits t the caller has (EAGLE-3's teacher over the
draft vocabulary) or that the same head reads out of teacher states (MTP, EAGLE-1, DFlash's soft CE: t = W x_t), or
against a label (DFlash's CE): soft_ce, kl, lk (with its eta) or ce, as head_loss_triton.py writes them out; and
DSpark's CE + L1 (`ce_l1_head_loss`), whose student logits carry the Markov head's low-rank bias.

Per chunk, as Liger-Kernel's fused linear cross-entropy and fused linear JSD run (their `ops/fused_linear_*.py`):
the head product z = x W^T by the BLAS (the chunk's (c, V) logits in the compute dtype, bf16 under autocast, are
the only vocabulary-wide tensor), one kernel program per row reading z (and t) a block of the vocabulary at a time
with online log-sum-exps for both, writing the loss, both argmaxes and d loss / d z over z, then the BLAS again for
d x = G W and, for a head that trains (EAGLE-3), d W += G^T x. Against the plain-torch chunk: no float32 copies of
the logits, no softmaxes, products and autograd graph of (c, V) tensors, one read of z and t for the statistics and
one for the gradient; the same three head products. A kernel that recomputed z = x W^T tile by tile instead of
holding the chunk would need the normalisers before the gradient, so one more head product (two for LK's
acceptance term) over a loss whose head products are already most of its time.

Liger itself does not serve here: its fused JSD takes a second head only (EAGLE-3's teacher is logits), sums to a
scalar (MTP and DFlash weight each row later), has no LK, and returns no argmaxes for the acceptance metrics.

Selection: `training.loss_kernel` (auto | fused | reference), resolved once per run by `resolve_backend` from
device.fused_loss_kernel (CUDA and ROCm with Triton; DRAFTSMITH_FUSED_LOSS=0 keeps auto on the reference). auto
takes the kernel only where the calling method says it was measured on the device (`measured`: the training.py
of EAGLE-3, MTP, DFlash and DSpark, whose 8B-shape runs at 16 x 2048 on an H200 ran 1.05x, 1.20x, 1.04x and 1.26x
the tokens/s with the kernel at the same or lower peak memory, benchmarks/results/kernels_h200/), the reference elsewhere
(EAGLE-1, not measured).
"""

from __future__ import annotations

import functools

import torch

BACKENDS = ("auto", "fused", "reference")  # training.loss_kernel
KINDS = {"soft_ce": 0, "kl": 1, "lk": 2, "ce": 3}  # head_loss_triton.KIND
BLOCK = 4096  # vocabulary columns a program reads at a time on a GPU (a 32,000-token head: 8 blocks a pass)
NUM_WARPS = 8


# ---- selection -----------------------------------------------------------------------------------------------
def resolve_backend(requested: str, device: torch.device | str, loss_grad: str = "in_forward",
                    measured: bool = False) -> str:
    """'fused' or 'reference' for training.loss_kernel `requested` on `device`: fused runs where
    device.fused_loss_kernel says the kernel does (CUDA and ROCm with Triton, DRAFTSMITH_FUSED_LOSS unset) and the
    gradient is taken in the forward pass (`loss_grad` in_forward: the kernel writes it there); auto takes it only
    where the caller's method was `measured` faster with it on the device (train_8b_shape.py +fusedloss,
    benchmarks/gpu_kernels.sh): nothing unmeasured runs by default."""
    from draftsmith import device as dev

    if requested not in BACKENDS:
        raise ValueError(f"training.loss_kernel={requested!r}: use one of {', '.join(BACKENDS)}")
    if requested == "reference" or loss_grad != "in_forward":  # the config refuses fused with recompute
        return "reference"
    runs = dev.fused_loss_kernel(device)
    if requested == "fused" and not runs:
        raise ValueError(f"training.loss_kernel=fused needs a CUDA or ROCm GPU with Triton and DRAFTSMITH_FUSED_LOSS "
                         f"unset (here {device}): set training.loss_kernel=auto or reference")
    return "fused" if runs and (requested == "fused" or measured) else "reference"


# ---- one chunk -----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _kernel(interpreted: bool):
    from draftsmith.kernels import head_loss_triton

    return head_loss_triton.interpreted() if interpreted else head_loss_triton.compiled


def compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head product runs in: autocast's where it is on (as nn.Linear would), else the inputs'."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return torch.promote_types(x.dtype, weight.dtype)


@torch.no_grad()
def head_loss_chunk(x, weight, *, kind: str, teacher_logits=None, teacher_x=None, labels=None, row_weight=None,
                    lk_eta: float = 3.0, need_x_grad: bool = False, need_weight_grad: bool = False,
                    weight_compute=None, block: int | None = None):
    """Per-row loss (c,) float32, student argmax (c,) int64 (-1 where a logit is not finite), teacher argmax (c,)
    (-2 where not finite; None for `ce`), and the gradients of sum_r row_weight[r] * loss_r with respect to x (c, H)
    (x's dtype) and to the head (V, H) (float32), each None unless asked for.

    x (c, H) student states; weight (V, H) the head; the teacher as `teacher_logits` (c, V), or `teacher_x` (c, H)
    read out by the same head, or `labels` (c,) for `ce`; row_weight (c,) float32, 0 for a row that does not count
    (its gradient is 0); weight_compute: `weight` already in the compute dtype (saves a cast per chunk)."""
    if kind not in KINDS:
        raise ValueError(f"unknown loss {kind!r}: expected one of {', '.join(KINDS)}")
    if (kind == "ce") != (labels is not None) or (kind != "ce" and (teacher_logits is None) == (teacher_x is None)):
        raise ValueError(f"loss {kind}: give labels for ce, else exactly one of teacher_logits and teacher_x")
    dtype = compute_dtype(x, weight)
    w = weight_compute if weight_compute is not None else weight.to(dtype)
    logits = x.to(dtype) @ w.t()  # (c, V): becomes d loss / d logits below
    teacher = teacher_logits if teacher_x is None else teacher_x.to(dtype) @ w.t()  # (c, V)
    if teacher is not None and teacher.stride(-1) != 1:
        teacher = teacher.contiguous()
    rows, vocab = logits.shape
    has_grad = need_x_grad or need_weight_grad
    if has_grad and row_weight is None:
        row_weight = torch.ones(rows, dtype=torch.float32, device=x.device)
    loss = torch.empty(rows, dtype=torch.float32, device=x.device)
    student_arg = torch.empty(rows, dtype=torch.int64, device=x.device)
    teacher_arg = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows:
        interpreted = x.device.type == "cpu"
        block = block or min(BLOCK, 1 << (vocab - 1).bit_length())
        _kernel(interpreted)[(rows,)](
            logits, logits.stride(0), teacher if teacher is not None else logits,
            teacher.stride(0) if teacher is not None else 0,
            labels if labels is not None else student_arg, row_weight.float() if has_grad else loss,
            loss, student_arg, teacher_arg, vocab, float(lk_eta), loss, 0.0, 0.0,
            KIND=KINDS[kind], HAS_GRAD=has_grad, BLOCK=block, num_warps=NUM_WARPS)
    grad_x = (logits @ w).to(x.dtype) if need_x_grad else None  # (c, H)
    grad_weight = (logits.t() @ x.to(dtype)).float() if need_weight_grad else None  # (V, H)
    return loss, student_arg, None if kind == "ce" else teacher_arg, grad_x, grad_weight


class _FusedHeadLoss(torch.autograd.Function):
    """head_loss_chunk as an autograd node: the gradients are taken in the forward pass; backward scales them by the
    upstream gradient (one scalar with `reduce`, one per row without)."""

    @staticmethod
    def forward(ctx, x, weight, reduce: bool, row_weight, options: dict):
        need_x, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if need_weight and not reduce:
            raise ValueError("a head that trains takes its gradient from the weighted sum of the rows' losses "
                             "(head_loss_sum): per-row losses would need each row's weight before it is known")
        loss, student_arg, teacher_arg, grad_x, grad_weight = head_loss_chunk(
            x, weight, row_weight=row_weight, need_x_grad=need_x, need_weight_grad=need_weight, **options)
        ctx.save_for_backward(*[g for g in (grad_x, grad_weight) if g is not None])
        ctx.present = (grad_x is not None, grad_weight is not None)
        ctx.reduce = reduce
        ctx.weight_dtype = weight.dtype
        extras = [loss, student_arg] + ([teacher_arg] if teacher_arg is not None else [])
        if reduce:
            total = torch.where(row_weight != 0, loss * row_weight, 0.0).sum()
            ctx.mark_non_differentiable(*extras)
            return (total, *extras)
        ctx.mark_non_differentiable(*extras[1:])
        return tuple(extras)

    @staticmethod
    def backward(ctx, grad_out, *_):
        saved = iter(ctx.saved_tensors)
        grad_x = next(saved) if ctx.present[0] else None
        grad_weight = next(saved) if ctx.present[1] else None
        if grad_x is not None:
            scale = grad_out if ctx.reduce else grad_out.view(-1, 1)
            grad_x = grad_x * scale.to(grad_x.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_out).to(ctx.weight_dtype)
        return grad_x, grad_weight, None, None, None


def head_loss_sum(x, weight, row_weight, *, kind: str, teacher_logits=None, teacher_x=None, labels=None,
                  lk_eta: float = 3.0, weight_compute=None, block: int | None = None):
    """(sum_r row_weight[r] * loss_r, a 0-dim tensor with gradients for x (c, H) and the head weight (V, H);
    per-row losses (c,); student argmax (c,); teacher argmax (c,), absent for `ce`). Rows of weight 0 count for
    nothing, whatever their loss. See head_loss_chunk for the arguments."""
    options = dict(kind=kind, teacher_logits=teacher_logits, teacher_x=teacher_x, labels=labels, lk_eta=lk_eta,
                   weight_compute=weight_compute, block=block)
    return _FusedHeadLoss.apply(x, weight, True, row_weight.float(), options)


def head_loss_rows(x, weight, *, kind: str, teacher_logits=None, teacher_x=None, labels=None, lk_eta: float = 3.0,
                   block: int | None = None):
    """(per-row losses (c,) with a gradient for x, each row's from its own row; student argmax (c,); teacher argmax
    (c,), absent for `ce`) over a frozen head (a head that trains needs head_loss_sum)."""
    options = dict(kind=kind, teacher_logits=teacher_logits, teacher_x=teacher_x, labels=labels, lk_eta=lk_eta,
                   block=block)
    return _FusedHeadLoss.apply(x, weight, False, None, options)


# ---- DSpark: CE + L1 over the target's head plus a low-rank bias -----------------------------------------------
class _CeL1HeadLoss(torch.autograd.Function):
    """sum_r row_weight[r] * (ce_weight * CE_r + l1_weight * ||q_r - p_r||_1), q = softmax(W x + B u), p =
    softmax(W x_t), a chunk of rows at a time, every gradient taken in the forward pass (the head W is frozen; the
    bias's input u and its weight B train)."""

    @staticmethod
    def forward(ctx, x, bias_x, bias_weight, weight, teacher_x, labels, row_weight, ce_weight: float,
                l1_weight: float, chunk_rows: int):
        need_x, need_bias_x, need_bias_weight = ctx.needs_input_grad[:3]
        dtype = compute_dtype(x, weight)
        w, bw = weight.to(dtype), bias_weight.to(dtype)
        rows, vocab = x.shape[0], weight.shape[0]
        l1 = torch.empty(rows, dtype=torch.float32, device=x.device)
        ce = torch.empty_like(l1)
        student_arg = torch.empty(rows, dtype=torch.int64, device=x.device)
        teacher_arg = torch.empty_like(student_arg)
        grad_x = torch.empty_like(x) if need_x else None
        grad_bias_x = torch.empty_like(bias_x) if need_bias_x else None
        grad_bias_weight = torch.zeros(bias_weight.shape, dtype=torch.float32, device=x.device) \
            if need_bias_weight else None
        row_weight = row_weight.float().contiguous()
        labels = labels.contiguous()
        block = min(BLOCK, 1 << (vocab - 1).bit_length())
        kernel = _kernel(x.device.type == "cpu")
        for start in range(0, rows, chunk_rows):
            end = min(start + chunk_rows, rows)
            u = bias_x[start:end].to(dtype)
            logits = x[start:end].to(dtype) @ w.t()  # (c, V): becomes its gradient in the kernel
            logits.addmm_(u, bw.t())
            teacher = teacher_x[start:end].to(dtype) @ w.t()
            kernel[(end - start,)](
                logits, logits.stride(0), teacher, teacher.stride(0), labels[start:end], row_weight[start:end],
                l1[start:end], student_arg[start:end], teacher_arg[start:end], vocab, 0.0, ce[start:end],
                float(ce_weight), float(l1_weight), KIND=4, HAS_GRAD=True, BLOCK=block, num_warps=NUM_WARPS)
            if need_x:
                grad_x[start:end] = logits @ w
            if need_bias_x:
                grad_bias_x[start:end] = logits @ bw
            if need_bias_weight:
                grad_bias_weight += (logits.t() @ u).float()
        total = (row_weight * (ce_weight * ce + l1_weight * l1)).sum()
        saved = (grad_x, grad_bias_x, grad_bias_weight)
        ctx.save_for_backward(*[g for g in saved if g is not None])
        ctx.present = [g is not None for g in saved]
        ctx.dtypes = (x.dtype, bias_x.dtype, bias_weight.dtype)
        ctx.mark_non_differentiable(l1, ce, student_arg, teacher_arg)
        return total, l1, ce, student_arg, teacher_arg

    @staticmethod
    def backward(ctx, grad_total, *_):
        saved = iter(ctx.saved_tensors)
        grads = [(next(saved) * grad_total).to(dtype) if present else None
                 for present, dtype in zip(ctx.present, ctx.dtypes)]
        return (*grads, None, None, None, None, None, None, None)


def ce_l1_head_loss(x, bias_x, bias_weight, weight, teacher_x, labels, row_weight, *, ce_weight: float,
                    l1_weight: float, chunk_rows: int):
    """DSpark's CE and L1 terms through the kernel (models/dspark/loss.py is the plain-torch reference): x (M, H)
    the draft states and weight (V, H) the frozen head, bias_x (M, r) the Markov head's input and bias_weight (V, r)
    its W2 (logits = W x + W2 bias_x), teacher_x (M, H) the target's states read out by the same head, labels (M,)
    ids in [0, V), row_weight (M,). Returns (the weighted sum, with gradients for x, bias_x and bias_weight; per row
    l1 = ||q - p||_1 (M,), CE (M,), student argmax (M,) (-1 where a logit is not finite), teacher argmax (M,) (-2
    likewise)), holding one chunk's (chunk_rows, V) logits at a time."""
    return _CeL1HeadLoss.apply(x, bias_x, bias_weight, weight, teacher_x, labels, row_weight, ce_weight, l1_weight,
                               chunk_rows)
