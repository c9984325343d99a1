"""Llama-shaped targets: Llama, Mistral, Qwen2, Qwen3, and Qwen3-MoE, whose layer differs only in its MLP module.

Pre-norm attention over the runtime's cache (q/k RMSNorm per head where the layer has them, Qwen3's; RoPE by
halves; grouped K/V heads), then the layer's own MLP module: a gated MLP, or Qwen3-MoE's sparse block, whose
router (softmax over the experts, top-k, renormalised when `norm_topk_prob`) and expert loop are transformers'
own. The dense families also have a compiled form of this layer (`target.decoder_layer_static`, DRAFTSMITH_COMPILE).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.models.targets.base import StepState, apply_rope


class LlamaFamily:
    def __init__(self, model: nn.Module, window: int | None = None, graphs: bool = True):
        """`window`: a sliding window every layer applies (Qwen3-MoE with use_sliding_window); `graphs`: False for
        MoE blocks, whose expert loop reads which experts were hit on the host."""
        config = model.config
        self.model = model
        self.layers = model.model.layers
        self.num_heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.window = window
        self.windows = (window,) if window else ()
        self.graphs = graphs

    def cache_shape(self) -> tuple[int, int, int]:
        return len(self.layers), self.num_kv_heads, self.head_dim

    def embed(self, input_ids: Tensor, state: StepState) -> Tensor:
        hidden = self.model.get_input_embeddings()(input_ids)  # (B, T, H)
        cos, sin = self.model.model.rotary_emb(hidden, state.position_ids)  # (B, T, hd)
        state.rotary = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, hd)
        return hidden

    def layer(self, index: int, hidden: Tensor, state: StepState) -> Tensor:
        layer = self.layers[index]
        attn = layer.self_attn
        batch, num_new, _ = hidden.shape
        cos, sin = state.rotary
        x = layer.input_layernorm(hidden)
        q = attn.q_proj(x).view(batch, num_new, -1, self.head_dim)  # (B, T, h, hd)
        k = attn.k_proj(x).view(batch, num_new, -1, self.head_dim)
        v = attn.v_proj(x).view(batch, num_new, -1, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values = state.write_kv(index, k, v)
        out = attend(q, keys, values, state.masks[self.window], scale=self.head_dim ** -0.5)  # (B, h, T, hd)
        hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(batch, num_new, -1))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def logits(self, hidden: Tensor) -> Tensor:
        return self.model.get_output_embeddings()(self.model.model.norm(hidden))


def attend(q, keys, values, mask, scale):
    """Scaled dot-product attention with grouped K/V heads and a boolean `mask` (True = may attend).

    q (B, h, T, hd); keys/values (B, kv, S, hd); mask broadcastable to (B, h, T, S) or None (no masking).
    """
    groups = q.shape[1] // keys.shape[1]
    if groups > 1:
        keys = keys.repeat_interleave(groups, dim=1)  # (B, h, S, hd)
        values = values.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
