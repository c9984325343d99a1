"""EAGLE-3 training-time-test (TTT) attention: FlexAttention kernels on GPUs, a plain-torch reference elsewhere.

Step i's query at position t attends causally to the step-0 keys (positions 0..t) and to the key at its own
position t of every earlier step 1..i (the "diagonal" of EAGLE-3's Fig. 6), in one softmax:

    scores(t) = [q_t . k0_u * scale for u <= t]  ++  [q_t . kj_t * scale for j = 1..i]

`doc_ids` (B, S), given for rows of packed samples, also hides every step-0 key of another sample (the diagonal
keys sit at the query's own position, so they are always its own sample's). Keys and values may have fewer heads
than the queries (grouped-query attention): query head n reads key head n // (h // kv), as `repeat_interleave`
lays them out.

Two implementations of that one definition, chosen once per unroll by `unroll_attention`:

* `ttt_attention_flex` (backend "flex", CUDA and ROCm): the causal, doc-masked part is one
  `torch.nn.attention.flex_attention` call, compiled to Triton, over a block mask that skips every block no query
  can see (the upper triangle, other samples' blocks); it returns the part's log-sum-exp, and the i diagonal scores,
  O(S) each, join it in a softmax over (1 + i) terms: out = w0 * out0 + sum_j w_j * v_j with
  (w0, w1..wi) = softmax(lse0, d1..di). The gradient flows through the log-sum-exp (FlexAttention's backward takes
  it). No S x S tensor exists in the forward or the backward pass, so no query blocks are needed.
* `ttt_attention` (backend "reference", NPU and CPU, and the definition the kernel is tested against): plain torch,
  a block of queries at a time, each against only the keys it can see, under activation checkpointing (the
  backward pass recomputes one block's scores at a time). `ttt_attention_reference` is the unblocked definition:
  (B, h, S, S) scores, a float32 softmax, all kept for the backward pass.

The reference's block (`query_block_for`) counts every TTT step: an unroll keeps all its steps' scores until the
backward pass, so one block is taken only while num_steps x B x h x S x S scores fit DENSE_SCORES_LIMIT. Blocking
and recomputing cost a small model's short sequences more time than the memory is worth (the fixture's 8,192-token
steps of samples up to 2,048 tokens: 293 ms a step blocked with a chunked loss, 131 ms without either;
benchmarks/results/peer_eagle3_h200), but an unblocked TTT-7 step at 2 x 4,096 tokens on the fixture peaked at
11.4 GB of RSS where blocks of 1,024 took 3.9 GB (issue 28).
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention import flex_attention as flex
from torch.utils.checkpoint import checkpoint

DEFAULT_QUERY_BLOCK = 1024  # queries per block: scores of (B, h, 1024, <=S) at a time
DENSE_SCORES_LIMIT = 1 << 28  # B*h*S*S scores of all TTT steps held whole (1 GiB in float32) before blocking pays
BACKENDS = ("auto", "flex", "reference")  # training.ttt_attention and training.block_attention
FLEX_MIN_HEAD_DIM = 16  # Triton's matrix products need inner dimensions of at least 16


# ---- selection -----------------------------------------------------------------------------------------------
def resolve_backend(requested: str, device: torch.device | str, head_dim: int,
                    key: str = "training.ttt_attention") -> str:
    """'flex' or 'reference' for the recipe's `key` (training.ttt_attention, or DFlash's and DSpark's
    training.block_attention: kernels/block_attention.py) set to `requested` on `device`: auto takes the compiled
    FlexAttention kernel where device.compiled_flex_attention says it runs (CUDA and ROCm; DRAFTSMITH_FLEX_ATTENTION=0
    turns it off), the plain-torch reference elsewhere."""
    from draftsmith import device as dev

    if requested not in BACKENDS:
        raise ValueError(f"{key}={requested!r}: use one of {', '.join(BACKENDS)}")
    if requested == "reference":
        return "reference"
    runs = dev.compiled_flex_attention(device) and head_dim >= FLEX_MIN_HEAD_DIM
    if requested == "flex" and not runs:
        raise ValueError(f"{key}=flex needs a CUDA or ROCm GPU with Triton, DRAFTSMITH_FLEX_ATTENTION "
                         f"unset and a head_dim of at least {FLEX_MIN_HEAD_DIM} (here {device}, head_dim {head_dim}): "
                         f"set {key}=auto or reference")
    return "flex" if runs else "reference"


def query_block_for(batch: int, heads: int, seq_len: int, num_steps: int, query_block: int | None) -> int:
    """The block the reference computes at a time in an unroll of `num_steps` TTT steps: `query_block` if given, else
    the whole sequence while all steps' (B, h, S, S) scores stay within DENSE_SCORES_LIMIT, else
    DEFAULT_QUERY_BLOCK."""
    if query_block is not None:
        return query_block
    whole = num_steps * batch * heads * seq_len * seq_len
    return seq_len if whole <= DENSE_SCORES_LIMIT else DEFAULT_QUERY_BLOCK


def unroll_attention(backend: str, batch: int, heads: int, seq_len: int, num_steps: int, device,
                     query_block: int | None = None, doc_ids=None):
    """The attention every step of one TTT unroll calls, fn(q, keys0, values0, diag_keys, diag_values, scale):
    with 'flex' over the block mask built once for all steps, with 'reference' a block of queries chosen for all
    `num_steps` steps (`query_block_for`)."""
    if backend == "flex":
        return functools.partial(ttt_attention_flex, block_mask=flex_block_mask(doc_ids, batch, seq_len, device))
    block = query_block_for(batch, heads, seq_len, num_steps, query_block)
    return functools.partial(ttt_attention, query_block=block, doc_ids=doc_ids)


# ---- the plain-torch reference -------------------------------------------------------------------------------
def _repeat_kv(x, heads: int):
    """(B, kv, S, hd) -> (B, heads, S, hd), query head n reading key head n // (heads // kv)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _attend(q, keys0, values0, diag_keys, diag_values, scale: float, offset: int, doc_q=None, doc_k=None):
    """Attention of queries at positions offset .. offset+c-1 (q: (B, h, c, hd)) over step-0 keys 0..offset+c-1
    (keys0: (B, kv, offset+c, hd)) and their own diagonal keys (each (B, kv, c, hd)); with doc_q (B, c) and doc_k
    (B, offset+c), only keys of the query's own sample. Returns (B, h, c, hd)."""
    h, c, n = q.shape[1], q.shape[-2], keys0.shape[-2]
    keys0, values0 = _repeat_kv(keys0, h), _repeat_kv(values0, h)
    diag_keys, diag_values = [_repeat_kv(k, h) for k in diag_keys], [_repeat_kv(v, h) for v in diag_values]
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
    # under autocast q is fp32 (RoPE) and the values bf16, so steps 1.. would give fp32 and step 0 bf16: one dtype
    # (what o_proj casts to anyway), so a compiled step half downstream compiles once
    return out.to(values0.dtype)


def ttt_attention_reference(q, keys0, values0, diag_keys, diag_values, scale: float, doc_ids=None):
    """The definition. q: (B, h, S, hd); keys0, values0: (B, kv, S, hd), kv dividing h; diag_keys and diag_values:
    lists of (B, kv, S, hd), one per earlier step 1..i; doc_ids (B, S) or None. Returns (B, h, S, hd)."""
    return _attend(q, keys0, values0, diag_keys, diag_values, scale, 0, doc_ids, doc_ids)


def ttt_attention(q, keys0, values0, diag_keys, diag_values, scale: float, query_block: int | None = None,
                  doc_ids=None):
    """`ttt_attention_reference`, `query_block` queries at a time, recomputed in the backward pass (see module).
    None: `query_block_for`'s choice for this one step's scores (an unroll chooses for all its steps:
    `unroll_attention`)."""
    b, h, s, _ = q.shape
    query_block = query_block_for(b, h, s, 1, query_block)
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


# ---- FlexAttention -------------------------------------------------------------------------------------------
def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@functools.lru_cache(maxsize=8)
def _causal_block_mask(seq_len: int, device: str):
    return flex.create_block_mask(_causal, None, None, seq_len, seq_len, device=device)


def flex_block_mask(doc_ids, batch: int, seq_len: int, device):
    """FlexAttention's block mask of the step-0 keys: causal (one per length and device, cached), and with doc_ids
    (B, S) inside each sample (one per batch: the packed rows differ)."""
    if doc_ids is None:
        return _causal_block_mask(seq_len, str(device))

    def causal_same_doc(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    return flex.create_block_mask(causal_same_doc, batch, None, seq_len, seq_len, device=device)


def _flex_with_lse(q, k, v, block_mask, scale: float):
    """FlexAttention's output (B, h, S, hd) and its log-sum-exp (B, h, S), float32, natural log."""
    gqa = k.shape[1] != q.shape[1]
    if _AUX_REQUEST is not None:
        out, aux = flex.flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                                       return_aux=_AUX_REQUEST(lse=True))
        return out, aux.lse
    return flex.flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_lse=True)


_AUX_REQUEST = getattr(flex, "AuxRequest", None)  # torch >= 2.9; before it, return_lse


@functools.cache
def _compiled_flex():
    # fullgraph: FlexAttention outside a compiled graph is its eager math form, which keeps S x S scores
    from draftsmith import device as dev

    return torch.compile(_flex_with_lse, fullgraph=True, dynamic=dev.compile_dynamic())


def flex_with_lse(q, k, v, block_mask, scale: float):
    """`_flex_with_lse` compiled (Triton kernels, forward and backward) on an accelerator; on the CPU, eager
    FlexAttention, which has no backward pass there: only the tests call it, to check its values."""
    fn = _flex_with_lse if q.device.type == "cpu" else _compiled_flex()
    device_type = q.device.type
    # Under autocast, q and k leave RoPE in float32 (cos/sin are float32) while v leaves its Linear in the autocast
    # dtype; the kernel's backward takes one dtype, so all three run in the dtype the reference's matmuls run in.
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else q.dtype
    with torch.autocast(device_type, enabled=False):
        return fn(q.to(dtype), k.to(dtype), v.to(dtype), block_mask, scale)


def ttt_attention_flex(q, keys0, values0, diag_keys, diag_values, scale: float, block_mask):
    """`ttt_attention_reference` (same arguments; `block_mask` from `flex_block_mask` in place of doc_ids): the
    step-0 part by FlexAttention, the diagonals joined through its log-sum-exp (see module)."""
    out0, lse0 = flex_with_lse(q, keys0, values0, block_mask, scale)  # (B, h, S, hd), (B, h, S) float32
    if not diag_keys:  # in the joined steps' (contiguous) layout, not q's: the compiled step half that reads it
        return out0.contiguous()  # guards on its strides and would compile again for the second step
    b, h, s, hd = q.shape
    kv = keys0.shape[1]
    grouped = q.view(b, kv, h // kv, s, hd)  # query head n = (n // g, n % g), as repeat_interleave lays keys out
    diag = [((grouped * dk[:, :, None]).sum(-1) * scale).float() for dk in diag_keys]  # each (B, kv, g, S)
    weights = torch.softmax(torch.stack([lse0.view(b, kv, h // kv, s), *diag], dim=-1), dim=-1)  # (B, kv, g, S, 1+i)
    weights = weights.to(q.dtype)
    out = weights[..., :1] * out0.view(b, kv, h // kv, s, hd)  # (B, kv, g, S, hd)
    for j, dv in enumerate(diag_values, start=1):
        out = out + weights[..., j: j + 1] * dv[:, :, None]
    return out.reshape(b, h, s, hd)  # a view where the layout allows it
