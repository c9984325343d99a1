"""EAGLE-1 training loss, a pure function (section.py says why this loss).

Index alignment (model.py): the drafter's output o_t at position t, from (embed(x_{t+1}), h_t), is regressed toward
the target's next feature h_{t+1}, and its logits lm_head(o_t) toward the target's distribution over x_{t+2},
softmax(lm_head(h_{t+1})). A position counts when x_{t+2} is an answer token:

    t          0      1      2   ...
    regress    h1     h2     h3        teacher = lm_head(h_{t+1})
    predicts   x2     x3     x4        valid(t) = loss_mask[t + 2]

    loss = regression_weight * mean_t smooth_l1(o_t, h_{t+1})  +  ce_weight * mean_t -sum_x p_t(x) log q_t(x)

both means over the valid positions of the process's micro-batch (the reference divides by loss_mask.sum()); smooth
L1 (beta 1) averages over the H features, as the reference's `torch.mean(loss_mask * vloss, 2)`. The vocabulary's
logits only ever exist for a chunk of valid rows at a time (mtp.loss.soft_ce_positions).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.kernels.chunked_loss import LossGrad
from draftsmith.models.losses import shift_left, simulated_acceptance_length, soft_ce_positions


def eagle_loss(out_hidden: torch.Tensor, last_hidden: torch.Tensor, loss_mask: torch.Tensor, lm_head: nn.Module, *,
               regression_weight: float = 1.0, ce_weight: float = 0.1, chunk_size: int | None = None,
               loss_grad: LossGrad = "in_forward", loss_kernel: str = "reference"):
    """out_hidden (B, S, H) drafter outputs; last_hidden (B, S, H) the target's final-normed last hidden state;
    loss_mask (B, S), 1 on answer tokens; lm_head the target's frozen head. Returns (loss, metrics of 0-dim
    tensors): loss_0 (the weighted sum), regression_loss, ce_loss, acc_0 (argmax agreement with the target's),
    count_0 and sim_accept_len (1 + acc_0: one draft step is trained)."""
    valid = shift_left(loss_mask.bool(), 2)  # (B, S): x_{t+2} is an answer token
    next_hidden = shift_left(last_hidden, 1)  # (B, S, H): h_{t+1}
    count = valid.sum()
    denominator = count.clamp(min=1)
    rows = valid.nonzero(as_tuple=True)
    regression = F.smooth_l1_loss(out_hidden[rows].float(), next_hidden[rows].float(), reduction="none", beta=1.0)
    regression = regression.mean(-1).sum() / denominator
    ce_rows, correct = soft_ce_positions(out_hidden, next_hidden, valid, lm_head, chunk_size, loss_grad, loss_kernel)
    ce = ce_rows.sum() / denominator
    loss = regression_weight * regression + ce_weight * ce
    metrics = {"loss_0": loss.detach(), "regression_loss": regression.detach(), "ce_loss": ce.detach(),
               "acc_0": correct.sum() / denominator, "count_0": count,
               "sim_accept_len": simulated_acceptance_length([correct], valid)}
    return loss, metrics
