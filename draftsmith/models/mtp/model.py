"""The MTP drafter (DeepSeek-V3 multi-token prediction) over a frozen target.

One module (DeepSeek-V3's names, which native checkpoints use):

    enorm, hnorm    RMSNorm of the token embedding and of the hidden state the depth reads
    eh_proj         Linear(2H -> H) over cat(enorm(embed), hnorm(hidden))   (embedding first, as the checkpoints)
    block           one decoder layer of the target's own class (Llama, Qwen3, DeepSeek-V3 MLA + MoE, ...)
    shared_head     .norm before the target's frozen lm_head

Hidden states are always *normed* ones, because that is what the engines hand an MTP module: h^0 is the target's
last hidden state after its final norm (what the target's forward returns in vLLM and SGLang), and h^d is depth
d's block output after its shared_head.norm (what lm_head reads, and what vLLM's DeepSeek-V3 and Qwen3-Next MTP
and SGLang's NextN return for the next depth; vLLM's GLM-4.5 MTP alone recycles the un-normed output). hnorm cannot
absorb a final norm's weight, so training on the pre-norm state would serve the module on other inputs.
Alignment (t = tokens):

    position i          0          1          2        ...
    target   h^0_i      h^0_0      h^0_1      h^0_2         lm_head(h^0_i) predicts t_{i+1}
    depth 1  input      t_1, h^0_0 t_2, h^0_1 t_3, h^0_2    lm_head(h^1_i) predicts t_{i+2}
    depth 2  input      t_2, h^1_0 t_3, h^1_1 t_4, h^1_2    lm_head(h^2_i) predicts t_{i+3}
    depth d  input      embed(t_{i+d}) and h^{d-1}_i        lm_head(h^d_i) predicts t_{i+1+d}

Every depth sits at position i (RoPE position i) and attends causally to its own depth at positions <= i, so
training is one causal pass per depth, with no training-time-test unroll. Depth d runs module (d-1) % n.
The target's embedding and lm_head are shared and frozen; they stay outside this module (callers pass
embeddings in and apply the head), so checkpoints and DDP never see them.
"""

from __future__ import annotations

import copy
import sys

import torch
from torch import nn

from draftsmith.models.losses import shift_left
from draftsmith.models.mtp.config import MtpDrafterConfig
from draftsmith.models.target import SUPPORTED_STEP_MODEL_TYPES, KVCache, attend
from draftsmith.models.targets.base import apply_rope


class MtpModelError(ValueError):
    """A target whose decoder layers draftsmith cannot build an MTP module from (or run in its runtime)."""


def decoder_layer_class(config) -> type[nn.Module]:
    """The decoder layer class of a transformers causal LM, found through the model's `_no_split_modules`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise MtpModelError(f"transformers has no causal LM class for model type {config.model_type!r}") from None
    module = sys.modules[model_cls.__module__]
    for name in getattr(model_cls, "_no_split_modules", None) or []:
        if isinstance(getattr(module, name, None), type):
            return getattr(module, name)
    raise MtpModelError(f"cannot find the decoder layer class of {model_cls.__name__}")


def rotary_class(layer_cls: type[nn.Module]) -> type[nn.Module]:
    """The family's rotary embedding (`XDecoderLayer` -> `XRotaryEmbedding`): the target's own RoPE variant."""
    module = sys.modules[layer_cls.__module__]
    name = layer_cls.__name__.removesuffix("DecoderLayer") + "RotaryEmbedding"
    if not isinstance(getattr(module, name, None), type):
        raise MtpModelError(f"cannot find {name} next to {layer_cls.__name__}")
    return getattr(module, name)


def block_config(config: MtpDrafterConfig):
    """The target's config with SDPA attention: training passes no mask and relies on SDPA's causal path."""
    hf = copy.deepcopy(config.hf_config())
    hf._attn_implementation = "sdpa"
    return hf


@torch.no_grad()
def _init_raw_parameters(block: nn.Module, std: float) -> None:
    """Fill the weight matrices that no torch layer initialised (transformers' fused MoE experts and routers are
    `torch.empty` until a PreTrainedModel's `_init_weights` runs, which a lone decoder layer never gets)."""
    for module in block.modules():
        if hasattr(module, "reset_parameters") or "Norm" in type(module).__name__:
            continue
        for p in module.parameters(recurse=False):
            if p.dim() >= 2:
                p.normal_(0.0, std)


class MtpLayer(nn.Module):
    def __init__(self, block: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        norm_cls = type(block.input_layernorm)  # the target family's RMSNorm (Qwen3-Next's is zero-centred)
        self.enorm = norm_cls(hidden_size, eps=eps)
        self.hnorm = norm_cls(hidden_size, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.shared_head = nn.ModuleDict({"norm": norm_cls(hidden_size, eps=eps)})

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))  # (B, S, H)

    def head_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head["norm"](hidden)


class MtpDrafter(nn.Module):
    def __init__(self, config: MtpDrafterConfig, layer_cls: type[nn.Module] | None = None):
        super().__init__()
        self.config = config
        hf = block_config(config)
        layer_cls = layer_cls or decoder_layer_class(hf)
        self.layers = nn.ModuleList(
            MtpLayer(layer_cls(hf, config.block_layer_idx), config.hidden_size, config.rms_norm_eps)
            for _ in range(config.num_modules)
        )
        self.rotary_emb = rotary_class(layer_cls)(config=hf)
        for layer in self.layers:
            _init_raw_parameters(layer.block, getattr(hf, "initializer_range", 0.02))

    def reset_rotary(self, device) -> None:
        """Rebuild RoPE's inverse frequencies in float32 (`.to(dtype)` rounds them with the weights)."""
        self.rotary_emb = type(self.rotary_emb)(config=block_config(self.config)).to(device)

    def layer_for_depth(self, depth: int) -> MtpLayer:
        return self.layers[self.config.module_for_depth(depth)]

    def _embeds_at(self, embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if not self.config.mask_position_0:
            return embeds
        return embeds * (position_ids != 0).unsqueeze(-1).to(embeds.dtype)  # vLLM zeroes position 0

    # ---- training: one causal pass per depth ------------------------------------------------------
    def forward(self, token_embeds: torch.Tensor, hidden: torch.Tensor, num_depths: int) -> list[torch.Tensor]:
        """Per-depth normed states h^1..h^num_depths, each (B, S, H); lm_head(h^d) at i predicts t_{i+1+d}.

        token_embeds (B, S, H): embed(t_0 .. t_{S-1}); hidden (B, S, H): h^0, the target's final-normed last hidden
        state. Right padding needs no mask: attention is causal, so padded positions never reach valid ones.
        """
        b, s, _ = hidden.shape
        position_ids = torch.arange(s, device=hidden.device).unsqueeze(0).expand(b, -1)  # (B, S)
        cos_sin = self.rotary_emb(hidden, position_ids)
        outs = []
        for depth in range(1, num_depths + 1):
            layer = self.layer_for_depth(depth)
            embeds = self._embeds_at(shift_left(token_embeds, depth), position_ids)  # embed(t_{i+d})
            out = layer.block(layer.fuse(embeds, hidden), attention_mask=None, position_ids=position_ids,
                              position_embeddings=cos_sin)
            hidden = layer.head_norm(out[0] if isinstance(out, tuple) else out)  # (B, S, H) = h^d, read by d+1
            outs.append(hidden)
        return outs

    # ---- runtime: one depth over a KV cache -------------------------------------------------------
    def runtime_support_error(self) -> str | None:
        """Why the cached runtime step cannot run this block (None when it can)."""
        model_type = self.config.target_model_type
        if model_type not in SUPPORTED_STEP_MODEL_TYPES:
            return f"draftsmith's runtime runs MTP blocks of {SUPPORTED_STEP_MODEL_TYPES} targets, not {model_type!r}"
        attn = self.layers[0].block.self_attn
        if not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return f"the MTP block's attention ({type(attn).__name__}) is not a q/k/v/o attention"
        return None

    def new_cache(self, batch_size: int, max_length: int, dtype, device) -> KVCache:
        attn = self.layers[0].block.self_attn
        num_kv_heads = attn.k_proj.out_features // attn.head_dim
        return KVCache(1, batch_size, num_kv_heads, attn.head_dim, max_length, dtype, device)

    def step(self, depth: int, embeds: torch.Tensor, hidden: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Depth `depth` over T new positions cache.length.. (embeds, hidden = h^{d-1} (B, T, H)); returns the normed
        h^d (B, T, H), as `forward` does."""
        b, t, _ = embeds.shape
        start, end = cache.length, cache.length + t
        if end > cache.max_length:
            raise ValueError(f"MTP KV cache overflow: {end} > {cache.max_length}")
        position_ids = torch.arange(start, end, device=embeds.device).unsqueeze(0).expand(b, -1)  # (B, T)
        layer = self.layer_for_depth(depth)
        x = layer.fuse(self._embeds_at(embeds, position_ids), hidden)  # (B, T, H)
        cos, sin = self.rotary_emb(x, position_ids)
        return layer.head_norm(cached_decoder_layer(layer.block, x, cos.unsqueeze(1), sin.unsqueeze(1), cache))

    def step_static(self, depth: int, embeds: torch.Tensor, hidden: torch.Tensor, cache: KVCache,
                    start: torch.Tensor) -> torch.Tensor:
        """`step` of one request (B = 1) at positions start..start+T-1, `start` a (1,) tensor, with shapes that do
        not depend on the cache length (CUDA graphs). Leaves cache.length alone: slots past the caller's new
        length are stale and masked by position."""
        t = embeds.shape[1]
        position_ids = start[:, None] + torch.arange(t, device=embeds.device)  # (1, T)
        layer = self.layer_for_depth(depth)
        x = layer.fuse(self._embeds_at(embeds, position_ids), hidden)  # (1, T, H)
        cos, sin = self.rotary_emb(x, position_ids)
        out = cached_decoder_layer(layer.block, x, cos.unsqueeze(1), sin.unsqueeze(1), cache, position_ids[0])
        return layer.head_norm(out)  # (1, T, H)


def cached_decoder_layer(block: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         cache: KVCache, positions: torch.Tensor | None = None) -> torch.Tensor:
    """A Llama-family decoder layer over a one-layer KV cache (the same math as TargetModel.step).

    x (B, T, H); cos/sin (B, 1, T, hd). Without `positions`: x sits at cache.length.., its K/V are appended and
    the cache advances. With `positions` (T,) long, the shape-static form for CUDA graphs: K/V are written at
    those slots, every query attends over the whole cache masked by position, and cache.length is the
    caller's to set.
    """
    b, t, _ = x.shape
    attn = block.self_attn
    hd = attn.head_dim
    h = block.input_layernorm(x)
    q = attn.q_proj(h).view(b, t, -1, hd)  # (B, T, h, hd)
    k = attn.k_proj(h).view(b, t, -1, hd)
    v = attn.v_proj(h).view(b, t, -1, hd)
    if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hd)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if positions is None:
        start, end = cache.length, cache.length + t
        cache.keys[0, :, :, start:end] = k
        cache.values[0, :, :, start:end] = v
        keys, values = cache.keys[0, :, :, :end], cache.values[0, :, :, :end]
        mask = None
        if t > 1:
            mask = (torch.arange(end, device=x.device)[None, :]
                    <= torch.arange(start, end, device=x.device)[:, None])[None, None]  # (1, 1, T, end)
        cache.length = end
    else:
        cache.keys[0].index_copy_(2, positions, k)
        cache.values[0].index_copy_(2, positions, v)
        keys, values = cache.keys[0], cache.values[0]
        key_pos = torch.arange(cache.max_length, device=x.device)
        mask = (key_pos[None, :] <= positions[:, None])[None, None]  # (1, 1, T, T_max)
    out = attend(q, keys, values, mask, scale=getattr(attn, "scaling", hd ** -0.5))  # (B, h, T, hd)
    x = x + attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
    return x + block.mlp(block.post_attention_layernorm(x))

