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

A pruned draft vocabulary (`draft_ids`, the V_d target ids the drafter can propose): p_d is a softmax over the draft
ids only (the drafter's own head, the Markov bias over the draft ids), p_t still the target's whole head's softmax,
and the L1 term is the full-vocabulary one, p_d being 0 outside the draft ids:

    ||p_d - p_t||_1 = sum over draft ids i |p_d(i) - p_t(id_i)| + (1 - sum over draft ids p_t(id_i))

so 1 - ||.||_1 / 2 stays the probability that verification accepts the slot's draft (the confidence target). The
CE labels are draft ids; a label outside the draft vocabulary (-1) has no CE, and the CE's weighted mean runs over
the counted slots whose label is inside (cross_entropy's ignore_index).

`loss_kernel` "fused" (the whole vocabulary only) computes the CE and L1 terms with the Triton kernel of
kernels/fused_head_loss.ce_l1_head_loss, every gradient (the states', the Markov head's) in the forward pass, and the
confidence term in plain torch beside it: the same loss as the plain-torch chunks here, which stay the reference (NPU,
CPU, the `recompute` path, a pruned vocabulary, a DeepSpeed ZeRO-3 Markov head); those take the `recompute` path,
since the Markov head trains.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.kernels.chunked_loss import LossGrad, loss_chunk_rows, row_losses, sharded_by_deepspeed
from draftsmith.kernels.fused_head_loss import ce_l1_head_loss
from draftsmith.models.losses import simulated_acceptance_length


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
               confidence_head, teacher_weight=None, draft_ids=None):
    """One chunk's weighted per-row loss and its results that carry no gradient (agreement with the target's
    argmax, ||p_d - p_t||_1, the confidence). With `draft_ids` (a pruned vocabulary) `head_weight` is the draft
    head (V_d, H), `teacher_weight` the target's (V, H) and `labels` draft ids, -1 outside the draft vocabulary."""
    logits = F.linear(hidden.to(head_weight.dtype), head_weight).float()
    logits = logits + markov_head.bias(hidden, prev_embed.to(hidden.dtype)).float()  # (M, V_d)
    log_draft = logits.log_softmax(-1)
    # argmax of a row holding NaN is the NaN's index, which can equal the label: such a row agrees with nothing
    pred = logits.argmax(-1).masked_fill(~torch.isfinite(logits).all(-1), -1)
    if draft_ids is None:
        with torch.no_grad():
            teacher_logits = F.linear(teacher_hidden.to(head_weight.dtype), head_weight).float()
            teacher = teacher_logits.softmax(-1)
        ce = -log_draft.gather(1, labels[:, None]).squeeze(1)
        l1 = (log_draft.exp() - teacher).abs().sum(-1)
    else:
        with torch.no_grad():
            teacher_logits = F.linear(teacher_hidden.to(teacher_weight.dtype), teacher_weight).float()  # (M, V)
            teacher = teacher_logits.softmax(-1).index_select(1, draft_ids)  # (M, V_d)
            outside = (1.0 - teacher.sum(-1)).clamp(min=0.0)  # p_t's mass the drafter can never propose
        inside = labels >= 0
        ce = torch.where(inside, -log_draft.gather(1, labels.clamp(min=0)[:, None]).squeeze(1), 0.0)
        l1 = (log_draft.exp() - teacher).abs().sum(-1) + outside
        pred = torch.where(pred >= 0, draft_ids[pred.clamp(min=0)], -1)  # a target id
    row = ce_coef * ce + l1_coef * l1
    if confidence_head is not None:
        confidence = confidence_head(hidden, prev_embed)  # (M,) logits
        want = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)
        row = row + bce_coef * F.binary_cross_entropy_with_logits(confidence, want, reduction="none")
        confidence = torch.sigmoid(confidence.detach())
    else:
        confidence = torch.full_like(l1, float("nan"))
    return row, pred == teacher_logits.argmax(-1), l1.detach(), confidence


def dspark_loss(block_hidden, head_weight, markov_head, confidence_head, labels, prev_ids, valid, teacher_hidden,
                *, ce_weight: float, l1_weight: float, confidence_weight: float, gamma: float,
                chunk_size: int | None = None, loss_grad: LossGrad = "in_forward",
                teacher_head_weight: torch.Tensor | None = None, draft_ids: torch.Tensor | None = None,
                loss_kernel: str = "reference"):
    """block_hidden (B, N, B_k, H) final-normed slot states; head_weight (V, H) the target's frozen lm_head;
    labels, prev_ids, valid (B, N, B_k) from `block_targets`; teacher_hidden (M, H) the target's final-normed
    states at the counted slots' teacher positions, in `valid`'s order. A pruned vocabulary (module docstring):
    head_weight (V_d, H) the drafter's own head, teacher_head_weight (V, H) the target's, draft_ids (V_d,) the
    target id of each draft id, labels draft ids (-1 outside the draft vocabulary; prev_ids stay target ids).
    Returns (loss, metrics of 0-dim tensors):
    per slot i loss_i (the mean ||p_d - p_t||_1), acc_i, count_i; sim_accept_len; confidence_error (mean
    |c - (1 - ||p_d - p_t||_1 / 2)|, when there is a confidence head)."""
    w = slot_weights(valid.shape[-1], gamma, valid.device) * valid  # (B, N, B_k)
    w_rows = w[valid]
    scale = 1.0 / w.sum().clamp(min=1e-6)
    row_labels = labels[valid]
    ce_rows = ce_weight * scale * w_rows
    if draft_ids is not None:  # CE's weighted mean over the slots whose label is a draft id
        inside = (row_labels >= 0).float()
        ce_rows = ce_weight * w_rows * inside / (w_rows * inside).sum().clamp(min=1e-6)
    # the kernel reads out over the whole vocabulary (a pruned one stays here: DsparkMethod refuses `fused` for it),
    # and reads the Markov table W2 outside its module's forward: a ZeRO-3 partition of it is not the table
    if loss_kernel == "fused" and draft_ids is None and not sharded_by_deepspeed(list(markov_head.parameters())):
        joined = _fused_rows(block_hidden[valid], row_labels, markov_head, confidence_head, prev_ids[valid],
                             teacher_hidden, head_weight, scale * w_rows, ce_weight=ce_weight, l1_weight=l1_weight,
                             confidence_weight=confidence_weight, chunk_size=chunk_size)
        return _with_metrics(joined, block_hidden, valid, confidence_head)
    rows = (block_hidden[valid], row_labels, markov_head.embed(prev_ids[valid]), teacher_hidden,
            ce_rows, l1_weight * scale * w_rows, confidence_weight * scale * w_rows)
    pruned = () if draft_ids is None else (teacher_head_weight, draft_ids)
    joined = row_losses(_slot_rows, rows, head_weight, markov_head, confidence_head, *pruned, chunk_size=chunk_size,
                        vocab_size=(head_weight if draft_ids is None else teacher_head_weight).shape[0],
                        loss_grad=loss_grad)
    if joined is not None:
        row_loss, agree, row_l1, confidence = joined
        joined = row_loss.sum(), agree, row_l1, confidence
    return _with_metrics(joined, block_hidden, valid, confidence_head)


def _fused_rows(hidden, labels, markov_head, confidence_head, prev_ids, teacher_hidden, head_weight, row_weight, *,
                ce_weight, l1_weight, confidence_weight, chunk_size):
    """(loss, agreement, ||p_d - p_t||_1, confidence) of the counted slots, as the reference chunks give them, the
    CE and L1 terms through the kernel; None when no slot counts."""
    if hidden.shape[0] == 0:
        return None
    prev_embed = markov_head.embed(prev_ids)
    total, row_l1, _, pred, teacher_pred = ce_l1_head_loss(
        hidden, markov_head.bias_input(hidden, prev_embed.to(hidden.dtype)), markov_head.markov_w2.weight,
        head_weight, teacher_hidden, labels, row_weight, ce_weight=ce_weight, l1_weight=l1_weight,
        chunk_rows=loss_chunk_rows(head_weight.shape[0], chunk_size))
    if confidence_head is None:
        return total, pred == teacher_pred, row_l1, torch.full_like(row_l1, float("nan"))
    logits = confidence_head(hidden, prev_embed)
    want = (1.0 - 0.5 * row_l1).clamp(0.0, 1.0)
    bce = F.binary_cross_entropy_with_logits(logits, want, reduction="none")
    return total + (confidence_weight * row_weight * bce).sum(), pred == teacher_pred, row_l1, \
        torch.sigmoid(logits.detach())


def _with_metrics(joined, block_hidden, valid, confidence_head):
    """(loss, metrics) from the counted slots' (loss, agreement, l1, confidence), or None when none counts."""
    if joined is None:  # no slot counts in this batch
        loss = block_hidden.sum() * 0.0
        row_l1 = agree = confidence = block_hidden.new_zeros(0)
    else:
        loss, agree, row_l1, confidence = joined
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
