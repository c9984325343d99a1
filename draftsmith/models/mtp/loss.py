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

from draftsmith.kernels.chunked_loss import LossGrad
from draftsmith.models.losses import shift_left, simulated_acceptance_length, soft_ce_positions


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
