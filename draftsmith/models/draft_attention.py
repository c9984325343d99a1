"""The attention projections EAGLE-1's and EAGLE-3's single draft layer share (DFlash's, with per-head norms and no
bias, has its own): grouped-query attention over an input of any width, keys named as the checkpoints name them
(`self_attn.q_proj`, ...)."""

from __future__ import annotations

from torch import nn

from draftsmith.models.targets.base import apply_rope


class DraftAttention(nn.Module):
    """q/k/v/o projections of one Llama-style attention over `input_width` features (EAGLE-1: the hidden size;
    EAGLE-3: twice it, cat(embedding, hidden)), back to the hidden size. `config` has the Llama attention keys."""

    def __init__(self, config, input_width: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(input_width, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(input_width, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(input_width, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)

    def qkv(self, x, cos, sin):
        """Rotated queries (B, h, S, hd) and keys (B, kv, S, hd), values (B, kv, S, hd)."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v
