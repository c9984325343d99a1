"""The Gemma 4 assistant as draftsmith runs and trains it: transformers' own modules (so the state dict is the
published layout), one forward of ours over K/V handed in from the target.

One draft step, for a query at target position p (vLLM's `Gemma4MultiTokenPredictor.forward`,
transformers' `Gemma4AssistantForCausalLM.forward`)::

    x      = pre_projection(cat(embed(t) * sqrt(H_backbone), h))      (B, T, H)  t: the token after position p,
                                                                                 h: the target's final-normed state at p
    x      = layer_i(x) for each layer: attention of q(x) at position p over the target's K/V of the last own-K/V
             layer of the same type (keys 0..p, the last `sliding_window` of them on sliding layers), then the MLP;
             Gemma 4's sandwich norms, `layer_scalar`
    d      = norm(x)                                                   (B, T, H)  read out: the draft token
    h_next = post_projection(d)                                        (B, T, H_backbone) the next step's h

Every step of one proposal queries the same position p over the same keys (vLLM's `constant_draft_positions`);
only the token and h change. The head is the assistant's own embedding (tied), read sparsely through the centroid
head when `use_ordered_embeddings`: the top `centroid_intermediate_top_k` of `num_centroids` clusters (rows of
`token_ordering`) are scored, every other token is out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.models.gemma4_mtp.config import Gemma4MtpConfig
from draftsmith.models.gemma4_mtp.loss import StepLoss, step_losses
from draftsmith.models.targets.base import apply_rope

KV = dict[str, tuple[Tensor, Tensor]]  # layer type -> (keys, values), each (B, kv, S, hd), RoPE and norms applied


class Gemma4MtpDrafter(nn.Module):
    _no_split_modules = ["Gemma4TextDecoderLayer"]  # FSDP's transformer-based wrap: one unit per assistant layer

    def __init__(self, config: Gemma4MtpConfig):
        from transformers.models.gemma4_assistant import Gemma4AssistantForCausalLM

        super().__init__()
        self.config = config
        hf = Gemma4AssistantForCausalLM(config.hf_config())
        self.hf_config = hf.config
        self.text_config = hf.config.get_text_config()
        self.model = hf.model  # Gemma4TextModel: embed_tokens (the tied head), layers (q-only attention), norm
        self.pre_projection = hf.pre_projection  # Linear(2 * H_backbone -> H)
        self.post_projection = hf.post_projection  # Linear(H -> H_backbone)
        self.masked_embedding = hf.masked_embedding  # centroids + token_ordering, or None
        self.tied = bool(getattr(hf.config, "tie_word_embeddings", True))
        if not self.tied:
            self.lm_head = hf.lm_head

    @property
    def head_weight(self) -> Tensor:
        """(V, H) the draft head: the assistant's own embedding when tied (vLLM ties them)."""
        return self.model.embed_tokens.weight if self.tied else self.lm_head.weight

    @property
    def layer_types(self) -> list[str]:
        return list(self.text_config.layer_types)

    def forward(self, token_embeds: Tensor, hidden: Tensor, position_ids: Tensor, kv: KV,
                masks: dict[str, Tensor | None], loss: StepLoss | None = None):
        """token_embeds (B, T, Hb) the target's scaled embedding of each query's input token, hidden (B, T, Hb),
        position_ids (B, T) each query's position, kv the target's K/V per layer type, masks per layer type
        (B or 1, 1, T, S) bool, True = may attend (None: all). Returns (d (B, T, H) normed, h_next (B, T, Hb));
        with `loss` (training), (h_next, loss.py's (soft CE (N,), centroid CE (N,), served agreement (N,)) of the
        loss rows)."""
        x = self.pre_projection(torch.cat([token_embeds, hidden], dim=-1).to(self.pre_projection.weight.dtype))
        batch, num, _ = x.shape
        rotary = {kind: self.model.rotary_emb(x, position_ids, kind) for kind in set(self.layer_types)}
        for layer in self.model.layers:
            attn = layer.self_attn
            kind = attn.layer_type
            cos, sin = (t.unsqueeze(2) for t in rotary[kind])  # (B, T, 1, hd)
            residual = x
            h = layer.input_layernorm(x)
            q = attn.q_norm(attn.q_proj(h).view(batch, num, -1, attn.head_dim))  # (B, T, heads, hd)
            q = apply_rope(q, cos, sin).transpose(1, 2)  # (B, heads, T, hd)
            keys, values = kv[kind]
            keys, values = keys.to(q.dtype), values.to(q.dtype)
            groups = q.shape[1] // keys.shape[1]
            if groups > 1:
                keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=masks.get(kind), scale=attn.scaling)
            out = attn.o_proj(out.transpose(1, 2).reshape(batch, num, -1))  # (B, T, H)
            x = residual + layer.post_attention_layernorm(out)
            residual = x
            x = residual + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
            x = x * layer.layer_scalar
        d = self.model.norm(x)
        if loss is not None:
            return self.post_projection(d), step_losses(self, d[loss.rows], loss.teacher, loss.teacher_head,
                                                        loss.cap, loss.chunk)
        return d, self.post_projection(d)

    def dense_logits(self, d: Tensor) -> Tensor:
        """(..., V) every token's logit (what training scores; the served head reads only the selected clusters)."""
        return d @ self.head_weight.t()

    def selected(self, d: Tensor) -> Tensor | None:
        """(..., V) bool: the tokens of the top-k centroid clusters (vLLM's `_select_and_score`); None without a
        centroid head (every token)."""
        emb = self.masked_embedding
        if emb is None:
            return None
        top = emb.centroids(d).topk(emb.centroid_intermediate_top_k, dim=-1).indices  # (..., k)
        clusters = emb.token_ordering.long().view(emb.num_centroids, emb.vocab_size_per_centroid)
        tokens = clusters[top].flatten(-2)  # (..., k * V/C)
        mask = torch.zeros(*d.shape[:-1], emb.vocab_size, dtype=torch.bool, device=d.device)
        return mask.scatter_(-1, tokens, True)

    def served_logits(self, d: Tensor) -> Tensor:
        """(..., V) float32 logits as the engine serves them: tokens outside the selected clusters at -inf."""
        logits = self.dense_logits(d).float()
        keep = self.selected(d)
        return logits if keep is None else logits.masked_fill(~keep, float("-inf"))

    def cluster_of(self) -> Tensor:
        """(V,) each token's centroid cluster (its row of `token_ordering`), for the centroid loss."""
        emb = self.masked_embedding
        order = emb.token_ordering.long()
        cluster = torch.empty_like(order)
        cluster[order] = torch.arange(order.numel(), device=order.device) // emb.vocab_size_per_centroid
        return cluster


def target_kv(layer: nn.Module, hidden_in: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """(keys, values) (B, kv, S, hd) a Gemma 4 target layer writes for the residual stream entering it
    (`hidden_in` (B, S, H)), as transformers' Gemma4TextAttention and draftsmith's runtime (models/targets/gemma4.py)
    compute them: RMSNorm over each head of k (weighted) and v (unweighted), RoPE on k, values = the raw key
    projection with `attention_k_eq_v`. cos / sin (B, S, hd) of that layer's type."""
    attn = layer.self_attn
    batch, num, _ = hidden_in.shape
    x = layer.input_layernorm(hidden_in)
    k = attn.k_proj(x).view(batch, num, -1, attn.head_dim)  # (B, S, kv, hd)
    v = attn.v_proj(x).view(batch, num, -1, attn.head_dim) if attn.v_proj is not None else k
    k = attn.k_norm(k)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    k = apply_rope(k, cos, sin).transpose(1, 2)
    return k, attn.v_norm(v).transpose(1, 2)


def causal_masks(num: int, windows: dict[str, int | None], device) -> dict[str, Tensor]:
    """Training masks (1, 1, S, S) per layer type: query i (at position i) sees keys 0..i, a sliding layer only
    the last `window` of them (keys i - window + 1 .. i), as vLLM's per-layer sliding window does."""
    pos = torch.arange(num, device=device)
    causal = pos[None, :] <= pos[:, None]  # (S, S) [query, key]
    out = {}
    for kind, window in windows.items():
        mask = causal if not window else causal & (pos[None, :] > pos[:, None] - window)
        out[kind] = mask[None, None]
    return out
