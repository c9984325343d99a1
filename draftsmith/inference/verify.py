"""Verification of draft tokens against the target (Leviathan et al. 2023, arXiv 2211.17192, greedy case).

Glossary (vLLM's words, `vllm/v1/sample/rejection_sampler.py`):
  * draft tokens: the k tokens a proposer guessed, d_0 .. d_k-1;
  * accepted tokens: the longest prefix of the drafts that the target agrees with; under greedy decoding
    d_j is accepted when it equals the target's argmax at its position, and every earlier draft was accepted;
  * recovered token: the target's own token at the first rejected position, which replaces the draft there;
  * bonus token: the target's token after the last draft when all k were accepted; it comes for free, because
    the target's verification pass already computed the distribution at that position.
A step therefore always commits accepted + 1 tokens (recovered or bonus last), never fewer than plain decoding.

Alignment of one row of the verification pass (c = committed context length, `last` = its final token)::

    target input        last      d_0       d_1      ...  d_k-1
    position            c-1       c         c+1      ...  c+k-1
    target_logits[:, j] j=0       j=1       j=2      ...  j=k       (the target's prediction for position c+j)
    compared with       d_0       d_1       d_2      ...  (bonus)

so draft d_j is checked against argmax(target_logits[:, j]), and target_logits[:, k] gives the bonus.
"""

from __future__ import annotations

import torch
from torch import Tensor

from draftsmith.inference.proposer import PAD_DRAFT_TOKEN


def greedy_verify(draft_ids: Tensor, draft_lengths: Tensor, target_logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Accept the longest prefix of drafts equal to the target's argmax, then the target's token after it.

    draft_ids (B, k) int64, PAD_DRAFT_TOKEN past `draft_lengths` (B,); target_logits (B, k+1, V) aligned as in the
    module docstring. Returns `accepted_counts` (B,) in 0..length, `output_tokens` (B, k+1) = accepted drafts then
    the recovered/bonus token, PAD_DRAFT_TOKEN after, and `output_lengths` (B,) = accepted_counts + 1.
    """
    if draft_ids.dim() != 2 or target_logits.dim() != 3:
        raise ValueError(
            f"greedy_verify: draft_ids must be (B, k) and target_logits (B, k+1, V), got "
            f"{tuple(draft_ids.shape)} and {tuple(target_logits.shape)}"
        )
    batch, k = draft_ids.shape
    if target_logits.shape[:2] != (batch, k + 1) or draft_lengths.shape != (batch,):
        raise ValueError(
            f"greedy_verify: for draft_ids {tuple(draft_ids.shape)} expected target_logits ({batch}, {k + 1}, V) "
            f"and draft_lengths ({batch},), got {tuple(target_logits.shape)} and {tuple(draft_lengths.shape)}"
        )
    target_ids = target_logits.argmax(dim=-1)  # (B, k+1)
    positions = torch.arange(k + 1, device=draft_ids.device)  # (k+1,)
    valid = positions[None, :k] < draft_lengths[:, None]  # (B, k): drafts that exist
    matches = (draft_ids == target_ids[:, :k]) & valid  # (B, k)
    accepted = matches.long().cumprod(dim=-1).sum(dim=-1)  # (B,) length of the all-match prefix
    # Accepted drafts equal the target's argmax, so the output row is simply the target's tokens up to and
    # including position `accepted` (the recovered or bonus token).
    keep = positions[None, :] <= accepted[:, None]  # (B, k+1)
    output_tokens = torch.where(keep, target_ids, torch.full_like(target_ids, PAD_DRAFT_TOKEN))
    return accepted, output_tokens, accepted + 1
