"""DFlash's (and DSpark's) training attention: every block of a sequence in one pass, FlexAttention on GPUs, SDPA
with a dense mask elsewhere.

Queries are the N blocks' slots laid out [block 0 | block 1 | ...] (N*B_k of them); keys and values are
[context | block 0 | block 1 | ...] (S + N*B_k). Block j, anchored at a_j, sees the context positions < a_j (the
target has features for those only: models/dflash/model.py draws the alignment) and, non-causally, its own B_k
slots; no other block. A padding block (anchor 0) sees only itself, which keeps its softmax finite:

    query q (block j = q // B_k) may attend to key kv  iff  kv < min(S, a_j)                    (context)
                                                        or  S <= kv and (kv - S) // B_k == j    (its own block)

Two implementations of that one rule, chosen once per run by kernels/ttt_attention.resolve_backend from
training.block_attention, then built once per training step and shared by every layer (`training_attention`):

* "reference" (NPU and CPU, or where training.block_attention asks for it):
  `block_attention_mask`, a dense (B, N*B_k, S + N*B_k) boolean mask, into SDPA (kernels/attention.attend).
  SDPA computes every score of the mask, seen or not: S + N*B_k keys a query (10,240 at 512 anchors x 16 slots
  over 2,048 tokens).
* "flex" (CUDA and ROCm, where the default auto takes it): the rule as FlexAttention's `mask_mod`
  (`block_mask_mod`), turned into a block mask by create_block_mask compiled (no (B, Q, K) tensor is made), and
  the compiled kernel, which skips every 128 x 128
  tile no query of it sees: other blocks' slots and the context past a tile's anchors (sample_anchors sorts them,
  so a tile's blocks lie close together).
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention import flex_attention as flex

from draftsmith.kernels.attention import attend
from draftsmith.kernels.ttt_attention import flex_with_lse


def block_attention_mask(anchor_positions: torch.Tensor, context_length: int, block_size: int) -> torch.Tensor:
    """The rule as a dense mask (B, N*B_k, S + N*B_k), True = may attend; anchor_positions (B, N)."""
    batch, n = anchor_positions.shape
    device = anchor_positions.device
    q_block = torch.arange(n * block_size, device=device) // block_size  # (Q,)
    anchor_of_query = anchor_positions[:, q_block]  # (B, Q)
    context = torch.arange(context_length, device=device)[None, None, :] < anchor_of_query[:, :, None]  # (B, Q, S)
    same_block = (q_block[:, None] == q_block[None, :]).expand(batch, -1, -1)  # (B, Q, Q)
    return torch.cat([context, same_block], dim=-1)


def block_mask_mod(anchor_positions: torch.Tensor, context_length: int, block_size: int):
    """The rule as FlexAttention's mask_mod(b, h, q_idx, kv_idx) over the anchors (B, N), each at most S.

    It reads only tensors (each query's anchor and the first key of its own block), never S itself: a Python int
    in the closure would be a constant of the compiled graph, recompiled for every context length."""
    n = anchor_positions.shape[1]
    q_block = torch.arange(n * block_size, device=anchor_positions.device) // block_size  # (Q,)
    anchor_of_query = anchor_positions[:, q_block]  # (B, Q)
    own_start = context_length + q_block * block_size  # (Q,) key index of the query's slot 0

    def visible(b, h, q_idx, kv_idx):
        context = kv_idx < anchor_of_query[b, q_idx]  # anchors <= S: context keys only
        own = (kv_idx >= own_start[q_idx]) & (kv_idx < own_start[q_idx] + block_size)
        return context | own

    return visible


@functools.cache
def _compiled_create_block_mask():
    # eager create_block_mask evaluates the mask_mod over the whole (B, Q, K) grid first (with int64 temporaries):
    # at 16 x 512 anchors x 16 slots over 2,048 tokens, 1.3 G elements. Compiled, it reduces tile by tile.
    from draftsmith import device as dev

    return torch.compile(flex.create_block_mask, dynamic=dev.compile_dynamic())


def flex_block_mask(anchor_positions: torch.Tensor, context_length: int, block_size: int):
    """FlexAttention's block mask of the rule for this step's anchors (B, N): one per batch (rows anchor
    differently), the same for every head and layer. Compiled on an accelerator, eager on the CPU (the tests)."""
    batch, n = anchor_positions.shape
    q_len = n * block_size
    device = anchor_positions.device
    create = flex.create_block_mask if device.type == "cpu" else _compiled_create_block_mask()
    return create(block_mask_mod(anchor_positions, context_length, block_size), batch, None, q_len,
                  context_length + q_len, device=device)


def block_attention_reference(q, keys, values, scale: float, mask):
    """q (B, h, Q, hd); keys, values (B, kv, S + Q, hd), kv dividing h; mask (B, 1, Q, S + Q) from
    `block_attention_mask`. Returns (B, h, Q, hd)."""
    return attend(q, keys, values, mask, scale)


def block_attention_flex(q, keys, values, scale: float, block_mask):
    """`block_attention_reference` with `flex_block_mask`'s block mask in place of the dense one (grouped keys are
    read unrepeated; under autocast all three run in its dtype, as SDPA's do)."""
    return flex_with_lse(q, keys, values, block_mask, scale)[0]


def training_attention(backend: str, anchor_positions: torch.Tensor, context_length: int, block_size: int):
    """The attention every layer of one training step calls, fn(q, keys, values, scale), its mask built once here:
    the block mask with "flex", the dense mask with "reference"."""
    if backend == "flex":
        return functools.partial(block_attention_flex,
                                 block_mask=flex_block_mask(anchor_positions, context_length, block_size))
    mask = block_attention_mask(anchor_positions, context_length, block_size).unsqueeze(1)  # (B, 1, Q, S + Q)
    return functools.partial(block_attention_reference, mask=mask)
