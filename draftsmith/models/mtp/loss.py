"""MTP training targets and loss, as pure functions.

Depth d at position i predicts t_{i+1+d} (model.py). The target's own distribution over that token is its
logits at position i+d, so with target logits z_j = lm_head(last_hidden_j):

    teacher(d, i) = softmax(z_{i+d})          valid(d, i) = loss_mask[i+1+d]

    i          0      1      2   ...
    depth 1    z_1    z_2    z_3        (predicts t_2, t_3, t_4)
    depth 2    z_2    z_3    z_4        (predicts t_3, t_4, t_5)

The loss is soft cross-entropy to the target's full-vocabulary distribution (the head is the target's own, so
there is no draft vocabulary), weighted decay**(d-1) over depths. Full-vocabulary logits are only ever built for
`chunk_size` loss positions at a time, each chunk's gradient taken while they exist (kernels/chunked_loss.py),
never kept.
"""

from __future__ import annotations

import torch
from torch import nn

from draftsmith.kernels.chunked_loss import LossGrad, row_losses
from draftsmith.kernels.fused_head_loss import head_loss_rows
from draftsmith.models.eagle3.loss import simulated_acceptance_length
from draftsmith.models.mtp.model import shift_left


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


def mtp_loss(depth_hidden, last_hidden, loss_mask, lm_head, decay: float = 0.8, chunk_size: int | None = None,
             loss_grad: LossGrad = "in_forward", loss_kernel: str = "reference"):
    """Weighted soft cross-entropy over depths: sum_d decay**(d-1) * L_d.

    depth_hidden: list of (B, S, H) final-normed drafter states (depth 1 first); last_hidden (B, S, H): the
    target's final-normed last hidden state; loss_mask (B, S), 1 on assistant tokens. L_d averages over its valid
    positions. Returns (loss, metrics of 0-dim tensors): loss_i / acc_i / count_i for depth i+1 (0-based keys,
    as EAGLE-3's) and sim_accept_len (1 + leading correct depths, teacher-forced).
    """
    total = 0.0
    metrics: dict[str, torch.Tensor] = {}
    correct_depths, valid_depths = [], []
    for i, hidden in enumerate(depth_hidden):
        depth = i + 1
        valid = shift_left(loss_mask.bool(), depth + 1)  # (B, S) t_{i+1+d} is an assistant token
        teacher = shift_left(last_hidden, depth)  # (B, S, H): z_{i+d}
        per_pos, correct = soft_ce_positions(hidden, teacher, valid, lm_head, chunk_size, loss_grad, loss_kernel)
        count = valid.sum()
        depth_loss = per_pos.sum() / count.clamp(min=1)
        total = total + (decay ** i) * depth_loss
        metrics[f"loss_{i}"] = depth_loss.detach()
        metrics[f"acc_{i}"] = correct.sum() / count.clamp(min=1)
        metrics[f"count_{i}"] = count
        correct_depths.append(correct)
        valid_depths.append(valid)
    metrics["sim_accept_len"] = simulated_acceptance_length(correct_depths, valid_depths[0])
    return total, metrics
