"""Prompt-lookup (n-gram) drafting, as vLLM's `method: "ngram"` does it (Saxena 2023, "prompt lookup decoding").

No model: the draft is a copy of what followed an earlier occurrence of the context's last few tokens.
Matching rule, the same as vLLM's `_find_longest_matched_ngram_and_propose_tokens`
(vllm/v1/spec_decode/ngram_proposer.py):
  * take the longest n in [prompt_lookup_min, prompt_lookup_max] such that the context's last n tokens occur
    earlier in the context (occurrences may overlap the suffix itself, but must end before the last token);
  * among the occurrences of that n-gram, use the *earliest* one (vLLM's reverse-KMP keeps the earliest);
  * propose the up to k tokens that follow it, fewer when the context ends sooner.
Example: context [1 2 3 4 | 1 2], n in [1, 2] -> "1 2" occurred at 0..1 -> propose [3 4 1 2][:k].
vLLM runs a KMP over the reversed context; here each step is a few vectorised numpy comparisons over the
context (O(context x prompt_lookup_max)), with the same result.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from draftsmith.runtime.proposer import PAD_DRAFT_TOKEN, Proposal


def ngram_lookup(context: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """The up to `k` tokens following the earliest earlier occurrence of the longest matching suffix n-gram.

    `context` (L,) int64. Returns an (m,) int64 array, m in 0..k (empty when no n-gram of length >= min_n recurs).
    """
    length = context.shape[0]
    if length < max(min_n, 2) or k <= 0:
        return context[:0]
    # match[e]: how many tokens ending at e equal the context's last tokens, read backwards (capped at max_n).
    # Candidate ends e = 0..L-2, so every occurrence has at least one token after it.
    ends = np.arange(length - 1)  # (L-1,)
    match = np.zeros(length - 1, dtype=np.int64)
    alive = np.ones(length - 1, dtype=bool)
    for t in range(min(max_n, length - 1)):
        idx = ends - t
        alive &= (idx >= 0) & (context[np.maximum(idx, 0)] == context[length - 1 - t])
        if not alive.any():
            break
        match += alive
    best = int(match.max())
    if best < min_n:
        return context[:0]
    start = int(np.argmax(match == best)) + 1  # first (earliest) end with the longest match, plus one
    return context[start : start + k]


class NgramProposer:
    """Drafts by prompt lookup over prompt + generated tokens. Needs no target features."""

    aux_layer_ids = None
    extends_on_host = True  # the runtime hands extend() host token ids (Proposer)

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, num_speculative_tokens: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"ngram: need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max ({prompt_lookup_max})"
            )
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.num_speculative_tokens = num_speculative_tokens
        self._contexts: list[np.ndarray] = []  # per row: the committed context, (L_b,) int64
        self._paired: list[int] = []  # per row: positions whose next token `extend` has given (Proposer docs)

    @classmethod
    def from_config(cls, spec, target=None) -> "NgramProposer":
        return cls(spec.prompt_lookup_min, spec.prompt_lookup_max, spec.num_speculative_tokens)

    def begin(self, prompt_ids: Tensor, sampler=None) -> None:  # drafts are one-hot: the sampler is not needed
        rows = prompt_ids.detach().to("cpu", torch.long).numpy()  # (B, S), PAD_DRAFT_TOKEN-padded
        self._contexts = [row[row != PAD_DRAFT_TOKEN].copy() for row in rows]
        self._paired = [0] * len(rows)

    def extend(self, token_ids: Tensor, aux_hidden: Tensor | None = None) -> None:
        rows = token_ids.detach().to("cpu", torch.long).numpy()  # (B, n)
        if len(rows) != len(self._contexts):
            raise ValueError(f"ngram: extend got {len(rows)} rows for {len(self._contexts)} requests; call begin first")
        for b, row in enumerate(rows):
            row = row[row != PAD_DRAFT_TOKEN]
            # token_ids[:, j] is the token at position paired + 1 + j; earlier positions are restated prompt tokens.
            keep = self._paired[b] + 1
            self._contexts[b] = np.concatenate([self._contexts[b][:keep], row])
            self._paired[b] += len(row)

    def propose(self, num_tokens: int) -> Proposal:
        k = min(num_tokens, self.num_speculative_tokens)
        batch = len(self._contexts)
        token_ids = np.full((batch, max(k, 0)), PAD_DRAFT_TOKEN, dtype=np.int64)  # (B, k)
        lengths = np.zeros(batch, dtype=np.int64)  # (B,)
        for b, context in enumerate(self._contexts):
            draft = ngram_lookup(context, self.prompt_lookup_min, self.prompt_lookup_max, k)
            token_ids[b, : len(draft)] = draft
            lengths[b] = len(draft)
        # Drafts stay on the CPU: the runtime reads their lengths without a device sync and copies them once.
        return Proposal(token_ids=torch.from_numpy(token_ids), lengths=torch.from_numpy(lengths))
