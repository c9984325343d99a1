"""DFlash as a runtime `Proposer`: one drafter pass per step drafts a whole block.

State between calls: the drafter cache holds the context K/V of every position p' < p whose target feature the
runtime has handed over, and `self.last` is the token at position p, the last committed one (the target has not
run it yet, so it has no feature). `propose(k)` runs the block [last, mask x (B_k-1)] at positions p..p+B_k-1 and
returns slots 1..k: exactly the training layout (model.py), whatever k is. The block never enters the cache, so a
rejected draft needs no rollback; `extend` appends the features of the committed tokens only.
"""

from __future__ import annotations

import torch

from draftsmith.inference.proposer import Proposal
from draftsmith.models.dflash.config import DflashConfigError
from draftsmith.models.dflash.model import DflashDrafter, load_drafter
from draftsmith.models.target import KVCache

INITIAL_CACHE_LENGTH = 2048


class DflashProposer:
    def __init__(self, drafter: DflashDrafter, embed_tokens: torch.nn.Module, lm_head: torch.nn.Module):
        self.drafter = drafter
        self.embed_tokens, self.lm_head = embed_tokens, lm_head  # the target's, shared
        self.block_size = drafter.config.block_size
        self.aux_layer_ids = tuple(drafter.config.aux_layer_ids)
        param = next(drafter.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.cache: KVCache | None = None
        self.last: torch.Tensor | None = None  # (B, 1) token at the newest committed position

    @classmethod
    def from_config(cls, spec, target) -> "DflashProposer":
        if not spec.model:
            raise DflashConfigError("speculative config: method dflash needs \"model\": the drafter folder")
        drafter = load_drafter(spec.model, device=target.device, dtype=target.dtype)
        cfg = drafter.config
        if cfg.vocab_size != target.vocab_size or cfg.hidden_size != target.hidden_size:
            raise DflashConfigError(
                f"{spec.model}: drafter was trained for a target with vocab {cfg.vocab_size} and hidden size "
                f"{cfg.hidden_size}, this target has {target.vocab_size} and {target.hidden_size}"
            )
        target.check_aux_layer_ids(cfg.aux_layer_ids)
        if spec.num_speculative_tokens > cfg.block_size - 1:
            raise DflashConfigError(
                f"speculative config: num_speculative_tokens={spec.num_speculative_tokens} exceeds what one DFlash "
                f"block of {cfg.block_size} drafts: use num_speculative_tokens <= {cfg.block_size - 1}"
            )
        return cls(drafter, target.embed_tokens, target.lm_head)

    def begin(self, prompt_ids: torch.Tensor) -> None:
        batch = prompt_ids.shape[0]
        length = max(INITIAL_CACHE_LENGTH, 2 * prompt_ids.shape[1])
        self.cache = self.drafter.new_cache(batch, length, self.dtype, self.device)
        self.last = prompt_ids[:, -1:].to(self.device)

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
            raise ValueError("DFlash needs the target's aux hidden states in extend()")
        self._ensure_capacity(self.cache.length + token_ids.shape[1] + self.block_size)
        self.drafter.extend_context(aux_hidden.to(self.dtype), self.cache)  # positions p .. p+n-1
        self.last = token_ids[:, -1:]  # the token at p+n, now the newest committed one

    @torch.no_grad()
    def propose(self, num_tokens: int) -> Proposal:
        batch = self.last.shape[0]
        if num_tokens <= 0:
            return Proposal.empty(batch, self.device)
        if num_tokens > self.block_size - 1:
            raise ValueError(f"DFlash drafts at most block_size - 1 = {self.block_size - 1} tokens, asked {num_tokens}")
        self._ensure_capacity(self.cache.length + self.block_size)
        anchor = self.embed_tokens(self.last)  # (B, 1, H)
        mask_embed = None
        if not self.drafter.config.learned_mask:
            mask_embed = self.embed_tokens.weight[self.drafter.config.mask_token_id]
        block = self.drafter.block_inputs(anchor, mask_embed)  # (B, B_k, H)
        hidden = self.drafter.draft_block(block, self.cache)[:, 1:num_tokens + 1]  # (B, k, H) slots 1..k
        logprobs = torch.log_softmax(self.lm_head(hidden).float(), dim=-1)  # (B, k, V)
        scores, token_ids = logprobs.max(dim=-1)
        lengths = torch.full((batch,), num_tokens, dtype=torch.long, device=self.device)
        return Proposal(token_ids=token_ids, lengths=lengths, scores=scores)
