"""DFlash as a runtime `Proposer`: one drafter pass per step drafts a whole block.

State between calls, per row b: the drafter cache holds the context K/V of positions 0 .. p_b - 1 (every position
whose target feature the runtime has handed over), and `self.last[b]` is the token at position p_b, the last
committed one (the target has not run it yet, so it has no feature). `propose(k)` runs the block
[last, mask x k] at positions p_b .. p_b+k and returns slots 1..k: the training layout (model.py) cut to the k + 1
queries vLLM runs (its DFlash proposer queries the anchor and k masks, not the whole trained block; attention
inside a block is bidirectional, so the width changes the drafts). The block never claims cache slots, so a
rejected draft needs no rollback; `extend` appends the features of committed tokens only.

Rows of a batch grow independently (`extend` pads each row with PAD_DRAFT_TOKEN past its count). Their lengths
stay on the device; the host only keeps an upper bound (`self.bound`, the widest row could have grown by every
extend's full width) to size the cache and the slice of it that is read, so no step waits for the device.
"""

from __future__ import annotations

from functools import partial

import torch

from draftsmith import device as dev
from draftsmith.models.dflash.section import DflashConfigError
from draftsmith.models.dflash.io import load_drafter
from draftsmith.models.dflash.model import DflashDrafter
from draftsmith.models.target import KVCache
from draftsmith.runtime.proposer import MAX_GRAPHED_DRAFT_WIDTH, PAD_DRAFT_TOKEN, Proposal

INITIAL_CACHE_LENGTH = 2048


class DflashProposer:
    name = "DFlash"
    error = DflashConfigError  # what a bad speculative config raises (DSpark's proposer names its own)

    def __init__(self, drafter: DflashDrafter, embed_tokens: torch.nn.Module, lm_head: torch.nn.Module):
        self.drafter = drafter
        self.embed_tokens, self.lm_head = embed_tokens, lm_head  # the target's, shared
        self.block_size = drafter.config.block_size
        self.max_drafts = self.block_size - 1  # slot 0 is the anchor
        self.aux_layer_ids = tuple(drafter.config.aux_layer_ids)
        param = next(drafter.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.cache: KVCache | None = None
        self.lengths: torch.Tensor | None = None  # (B,) context positions cached per row (p_b)
        self.bound = 0  # host-side upper bound of max(lengths)
        self.last: torch.Tensor | None = None  # (B, 1) token at each row's newest committed position
        self._graphs_on = dev.graphs_supported(self.device)
        self._graphs = dev.GraphPool()  # one request: ("block" or extend width, cache id) -> graph

    @classmethod
    def from_config(cls, spec, target) -> "DflashProposer":
        if not spec.model:
            raise DflashConfigError("speculative config: method dflash needs \"model\": the drafter folder")
        drafter = load_drafter(spec.model, device=target.device, dtype=target.dtype)
        cfg = drafter.config
        target.check_drafter_fits(spec.model, "drafter", cfg.vocab_size, cfg.hidden_size, error=DflashConfigError)
        target.check_aux_layer_ids(cfg.aux_layer_ids)
        proposer = cls(drafter, target.embed_tokens, target.lm_head)
        proposer.check_num_tokens(spec.num_speculative_tokens)
        return proposer

    def check_num_tokens(self, k: int) -> None:
        """The method's one limit on k: what a trained block drafts."""
        if k > self.max_drafts:
            raise self.error(
                f"speculative config: num_speculative_tokens={k} exceeds what one {self.name} block of "
                f"{self.block_size} drafts: use num_speculative_tokens <= {self.max_drafts}"
            )

    def begin(self, prompt_ids: torch.Tensor, sampler=None) -> None:
        """Drafts are argmax (one-hot), lossless at any temperature: the sampler is not needed."""
        batch, width = prompt_ids.shape
        length = max(INITIAL_CACHE_LENGTH, 2 * width)
        reusable = (self._graphs_on and self.cache is not None and self.cache.keys.shape[1] == batch
                    and self.cache.max_length >= length)
        if not reusable:  # a kept cache keeps the graph recorded on it valid across requests
            self.cache = self.drafter.new_cache(batch, length, self.dtype, self.device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.bound = 0
        self.last = prompt_ids[:, :1].to(self.device)  # replaced by the prefill's extend

    def _ensure_capacity(self, needed: int) -> None:
        if needed <= self.cache.max_length:
            return
        tight = int(self.lengths.max())  # the bound overestimates in batches: re-read it before growing
        needed, self.bound = needed - (self.bound - tight), tight
        if needed <= self.cache.max_length:
            return
        bigger = self.drafter.new_cache(self.cache.keys.shape[1], max(needed, 2 * self.cache.max_length),
                                        self.dtype, self.device)
        bigger.keys[..., : self.bound, :] = self.cache.keys[..., : self.bound, :]
        bigger.values[..., : self.bound, :] = self.cache.values[..., : self.bound, :]
        self.cache = bigger
        self._graphs.clear()  # recorded on the old cache

    @torch.no_grad()
    def extend(self, token_ids: torch.Tensor, aux_hidden: torch.Tensor | None) -> None:
        if aux_hidden is None:
            raise ValueError("DFlash needs the target's aux hidden states in extend()")
        n = token_ids.shape[1]
        if n == 0:
            return
        self._ensure_capacity(self.bound + n + self.block_size)
        token_ids = token_ids.to(self.device)
        counts = (token_ids != PAD_DRAFT_TOKEN).sum(dim=1)  # (B,) committed tokens per row
        aux_hidden = aux_hidden.to(self.dtype)
        if self._graphs_on and token_ids.shape[0] == 1 and n <= MAX_GRAPHED_DRAFT_WIDTH:
            self._graphs.run((n, id(self.cache)), partial(self._extend_context, self.cache), aux_hidden,
                             self.lengths)
        else:
            self._extend_context(self.cache, aux_hidden, self.lengths)
        newest = token_ids.gather(1, (counts - 1).clamp(min=0)[:, None])  # (B, 1) the token at p_b + count
        self.last = torch.where(counts[:, None] > 0, newest, self.last)
        self.lengths = self.lengths + counts
        self.bound += n

    @torch.no_grad()
    def propose(self, num_tokens: int) -> Proposal:
        batch = self.last.shape[0]
        if num_tokens <= 0:
            return Proposal.empty(batch, self.device)
        if num_tokens > self.max_drafts:
            raise ValueError(f"{self.name} drafts at most {self.max_drafts} tokens a block, asked {num_tokens}")
        width = self.block_width(num_tokens)
        self._ensure_capacity(self.bound + width)
        if self._graphs_on and batch == 1:
            # Attending over the whole cache (masked past the row's length) gives every step the same shapes.
            cache = self.cache
            outputs = self._graphs.run(
                ("block", num_tokens, id(cache)),
                lambda last, lengths: self._draft(last, lengths, cache.max_length, num_tokens),
                self.last, self.lengths)
            scores, token_ids, lengths = (t.clone() for t in outputs)
        else:
            scores, token_ids, lengths = self._draft(self.last, self.lengths, self.bound + width, num_tokens)
        return Proposal(token_ids=token_ids, lengths=lengths, scores=scores)

    def _extend_context(self, cache, aux_hidden, lengths):
        """Context K/V of the n new positions of each row, p_b .. p_b+n-1. Padding columns of a batch write past
        the row's new length: slots the next extend or block overwrites."""
        positions = lengths[:, None] + torch.arange(aux_hidden.shape[1], device=self.device)  # (B, n)
        self.drafter.extend_context(aux_hidden, cache, positions)

    def _block_hidden(self, last: torch.Tensor, lengths: torch.Tensor, key_length: int, width: int) -> torch.Tensor:
        """Final-normed states (B, width, H) of the block [last, mask x (width-1)] at each row's next positions."""
        mask_embed = None
        if not self.drafter.config.learned_mask:
            mask_embed = self.embed_tokens.weight[self.drafter.config.mask_token_id]
        block = self.drafter.block_inputs(self.embed_tokens(last), mask_embed, width)  # (B, width, H)
        return self.drafter.draft_block(block, self.cache, lengths, key_length)

    def block_width(self, num_tokens: int) -> int:
        """Slots run to draft k tokens: the anchor and k masks."""
        return num_tokens + 1

    def _draft(self, last: torch.Tensor, lengths: torch.Tensor, key_length: int, num_tokens: int):
        """(log-probs, argmax, lengths) of the k drafts: the mask slots 1..k of a block of k + 1."""
        hidden = self._block_hidden(last, lengths, key_length, self.block_width(num_tokens))[:, 1:]  # slots 1..k
        scores, token_ids = torch.log_softmax(self.lm_head(hidden).float(), dim=-1).max(dim=-1)
        return scores, token_ids, torch.full_like(lengths, num_tokens)
