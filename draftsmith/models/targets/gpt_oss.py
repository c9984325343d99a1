"""GPT-OSS targets: attention sinks, a sliding window on alternate layers, a biased top-k router.

As transformers' modeling_gpt_oss.py computes them (its eager attention, the one it ships besides flash/flex):
biased q/k/v/o projections; RoPE on the two halves of each head with half-width cos/sin (YaRN by default); scores
times head_dim^-0.5 joined by one learned sink logit per head, softmaxed in the scores' dtype after subtracting the
row maximum, the sink's share dropped; the layer types (`sliding_attention` / `full_attention`) pick each layer's
mask. The MLP is the layer's own module: router logits with a bias, top-k, softmax over the k, and the clamped
SwiGLU experts.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from draftsmith.models.targets.base import StepState, repeat_kv


class GptOssFamily:
    graphs = False  # the expert loop reads on the host which experts a step hit

    def __init__(self, model: nn.Module):
        config = model.config
        self.model = model
        self.layers = model.model.layers
        self.head_dim = config.head_dim
        self.num_kv_heads = config.num_key_value_heads
        self.layer_windows = [config.sliding_window if kind == "sliding_attention" else None
                              for kind in config.layer_types]
        self.windows = tuple(sorted({w for w in self.layer_windows if w}))

    def cache_shape(self) -> tuple[int, int, int]:
        return len(self.layers), self.num_kv_heads, self.head_dim

    def embed(self, input_ids: Tensor, state: StepState) -> Tensor:
        hidden = self.model.get_input_embeddings()(input_ids)  # (B, T, H)
        cos, sin = self.model.model.rotary_emb(hidden, state.position_ids)  # (B, T, hd/2)
        state.rotary = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, hd/2)
        return hidden

    def layer(self, index: int, hidden: Tensor, state: StepState) -> Tensor:
        layer = self.layers[index]
        attn = layer.self_attn
        batch, num_new, _ = hidden.shape
        x = layer.input_layernorm(hidden)
        q = attn.q_proj(x).view(batch, num_new, -1, self.head_dim).transpose(1, 2)  # (B, h, T, hd)
        k = attn.k_proj(x).view(batch, num_new, -1, self.head_dim).transpose(1, 2)  # (B, kv, T, hd)
        v = attn.v_proj(x).view(batch, num_new, -1, self.head_dim).transpose(1, 2)
        q, k = rope_by_halves(q, *state.rotary), rope_by_halves(k, *state.rotary)
        keys, values = state.write_kv(index, k, v)
        out = sink_attention(q, keys, values, state.masks[self.layer_windows[index]], attn.scaling, attn.sinks)
        hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(batch, num_new, -1))
        mlp_out, _ = layer.mlp(layer.post_attention_layernorm(hidden))  # (output, router scores)
        return hidden + mlp_out

    def logits(self, hidden: Tensor) -> Tensor:
        return self.model.get_output_embeddings()(self.model.model.norm(hidden))


def rope_by_halves(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """GPT-OSS's rotary embedding: the head's first and second halves rotated by half-width cos/sin."""
    first, second = torch.chunk(x, 2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def sink_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, scale: float, sinks: Tensor
                   ) -> Tensor:
    """Attention with one sink logit per head that takes a share of the softmax and contributes no value.

    q (B, h, T, hd); keys/values (B, kv, S, hd); mask (B or 1, 1, T, S) bool or None; sinks (h,). Returns (B, h, T, hd).
    """
    groups = q.shape[1] // keys.shape[1]
    keys, values = repeat_kv(keys, groups), repeat_kv(values, groups)
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale  # (B, h, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    sink = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], -1)  # (B, h, T, 1)
    joined = torch.cat([scores, sink], dim=-1)
    joined = joined - joined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(joined, dim=-1, dtype=joined.dtype)[..., :-1]  # the sink's share dropped
    return torch.matmul(probs.to(values.dtype), values)
