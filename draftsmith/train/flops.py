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
    """Per token: the target's decoder layers and their attention. Each layer as its config describes it
    (`_layer_multiply_adds`): q, k, v, o (DeepSeek's latent attention, Gemma 4's layers of two shapes and KV shared
    across layers), then the MLP, of which a mixture of experts counts the experts a token runs through (its top-k,
    shared experts, the router), not all of them."""
    return sum(2 * _layer_multiply_adds(config, i, _attention_keys(seq_len, attention))
               for i in range(config.num_hidden_layers)) + 2 * _per_layer_input_projection(config)


def _layer_config(config, index: int):
    """Layer `index`'s view of the config where layers differ (Gemma 4's head_dim), else the config itself."""
    per_layer = getattr(config, "_heterogeneity_spec", None) and getattr(config, "per_layer_config", None)
    return per_layer[index] if per_layer else config


def _layer_multiply_adds(config, index: int, keys: float) -> float:
    """Multiply-adds per token of decoder layer `index` (attention over `keys` keys a query)."""
    h = config.hidden_size
    heads = config.num_attention_heads
    if getattr(config, "kv_lora_rank", None):  # DeepSeek's multi-head latent attention
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        rank = getattr(config, "q_lora_rank", None)
        q = h * rank + rank * heads * qk if rank else h * heads * qk
        kv = h * (config.kv_lora_rank + config.qk_rope_head_dim) + config.kv_lora_rank * heads * (
            config.qk_nope_head_dim + config.v_head_dim)
        projections = q + kv + heads * config.v_head_dim * h
        scores = heads * (qk + config.v_head_dim) * keys  # q.k and p.v
    else:
        layer = _layer_config(config, index)
        head_dim = getattr(layer, "head_dim", None) or h // heads
        kv = layer.num_key_value_heads * head_dim
        sharing = getattr(config, "kv_sharing_modes", None)  # Gemma 4: the last layers reuse earlier K/V
        shared = sharing is not None and sharing[index] == "reuse"
        k_is_v = getattr(config, "attention_k_eq_v", False) and config.layer_types[index] == "full_attention"
        projections = 2 * h * heads * head_dim + (0 if shared else (1 if k_is_v else 2) * h * kv)
        scores = 2 * heads * head_dim * keys  # q.k and p.v, a multiply-add each
    return projections + scores + _mlp_multiply_adds(config, index)


def _mlp_multiply_adds(config, index: int) -> float:
    """A gated MLP's 3 * hidden * intermediate, or a sparse layer's routed experts (top-k of them), shared experts
    and router, by each family's config keys: Qwen2/3-MoE (num_experts, decoder_sparse_step, mlp_only_layers,
    shared_expert_intermediate_size), GPT-OSS and Mixtral (num_local_experts), DeepSeek (n_routed_experts,
    n_shared_experts, first_k_dense_replace), Gemma 4 (a dense MLP, double-wide on KV-shared layers, and with
    enable_moe_block top_k_experts experts beside it)."""
    h = config.hidden_size
    dense = 3 * h * config.intermediate_size
    if getattr(config, "hidden_size_per_layer_input", None):  # Gemma 4: the per-layer input's gate and projection
        dense += 2 * h * config.hidden_size_per_layer_input
    if getattr(config, "use_double_wide_mlp", False) and config.kv_sharing_modes[index] == "reuse":
        dense += 3 * h * config.intermediate_size
    experts = (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
               or getattr(config, "n_routed_experts", None))
    if getattr(config, "model_type", "").startswith("gemma4"):
        if not getattr(config, "enable_moe_block", False):
            return dense
    elif not experts or index in (getattr(config, "mlp_only_layers", None) or ()) \
            or (index + 1) % (getattr(config, "decoder_sparse_step", None) or 1) \
            or index < (getattr(config, "first_k_dense_replace", None) or 0):
        return dense
    else:
        dense = 0  # a sparse layer's MLP is its experts
    top_k = getattr(config, "num_experts_per_tok", None) or config.top_k_experts
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared = 3 * h * (width * (getattr(config, "n_shared_experts", None) or 0)
                      + (getattr(config, "shared_expert_intermediate_size", None) or 0))
    if getattr(config, "shared_expert_intermediate_size", None):
        shared += h  # Qwen2-MoE's sigmoid gate of the shared expert
    return dense + top_k * 3 * h * width + shared + h * experts  # + the router


def _per_layer_input_projection(config) -> float:
    """Gemma 4's per-layer inputs: one projection of the embedding to every layer's input, per token."""
    width = getattr(config, "hidden_size_per_layer_input", None)
    return config.hidden_size * config.num_hidden_layers * width if width else 0.0


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
