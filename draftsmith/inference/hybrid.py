"""Suffix decoding and a trained drafter behind one proposer: per step and row, the better bet of the two.

Suffix decoding drafts for free (a CPU trie walk) and is right for long stretches where the output repeats the
prompt or earlier answers; a trained drafter (EAGLE-3) is right more often elsewhere but costs a forward per
token. So each step first asks the suffix tries: a row whose suffix draft scores at least `min_score` (the
draft's expected accepted length by the suffix counts, `suffix.path_score`) takes it, and the drafter runs only
when some row does not. Both halves see every committed token (`extend`), so either can draft at any step.

This is draftsmith's own combination, as in ArcticInference's suffix + draft-model mode; vLLM does not serve it
(`suffix_hybrid` in the speculative config). Drafts are one-hot either way (greedy drafter chains), so
verification and sampling stay lossless like any chain.
"""

from __future__ import annotations

import torch
from torch import Tensor

from draftsmith import device as dev
from draftsmith.inference.suffix import SuffixProposer, path_score
from draftsmith.runtime.proposer import Proposal


class SuffixHybridProposer:
    extends_on_host = True  # the suffix half reads host ids (Proposer); the drafter gets a queued copy
    extends_finished_rows = True  # the suffix half's global tree learns a request's last tokens, as vLLM's does

    def __init__(self, drafter, suffix: SuffixProposer, min_score: float):
        self.drafter = drafter
        self.suffix = suffix
        self.min_score = min_score
        self.aux_layer_ids = drafter.aux_layer_ids
        self.suffix_steps = 0  # rows x steps that took the suffix draft (what tests and debugging read)
        self.drafter_steps = 0

    def begin(self, prompt_ids: Tensor, sampler=None) -> None:
        self.drafter.begin(prompt_ids, sampler)
        self.suffix.begin(prompt_ids, sampler)

    def extend(self, token_ids: Tensor, aux_hidden: Tensor | None) -> None:
        self.suffix.extend(token_ids)
        self.drafter.extend(dev.host_to_device(token_ids, self.drafter.device), aux_hidden)

    def propose(self, num_tokens: int) -> Proposal:
        drafts = self.suffix.drafts(num_tokens)
        use_suffix = [bool(tokens) and path_score(ratios) >= self.min_score for tokens, ratios in drafts]
        self.suffix_steps += sum(use_suffix)
        self.drafter_steps += len(drafts) - sum(use_suffix)
        if all(use_suffix):  # the drafter is not run; the lengths stay on the CPU, as suffix's own
            return self.suffix.proposal(drafts, num_tokens)
        proposal = self.drafter.propose(num_tokens)
        if not any(use_suffix):
            return proposal
        device = proposal.token_ids.device
        mine = self.suffix.proposal(drafts, proposal.token_ids.shape[1])
        rows = dev.host_to_device(torch.tensor(use_suffix), device)  # queued copies: no sync on the drafter's work
        return Proposal(token_ids=torch.where(rows[:, None], dev.host_to_device(mine.token_ids, device),
                                              proposal.token_ids),
                        lengths=torch.where(rows, dev.host_to_device(mine.lengths, device),
                                            proposal.lengths.to(device)))
