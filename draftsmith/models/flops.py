"""Floating-point operations per trained token: what every method's count shares (the target's forward pass, its
head, a decoder layer of its shape), so each method folder can state its own formula (`<method>_flops_per_token`
in its training.py, the `flops_per_token` of its TrainingMethod) and the trainer can log model FLOP utilisation
(MFU; train/flops.py writes the log line).

Counts the matrix products the mathematics needs (2 FLOP per multiply-add), as MFU is usually defined: no
recomputation from activation checkpointing, no masked-out attention work. Causal attention over a sequence of S
positions averages (S + 1) / 2 keys per query. A method's count is a dict of terms and their "total":

    target_forward             every decoder layer of the target, no logits (its head is not run in training)
    teacher_head               the target's head where the method reads the target's distribution
    drafter_forward_backward   the drafter, forward and backward (backward = 2 x forward, except where an input
                               carries no gradient)

`tests/test_flops.py` checks the counts against torch's FlopCounterMode on tiny models.
"""

from __future__ import annotations


def attention_keys(seq_len: int, attention: str) -> float:
    """Mean keys a query sees: causal (the useful work) or full (what an S x S implementation multiplies)."""
    return (seq_len + 1) / 2 if attention == "causal" else float(seq_len)


def target_forward_flops(config, seq_len: int, attention: str = "causal") -> float:
    """Per token: the target's decoder layers and their attention. Each layer as its config describes it
    (`_layer_multiply_adds`): q, k, v, o (DeepSeek's latent attention, Gemma 4's layers of two shapes and KV shared
    across layers), then the MLP, of which a mixture of experts counts the experts a token runs through (its top-k,
    shared experts, the router), not all of them."""
    return sum(2 * _layer_multiply_adds(config, i, attention_keys(seq_len, attention))
               for i in range(config.num_hidden_layers)) + 2 * _per_layer_input_projection(config)


def target_head_flops(config) -> float:
    """Per row: the target's head over its whole vocabulary."""
    return 2.0 * config.hidden_size * config.vocab_size


def with_total(terms: dict[str, float]) -> dict[str, float]:
    """`terms` with their sum as "total" (a "total" already there is replaced)."""
    terms["total"] = sum(v for k, v in terms.items() if k != "total")
    return terms


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
