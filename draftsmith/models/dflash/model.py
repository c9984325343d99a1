"""The DFlash drafter: a block of [anchor, mask, ..., mask] denoised in one pass, conditioned on target features.

Shapes: H = hidden size (the target's), n = fused target layers, B_k = block size, S = context length.

    fc, hidden_norm:  (n*H) -> H                 fuse the target features of each context position: c_t
    layers (Qwen3 layout, q/k norm):             queries from the block only; keys/values = [K(c); K(block)]
        context K/V = k_norm(k_proj(c)) with RoPE at the context positions, v_proj(c) (no input_layernorm)
    norm, then the target's frozen lm_head       (not part of this module)

Position alignment (z-lab's `dflash_generate`, SpecForge's training mask): the anchor x_a is the last committed
token; the target has features for positions < a only (it has not run x_a yet), so a block sees context c_0..c_{a-1}
and, bidirectionally, its own B_k slots. Slot k sits at position a + k and predicts the token *at* a + k:

    position   ... a-2   a-1 |  a       a+1    a+2   ...  a+B_k-1
    context    ... c     c   |
    block                    |  x_a     MASK   MASK  ...  MASK
    predicts                 |  -       x_a+1  x_a+2 ...  x_a+B_k-1
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from draftsmith.kernels.block_attention import block_attention_mask, training_attention  # noqa: F401 - re-exported
from draftsmith.models.dflash.config import DflashDrafterConfig
from draftsmith.models.target import KVCache, attend
from draftsmith.models.targets.base import apply_rope

MASK_EMBEDDING_FILE = "mask_embedding.pt"  # vLLM's name for a separately trained mask embedding


class DflashAttention(nn.Module):
    def __init__(self, config: DflashDrafterConfig):
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=False)
        self.q_norm = LlamaRMSNorm(hd, eps=config.rms_norm_eps)  # per-head RMSNorm before RoPE (Qwen3)
        self.k_norm = LlamaRMSNorm(hd, eps=config.rms_norm_eps)

    def query(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)  # (B, h, T, hd)
        return apply_rope(q, cos, sin)

    def key_value(self, x, cos, sin):
        """Rotated keys and values (B, kv, T, hd) of x (B, T, H): block tokens, or fused context features."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v


class DflashLayer(nn.Module):
    """A Qwen3 decoder layer whose attention over [context; block] is supplied by the caller (`attend_fn`), so
    training (one mask over all blocks) and the runtime (cached context) share every weight and op."""

    def __init__(self, config: DflashDrafterConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DflashAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config.llama_config())

    def forward(self, hidden, cos, sin, attend_fn):
        b, t, _ = hidden.shape
        x = self.input_layernorm(hidden)
        q = self.self_attn.query(x, cos, sin)
        k, v = self.self_attn.key_value(x, cos, sin)
        out = attend_fn(q, k, v)  # (B, h, T, hd)
        hidden = hidden + self.self_attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def training_layer(layer: DflashLayer, hidden, context, ctx_cos, ctx_sin, cos, sin, attend_blocks):
    """One draft layer over every block of a sequence: context K/V from the fused features, then `attend_blocks`
    (kernels/block_attention.training_attention: each block sees the context before its anchor and itself) over
    [context | all blocks], one fused kernel that keeps no score tensor for the backward pass."""
    ctx_k, ctx_v = layer.self_attn.key_value(context, ctx_cos, ctx_sin)  # (B, kv, S, hd)
    scale = layer.self_attn.head_dim ** -0.5

    def attend_all(q, k, v):
        return attend_blocks(q, torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2), scale)

    return layer(hidden, cos, sin, attend_all)


class PlainBlockKernels:
    """How `DflashDrafter.forward` (training: all blocks at once) computes unless it is handed another way
    (`drafter.block_kernels`): SDPA over the dense block mask (kernels/block_attention.py), every layer run eagerly
    as it is. Training hands in its own from outside (FlexAttention, recomputed layers: dflash/training.py
    apply_training_options); the model knows none of its options."""

    def attention(self, anchor_positions, context_length: int, block_size: int):
        """The attention every layer of one training step calls, fn(q, keys, values, scale), its mask built once."""
        return training_attention("reference", anchor_positions, context_length, block_size)

    def layer(self, *args):
        """One draft layer over every block (`training_layer`'s arguments)."""
        return training_layer(*args)


class DflashDrafter(nn.Module):
    def __init__(self, config: DflashDrafterConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DflashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        if config.learned_mask:
            self.mask_embedding = nn.Parameter(torch.zeros(h))
        self.rotary_emb = LlamaRotaryEmbedding(config.llama_config())
        self.block_kernels = PlainBlockKernels()  # how forward computes: handed in from outside (not saved)

    def rope(self, like, position_ids):
        cos, sin = self.rotary_emb(like, position_ids)  # (B, T, hd)
        return cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, hd)

    def fuse(self, aux_hidden):
        """Context features c_t = hidden_norm(fc(aux_t)): (B, T, n*H) -> (B, T, H)."""
        return self.hidden_norm(self.fc(aux_hidden.to(self.fc.weight.dtype)))

    def mask_vector(self, mask_embed: torch.Tensor | None) -> torch.Tensor:
        """The (H,) input of every mask slot: the learned one, or the target's embedding row passed in."""
        if self.config.learned_mask:
            return self.mask_embedding
        if mask_embed is None:
            raise ValueError("this drafter embeds masks with the target's row of mask_token_id: pass mask_embed")
        return mask_embed.to(self.fc.weight.dtype)

    def block_inputs(self, anchor_embeds, mask_embed=None, width: int | None = None):
        """(B, N, H) anchor embeddings -> (B, N*W, H) blocks [anchor, mask, ..., mask] of W slots (default: the
        trained block size; the runtime may run fewer)."""
        b, n, h = anchor_embeds.shape
        width = self.config.block_size if width is None else width
        masks = self.mask_vector(mask_embed).expand(b, n, width - 1, h)
        blocks = torch.cat([anchor_embeds.to(masks.dtype).unsqueeze(2), masks], dim=2)  # (B, N, W, H)
        return blocks.reshape(b, n * width, h)

    # ---- training: all blocks of a sequence in one pass -------------------------------------------------------
    def forward(self, aux_hidden, anchor_embeds, anchor_positions, mask_embed=None):
        """aux_hidden (B, S, n*H): target features at positions 0..S-1; anchor_embeds (B, N, H): embeddings of the
        anchor tokens at anchor_positions (B, N). Returns final-normed hidden states (B, N, B_k, H)."""
        b, s, _ = aux_hidden.shape
        n, bk = anchor_positions.shape[1], self.config.block_size
        device = aux_hidden.device
        context = self.fuse(aux_hidden)  # (B, S, H)
        hidden = self.block_inputs(anchor_embeds, mask_embed)  # (B, N*B_k, H)
        ctx_cos, ctx_sin = self.rope(context, torch.arange(s, device=device).unsqueeze(0).expand(b, -1))
        block_pos = (anchor_positions.unsqueeze(-1) + torch.arange(bk, device=device)).reshape(b, n * bk)
        cos, sin = self.rope(hidden, block_pos)
        attend_blocks = self.block_kernels.attention(anchor_positions, s, bk)  # its mask built once a step
        for layer in self.layers:
            hidden = self.block_kernels.layer(layer, hidden, context, ctx_cos, ctx_sin, cos, sin, attend_blocks)
        return self.norm(hidden).view(b, n, bk, -1)

    # ---- runtime: cached context, one block per step -------------------------------------------------------------
    def new_cache(self, batch_size, max_length, dtype, device) -> KVCache:
        """Zero-filled: in a batch a row's mask hides slots other rows wrote, and a masked NaN would still poison
        the attention product (0 * NaN), so no slot may hold uninitialised memory."""
        cfg = self.config
        cache = KVCache(cfg.num_hidden_layers, batch_size, cfg.num_key_value_heads, cfg.head_dim, max_length,
                        dtype, device)
        cache.keys.zero_()
        cache.values.zero_()
        return cache

    def extend_context(self, aux_hidden, cache: KVCache, positions) -> None:
        """Write the context K/V of committed positions into every layer's cache slots, slot = position.

        aux_hidden (B, T, n*H); positions (B, T) int64, each row's own (rows of a batch grow independently), all
        below cache.max_length (the caller sizes the cache; checking here would cost a device sync).
        """
        context = self.fuse(aux_hidden)  # (B, T, H)
        cos, sin = self.rope(context, positions)
        slots = positions[:, None, :, None].expand(-1, self.config.num_key_value_heads, -1, self.config.head_dim)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.key_value(context, cos, sin)  # (B, kv, T, hd)
            cache.keys[i].scatter_(2, slots, k.to(cache.keys.dtype))
            cache.values[i].scatter_(2, slots, v.to(cache.values.dtype))

    def draft_block(self, block_embeds, cache: KVCache, starts, key_length: int):
        """Run one block (B, B_k, H) per row at positions starts[b] .. starts[b]+B_k-1 (starts (B,) = each row's
        context length), seeing that row's cached context and its own block; returns final-normed (B, B_k, H).

        The block's K/V go into the slots right after each row's context, which stay unclaimed: the next
        `extend_context` overwrites them, so the cache only ever holds context. `key_length` >= max(starts) + B_k
        bounds the slots read.
        """
        b, t, _ = block_embeds.shape
        if key_length > cache.max_length:
            raise ValueError(f"DFlash context cache overflow: {key_length} > {cache.max_length}")
        hidden = block_embeds.to(self.fc.weight.dtype)
        positions = starts[:, None] + torch.arange(t, device=hidden.device)  # (B, B_k)
        cos, sin = self.rope(hidden, positions)
        slots = positions[:, None, :, None].expand(-1, self.config.num_key_value_heads, -1, self.config.head_dim)
        key_pos = torch.arange(key_length, device=hidden.device)
        mask = (key_pos[None, :] < (starts + t)[:, None])[:, None, None, :]  # (B, 1, 1, K): context + own block
        scale = self.config.head_dim ** -0.5
        for i, layer in enumerate(self.layers):

            def attend_cached(q, k, v, i=i):
                cache.keys[i].scatter_(2, slots, k.to(cache.keys.dtype))
                cache.values[i].scatter_(2, slots, v.to(cache.values.dtype))
                return attend(q, cache.keys[i, :, :, :key_length], cache.values[i, :, :, :key_length], mask, scale)

            hidden = layer(hidden, cos, sin, attend_cached)
        return self.norm(hidden)


def init_drafter(drafter: DflashDrafter, target_embedding: torch.Tensor, std: float = 0.02) -> None:
    """Normal(0, std) projections as Hugging Face initialises Qwen3; a learned mask embedding starts as a
    typical target embedding (per-dimension mean and spread of the rows), never zero, which RMSNorm would
    turn into an all-zero query that cannot tell the mask slots apart."""
    with torch.no_grad():
        for module in drafter.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
        if drafter.config.learned_mask:
            rows = target_embedding.float()
            mean, spread = rows.mean(0), rows.std(0)
            noise = torch.randn(rows.shape[1], device=rows.device)
            drafter.mask_embedding.copy_((mean + spread * noise).to(drafter.mask_embedding.dtype))
