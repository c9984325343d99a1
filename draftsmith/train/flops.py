"""Floating-point operations per trained token, by term, so the trainer can log model FLOP utilisation (MFU).

Counts the matrix products the mathematics needs (2 FLOP per multiply-add), as MFU is usually defined: no
recomputation from activation checkpointing, no masked-out attention work. Causal attention over a sequence of S
positions averages (S + 1) / 2 keys per query. For EAGLE-3 TTT (draftsmith/models/eagle3/model.py):

    target_forward   every decoder layer of the target, no logits (its head is not run in training)
    teacher_head     the target's head on the last hidden state, over the whole vocabulary (the in-draft mask
                     needs the full argmax; the soft targets then take the draft vocabulary's columns)
    drafter          fc once, then per TTT step the decoder layer and the draft head, forward and backward
                     (backward = 2 x forward, but fc's input carries no gradient: 1 x)

For DFlash (draftsmith/models/dflash/): N anchors a sequence, each a block of B_k slots, so N*B_k block tokens per
S context tokens, and N*(B_k-1) slots read out by the target's frozen head:

    target_forward   as above
    teacher_head     the target's head at every position (the argmax labels)
    drafter          fc and each layer's context K/V once per context token; each layer's projections, MLP and
                     attention (context before the anchor, about S/2 keys, plus the block's B_k) per block token,
                     forward and backward; the head per slot, forward and the gradient of its input (it is frozen)

For MTP (draftsmith/models/mtp/): D depths, each one module over every position:

    target_forward   as above
    teacher_head     the target's head at the positions under the loss, once (depth d's teacher is position
                     i+d's distribution)
    drafter          per depth: eh_proj (2H -> H) and one decoder layer of the target's shape, forward and
                     backward; the frozen head at the positions under that depth's loss, forward and input gradient

The trainer passes the share of positions under the loss in its data (`loss_share`): DFlash anchors blocks and
MTP reads its heads only there, so their counts per token follow it; EAGLE-3's steps run at every position.

`tests/test_flops.py` checks the counts against torch's FlopCounterMode on tiny models.
"""

from __future__ import annotations


def _attention_keys(seq_len: int, attention: str) -> float:
    """Mean keys a query sees: causal (the useful work) or full (what an S x S implementation multiplies)."""
    return (seq_len + 1) / 2 if attention == "causal" else float(seq_len)


def target_forward_flops(config, seq_len: int, attention: str = "causal") -> float:
    """Per token: the target's decoder layers (Llama-style: q, k, v, o, gated MLP) and their attention."""
    h = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = config.num_key_value_heads * head_dim
    linear = h * heads * head_dim + 2 * h * kv + heads * head_dim * h + 3 * h * config.intermediate_size
    attn = 2 * heads * head_dim * _attention_keys(seq_len, attention)  # q.k and p.v, a multiply-add each
    return config.num_hidden_layers * 2 * (linear + attn)


def eagle3_flops_per_token(target_config, drafter_config, seq_len: int, ttt_steps: int,
                           attention: str = "causal") -> dict[str, float]:
    """FLOP per trained token of online EAGLE-3 training, by term (see the module docstring), and their total."""
    d = drafter_config
    h, heads, head_dim = d.hidden_size, d.num_attention_heads, d.head_dim
    kv = d.num_key_value_heads * head_dim
    fc = 2 * len(d.aux_layer_ids) * d.target_hidden_size * h
    layer = 2 * (2 * h * heads * head_dim + 2 * 2 * h * kv + heads * head_dim * h + 3 * h * d.intermediate_size)
    head = 2 * h * d.draft_vocab_size
    steps_forward = 0.0
    for i in range(ttt_steps):  # step i also attends to its i diagonal keys
        steps_forward += layer + head + 2 * 2 * heads * head_dim * (_attention_keys(seq_len, attention) + i)
    terms = {"target_forward": target_forward_flops(target_config, seq_len, attention),
             "teacher_head": 2.0 * target_config.hidden_size * target_config.vocab_size,
             "drafter_forward_backward": 2.0 * fc + 3.0 * steps_forward}
    terms["total"] = sum(terms.values())
    return terms


def dflash_flops_per_token(target_config, drafter_config, seq_len: int, anchors: int,
                           attention: str = "causal") -> dict[str, float]:
    """FLOP per context token of online DFlash training with `anchors` blocks a sequence of `seq_len` (every block
    whole inside the sequence and under the loss), by term (see the module docstring), and their total.

    attention="full" counts what the masked fused attention multiplies: every query against all S + N*B_k keys."""
    d = drafter_config
    h, heads, head_dim = d.hidden_size, d.num_attention_heads, d.head_dim
    kv = d.num_key_value_heads * head_dim
    bk = d.block_size
    block_tokens = anchors * bk / seq_len  # per context token
    slots = anchors * (bk - 1) / seq_len
    fc = 2 * len(d.target_layer_ids) * h * h
    context_kv = 2 * 2 * h * kv
    block_linear = 2 * (h * heads * head_dim + 2 * h * kv + heads * head_dim * h + 3 * h * d.intermediate_size)
    keys = seq_len + anchors * bk if attention == "full" else seq_len / 2 + bk
    block_attention = 2 * 2 * heads * head_dim * keys
    head = 2 * h * d.vocab_size
    layers = d.num_hidden_layers * (context_kv + block_tokens * (block_linear + block_attention))
    terms = {"target_forward": target_forward_flops(target_config, seq_len, attention),
             "teacher_head": 2.0 * target_config.hidden_size * target_config.vocab_size,
             "drafter_forward_backward": 2.0 * fc + 3.0 * layers + 2.0 * slots * head}
    terms["total"] = sum(terms.values())
    return terms


def mtp_flops_per_token(target_config, num_depths: int, seq_len: int, attention: str = "causal",
                        loss_share: float = 1.0) -> dict[str, float]:
    """FLOP per token of online MTP training with `num_depths` depths over sequences of `seq_len`, by term, and
    their total. Depth d's head reads the seq_len - 1 - d positions whose t_{i+1+d} exists, times `loss_share`,
    the share of them under the loss (1: the whole sequence), and so does its teacher. The block is counted as one
    of the target's own (Llama-style) decoder layers."""
    h, v = target_config.hidden_size, target_config.vocab_size
    block = target_forward_flops(target_config, seq_len, attention) / target_config.num_hidden_layers
    eh_proj = 2 * 2 * h * h
    heads = loss_share * sum(max(0, seq_len - 1 - d) for d in range(1, num_depths + 1)) / seq_len  # rows a token
    terms = {"target_forward": target_forward_flops(target_config, seq_len, attention),
             "teacher_head": loss_share * 2.0 * h * v,
             "drafter_forward_backward": 3.0 * num_depths * (eh_proj + block) + 2.0 * heads * 2 * h * v}
    terms["total"] = sum(terms.values())
    return terms


def describe(terms: dict[str, float]) -> str:
    """'31.1 GFLOP/token = target_forward 14.5 + teacher_head 0.26 + ...' for the training log."""
    parts = " + ".join(f"{name} {value / 1e9:.3g}" for name, value in terms.items() if name != "total")
    return f"{terms['total'] / 1e9:.3g} GFLOP per token = {parts}"
