"""Gemma 4 MTP training targets and loss, as pure functions.

Step j (1-based) of the query at position i reads the token t_{i+j} (teacher-forced: an accepted draft is that
token) and predicts t_{i+j+1}; the target's distribution over it is its logits at position i+j::

    position i           0        1        2      ...
    step 1   reads       t1       t2       t3          predicts t2, t3, t4    teacher z_1, z_2, z_3
    step 2   reads       t2       t3       t4          predicts t3, t4, t5    teacher z_2, z_3, z_4

    valid(j, i) = loss_mask[i + j + 1]       z = softcap(lm_head(last_hidden)), the target's served logits

Loss per step: soft cross-entropy of the dense head (every token's logit, so every token learns) to the target's
distribution, plus `centroid_weight` x cross-entropy of the centroid head to the cluster of the target's argmax (the
served head only scores the top clusters, so the right cluster must stay among them). Steps weigh decay**(j-1).
Agreement (the accuracy logged) is the *served* argmax, centroid selection included, against the target's argmax.
Vocabulary logits exist for `chunk` rows at a time and are recomputed in the backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class StepLoss:
    """What one training step's loss reads besides the drafter's output; the drafter's forward takes it, so its own
    (tied, trainable) head is read inside the forward, where FSDP has gathered it."""

    rows: tuple[torch.Tensor, ...]  # (B, S) -> (N,) indices of the trained positions (valid.nonzero)
    teacher: torch.Tensor  # (N, Hb) the target's final-normed state at each row's teacher position
    teacher_head: torch.Tensor  # (V, Hb) the target's head, frozen
    cap: float | None  # the target's final_logit_softcapping
    chunk: int  # rows whose vocabulary logits exist at a time


def softcapped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return logits if not cap else torch.tanh(logits / cap) * cap


def _rows(drafter, d_rows, teacher_rows, teacher_head, cap):
    """(soft CE (N,), centroid CE (N,), served agreement (N,) bool) of draft rows d (N, H) against teacher rows
    (N, Hb) of the target's final-normed state."""
    log_q = torch.log_softmax(drafter.dense_logits(d_rows).float(), dim=-1)  # (N, V)
    with torch.no_grad():
        z = softcapped(teacher_rows.to(teacher_head.dtype) @ teacher_head.t(), cap).float()  # (N, V)
        p = torch.softmax(z, dim=-1)
        best = z.argmax(-1)  # (N,)
        agree = drafter.served_logits(d_rows.detach()).argmax(-1) == best
    ce = -(p * log_q).sum(-1)
    if drafter.masked_embedding is None:
        return ce, torch.zeros_like(ce), agree
    centroid = F.cross_entropy(drafter.masked_embedding.centroids(d_rows).float(), drafter.cluster_of()[best],
                               reduction="none")
    return ce, centroid, agree


def step_losses(drafter, d_rows, teacher_rows, teacher_head, cap, chunk: int):
    """`_rows` over chunks of `chunk` rows, each chunk's vocabulary logits recomputed in the backward pass."""
    if d_rows.shape[0] == 0:  # nothing to learn here, but keep the graph so backward (and DDP) still run
        zero = d_rows.sum() * 0.0
        return zero[None][:0], zero[None][:0], torch.zeros(0, dtype=torch.bool, device=d_rows.device)
    parts = []
    for start in range(0, d_rows.shape[0], chunk):
        args = (drafter, d_rows[start:start + chunk], teacher_rows[start:start + chunk], teacher_head, cap)
        parts.append(checkpoint(_rows, *args, use_reentrant=False) if torch.is_grad_enabled() else _rows(*args))
    return tuple(torch.cat(p) for p in zip(*parts))

