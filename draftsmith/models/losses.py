"""Loss pieces and the training metric several drafter methods share, as pure functions.

    shift_left                   the alignment every method draws: out[:, t] = x[:, t + n] (the token, hidden
                                 state or mask n positions later, at position t)
    soft_ce_positions            soft cross-entropy of a draft state against a teacher state, both read out through
                                 the same head, at chosen positions only (MTP, EAGLE-1)
    simulated_acceptance_length  `sim_accept_len`, the acceptance length a chain of per-step agreements implies
                                 (every method logs it; DESIGN.md "Metrics")

A method folder imports these from here, never from another method's folder.
"""

from __future__ import annotations

import torch
from torch import nn

from draftsmith.kernels.chunked_loss import LossGrad, row_losses
from draftsmith.kernels.fused_head_loss import head_loss_rows


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """out[:, t] = x[:, t + n], `fill` past the end; a new tensor (a copy for n = 0).

        x      x0  x1  x2  x3  x4
        n = 2  x2  x3  x4  f   f
    """
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


def _soft_ce_rows(draft_hidden: torch.Tensor, teacher_hidden: torch.Tensor, lm_head: nn.Module):
    """Per-row soft CE and top-1 agreement for rows of (N, H) draft and teacher (final-normed) states; a row with
    a non-finite logit never agrees."""
    weight_dtype = lm_head.weight.dtype
    log_q = torch.log_softmax(lm_head(draft_hidden.to(weight_dtype)).float(), dim=-1)  # (N, V)
    with torch.no_grad():
        teacher = lm_head(teacher_hidden.to(weight_dtype)).float()  # (N, V)
        p = torch.softmax(teacher, dim=-1)
        finite = torch.isfinite(log_q).all(-1) & torch.isfinite(teacher).all(-1)  # a NaN row's argmax is its NaN
        agree = (log_q.argmax(-1) == teacher.argmax(-1)) & finite  # (N,)
    return -(p * log_q).sum(-1), agree


def _soft_ce_rows_fused(draft_hidden: torch.Tensor, teacher_hidden: torch.Tensor, lm_head: nn.Module):
    """`_soft_ce_rows` through the Triton kernel (kernels/fused_head_loss.py), for a head without a bias."""
    if lm_head.bias is not None:
        raise ValueError("training.loss_kernel=fused reads out through a head without a bias: set "
                         "training.loss_kernel=reference")
    weight = lm_head.weight
    losses, student_arg, teacher_arg = head_loss_rows(draft_hidden.to(weight.dtype), weight, kind="soft_ce",
                                                      teacher_x=teacher_hidden.to(weight.dtype))
    return losses, student_arg == teacher_arg  # a non-finite row's argmaxes are -1 and -2: never agree


def soft_ce_positions(draft_hidden, teacher_hidden, valid, lm_head, chunk_size: int | None = None,
                      loss_grad: LossGrad = "in_forward", loss_kernel: str = "reference"):
    """Soft CE (B, S) float32 and agreement (B, S) bool at the `valid` positions (zero / False elsewhere).

    Only valid positions are projected to the vocabulary, `chunk_size` rows at a time (None: chosen by the head's
    size, kernels/chunked_loss.loss_chunk_rows), each chunk's gradient taken as `loss_grad` says, so memory is
    O(chunk_size x V) whatever the batch; `loss_kernel` "fused" computes each chunk with the Triton kernel.
    """
    rows = valid.nonzero(as_tuple=True)
    draft_rows, teacher_rows = draft_hidden[rows], teacher_hidden[rows]  # (N, H)
    fn = _soft_ce_rows_fused if loss_kernel == "fused" else _soft_ce_rows
    joined = row_losses(fn, (draft_rows, teacher_rows), lm_head, chunk_size=chunk_size,
                        vocab_size=lm_head.weight.shape[0], loss_grad=loss_grad)
    per_pos = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
    correct = torch.zeros(valid.shape, dtype=torch.bool, device=valid.device)
    if joined is not None:
        losses, agrees = joined
        per_pos = per_pos.index_put(rows, losses)
        correct[rows] = agrees
    elif draft_hidden.requires_grad:  # nothing to learn here, but keep the graph so backward (and DDP) still run
        per_pos = per_pos + 0.0 * draft_hidden.sum()
    return per_pos, correct


def simulated_acceptance_length(correct_steps, valid0) -> torch.Tensor:
    """1 + mean number of leading correct steps, over positions where step 0 is valid (a 0-dim tensor).

    correct_steps[i] (B, S) bool: draft step i agrees with the target at that position; a chain is accepted up to
    its first disagreement, and the target's own token (the bonus) makes the 1."""
    run = torch.ones_like(correct_steps[0])
    accepted = torch.zeros(correct_steps[0].shape, dtype=torch.float32, device=correct_steps[0].device)
    for correct in correct_steps:
        run = run & correct
        accepted += run.float()
    return 1.0 + (accepted * valid0).sum() / valid0.sum().clamp(min=1)
