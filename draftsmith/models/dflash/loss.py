"""DFlash training targets and loss, as pure functions.

Anchors (SpecForge / DeepSpec sample them the same way): up to `num_anchors` random positions a per sequence
whose next token x_{a+1} is an assistant (loss-mask) token, resampled every step. Block slot k = 1..B_k-1 predicts
the token at a + k (model.py); its label is the target's greedy choice there, i.e. the argmax of the target's
logits at position a + k - 1, given the (teacher-forced) sequence before it:

    slot        0 (anchor)   1             2             ...   B_k-1
    position    a            a+1           a+2                 a+B_k-1
    label       -            argmax p_a    argmax p_a+1        argmax p_a+B_k-2
    valid       -            loss_mask[a+1] & a+1 < S   ...

Hard cross-entropy (`dflash.loss: ce`), as the DFlash reference (SpecForge) trains; against the target's argmax
rather than the data token, because that is what greedy verification accepts, and it equals the data token on
target-regenerated data. `dflash.loss: soft_ce` uses the target's whole distribution at that position instead (its
final-normed state re-read by the head a chunk at a time); on the fixture it measured lower after 6 minutes
(benchmarks/results/drafters_6min_h200).

Loss = sum_k w_k * CE_k / sum_k w_k over valid slots, w_k = exp(-(k-1) / gamma): early slots matter most,
since a block is only accepted up to its first miss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.kernels.chunked_loss import LossGrad, row_losses
from draftsmith.kernels.fused_head_loss import head_loss_rows
from draftsmith.models.losses import simulated_acceptance_length


@torch.no_grad()
def teacher_argmax(last_hidden: torch.Tensor, lm_head, chunk_size: int = 1024) -> torch.Tensor:
    """The target's greedy next token at every position, (B, S) int64, from its final-normed last hidden state;
    full-vocabulary logits exist one chunk of positions at a time."""
    out = [lm_head(last_hidden[:, i:i + chunk_size]).argmax(-1) for i in range(0, last_hidden.shape[1], chunk_size)]
    return torch.cat(out, dim=1)


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None,
                   anchor_in_mask: bool = False):
    """Random distinct anchors per row, sorted: positions a with loss_mask[a+1] set (and, with `anchor_in_mask`,
    loss_mask[a] too: DSpark's anchor slot predicts, so DeepSpec takes anchors inside the answer only).

    Returns anchor_positions (B, N) int64 and block_valid (B, N) bool, N = min(num_anchors, most candidates in a
    row); rows with fewer candidates are padded with anchor 0 and block_valid False.
    """
    b, s = loss_mask.shape
    candidate = torch.zeros(b, s, dtype=torch.bool, device=loss_mask.device)
    candidate[:, :-1] = loss_mask[:, 1:] > 0
    if anchor_in_mask:
        candidate &= loss_mask > 0
    counts = candidate.sum(dim=1)  # (B,)
    n = max(1, min(num_anchors, int(counts.max())))
    scores = torch.rand(b, s, generator=generator, device=loss_mask.device if generator is None else "cpu")
    scores = scores.to(loss_mask.device).masked_fill(~candidate, 2.0)  # candidates first, in random order
    picked = scores.argsort(dim=1)[:, :n]  # (B, N)
    valid = torch.arange(n, device=loss_mask.device)[None, :] < counts[:, None]  # (B, N)
    positions, _ = torch.where(valid, picked, s).sort(dim=1)  # valid anchors ascending, padding (s) last
    return torch.where(valid, positions, 0), valid


def label_source_positions(anchor_positions, block_size: int, seq_len: int) -> torch.Tensor:
    """(B, N, B_k-1): the position whose target output labels each mask slot, a + k - 1, clamped inside the
    sequence (slots past the end carry no loss)."""
    pos = anchor_positions.unsqueeze(-1) + torch.arange(1, block_size, device=anchor_positions.device)
    return pos.clamp(max=seq_len - 1) - 1


def teacher_rows(last_hidden, anchor_positions, valid, block_size: int) -> torch.Tensor:
    """(M, H): the target's final-normed state at each valid slot's label position, in `valid`'s order."""
    b, s, h = last_hidden.shape
    source = label_source_positions(anchor_positions, block_size, s)  # (B, N, B_k-1)
    rows = source + torch.arange(b, device=source.device)[:, None, None] * s
    return last_hidden.reshape(b * s, h)[rows[valid]]


def block_labels(teacher_ids, loss_mask, anchor_positions, block_valid, block_size: int):
    """Labels (B, N, B_k-1) of mask slots 1..B_k-1 and whether each counts (see the module docstring)."""
    b, s = teacher_ids.shape
    n = anchor_positions.shape[1]
    source = label_source_positions(anchor_positions, block_size, s)  # (B, N, B_k-1): a + k - 1, clamped
    inside = anchor_positions.unsqueeze(-1) + torch.arange(1, block_size, device=teacher_ids.device) < s
    labels = teacher_ids.gather(1, source.view(b, -1)).view(b, n, -1)  # the target's argmax one position earlier
    valid = inside & (loss_mask.gather(1, (source + 1).view(b, -1)).view(b, n, -1) > 0) & block_valid.unsqueeze(-1)
    return labels, valid


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for slots k = 1..B_k-1, shape (B_k-1,)."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def _chunk_cross_entropy(hidden, labels, weight):
    logits = F.linear(hidden.to(weight.dtype), weight).float()  # (M, V)
    # argmax of a row holding NaN is the NaN's index, which can equal the label: such a row predicts nothing (-1)
    pred = logits.argmax(-1).masked_fill(~torch.isfinite(logits).all(-1), -1)
    return F.cross_entropy(logits, labels, reduction="none"), pred


def _chunk_soft_cross_entropy(hidden, labels, teacher_hidden, weight):
    logits = F.linear(hidden.to(weight.dtype), weight).float()  # (M, V)
    pred = logits.argmax(-1).masked_fill(~torch.isfinite(logits).all(-1), -1)
    with torch.no_grad():
        teacher = F.linear(teacher_hidden.to(weight.dtype), weight).float().softmax(-1)
    return -(teacher * logits.log_softmax(-1)).sum(-1), pred


def _chunk_cross_entropy_fused(hidden, labels, weight):
    """`_chunk_cross_entropy` through the Triton kernel (kernels/fused_head_loss.py)."""
    return head_loss_rows(hidden.to(weight.dtype), weight, kind="ce", labels=labels)  # argmax -1 where not finite


def _chunk_soft_cross_entropy_fused(hidden, labels, teacher_hidden, weight):
    losses, pred, _ = head_loss_rows(hidden.to(weight.dtype), weight, kind="soft_ce",
                                     teacher_x=teacher_hidden.to(weight.dtype))
    return losses, pred


def head_cross_entropy(hidden, labels, head_weight, chunk_size: int | None = None, teacher_hidden=None,
                       loss_grad: LossGrad = "in_forward", loss_kernel: str = "reference"):
    """Per-row CE (M,) and argmax (M,) of `hidden` (M, H) read out by the frozen head (V, H); the argmax of a
    non-finite row is -1, so it never counts as correct. With `teacher_hidden` (M, H), the target's final-normed
    states the labels came from, the CE is against the target's whole distribution instead of its argmax.

    `chunk_size` rows at a time (None: chosen by the head's size, kernels/chunked_loss.loss_chunk_rows), each
    chunk's gradient taken as `loss_grad` says, so only (chunk, V) logits are ever alive; `loss_kernel` "fused"
    computes each chunk with the Triton kernel.
    """
    fused = loss_kernel == "fused"
    if teacher_hidden is None:
        fn, rows = _chunk_cross_entropy_fused if fused else _chunk_cross_entropy, (hidden, labels)
    else:
        fn = _chunk_soft_cross_entropy_fused if fused else _chunk_soft_cross_entropy
        rows = (hidden, labels, teacher_hidden)
    joined = row_losses(fn, rows, head_weight, chunk_size=chunk_size, vocab_size=head_weight.shape[0],
                        loss_grad=loss_grad)
    if joined is None:
        return hidden.new_zeros(0), labels.new_zeros(0)
    return joined


def dflash_loss(block_hidden, head_weight, labels, valid, gamma: float, teacher_hidden=None, chunk_size=None,
                loss_grad: LossGrad = "in_forward", loss_kernel: str = "reference"):
    """Position-decayed cross-entropy over the mask slots of every block.

    block_hidden (B, N, B_k, H) final-normed drafter states; head_weight (V, H) the target's lm_head; labels and
    valid (B, N, B_k-1). Returns (loss, metrics of 0-dim tensors): per slot i (= k-1) loss_i, acc_i, count_i, and
    sim_accept_len = 1 + mean leading correct slots per block, over blocks whose first slot counts.
    Only valid slots are read out by the head. teacher_hidden (M, H), the target's final-normed states at the
    valid slots' label positions (in `valid`'s order), makes it a soft cross-entropy against the target's whole
    distribution (`dflash.loss: soft_ce`); without it, hard CE against the argmax labels.
    """
    slots = block_hidden[:, :, 1:]  # (B, N, B_k-1, H): slot 0 is the anchor, it predicts nothing
    ce_valid, pred_valid = head_cross_entropy(slots[valid], labels[valid], head_weight, chunk_size,
                                              teacher_hidden=teacher_hidden, loss_grad=loss_grad,
                                              loss_kernel=loss_kernel)  # (M,)
    ce = torch.zeros(valid.shape, dtype=ce_valid.dtype, device=valid.device).masked_scatter(valid, ce_valid)
    correct = torch.zeros_like(valid).masked_scatter(valid, pred_valid == labels[valid])  # (B, N, B_k-1)

    w = position_weights(valid.shape[-1] + 1, gamma, valid.device) * valid  # (B, N, B_k-1)
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    metrics: dict[str, torch.Tensor] = {}
    for i in range(valid.shape[-1]):
        count = valid[..., i].sum()
        metrics[f"loss_{i}"] = ((ce[..., i] * valid[..., i]).sum() / count.clamp(min=1)).detach()
        metrics[f"acc_{i}"] = correct[..., i].sum() / count.clamp(min=1)
        metrics[f"count_{i}"] = count
    metrics["sim_accept_len"] = simulated_acceptance_length(list(correct.unbind(-1)), valid[..., 0])
    return loss, metrics
