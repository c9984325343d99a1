"""Llama-shaped targets: Llama, Mistral, Qwen2, Qwen3, and Qwen3-MoE, whose layer differs only in its MLP module.

One decoder layer (`LlamaFamily.decoder_layer`) for every path the runtime runs: pre-norm attention over the
runtime's cache (q/k RMSNorm per head where the layer has them, Qwen3's; RoPE by halves; grouped K/V heads), then
the MLP. The module path (`layer`: eager and CUDA-graph steps) reads the modules' own weights and runs the layer's
own MLP module: a gated MLP, or Qwen3-MoE's sparse block, whose router (softmax over the experts, top-k,
renormalised when `norm_topk_prob`) and expert loop are transformers' own. The compiled path of the dense families
(`static_layer`, DRAFTSMITH_COMPILE: `TargetModel._compile_layers`) is the same layer as a function of tensors
only, over merged q/k/v and gate/up matrices (`merge_weights`), with grouped attention and the gated SiLU MLP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.kernels.attention import attend, grouped_attention
from draftsmith.models.targets.base import StepState, TargetError, apply_rope

Linear = tuple[Tensor, Tensor | None]  # a projection's (weight (out, in), bias (out,) or None)


class LlamaWeights(NamedTuple):
    """What `decoder_layer` reads of one layer: tensors only, so torch.compile takes them as arguments and every
    layer shares one compilation."""

    input_norm: Tensor  # (H,)
    qkv: tuple[Linear, ...]  # q, k, v projections: the modules' three, or one merged ((h + 2 kv) * hd, H)
    q_norm: Tensor | None  # (hd,) Qwen3's per-head RMSNorm before RoPE; None for the others
    k_norm: Tensor | None
    o_proj: Linear  # (H, h * hd)
    post_norm: Tensor  # (H,)
    gate_up: Linear | None  # merged gate/up (2 I, H) of the gated SiLU MLP; None: the layer's own MLP module runs
    down: Linear | None  # (H, I)


class LlamaFamily:
    def __init__(self, model: nn.Module, window: int | None = None, graphs: bool = True):
        """`window`: a sliding window every layer applies (Qwen3-MoE with use_sliding_window); `graphs`: False for
        MoE blocks, whose expert loop reads which experts were hit on the host."""
        config = model.config
        self.model = model
        self.layers = model.model.layers
        self.num_heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.eps = self.layers[0].input_layernorm.variance_epsilon  # every norm of the layer: config.rms_norm_eps
        self.window = window
        self.windows = (window,) if window else ()
        self.graphs = graphs

    def cache_shape(self) -> tuple[int, int, int]:
        return len(self.layers), self.num_kv_heads, self.head_dim

    def embed(self, input_ids: Tensor, state: StepState) -> Tensor:
        hidden = self.model.get_input_embeddings()(input_ids)  # (B, T, H)
        cos, sin = self.model.model.rotary_emb(hidden, state.position_ids)  # (B, T, hd)
        state.rotary = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, hd)
        return hidden

    def layer(self, index: int, hidden: Tensor, state: StepState) -> Tensor:
        """The module path: the modules' own weights and MLP, K/V written by `state` (eager or shape-static)."""
        layer = self.layers[index]

        def write_kv(k, v):
            return state.write_kv(index, k, v)

        return self.decoder_layer(hidden, *state.rotary, module_weights(layer), write_kv, attend,
                                  state.masks[self.window], layer.mlp)

    def static_layer(self, hidden, cos, sin, mask, slots, keys, values, weights: LlamaWeights) -> Tensor:
        """The compiled path: the shape-static step's layer as a function of tensors (`TargetModel._compile_layers`
        compiles it). K/V are written into `keys` / `values` (B, kv, T_max, hd) at `slots` (T,); `weights` from
        `merge_weights`; `mask` (B or 1, 1, T, T_max) hides the stale slots."""
        def write_kv(k, v):
            keys.index_copy_(2, slots, k)
            values.index_copy_(2, slots, v)
            return keys, values

        def mlp(x):
            gate, up = F.linear(x, *weights.gate_up).chunk(2, dim=-1)  # (B, T, I) each
            return F.linear(F.silu(gate) * up, *weights.down)

        return self.decoder_layer(hidden, cos, sin, weights, write_kv, grouped_attention, mask, mlp)

    def decoder_layer(self, hidden: Tensor, cos: Tensor, sin: Tensor, w: LlamaWeights,
                      write_kv: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]], attention: Callable,
                      mask: Tensor | None, mlp: Callable[[Tensor], Tensor]) -> Tensor:
        """The one Llama decoder layer. hidden (B, T, H); cos/sin (B, 1, T, hd); `write_kv(k, v)` stores this step's
        K/V (B, kv, T, hd) and returns the keys and values the queries attend over (B, kv, S, hd); `attention`
        (kernels/attention.py) masked by `mask` (B or 1, 1, T, S), True = may attend; `mlp` after the second norm."""
        batch, num_new, _ = hidden.shape
        x = rms_norm(hidden, w.input_norm, self.eps)
        if len(w.qkv) == 1:  # merged: one read of the weights
            heads = (self.num_heads, self.num_kv_heads, self.num_kv_heads)
            q, k, v = F.linear(x, *w.qkv[0]).view(batch, num_new, -1, self.head_dim).split(heads, dim=2)
        else:
            q, k, v = (F.linear(x, *p).view(batch, num_new, -1, self.head_dim) for p in w.qkv)  # (B, T, h|kv, hd)
        if w.q_norm is not None:  # Qwen3: RMSNorm over each head before RoPE
            q, k = rms_norm(q, w.q_norm, self.eps), rms_norm(k, w.k_norm, self.eps)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values = write_kv(k, v)
        out = attention(q, keys, values, mask, scale=self.head_dim ** -0.5)  # (B, h, T, hd)
        hidden = hidden + F.linear(out.transpose(1, 2).reshape(batch, num_new, -1), *w.o_proj)
        return hidden + mlp(rms_norm(hidden, w.post_norm, self.eps))

    def merge_weights(self) -> list[LlamaWeights]:
        """Every layer's weights for `static_layer`, q/k/v and gate/up merged into one matrix each, as serving
        engines do: a decode step is a chain of matrix-vector products bound by reading weights, and one long read
        keeps the memory system busier than three short ones (k_proj and v_proj of an 8B model are only 8 MB each).
        The modules' own weights become views into the merged matrices, so this costs no memory and the module path
        (eager steps, transformers' `generate`) sees the same numbers; the merge moves the weights, so graphs
        recorded on them before are stale."""
        merged = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = _merge_linears(attn.q_proj, attn.k_proj, attn.v_proj)
            gate_up = _merge_linears(mlp.gate_proj, mlp.up_proj)
            merged.append(module_weights(layer)._replace(qkv=(qkv,), gate_up=gate_up,
                                                         down=(mlp.down_proj.weight, mlp.down_proj.bias)))
        return merged

    def logits(self, hidden: Tensor) -> Tensor:
        return self.model.get_output_embeddings()(self.model.model.norm(hidden))


def module_weights(layer: nn.Module) -> LlamaWeights:
    """A transformers Llama-family decoder layer's own weights (read at each call: `merge_weights` re-points them)."""
    attn = layer.self_attn
    qkv = tuple((p.weight, p.bias) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    q_norm, k_norm = (attn.q_norm.weight, attn.k_norm.weight) if hasattr(attn, "q_norm") else (None, None)
    return LlamaWeights(layer.input_layernorm.weight, qkv, q_norm, k_norm, (attn.o_proj.weight, attn.o_proj.bias),
                        layer.post_attention_layernorm.weight, gate_up=None, down=None)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm as transformers' Llama/Qwen norms compute it: in float32, then the weight in the input dtype."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _merge_linears(*linears: nn.Linear) -> Linear:
    """One (weight, bias) whose output is the outputs of `linears` side by side; each module's weight (and bias)
    is re-pointed at its rows of the merged tensor, so the merge allocates nothing that stays."""
    weight = torch.cat([m.weight for m in linears])
    has_bias = [m.bias is not None for m in linears]
    if any(has_bias) and not all(has_bias):
        raise TargetError("cannot merge projections of which only some have a bias")
    bias = torch.cat([m.bias for m in linears]) if all(has_bias) else None
    row = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(weight[row:row + rows], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[row:row + rows], requires_grad=False)
        row += rows
    return weight, bias
