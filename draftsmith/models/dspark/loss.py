"""DSpark training targets and loss, as pure functions (DeepSpec's `deepspec/modeling/dspark/loss.py`).

Anchors are positions a with loss_mask[a] and loss_mask[a+1] set (dflash/loss.sample_anchors, anchor_in_mask), so
the anchor slot's own prediction is an answer token. Slot k (0-based) of the block at a (config.py):

    slot          0            1            ...  k
    label         x_a+1        x_a+2             x_a+k+1         (the data token)
    teacher       p_t(a)       p_t(a+1)          p_t(a+k)        (the target's next-token distribution there)
    Markov prev   x_a          x_a+1             x_a+k           (teacher-forced: the data tokens)
    counts        loss_mask[a+k+1], a+k+1 < S, and every earlier slot of the block counts (a block is only
                  accepted up to its first miss, so slots past an unusable label teach nothing)

Per counted slot, with p_d the draft's distribution including the Markov bias:

    loss = ce_weight * CE(p_d, x_a+k+1) + l1_weight * ||p_d - p_t||_1 + confidence_weight * BCE(c_k, 1 - ||p_d - p_t||_1 / 2)

each term a weighted mean over the counted slots with weights exp(-k / gamma); the confidence target is detached.
Both distributions are float32 softmaxes at temperature 1 over the target's whole vocabulary, read out one chunk of
rows at a time (kernels/chunked_loss.row_losses). Metrics compare the draft's argmax with the target's (what greedy
verification accepts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.kernels.chunked_loss import LossGrad, row_losses
from draftsmith.models.eagle3.loss import simulated_acceptance_length


def slot_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """w_k = exp(-k / gamma) for slots k = 0..B-1, shape (B,)."""
    return torch.exp(-torch.arange(block_size, device=device, dtype=torch.float32) / gamma)


def block_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchor_positions: torch.Tensor,
                  block_valid: torch.Tensor, block_size: int):
    """(labels, prev_ids, teacher_positions, valid), each (B, N, B_k), as the module docstring draws them."""
    b, s = input_ids.shape
    n = anchor_positions.shape[1]
    at = anchor_positions.unsqueeze(-1) + torch.arange(block_size, device=input_ids.device)  # (B, N, B_k): a + k
    inside = at + 1 < s
    label_pos = (at + 1).clamp(max=s - 1)
    labels = input_ids.gather(1, label_pos.view(b, -1)).view(b, n, -1)
    prev_ids = input_ids.gather(1, at.clamp(max=s - 1).view(b, -1)).view(b, n, -1)
    usable = inside & (loss_mask.gather(1, label_pos.view(b, -1)).view(b, n, -1) > 0) & block_valid.unsqueeze(-1)
    valid = usable.int().cumprod(dim=-1).bool()
    return labels, prev_ids, at.clamp(max=s - 1), valid


def _slot_rows(hidden, labels, prev_embed, teacher_hidden, ce_coef, l1_coef, bce_coef, head_weight, markov_head,
               confidence_head):
    """One chunk's weighted per-row loss and its results that carry no gradient (agreement with the target's
    argmax, ||p_d - p_t||_1, the confidence)."""
    logits = F.linear(hidden.to(head_weight.dtype), head_weight).float()
    logits = logits + markov_head.bias(hidden, prev_embed.to(hidden.dtype)).float()  # (M, V)
    log_draft = logits.log_softmax(-1)
    with torch.no_grad():
        teacher_logits = F.linear(teacher_hidden.to(head_weight.dtype), head_weight).float()
        teacher = teacher_logits.softmax(-1)
    ce = -log_draft.gather(1, labels[:, None]).squeeze(1)
    l1 = (log_draft.exp() - teacher).abs().sum(-1)
    row = ce_coef * ce + l1_coef * l1
    if confidence_head is not None:
        confidence = confidence_head(hidden, prev_embed)  # (M,) logits
        want = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)
        row = row + bce_coef * F.binary_cross_entropy_with_logits(confidence, want, reduction="none")
        confidence = torch.sigmoid(confidence.detach())
    else:
        confidence = torch.full_like(l1, float("nan"))
    # argmax of a row holding NaN is the NaN's index, which can equal the label: such a row agrees with nothing
    pred = logits.argmax(-1).masked_fill(~torch.isfinite(logits).all(-1), -1)
    return row, pred == teacher_logits.argmax(-1), l1.detach(), confidence


def dspark_loss(block_hidden, head_weight, markov_head, confidence_head, labels, prev_ids, valid, teacher_hidden,
                *, ce_weight: float, l1_weight: float, confidence_weight: float, gamma: float,
                chunk_size: int | None = None, loss_grad: LossGrad = "in_forward"):
    """block_hidden (B, N, B_k, H) final-normed slot states; head_weight (V, H) the target's frozen lm_head;
    labels, prev_ids, valid (B, N, B_k) from `block_targets`; teacher_hidden (M, H) the target's final-normed
    states at the counted slots' teacher positions, in `valid`'s order. Returns (loss, metrics of 0-dim tensors):
    per slot i loss_i (the mean ||p_d - p_t||_1), acc_i, count_i; sim_accept_len; confidence_error (mean
    |c - (1 - ||p_d - p_t||_1 / 2)|, when there is a confidence head)."""
    w = slot_weights(valid.shape[-1], gamma, valid.device) * valid  # (B, N, B_k)
    w_rows = w[valid]
    scale = 1.0 / w.sum().clamp(min=1e-6)
    rows = (block_hidden[valid], labels[valid], markov_head.embed(prev_ids[valid]), teacher_hidden,
            ce_weight * scale * w_rows, l1_weight * scale * w_rows, confidence_weight * scale * w_rows)
    joined = row_losses(_slot_rows, rows, head_weight, markov_head, confidence_head, chunk_size=chunk_size,
                        vocab_size=head_weight.shape[0], loss_grad=loss_grad)
    if joined is None:  # no slot counts in this batch
        loss = block_hidden.sum() * 0.0
        row_l1 = agree = confidence = block_hidden.new_zeros(0)
    else:
        row_loss, agree, row_l1, confidence = joined
        loss = row_loss.sum()
    correct = torch.zeros_like(valid).masked_scatter(valid, agree.bool())
    l1 = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device).masked_scatter(valid, row_l1.float())
    metrics: dict[str, torch.Tensor] = {}
    for i in range(valid.shape[-1]):
        count = valid[..., i].sum()
        metrics[f"loss_{i}"] = (l1[..., i].sum() / count.clamp(min=1)).detach()
        metrics[f"acc_{i}"] = correct[..., i].sum() / count.clamp(min=1)
        metrics[f"count_{i}"] = count
    metrics["sim_accept_len"] = simulated_acceptance_length(list(correct.unbind(-1)), valid[..., 0])
    if confidence_head is not None and joined is not None and valid.any():
        metrics["confidence_error"] = (confidence - (1.0 - 0.5 * row_l1)).abs().mean()
    return loss, metrics
