"""Losses over a vocabulary head, a chunk of rows at a time, that never hold the whole batch's logits.

Every method's loss reads its drafter's states out through a head of V outputs (EAGLE-3's draft head, the
target's whole head for MTP and DFlash): the (rows, V) float32 logits and their softmaxes of a whole batch would
be the largest tensors of a step. Two ways to take the gradient a chunk at a time, the same values either way
(tests/test_ttt_memory.py):

- `recompute` (the plain reference): each chunk under activation checkpointing; the backward pass computes the
  chunk's logits again, then their gradient. Works with any wrapper, DeepSpeed ZeRO-3 included.
- `in_forward` (the default, `training.loss_grad`): the forward pass takes each chunk's gradient right after its
  loss, while the logits are still there, and keeps only the gradient of the chunk's inputs (and of the head, for
  EAGLE-3's trainable one); the backward pass only scales it by the upstream gradient. One head product and one
  softmax less per chunk than `recompute`: the fused linear cross-entropy of Liger-Kernel, in plain torch, so the
  same code runs on CUDA, ROCm, NPU and CPU.

`row_losses` serves a loss per row whose later weighting is left to the caller (MTP, DFlash): a row's loss depends
on its own row only, so d loss_r / d row_r, taken in the forward pass, is all its backward needs. A head that trains
(EAGLE-3) needs the weights of every row before its gradient can be summed: `loss_grad_in_forward` runs a body
that knows them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch.utils.checkpoint import checkpoint

LossGrad = Literal["in_forward", "recompute"]

# Logit elements of one loss chunk (512 MiB in float32), for every method's loss (training.loss_chunk_size null):
# EAGLE-3's fixture steps of 8,192 rows over its 12,000-token draft vocabulary in one chunk, an 8B shape's
# 32,000-token draft head 4,194 rows at a time, a 128k-token full head (MTP, DFlash) 1,046. Each chunk costs a pass
# of small kernels: 1,024-row chunks made the fixture's EAGLE-3 step 1.4x slower.
LOSS_CHUNK_ELEMENTS = 1 << 27


def loss_chunk_rows(vocab_size: int, chunk_size: int | None) -> int:
    """Rows per loss chunk over a head of `vocab_size` outputs: `chunk_size` if given, else as many as
    LOSS_CHUNK_ELEMENTS allows (at least 1,024)."""
    return chunk_size if chunk_size is not None else max(1024, LOSS_CHUNK_ELEMENTS // vocab_size)


def sharded_by_deepspeed(params: Sequence[torch.Tensor]) -> bool:
    """ZeRO-3 keeps a parameter partitioned outside its module's forward: a gradient taken in the forward pass
    and handed back later would not match it, so such heads take the `recompute` path."""
    return any(hasattr(p, "ds_id") for p in params)


class _RowLossesGradInForward(torch.autograd.Function):
    """fn's per-row losses over chunks of rows, with each row's d loss / d row taken in the forward pass."""

    @staticmethod
    def forward(ctx, fn, chunk_size: int, num_rows: int, *tensors):
        rows, args = tensors[:num_rows], tensors[num_rows:]
        needs = ctx.needs_input_grad[3:3 + num_rows]
        row_grads = [torch.empty_like(r) if need else None for r, need in zip(rows, needs)]
        outputs = []
        bases = [r.detach().requires_grad_(need) for r, need in zip(rows, needs)]
        for start in range(0, rows[0].shape[0], chunk_size):
            end = start + chunk_size
            with torch.enable_grad():
                # views of the detached rows, not leaves of their own: module hooks that inspect the graph
                # (FlopCounterMode's module tracker) refuse a leaf inside autograd.grad
                part = [base[start:end] for base in bases]
                losses, *extras = fn(*part, *args)
                wanted = [p for p, need in zip(part, needs) if need]
                grads = iter(torch.autograd.grad(losses.sum(), wanted) if wanted else ())
            for buffer, need in zip(row_grads, needs):
                if need:
                    buffer[start:end] = next(grads)
            outputs.append((losses.detach(), *(e.detach() for e in extras)))
        ctx.save_for_backward(*[g for g in row_grads if g is not None])
        ctx.needs = needs
        ctx.num_args = len(args)
        joined = [torch.cat(column) for column in zip(*outputs)]
        ctx.mark_non_differentiable(*joined[1:])
        return tuple(joined)

    @staticmethod
    def backward(ctx, grad_losses, *_):
        saved = iter(ctx.saved_tensors)
        grads = []
        for need in ctx.needs:
            if need:
                row_grad = next(saved)
                grads.append(row_grad * grad_losses.view(-1, *[1] * (row_grad.dim() - 1)).to(row_grad.dtype))
            else:
                grads.append(None)
        return (None, None, None, *grads, *[None] * ctx.num_args)


def row_losses(fn: Callable, rows: tuple[torch.Tensor, ...], *args, chunk_size: int | None, vocab_size: int,
               loss_grad: LossGrad = "in_forward"):
    """`fn(*row_chunks, *args)` over `chunk_size` rows at a time (None: `loss_chunk_rows` for a head of
    `vocab_size`) of every tensor in `rows`, joined: a tuple of fn's outputs over all rows, or None when there
    are no rows. fn returns the per-row loss (differentiable, each row's from that row alone) and per-row
    results that are not (agreement, argmax). Only one chunk's logits are ever alive; with `loss_grad`
    `in_forward` the gradient is taken as they are, `recompute` recomputes each chunk in the backward pass. A
    tensor or module in `args` that needs a gradient (a head that trains) takes the `recompute` path; a function
    that reads trainable parameters some other way must not be given `in_forward`, they would get no gradient."""
    if rows[0].shape[0] == 0:
        return None
    chunk_size = loss_chunk_rows(vocab_size, chunk_size)
    grad_needed = torch.is_grad_enabled() and any(r.requires_grad for r in rows)
    arg_tensors = [a for a in args if isinstance(a, torch.Tensor)]
    arg_tensors += [p for a in args if isinstance(a, torch.nn.Module) for p in a.parameters()]
    if grad_needed and loss_grad == "in_forward" and not any(a.requires_grad for a in arg_tensors):
        return _RowLossesGradInForward.apply(fn, chunk_size, len(rows), *rows, *args)
    chunks = []
    for i in range(0, rows[0].shape[0], chunk_size):
        part = [r[i:i + chunk_size] for r in rows]
        if grad_needed:
            chunks.append(checkpoint(fn, *part, *args, use_reentrant=False))
        else:
            chunks.append(fn(*part, *args))
    return tuple(torch.cat(column) for column in zip(*chunks))


class _LossGradInForward(torch.autograd.Function):
    """A scalar loss whose gradients `body` computes in the forward pass; backward scales them."""

    @staticmethod
    def forward(ctx, body, *tensors):
        total, grads, extras = body(ctx.needs_input_grad[1:])
        ctx.save_for_backward(*[g for g in grads if g is not None])
        ctx.present = [g is not None for g in grads]
        ctx.dtypes = [t.dtype for t in tensors]
        extras = tuple(e.detach() for e in extras)
        ctx.mark_non_differentiable(*extras)
        return (total.detach(), *extras)

    @staticmethod
    def backward(ctx, grad_total, *_):
        saved = iter(ctx.saved_tensors)
        grads = [(next(saved) * grad_total).to(dtype) if present else None
                 for present, dtype in zip(ctx.present, ctx.dtypes)]
        return (None, *grads)


def loss_grad_in_forward(body: Callable, tensors: Sequence[torch.Tensor]):
    """(total, *extras) where `body(needs)` returns (total 0-dim, the gradients of total with respect to each of
    `tensors` (None where `needs` says none is wanted), extras that carry no gradient), computed in the forward
    pass; the backward pass hands each gradient on scaled by the upstream one. `tensors` must be every tensor
    with a gradient that body's loss depends on: a missing one would get none."""
    return _LossGradInForward.apply(body, *tensors)
