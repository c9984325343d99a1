"""Gemma 4 MTP as a runtime `Proposer`: the assistant's query-only layers over the target's own KV cache.

As vLLM's `Gemma4Proposer` runs it: with the context t_0..t_c (c = committed tokens - 1), the target's cache holds
positions 0..c-1 and its last hidden state h_{c-1} (final-normed) predicted t_c. Every draft step queries position
c-1 over those keys (`constant_draft_positions`), so the assistant keeps no cache of its own::

    step 1   token t_c     hidden h_{c-1}                    -> d_1 = argmax, h'_1 = post_projection(d)
    step 2   token d_1     hidden h'_1                       -> d_2
    ...      each at position c-1, keys 0..c-1 of the target's last own-K/V sliding and full layers

A sliding layer sees the last `sliding_window` keys, as vLLM's per-layer window (transformers' assisted generation
lets it see one more). Drafts are the served head's argmax (the centroid clusters' tokens only), one-hot, so the
sampler is not used. The runtime hands over the cache before each proposal (`reads_target_cache`); batches with
holes read it through the runtime's per-row validity mask, so every row sees exactly its own committed keys.
"""

from __future__ import annotations

import torch

from draftsmith.models.gemma4_mtp.config import TARGET_MODEL_TYPES, source_layers
from draftsmith.models.gemma4_mtp.io import load_drafter
from draftsmith.models.gemma4_mtp.model import Gemma4MtpDrafter
from draftsmith.models.targets.base import windowed
from draftsmith.runtime.proposer import PAD_DRAFT_TOKEN, Proposal


class Gemma4MtpProposer:
    reads_target_cache = True

    def __init__(self, drafter: Gemma4MtpDrafter, target, num_speculative_tokens: int):
        family = target.family
        if getattr(target.config, "model_type", "") not in TARGET_MODEL_TYPES or family is None:
            raise ValueError(f"Gemma 4 MTP drafts for Gemma 4 targets, not a "
                             f"{getattr(target.config, 'model_type', '?')!r} target")
        sources = source_layers(target.config)
        self.rows: dict[str, tuple[int, int, int]] = {}  # layer type -> (cache row, kv heads, head dim)
        for layer in drafter.model.layers:
            kind = layer.self_attn.layer_type
            if kind not in sources:
                raise ValueError(f"Gemma 4 MTP: the assistant has a {kind} layer, the target none that computes K/V")
            index = sources[kind]
            heads, head_dim = family.kv_heads[index], family.layers[index].self_attn.head_dim
            if layer.self_attn.head_dim != head_dim or drafter.text_config.num_attention_heads % heads:
                raise ValueError(f"Gemma 4 MTP: the assistant's {kind} layers (head dim {layer.self_attn.head_dim}) "
                                 f"do not fit target layer {index} ({heads} K/V heads of dim {head_dim})")
            self.rows[kind] = (family.cache_index[index], heads, head_dim)
        self.windows = {kind: drafter.text_config.sliding_window if kind == "sliding_attention" else None
                        for kind in self.rows}
        self.drafter = drafter
        self.embed_tokens = target.embed_tokens  # the target's, scaled by sqrt(H): vLLM shares it
        self.final_norm = target.final_norm  # h = final_norm(capture id L), what vLLM's Gemma 4 returns
        self.num_steps = num_speculative_tokens
        self.aux_layer_ids = (target.num_layers,)
        param = next(drafter.parameters())
        self.device, self.dtype = param.device, param.dtype
        self._cache = self._valid = None

    @classmethod
    def from_config(cls, spec, target) -> "Gemma4MtpProposer":
        try:
            drafter = load_drafter(spec.model, device=target.device, dtype=target.dtype)
        except ValueError as e:
            raise ValueError(f"speculative config: Gemma 4 MTP: {e}") from None
        cfg = drafter.config
        if (cfg.vocab_size, cfg.backbone_hidden_size) != (target.vocab_size, target.hidden_size):
            raise ValueError(f"{spec.model}: Gemma 4 assistant for a target of vocab {cfg.vocab_size} and hidden size "
                             f"{cfg.backbone_hidden_size}; this target has {target.vocab_size} and "
                             f"{target.hidden_size}")
        return cls(drafter, target, spec.num_speculative_tokens)

    def begin(self, prompt_ids: torch.Tensor, sampler=None) -> None:
        batch = prompt_ids.shape[0]
        hidden = self.drafter.config.backbone_hidden_size
        self.last_token = torch.zeros(batch, dtype=torch.long, device=self.device)  # (B,) t_c
        self.last_hidden = torch.zeros(batch, hidden, dtype=self.dtype, device=self.device)  # (B, Hb) h_{c-1}
        self.position = torch.full((batch,), -1, dtype=torch.long, device=self.device)  # (B,) c-1
        self.fresh = torch.zeros(batch, dtype=torch.bool, device=self.device)  # extended since its last proposal
        self._cache = self._valid = None  # the runtime hands this request's over before each proposal

    def see_target_cache(self, cache, valid) -> None:
        self._cache, self._valid = cache, valid

    def extend(self, token_ids: torch.Tensor, aux_hidden: torch.Tensor | None) -> None:
        if aux_hidden is None:
            raise ValueError("Gemma 4 MTP needs the target's last hidden state in extend()")
        token_ids = token_ids.to(self.device, torch.long)
        batch, width = token_ids.shape
        counts = (token_ids != PAD_DRAFT_TOKEN).sum(1) if batch > 1 else torch.full((1,), width, device=self.device)
        last = (counts - 1).clamp_min(0)  # (B,) each row's newest token
        rows = torch.arange(batch, device=self.device)
        got = counts > 0
        token = token_ids[rows, last]
        hidden = self.final_norm(aux_hidden[rows, last].to(self.device)).to(self.dtype)  # (B, Hb)
        self.last_token = torch.where(got, token, self.last_token)
        self.last_hidden = torch.where(got[:, None], hidden, self.last_hidden)
        self.position = self.position + counts
        self.fresh = self.fresh | got

    def _target_kv(self):
        """Per layer type (keys, values) (B, kv, S, hd) of the target's cache, and the masks (B or 1, 1, 1, S)."""
        cache = self._cache
        if cache is None:
            raise ValueError("Gemma 4 MTP: the runtime did not hand over the target's cache (see_target_cache)")
        length = cache.length
        kv = {}
        for kind, (row, heads, head_dim) in self.rows.items():
            kv[kind] = tuple(store[row, :, 0, :length, :heads * head_dim].unflatten(-1, (heads, head_dim))
                             .transpose(1, 2) for store in (cache.keys, cache.values))
        seen = (self._valid[:, :length] if self._valid is not None
                else torch.ones(1, length, dtype=torch.bool, device=self.device))[:, None, None, :]
        masks = {kind: seen if not window else windowed(seen, window) for kind, window in self.windows.items()}
        return kv, masks

    @torch.no_grad()
    def propose(self, num_tokens: int) -> Proposal:
        num = min(num_tokens, self.num_steps)
        batch = self.last_token.shape[0]
        if num <= 0:
            return Proposal.empty(batch, self.device)
        kv, masks = self._target_kv()
        position = self.position[:, None]  # (B, 1) every step queries the last paired position
        token, hidden = self.last_token, self.last_hidden
        drafts, scores = [], []
        for _ in range(num):
            d, hidden = self.drafter(self.embed_tokens(token[:, None]), hidden[:, None], position, kv, masks)
            d, hidden = d[:, 0], hidden[:, 0]  # (B, H), (B, Hb)
            score, token = torch.log_softmax(self.drafter.served_logits(d), dim=-1).max(dim=-1)  # (B,)
            drafts.append(token)
            scores.append(score)
        live = self.fresh
        self.fresh = torch.zeros_like(live)
        token_ids = torch.stack(drafts, dim=1).masked_fill(~live[:, None], PAD_DRAFT_TOKEN)  # (B, num)
        lengths = torch.where(live, num, 0).long()
        return Proposal(token_ids=token_ids, lengths=lengths, scores=torch.stack(scores, dim=1))
