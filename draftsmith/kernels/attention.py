"""Attention over a cache with grouped K/V heads and a boolean mask (True = may attend): the targets' layers, the
drafters' layers and the block-attention reference all call `attend`; the compiled decoder layer of the dense
targets calls `grouped_attention`, the same numbers without repeating K/V.

q (B, h, T, hd); keys/values (B, kv, S, hd), kv dividing h (query head n reads K/V head n // (h // kv), as
`repeat_interleave` lays them out); mask broadcastable to (B, h, T, S), or None (no masking).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend(q, keys, values, mask, scale):
    """Scaled dot-product attention (SDPA) with the K/V heads repeated for their query heads. (B, h, T, hd)."""
    groups = q.shape[1] // keys.shape[1]
    if groups > 1:
        keys = keys.repeat_interleave(groups, dim=1)  # (B, h, S, hd)
        values = values.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)


def grouped_attention(q, keys, values, mask, scale):
    """`attend` without copying K/V once per query head: the queries of each K/V head are stacked
    (B, kv, groups*T, hd), so keys and values are read once. Softmax in float32. For the compiled static step, where
    the compiler fuses mask, softmax and casts; `mask` (B or 1, 1, T, S)."""
    batch, num_heads, num_new, head_dim = q.shape
    num_kv = keys.shape[1]
    q = q.reshape(batch, num_kv, num_heads // num_kv * num_new, head_dim)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale  # (B, kv, g*T, S)
    if mask is not None:
        scores = scores.view(batch, num_kv, -1, num_new, scores.shape[-1])
        scores = scores.masked_fill(~mask[:, :, None], float("-inf")).flatten(2, 3)
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).view(batch, num_heads, num_new, head_dim)
