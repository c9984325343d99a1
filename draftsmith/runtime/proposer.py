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

from draftsmith.runtime.sampling import Sampler

# Fills `Proposal.token_ids` past a row's valid length. Not a vocabulary id, so it can never be accepted.
PAD_DRAFT_TOKEN = -1
# Drafter steps of one request at most this wide replay as CUDA graphs (one per width); wider ones (the first
# extend after a prompt, whose width is the prompt's length) run eagerly rather than record a graph per prompt.
MAX_GRAPHED_DRAFT_WIDTH = 16
# `Proposal.parents` entry of a tree node that continues the committed context directly.
ROOT_PARENT = -1


@dataclass
class Proposal:
    """Draft tokens for one speculative step, padded to a rectangle: a chain, or a tree when `parents` is given.

    A tree lists its nodes in topological order (every parent before its children); node j continues the
    context along the path root -> ... -> parents[j] -> j, where the root (parent ROOT_PARENT) is the last
    committed token. A chain is the tree with parents [-1, 0, 1, ..., k-2], which is what `parents=None` means.
    Example, two candidates for the first token and two continuations of the first::

        token_ids  [a, b, c, d]      a, b continue the context; c, d continue "a"
        parents    [-1, -1, 0, 0]
    """

    token_ids: Tensor  # (B, k) int64, PAD_DRAFT_TOKEN past `lengths`
    lengths: Tensor  # (B,) int64, valid drafts (tree nodes) per row, 0..k
    scores: Tensor | None = None  # (B, k) draft log-prob of each token given its parent, where the proposer has it
    parents: Tensor | None = None  # (B, k) int64 index of each node's parent in token_ids, ROOT_PARENT = the root
    draft_probs: Tensor | None = None  # (B, k, V) the distributions the drafts were *sampled* from; None = one-hot
    depth: int | None = None  # a tree's deepest path, where the proposer knows it without reading the device

    def __post_init__(self) -> None:
        if self.token_ids.dim() != 2 or self.lengths.shape != self.token_ids.shape[:1]:
            raise ValueError(
                f"Proposal: token_ids must be (B, k) and lengths (B,), got {tuple(self.token_ids.shape)} "
                f"and {tuple(self.lengths.shape)}"
            )
        for name in ("scores", "parents"):
            value = getattr(self, name)
            if value is not None and value.shape != self.token_ids.shape:
                raise ValueError(
                    f"Proposal: {name} {tuple(value.shape)} must match token_ids {tuple(self.token_ids.shape)}"
                )
        if self.draft_probs is not None and (self.draft_probs.dim() != 3
                                             or self.draft_probs.shape[:2] != self.token_ids.shape):
            raise ValueError(
                f"Proposal: draft_probs must be (B, k, V) for token_ids {tuple(self.token_ids.shape)}, "
                f"got {tuple(self.draft_probs.shape)}"
            )
        if self.parents is not None and self.draft_probs is not None:
            raise ValueError("Proposal: tree drafts are deterministic (top-k children); draft_probs is for chains")

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

    Batches (B > 1): rows are independent requests of different lengths. `begin` gets the prompts right-padded
    with PAD_DRAFT_TOKEN; `extend` gets each row's tokens right-padded with PAD_DRAFT_TOKEN past that row's count
    (a row may get none: it has finished), its features aligned with the tokens and undefined under the padding.
    A tree proposal (`Proposal.parents`) is verified along all its paths at once; `num_tokens` then bounds the
    depth of the tree (the tokens that can be committed from drafts), its node count is the proposer's own.

    Sampling: `begin` also gets the generation's `Sampler` (None when decoding greedily). A proposer that drafts
    by argmax ignores it, its drafts count as one-hot (lossless at any temperature); one that *samples* its
    drafts must draw them with `sampler.sample(sampler.probs(draft_logits))` and return those distributions as
    `Proposal.draft_probs`, over the target vocabulary.
    """

    aux_layer_ids: tuple[int, ...] | None  # target features consumed (capture convention); None when none
    # Optional, False when absent: True makes the runtime pass `extend` its token ids on the CPU, built from the
    # step's one host sync, so that a proposer whose state lives on the host (n-gram, suffix) never reads the
    # device itself (a second sync per step).
    # extends_on_host: bool
    # Optional, False when absent: True makes the runtime also `extend` a row with the tokens of the step in which
    # it ended (its output's last tokens), which a proposer learning from whole outputs needs; the row is never
    # asked for drafts again.
    # extends_finished_rows: bool
    # Optional, False when absent: True makes the runtime call `see_target_cache(cache, valid)` before every
    # `propose`, for a drafter that attends to the target's own KV cache instead of keeping one (Gemma 4's
    # assistant, as vLLM shares the target's cache with it): `cache` is the target's `KVCache` as the step left
    # it, holding every committed position but the last token, `valid` (B, T_max) bool which slots each row may
    # attend to (None: every slot below cache.length). Both are read, never written.
    # reads_target_cache: bool

    def begin(self, prompt_ids: Tensor, sampler: Sampler | None = None) -> None:
        """Start new request(s): forget all previous state. `prompt_ids` is (B, S), PAD_DRAFT_TOKEN-padded."""
        ...

    def extend(self, token_ids: Tensor, aux_hidden: Tensor | None) -> None:
        """Append committed tokens (B, n) and the target features (B, n, F) aligned as drawn above."""
        ...

    def propose(self, num_tokens: int) -> Proposal:
        """Draft tokens that continue the committed context, at most `num_tokens` along any path."""
        ...
