"""Gemma 4 targets (`gemma4_text`; `gemma4`, the multimodal checkpoints, by their text model): sliding and full
layers, KV shared across layers, per-layer inputs, MoE.

As transformers' modeling_gemma4.py computes them:

- sliding and full layers differ in window, head dim (`global_head_dim`), K/V heads and RoPE (`rope_parameters`
  per layer type), so the cache keeps one flat row of kv * hd values a slot (`StepState.write_kv_flat`);
- attention: RMSNorm over each head of q and k (weighted) and of v (unweighted), RoPE after the norm, scale 1,
  values = the raw key projection on full layers with `attention_k_eq_v`;
- the last `num_kv_shared_layers` layers compute no K/V: each reads the cache of the last earlier layer of its type;
- the layer: sandwich norms around attention and MLP; with `enable_moe_block` a routed expert block (router on the
  residual, its own norms) added to the dense MLP's output; per-layer inputs (PLE) gated in after the MLP; the
  output scaled by `layer_scalar`;
- embeddings scaled by sqrt(hidden) (the embedding module does it); logits soft-capped (`final_logit_softcapping`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.models.targets.base import StepState, apply_rope


class Gemma4Family:
    def __init__(self, model: nn.Module):
        """`model`: a Gemma4ForCausalLM, or a Gemma4ForConditionalGeneration (the checkpoints Google ships), whose
        text model serves text."""
        self.model = model
        self.decoder = getattr(model.model, "language_model", model.model)
        self.layers = self.decoder.layers
        self.config = config = self.decoder.config
        self.graphs = not config.enable_moe_block  # the expert loop reads on the host which experts a step hit
        self.layer_windows = [config.sliding_window if kind == "sliding_attention" else None
                              for kind in config.layer_types]
        self.windows = tuple(sorted({w for w in self.layer_windows if w}))
        # Each layer's cache row: its own, or for a KV-shared layer that of the last earlier layer of its type.
        self.cache_index: list[int] = []
        own: dict[str, int] = {}  # layer type -> cache row of the newest layer of that type that computes K/V
        self.num_rows = 0
        for layer, kind in zip(self.layers, config.layer_types):
            if not layer.self_attn.is_kv_shared_layer:
                own[kind], self.num_rows = self.num_rows, self.num_rows + 1
            self.cache_index.append(own[kind])
        self.kv_heads = [config.num_attention_heads // layer.self_attn.num_key_value_groups for layer in self.layers]
        self.row_width = max(kv * layer.self_attn.head_dim for kv, layer in zip(self.kv_heads, self.layers))

    def cache_shape(self) -> tuple[int, int, int]:
        return self.num_rows, 1, self.row_width  # flat rows: see the module docstring

    def embed(self, input_ids: Tensor, state: StepState) -> Tensor:
        hidden = self.decoder.embed_tokens(input_ids)  # (B, T, H) scaled by sqrt(H)
        if self.config.hidden_size_per_layer_input:
            per_layer = self.decoder.get_per_layer_inputs(input_ids, hidden)
            state.extras["per_layer_inputs"] = self.decoder.project_per_layer_inputs(hidden, per_layer)  # (B,T,L,P)
        state.rotary = {kind: self.decoder.rotary_emb(hidden, state.position_ids, kind)  # (B, T, hd) each
                        for kind in set(self.config.layer_types)}
        return hidden

    def layer(self, index: int, hidden: Tensor, state: StepState) -> Tensor:
        layer = self.layers[index]
        attn = layer.self_attn
        batch, num_new, _ = hidden.shape
        head_dim = attn.head_dim
        cos, sin = (t.unsqueeze(2) for t in state.rotary[attn.layer_type])  # (B, T, 1, hd)

        residual = hidden
        x = layer.input_layernorm(hidden)
        q = attn.q_norm(attn.q_proj(x).view(batch, num_new, -1, head_dim))  # (B, T, h, hd)
        q = apply_rope(q, cos, sin).transpose(1, 2)  # (B, h, T, hd)
        if attn.is_kv_shared_layer:
            keys, values = state.read_kv_flat(self.cache_index[index], self.kv_heads[index], head_dim)
        else:
            k = attn.k_proj(x).view(batch, num_new, -1, head_dim)  # (B, T, kv, hd)
            v = attn.v_proj(x).view(batch, num_new, -1, head_dim) if attn.v_proj is not None else k
            k = attn.k_norm(k)
            k = apply_rope(k, cos, sin).transpose(1, 2)  # (B, kv, T, hd)
            v = attn.v_norm(v).transpose(1, 2)
            keys, values = state.write_kv_flat(self.cache_index[index], k, v)
        groups = q.shape[1] // keys.shape[1]
        if groups > 1:
            keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=state.masks[self.layer_windows[index]],
                                             scale=attn.scaling)  # (B, h, T, hd)
        out = attn.o_proj(out.transpose(1, 2).reshape(batch, num_new, -1))
        hidden = residual + layer.post_attention_layernorm(out)

        residual = hidden
        x = layer.mlp(layer.pre_feedforward_layernorm(hidden))
        if layer.enable_moe_block:
            flat = residual.reshape(-1, residual.shape[-1])  # (B*T, H) the router reads the residual
            _, top_k_weights, top_k_index = layer.router(flat)
            experts = layer.experts(layer.pre_feedforward_layernorm_2(flat), top_k_index, top_k_weights)
            x = layer.post_feedforward_layernorm_1(x) + layer.post_feedforward_layernorm_2(
                experts.reshape(residual.shape))
        hidden = residual + layer.post_feedforward_layernorm(x)

        if layer.hidden_size_per_layer_input:
            gate = layer.act_fn(layer.per_layer_input_gate(hidden)) * state.extras["per_layer_inputs"][:, :, index]
            hidden = hidden + layer.post_per_layer_input_norm(layer.per_layer_projection(gate))
        return hidden * layer.layer_scalar

    def logits(self, hidden: Tensor) -> Tensor:
        logits = self.model.get_output_embeddings()(self.decoder.norm(hidden))
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def unsupported(config) -> str | None:
    """Why the runtime cannot serve this Gemma 4 config exactly, or None."""
    if getattr(config, "use_bidirectional_attention", None) == "all":
        return "use_bidirectional_attention='all' makes every layer bidirectional: not a causal LM"
    return None
