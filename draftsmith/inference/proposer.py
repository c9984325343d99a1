"""The one interface between the speculative runtime and every drafter (n-gram, EAGLE-3, MTP, DFlash, ...).

The runtime calls `begin` once per request, then alternates `propose` and `extend`; it never asks which kind of
proposer it holds. A proposer that needs target features names them in `aux_layer_ids` (capture convention,
DESIGN.md §3: id k = residual stream entering decoder layer k); the runtime then computes them during the target's
verification step and hands them over in `extend`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

# Fills `Proposal.token_ids` past a row's valid length. Not a vocabulary id, so it can never be accepted.
PAD_DRAFT_TOKEN = -1


@dataclass
class Proposal:
    """Draft tokens for one speculative step, padded to a rectangle."""

    token_ids: Tensor  # (B, k) int64, PAD_DRAFT_TOKEN past `lengths`
    lengths: Tensor  # (B,) int64, valid drafts per row, 0..k
    scores: Tensor | None = None  # (B, k) draft log-probs where the proposer has them

    def __post_init__(self) -> None:
        if self.token_ids.dim() != 2 or self.lengths.shape != self.token_ids.shape[:1]:
            raise ValueError(
                f"Proposal: token_ids must be (B, k) and lengths (B,), got {tuple(self.token_ids.shape)} "
                f"and {tuple(self.lengths.shape)}"
            )
        if self.scores is not None and self.scores.shape != self.token_ids.shape:
            raise ValueError(
                f"Proposal: scores {tuple(self.scores.shape)} must match token_ids {tuple(self.token_ids.shape)}"
            )

    @classmethod
    def empty(cls, batch_size: int, device: torch.device | str = "cpu") -> "Proposal":
        """No drafts for any row (k = 0): the step degenerates to one plain target step."""
        return cls(
            token_ids=torch.empty(batch_size, 0, dtype=torch.long, device=device),
            lengths=torch.zeros(batch_size, dtype=torch.long, device=device),
        )


@runtime_checkable
class Proposer(Protocol):
    """What the runtime needs from a drafter.

    `extend` pairs each target feature with the token that followed it. With `p` = positions paired so far
    (0 after `begin`), one row reads::

        position        p         p+1       ...  p+n-1
        aux_hidden      [:, 0]    [:, 1]    ...  [:, n-1]    target features computed at that position
        token_ids       [:, 0]    [:, 1]    ...  [:, n-1]    the token at the *next* position, p+1 .. p+n

    so `aux_hidden[:, j]` was computed at the position right before `token_ids[:, j]`: the feature from which the
    target predicted that token, the same pairing (g_i, x_i+1) a drafter is trained on. Afterwards p += n and the
    committed context is p + 1 tokens long. The runtime drives it like this (S = prompt length)::

        begin(prompt)                                    p = 0, context = prompt (S tokens, none paired yet)
        extend(prompt[:, 1:] ++ [t0], aux @ 0..S-1)      prefill: restates the prompt so every prompt feature
                                                         gets its next token; p = S, context = prompt ++ [t0]
        propose(k) -> d_0..d_k-1                         drafts continue the context
        (target verifies [last, d_0..d_k-1] at positions p..p+k, accepts a, adds recovered/bonus b)
        extend([d_0..d_a-1, b], aux @ p..p+a)            p += a + 1

    Tokens restated for positions the proposer already knows (the prompt) equal what it was given in `begin`.
    Batches (B > 1) with ragged commits will pad `token_ids` with PAD_DRAFT_TOKEN past each row's count; today
    the runtime drives B = 1 only.
    """

    aux_layer_ids: tuple[int, ...] | None  # target features consumed (capture convention); None when none

    def begin(self, prompt_ids: Tensor) -> None:
        """Start new request(s): forget all previous state. `prompt_ids` is (B, S)."""
        ...

    def extend(self, token_ids: Tensor, aux_hidden: Tensor | None) -> None:
        """Append committed tokens (B, n) and the target features (B, n, F) aligned as drawn above."""
        ...

    def propose(self, num_tokens: int) -> Proposal:
        """Draft up to `num_tokens` tokens that continue the committed context."""
        ...
