"""EAGLE-3 training-time-test (TTT) attention, with memory that grows linearly in the sequence length.

Step i's query at position t attends causally to the step-0 keys (positions 0..t) and to the key at its own
position t of every earlier step 1..i (the "diagonal" of EAGLE-3's Fig. 6), in one softmax:

    scores(t) = [q_t . k0_u * scale for u <= t]  ++  [q_t . kj_t * scale for j = 1..i]

`ttt_attention_reference` is the definition: (B, h, S, S) scores, a float32 softmax, all of it kept for the
backward pass, so a TTT-7 step holds seven S x S score tensors. `ttt_attention` computes the same thing a block of
queries at a time, each block against only the keys it can see (queries < b see keys < b, which also skips the
masked half of the work), under activation checkpointing: the backward pass recomputes one block's scores at a
time instead of keeping them, so no S x S tensor ever exists. Sequences of at most `query_block` positions take
the reference path unchanged (nothing recomputed). By default (`query_block=None`) a batch whose whole scores fit
`DENSE_SCORES_LIMIT` takes the reference path too: blocking and recomputing cost a small model's short sequences
more time than the memory is worth (the fixture target's 8,192-token steps of samples up to 2,048 tokens: the
blocked path and a chunked loss took 293 ms a step, 131 ms without either; benchmarks/results/peer_eagle3_h200).
Plain torch: the same code runs on CUDA, ROCm, NPU and CPU.

`doc_ids` (B, S), given for rows of packed samples, also hides every key of another sample (the diagonal keys sit
at the query's own position, so they are always its own sample's).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

DEFAULT_QUERY_BLOCK = 1024  # queries per block: scores of (B, h, 1024, <=S) at a time
DENSE_SCORES_LIMIT = 1 << 28  # B*h*S*S scores of one TTT step held whole (1 GiB in float32) before blocking pays


def query_block_for(batch: int, heads: int, seq_len: int, query_block: int | None) -> int:
    """The block `ttt_attention` computes at a time: `query_block` if given, else the whole sequence while its
    (B, h, S, S) scores stay within DENSE_SCORES_LIMIT, else DEFAULT_QUERY_BLOCK."""
    if query_block is not None:
        return query_block
    return seq_len if batch * heads * seq_len * seq_len <= DENSE_SCORES_LIMIT else DEFAULT_QUERY_BLOCK


def _attend(q, keys0, values0, diag_keys, diag_values, scale: float, offset: int, doc_q=None, doc_k=None):
    """Attention of queries at positions offset .. offset+c-1 (q: (B, h, c, hd)) over step-0 keys 0..offset+c-1
    (keys0: (B, h, offset+c, hd)) and their own diagonal keys (each (B, h, c, hd)); with doc_q (B, c) and doc_k
    (B, offset+c), only keys of the query's own sample. Returns (B, h, c, hd)."""
    c, n = q.shape[-2], keys0.shape[-2]
    visible = torch.arange(n, device=q.device)[None, :] <= torch.arange(offset, offset + c, device=q.device)[:, None]
    if doc_q is not None:
        visible = (visible[None] & (doc_q[:, :, None] == doc_k[:, None, :]))[:, None]  # (B, 1, c, n)
    scores = (q @ keys0.transpose(-1, -2)) * scale  # (B, h, c, n)
    scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
    diag = [(q * dk).sum(-1, keepdim=True) * scale for dk in diag_keys]  # each (B, h, c, 1)
    probs = torch.softmax(torch.cat([scores, *diag], dim=-1).float(), dim=-1).to(q.dtype)
    out = probs[..., :n] @ values0  # (B, h, c, hd)
    for j, dv in enumerate(diag_values):
        out = out + probs[..., n + j: n + j + 1] * dv
    return out


def ttt_attention_reference(q, keys0, values0, diag_keys, diag_values, scale: float, doc_ids=None):
    """The definition. q, keys0, values0: (B, h, S, hd) (keys already repeated to h heads); diag_keys and
    diag_values: lists of (B, h, S, hd), one per earlier step 1..i; doc_ids (B, S) or None. Returns (B, h, S, hd)."""
    return _attend(q, keys0, values0, diag_keys, diag_values, scale, 0, doc_ids, doc_ids)


def ttt_attention(q, keys0, values0, diag_keys, diag_values, scale: float, query_block: int | None = None,
                  doc_ids=None):
    """`ttt_attention_reference`, `query_block` queries at a time (None: `query_block_for`'s choice), recomputed in
    the backward pass (see module)."""
    b, h, s, _ = q.shape
    query_block = query_block_for(b, h, s, query_block)
    if s <= query_block:
        return _attend(q, keys0, values0, diag_keys, diag_values, scale, 0, doc_ids, doc_ids)
    recompute = torch.is_grad_enabled() and any(t.requires_grad for t in (q, keys0, values0, *diag_keys))
    blocks = []
    for start in range(0, s, query_block):
        end = min(start + query_block, s)
        args = (q[:, :, start:end], keys0[:, :, :end], values0[:, :, :end],
                [dk[:, :, start:end] for dk in diag_keys], [dv[:, :, start:end] for dv in diag_values], scale, start,
                None if doc_ids is None else doc_ids[:, start:end], None if doc_ids is None else doc_ids[:, :end])
        blocks.append(checkpoint(_attend, *args, use_reentrant=False) if recompute else _attend(*args))
    return torch.cat(blocks, dim=2)
