"""EAGLE-3 as a runtime `Proposer`: greedy chain drafting with the drafter's own KV cache.

State between calls: the drafter cache holds the committed pairs (embed(x_{t+1}), g_t) for t < p, and
`self.next_hidden` is the drafter's output hidden at the last committed position, whose logits give the first
draft. Drafting appends speculative positions to the cache; the next `extend` rolls them back first.
"""

from __future__ import annotations

import torch

from draftsmith.inference.proposer import Proposal
from draftsmith.models.eagle3.io import load_drafter
from draftsmith.models.eagle3.model import Eagle3Drafter
from draftsmith.models.target import KVCache

INITIAL_CACHE_LENGTH = 2048


class Eagle3Proposer:
    def __init__(self, drafter: Eagle3Drafter, embed_tokens: torch.nn.Module):
        self.drafter = drafter
        self.embed_tokens = embed_tokens  # the target's, shared
        self.aux_layer_ids = tuple(drafter.config.aux_layer_ids)
        param = next(drafter.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.cache: KVCache | None = None
        self.committed = 0  # pairs in the cache that belong to the committed context
        self.next_hidden: torch.Tensor | None = None  # (B, 1, H)

    @classmethod
    def from_config(cls, spec, target) -> "Eagle3Proposer":
        if not spec.model:
            raise ValueError("speculative config: method eagle3 needs \"model\": the drafter folder")
        drafter = load_drafter(spec.model, device=target.device, dtype=target.dtype)
        cfg = drafter.config
        if cfg.vocab_size != target.vocab_size or cfg.target_hidden_size != target.hidden_size:
            raise ValueError(
                f"{spec.model}: drafter was trained for a target with vocab {cfg.vocab_size} and hidden size "
                f"{cfg.target_hidden_size}, this target has {target.vocab_size} and {target.hidden_size}"
            )
        target.check_aux_layer_ids(cfg.aux_layer_ids)
        return cls(drafter, target.embed_tokens)

    def begin(self, prompt_ids: torch.Tensor) -> None:
        batch = prompt_ids.shape[0]
        length = max(INITIAL_CACHE_LENGTH, 2 * prompt_ids.shape[1])
        self.cache = self.drafter.new_cache(batch, length, self.dtype, self.device)
        self.committed = 0
        self.next_hidden = None

    def _ensure_capacity(self, needed: int) -> None:
        if needed <= self.cache.max_length:
            return
        bigger = self.drafter.new_cache(self.cache.keys.shape[1], max(needed, 2 * self.cache.max_length),
                                        self.dtype, self.device)
        bigger.keys[..., : self.cache.length, :] = self.cache.keys[..., : self.cache.length, :]
        bigger.values[..., : self.cache.length, :] = self.cache.values[..., : self.cache.length, :]
        bigger.length = self.cache.length
        self.cache = bigger

    @torch.no_grad()
    def extend(self, token_ids: torch.Tensor, aux_hidden: torch.Tensor | None) -> None:
        if aux_hidden is None:
            raise ValueError("EAGLE-3 needs the target's aux hidden states in extend()")
        self.cache.rollback(self.committed)  # drop the speculative positions of the last draft
        self._ensure_capacity(self.committed + token_ids.shape[1] + 1)
        fused = self.drafter.fc(aux_hidden.to(self.dtype))  # (B, n, H)
        out = self.drafter.step(self.embed_tokens(token_ids), fused, self.cache)  # (B, n, H)
        self.committed = self.cache.length
        self.next_hidden = out[:, -1:]

    @torch.no_grad()
    def propose(self, num_tokens: int) -> Proposal:
        batch = self.next_hidden.shape[0]
        if num_tokens <= 0:
            return Proposal.empty(batch, self.device)
        self._ensure_capacity(self.committed + num_tokens)
        hidden = self.next_hidden
        drafts, scores = [], []
        for i in range(num_tokens):
            logprobs = torch.log_softmax(self.drafter.logits(hidden)[:, -1].float(), dim=-1)  # (B, V_d)
            score, draft_id = logprobs.max(dim=-1)
            token = self.drafter.draft_to_target(draft_id)  # (B,) target ids
            drafts.append(token)
            scores.append(score)
            if i + 1 < num_tokens:
                hidden = self.drafter.step(self.embed_tokens(token[:, None]), hidden, self.cache)
        token_ids = torch.stack(drafts, dim=1)  # (B, k)
        lengths = torch.full((batch,), num_tokens, dtype=torch.long, device=self.device)
        return Proposal(token_ids=token_ids, lengths=lengths, scores=torch.stack(scores, dim=1))
