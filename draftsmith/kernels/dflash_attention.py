"""DFlash training attention that skips the blocks a query cannot see.

In a training pass every sequence carries N blocks of B_k slots. A query of block j sees the context positions
before its anchor and the B_k slots of its own block, nothing else (models/dflash/model.py). The definition,
`dflash_attention_reference`, lays the keys out as [context | block 0 | ... | block N-1] and masks them: one fused
attention over S + N*B_k keys per query, almost all of them the masked-off blocks of other anchors (at 512 anchors
and B_k 16, 8,192 block keys per query against the B_k that count), and a (B, N*B_k, S + N*B_k) mask.

`dflash_attention` runs the same attention `blocks_per_chunk` blocks at a time, each chunk over the context up to
its largest anchor and its own blocks only: keys [context < max anchor | the chunk's blocks], masked as the
definition masks them. Each chunk is one call of torch's fused scaled_dot_product_attention (no score tensor
kept for the backward pass), so compute falls from N*B_k * (S + N*B_k) to about N*B_k * (S + chunk*B_k) key
products per head, and the mask from (N*B_k)^2 to chunk-sized pieces. The same code runs on CUDA, ROCm, NPU and CPU.
"""

from __future__ import annotations

import torch

DEFAULT_BLOCKS_PER_CHUNK = 64  # 64 blocks of 16 slots: 1,024 queries a chunk


def block_attention_mask(anchor_positions: torch.Tensor, context_length: int, block_size: int) -> torch.Tensor:
    """The definition's mask (B, N*B_k, S + N*B_k), True = may attend, keys laid out [context | block 0 | ...].

    A query of block j sees context positions < anchor_j and every slot of block j; no other block. A padding
    block (anchor 0) sees only itself, which keeps its softmax finite; its slots carry no loss.
    """
    batch, n = anchor_positions.shape
    device = anchor_positions.device
    q_block = torch.arange(n * block_size, device=device) // block_size  # (Q,)
    anchor_of_query = anchor_positions[:, q_block]  # (B, Q)
    context = torch.arange(context_length, device=device)[None, None, :] < anchor_of_query[:, :, None]  # (B, Q, S)
    same_block = (q_block[:, None] == q_block[None, :]).expand(batch, -1, -1)  # (B, Q, Q)
    return torch.cat([context, same_block], dim=-1)


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    groups = heads // x.shape[1]
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def dflash_attention_reference(q, ctx_k, ctx_v, block_k, block_v, anchor_positions, block_size: int, scale: float):
    """The definition. q, block_k, block_v: (B, h|kv, N*B_k, hd); ctx_k, ctx_v: (B, kv, S, hd); anchor_positions
    (B, N). Returns (B, h, N*B_k, hd)."""
    heads = q.shape[1]
    keys = _repeat_kv(torch.cat([ctx_k, block_k], dim=2), heads)
    values = _repeat_kv(torch.cat([ctx_v, block_v], dim=2), heads)
    mask = block_attention_mask(anchor_positions, ctx_k.shape[2], block_size).unsqueeze(1)
    return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)


def dflash_attention(q, ctx_k, ctx_v, block_k, block_v, anchor_positions, block_size: int, scale: float,
                     blocks_per_chunk: int = DEFAULT_BLOCKS_PER_CHUNK):
    """`dflash_attention_reference`, `blocks_per_chunk` blocks at a time (see the module docstring).

    Anchors need not be sorted; a chunk reads the context up to its largest anchor (one host read of the anchors
    per call)."""
    heads = q.shape[1]
    ctx_k, ctx_v = _repeat_kv(ctx_k, heads), _repeat_kv(ctx_v, heads)
    block_k, block_v = _repeat_kv(block_k, heads), _repeat_kv(block_v, heads)
    n = anchor_positions.shape[1]
    starts = list(range(0, n, blocks_per_chunk))
    limits = [max(1, int(v)) for v in
              torch.stack([anchor_positions[:, i:i + blocks_per_chunk].max() for i in starts]).tolist()]
    outs = []
    for start, limit in zip(starts, limits):
        end = min(start + blocks_per_chunk, n)
        lo, hi = start * block_size, end * block_size
        keys = torch.cat([ctx_k[:, :, :limit], block_k[:, :, lo:hi]], dim=2)
        values = torch.cat([ctx_v[:, :, :limit], block_v[:, :, lo:hi]], dim=2)
        mask = block_attention_mask(anchor_positions[:, start:end], limit, block_size).unsqueeze(1)
        outs.append(torch.nn.functional.scaled_dot_product_attention(q[:, :, lo:hi], keys, values, attn_mask=mask,
                                                                      scale=scale))
    return torch.cat(outs, dim=2)
