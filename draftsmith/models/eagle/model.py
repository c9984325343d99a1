"""The EAGLE-1/2 drafter: fc over the token embedding and the target's feature, one decoder layer, the target's head.

Shapes: H = the target's hidden size (the drafter's too), V = the target's vocabulary.

    x      = fc(cat(embed(x_{t+1}), h_t))           (2H -> H), embedding first, bias as the config says
    a      = x + o_proj(attn(x))                     no input norm: the reference's layer 0 has none
    out    = a + mlp(post_attention_layernorm(a))    no final norm: out is the predicted next feature
    logits = lm_head(out)                            the target's head, frozen and shared

as the EAGLE reference computes it (SafeAILab/EAGLE `eagle/model/cnets1.py`: `fc(cat((inputs_embeds,
hidden_states)))`, `LlamaDecoderLayer` index 0 without `input_layernorm`, `head(out_hidden)`) and vLLM's
`llama_eagle.py` (`fc(cat((input_embeds, hidden_states)))`, `disable_input_layernorm`, `hidden_states + residual`).
h_t is the target's last hidden state *after* its final norm: what the target's head reads, what the reference
trains on (Hugging Face's last `hidden_states`) and what vLLM hands the drafter for `method: eagle` (the model's
forward output). The runtime captures the last layer's output (capture id L) and applies the target's own final norm
(`fuse`), as MTP does.

Position alignment (vLLM's EAGLE proposer, and EAGLE-3's): drafter position t holds the pair (embed(x_{t+1}), h_t)
and its output o_t, trained toward h_{t+1}, predicts x_{t+2}; drafting, the i-th step from t sits at position t + i
and reads the drafter's own previous output in place of h.

    tokens   x0      x1      x2      x3 ...
    target   h0      h1      h2      h3         (h_t has seen x_0..x_t; lm_head(h_t) predicts x_{t+1})
    drafter  (x1,h0) (x2,h1) (x3,h2)            at positions 0, 1, 2
    output   o0~h1   o1~h2   o2~h3              lm_head(o_t) predicts x_{t+2}: x2, x3, x4
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from draftsmith.models.eagle.config import EagleConfig
from draftsmith.models.draft_attention import DraftAttention
from draftsmith.models.target import KVCache, attend


class EagleLayer(nn.Module):
    """The reference's decoder layer 0: attention straight on fc's output (no input_layernorm), then the MLP."""

    def __init__(self, config: EagleConfig):
        super().__init__()
        self.self_attn = DraftAttention(config, config.hidden_size)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config.llama_config())

    def finish(self, x, attn_out):
        """o_proj plus the residual x (fc's output), then the MLP block: the layer's output (B, S, H)."""
        b, _, s, _ = attn_out.shape
        out = x + self.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, s, -1))
        return out + self.mlp(self.post_attention_layernorm(out))


class EagleDrafter(nn.Module):
    """Tensor names are the reference's (`fc.*`, `layers.0.*`). The target's final norm and head are shared at run
    time (`share_target`), never owned or saved: the runtime loop of EAGLE-3 (models/eagle3/proposer.py) drives it
    through `fuse`, `step`, `step_static`, `chain_static`, `logits` and `draft_to_target`."""

    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.fc_bias)
        self.layers = nn.ModuleList([EagleLayer(config)])
        self.rotary_emb = LlamaRotaryEmbedding(config.llama_config())
        # the runtime loop maps draft ids to target ids with d2t (EAGLE-3's draft vocabulary); here they are equal
        self.register_buffer("d2t", torch.zeros(config.vocab_size, dtype=torch.long), persistent=False)
        self._target: tuple[nn.Module, nn.Module] | None = None  # (final norm, head): a tuple, so never registered

    @property
    def layer(self) -> EagleLayer:
        return self.layers[0]

    def share_target(self, final_norm: nn.Module, lm_head: nn.Module) -> None:
        """Read out through the target's own final norm (of the captured last-layer output) and head."""
        self._target = (final_norm, lm_head)

    def _shared(self) -> tuple[nn.Module, nn.Module]:
        if self._target is None:
            raise RuntimeError("EAGLE drafter: share_target(final_norm, lm_head) was not called")
        return self._target

    def rope(self, like, position_ids):
        cos, sin = self.rotary_emb(like, position_ids)  # (B, S, hd)
        return cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, S, hd)

    def _project(self, embeds, hidden, cos, sin):
        """x = fc(cat(embeds, hidden)) (B, S, H) and its rotated queries, keys and values."""
        x = self.fc(torch.cat([embeds.to(hidden.dtype), hidden], dim=-1))  # embedding first (module docstring)
        return (x, *self.layer.self_attn.qkv(x, cos, sin))

    # ---- training ------------------------------------------------------------------------------------------
    def forward(self, hidden, token_embeds, position_ids=None):
        """Training forward over whole sequences: hidden (B, S, H) = h_t, token_embeds (B, S, H) = embed(x_t).
        Position t pairs embed(x_{t+1}) with h_t (the last position, whose next token lies past the end, gets a
        zero embedding; the loss never reads it) and returns o_t (B, S, H), causal over positions 0..t."""
        b, s, _ = hidden.shape
        embeds = torch.zeros_like(token_embeds)
        embeds[:, : s - 1] = token_embeds[:, 1:]  # embed(x_{t+1})
        if position_ids is None:
            position_ids = torch.arange(s, device=hidden.device).unsqueeze(0).expand(b, -1)
        cos, sin = self.rope(hidden, position_ids)
        x, q, k, v = self._project(embeds, hidden, cos, sin)
        groups = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1),
                                             is_causal=True, scale=self.layer.self_attn.head_dim ** -0.5)
        return self.layer.finish(x, out)

    # ---- runtime (what the EAGLE loop calls) ------------------------------------------------------------------
    def fuse(self, last_hidden):
        """The target's final norm over its captured last-layer output (B, T, H): h_t as the drafter was trained."""
        return self._shared()[0](last_hidden)

    def logits(self, hidden):
        """Logits (B, T, V) of output hiddens, through the target's head (no norm: the reference has none)."""
        return self._shared()[1](hidden)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids  # the target's vocabulary

    def new_cache(self, batch_size, max_length, dtype, device) -> KVCache:
        attn = self.layer.self_attn
        return KVCache(1, batch_size, attn.num_kv_heads, attn.head_dim, max_length, dtype, device)

    def step(self, embeds, hidden, cache: KVCache, attention_mask=None, position_ids=None):
        """Append T pairs (embeds (B, T, H), hidden (B, T, H)) at slots cache.length..; returns the outputs (B, T, H).

        `hidden` is fuse(captured) for committed context and the drafter's previous output while drafting.
        `attention_mask` (B or 1, 1, T, cache.length+T) bool replaces the causal mask and `position_ids` (B, T) the
        slot positions (draft trees, batches with per-row lengths)."""
        b, t, _ = embeds.shape
        start, end = cache.length, cache.length + t
        if end > cache.max_length:
            raise ValueError(f"draft KV cache overflow: {end} > {cache.max_length}")
        if position_ids is None:
            position_ids = torch.arange(start, end, device=embeds.device).unsqueeze(0).expand(b, -1)
        x, q, k, v = self._project(embeds, hidden, *self.rope(embeds, position_ids))
        cache.keys[0, :, :, start:end] = k
        cache.values[0, :, :, start:end] = v
        mask = attention_mask
        if mask is None and t > 1:
            mask = (torch.arange(end, device=embeds.device)[None, :]
                    <= torch.arange(start, end, device=embeds.device)[:, None])[None, None]
        scale = self.layer.self_attn.head_dim ** -0.5
        out = attend(q, cache.keys[0, :, :, :end], cache.values[0, :, :, :end], mask, scale=scale)
        cache.length = end
        return self.layer.finish(x, out)

    def step_static(self, embeds, hidden, cache: KVCache, position_ids, attention_mask=None, slots=None):
        """Shape-static `step` for CUDA graphs (B = 1): K/V scattered at `slots` (T,) (default: the positions of
        `position_ids` (1, T)), queries over the whole cache masked by position or by `attention_mask` (1, 1, T,
        T_max). Does not move `cache.length`: the caller does."""
        x, q, k, v = self._project(embeds, hidden, *self.rope(embeds, position_ids))
        slots = position_ids[0] if slots is None else slots  # (T,)
        cache.keys[0].index_copy_(2, slots, k)
        cache.values[0].index_copy_(2, slots, v)
        mask = attention_mask
        if mask is None:
            key_pos = torch.arange(cache.max_length, device=embeds.device)
            mask = (key_pos[None, None, :] <= position_ids[:, :, None])[:, None]  # (1, 1, T, T_max)
        out = attend(q, cache.keys[0], cache.values[0], mask, scale=self.layer.self_attn.head_dim ** -0.5)
        return self.layer.finish(x, out)

    def chain_static(self, hidden, start, cache: KVCache, embed_tokens, num_tokens: int, choose=None):
        """`num_tokens` drafts from `hidden` (1, 1, H), the output at the last committed pair; step i writes its pair
        at position start + i (start (1, 1) long). `choose(i, logits)` picks step i's id and score from the float32
        logits (1, V), by default the argmax and its log-prob. No host sync: what a CUDA graph records. Returns
        token ids (1, k) and scores (1, k)."""
        tokens, scores = [], []
        for i in range(num_tokens):
            logits = self.logits(hidden)[:, -1].float()  # (1, V)
            if choose is None:
                score, token = torch.log_softmax(logits, dim=-1).max(dim=-1)
            else:
                token, score = choose(i, logits)
            tokens.append(token)
            scores.append(score)
            if i + 1 < num_tokens:
                hidden = self.step_static(embed_tokens(token[:, None]), hidden, cache, start + i)
        return torch.stack(tokens, dim=1), torch.stack(scores, dim=1)
