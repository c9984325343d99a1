"""The EAGLE-3 drafter: fused target features + token embedding -> one Llama decoder layer -> draft-vocab head.

Shapes: H = draft hidden size, H_t = target hidden size, n = number of aux layers, V_d = draft vocab.

    fc:        (n*H_t) -> H                              fuses the target's aux features g_t
    midlayer:  attention input cat(input_layernorm(e), hidden_norm(h))  (2H wide), residual = h (un-normed)
    norm, lm_head: H -> V_d                               d2t maps a draft id i to target id i + d2t[i]

Forward-pass variants (config flags, named and computed as vLLM's llama_eagle3.py does; all off in the EAGLE-3
reference and in SGLang): `norm_before_fc` RMS-normalises the concatenated aux features before fc (`input_norm`),
`fc_norm` each aux layer's (`fc_norm.{i}`); `norm_before_residual` takes the residual after hidden_norm;
`norm_output` feeds norm(out) instead of out back as the next draft step's hidden (EAGLE 3.1), and the logits are
read from that normed hidden without a second norm.

Position alignment (the same as vLLM's EAGLE proposer): drafter position t holds the pair
(embed(x_{t+1}), g_t) and predicts x_{t+2}; the i-th unrolled draft step from t sits at position t + i.

    tokens   x0   x1   x2   x3 ...
    target   g0   g1   g2   g3        (g_t has seen x_0..x_t)
    drafter  (x1,g0) (x2,g1) (x3,g2)  -> predicts x2, x3, x4
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from draftsmith.kernels.ttt_attention import unroll_attention
from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.draft_attention import DraftAttention
from draftsmith.models.target import KVCache, attend


class Eagle3Layer(nn.Module):
    """The single decoder layer (`midlayer`), split so training (TTT) and the runtime (KV cache) share it."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        llama = config.llama_config()
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DraftAttention(config, 2 * config.hidden_size)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(llama)

    def attention_input(self, embeds, hidden):
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # (B, S, 2H)

    def finish(self, attn_out, hidden):
        """o_proj, residual from the hidden branch (un-normed, or hidden_norm(h) with norm_before_residual), then
        the MLP block. Returns the layer output before the final norm."""
        b, _, s, _ = attn_out.shape
        residual = self.hidden_norm(hidden) if self.norm_before_residual else hidden
        out = residual + self.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, s, -1))  # (B, S, H)
        return out + self.mlp(self.post_attention_layernorm(out))


class PlainTTTKernels:
    """How `Eagle3Drafter.forward_ttt` computes unless it is handed another way (`drafter.ttt_kernels`): plain torch,
    the reference attention of kernels/ttt_attention.py over keys and values repeated to the query heads once a step,
    every step run eagerly as it is. Training hands in its own from outside (FlexAttention, recomputed and compiled
    steps: eagle3/training.py apply_training_options); the model knows none of its options."""

    def attention(self, batch: int, heads: int, seq_len: int, num_steps: int, device, query_block=None,
                  doc_ids=None):
        """(the attention every step of one unroll calls, fn(q, keys0, values0, diag_keys, diag_values, scale),
        whether it reads keys and values repeated to the query heads)."""
        return unroll_attention("reference", batch, heads, seq_len, num_steps, device, query_block, doc_ids), True

    def step(self, drafter: Eagle3Drafter, *args):
        """One unrolled step: `drafter.ttt_step` over its two halves as they are."""
        return drafter.ttt_step(drafter.step_qkv, drafter.step_finish, *args)


class Eagle3Drafter(nn.Module):
    adamw_only = ("lm_head",)  # the draft head (when trained) stays with AdamW under training.optimizer=muon (optim.py)

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        n_aux, width = len(config.aux_layer_ids), config.target_hidden_size
        self.input_norm = LlamaRMSNorm(n_aux * width, eps=config.rms_norm_eps) if config.norm_before_fc else None
        self.fc_norm = nn.ModuleList(
            [LlamaRMSNorm(width, eps=config.rms_norm_eps) for _ in range(n_aux)]) if config.fc_norm else None
        self.fc = nn.Linear(n_aux * width, config.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary_emb = LlamaRotaryEmbedding(config.llama_config())
        self.ttt_kernels = PlainTTTKernels()  # how forward_ttt computes: handed in from outside (not saved)

    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"draft vocab of shapes {tuple(d2t.shape)}/{tuple(t2d.shape)} does not fit "
                             f"{tuple(self.d2t.shape)}/{tuple(self.t2d.shape)}")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def rope(self, like, position_ids):
        cos, sin = self.rotary_emb(like, position_ids)  # (B, S, hd)
        return cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, S, hd)

    def fuse(self, aux_hidden):
        """fc over the target's aux features (B, S, n*H_t) -> (B, S, H), after the configured input norms."""
        if self.input_norm is not None:
            aux_hidden = self.input_norm(aux_hidden)
        if self.fc_norm is not None:
            chunks = aux_hidden.chunk(len(self.fc_norm), dim=-1)
            aux_hidden = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux_hidden)

    def output_hidden(self, out):
        """The hidden a draft step hands on (to the next step and to `logits`): norm(out) with norm_output."""
        return self.norm(out) if self.config.norm_output else out

    def logits(self, hidden):
        """Draft logits (B, S, V_d) of an `output_hidden`: the final norm is applied once, here or there."""
        return self.lm_head(self.head_input(hidden))

    def head_input(self, hidden):
        """What the head reads of an `output_hidden`: logits(h) = lm_head(head_input(h)) (the fused loss's split)."""
        return hidden if self.config.norm_output else self.norm(hidden)

    def head_parameters(self) -> list[nn.Parameter]:
        """Every parameter `logits` reads (the fused loss takes their gradients in its forward pass)."""
        return list(self.lm_head.parameters()) + ([] if self.config.norm_output else list(self.norm.parameters()))

    # ---- training: training-time test (TTT) -----------------------------------------------------
    def step_qkv(self, embeds, hidden, cos, sin):
        """A TTT step's first half: its queries (B, h, S, hd), keys and values (B, kv, S, hd)."""
        return self.midlayer.self_attn.qkv(self.midlayer.attention_input(embeds, hidden), cos, sin)

    def step_finish(self, attn_out, hidden):
        """A TTT step's second half, after its attention: the output hidden (B, S, H)."""
        return self.output_hidden(self.midlayer.finish(attn_out, hidden))

    def ttt_step(self, qkv, finish, embeds, hidden, cos, sin, attend, repeat_kv, keys0, values0, *diagonal):
        """One unrolled draft step: returns its output hidden and its keys and values (B, kv or h, S, hd). `qkv` and
        `finish` are its two halves (`step_qkv`, `step_finish`, or those compiled); `attend` is the unroll's
        attention (kernels/ttt_attention.unroll_attention), which with `repeat_kv` reads keys and values repeated to
        the query heads; `diagonal` holds the earlier steps' keys then values (steps 1..i-1); step 0 passes
        keys0 = values0 = None."""
        q, k, v = qkv(embeds, hidden, cos, sin)
        if repeat_kv:  # repeated once here, not at every later step that reads them
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, h, S, hd)
        half = len(diagonal) // 2
        diag_keys, diag_values = list(diagonal[:half]), list(diagonal[half:])
        if keys0 is None:
            keys0, values0 = k, v
        else:
            diag_keys.append(k)
            diag_values.append(v)
        scale = self.midlayer.self_attn.head_dim ** -0.5
        out = attend(q, keys0, values0, diag_keys, diag_values, scale)  # (B, h, S, hd)
        return finish(out, hidden), k, v

    def forward_ttt(self, aux_hidden, token_embeds, num_steps: int, position_ids=None, return_hidden: bool = False,
                    query_block: int | None = None, doc_ids=None):
        """Unroll `num_steps` draft steps over a whole sequence at once; returns per-step logits (B, S, V_d), or with
        `return_hidden` the per-step output hidden states (B, S, H) that `logits` reads (the fused loss does so a
        chunk of positions at a time, so the logits of a whole step never exist).

        aux_hidden (B, S, n*H_t): g_t; token_embeds (B, S, H): embed(x_t) of the whole sequence.
        Step i at position t takes embed(x_{t+1+i}) and, for i > 0, the drafter's own output hidden of step i-1
        at t, sits at position t+i, and predicts x_{t+2+i}. Its query attends causally to the step-0 keys and to
        the key at its own position of every step 1..i (the "diagonal" of EAGLE-3's Fig. 6): kernels/ttt_attention.py
        computes it as `ttt_kernels` says (FlexAttention, or the reference `query_block` queries at a time when all
        steps' scores would be large, so no S x S scores are kept).
        Positions whose input token lies past the end get zero embeddings; the loss masks them.
        Packed rows: `position_ids` restart in every sample (RoPE) and `doc_ids` (B, S) keep the attention inside
        each; a position whose input or target lies in the next sample is masked by the loss (same `doc_ids`).
        """
        b, s, _ = token_embeds.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=token_embeds.device).unsqueeze(0).expand(b, -1)
        # (B, S, H) in the dtype every later step's output hidden has (the weights': under autocast fc gives bf16,
        # the residual stream fp32), so each compiled step half sees one dtype and compiles once, not twice
        hidden = self.fuse(aux_hidden).to(self.norm.weight.dtype)
        attend, repeat_kv = self.ttt_kernels.attention(b, self.config.num_attention_heads, s, num_steps,
                                                       token_embeds.device, query_block, doc_ids)  # for every step
        keys0 = values0 = None
        diag_keys, diag_values = [], []  # steps 1..i, each (B, kv, S, hd) (repeated to h heads for the reference)
        outputs = []
        for i in range(num_steps):
            embeds = torch.zeros_like(token_embeds)
            embeds[:, : max(s - 1 - i, 0)] = token_embeds[:, 1 + i:]  # embed(x_{t+1+i})
            cos, sin = self.rope(token_embeds, position_ids + i)
            args = (embeds, hidden, cos, sin, attend, repeat_kv, keys0, values0, *diag_keys, *diag_values)
            hidden, k, v = self.ttt_kernels.step(self, *args)  # hidden: (B, S, H), the input hidden of step i+1
            if i == 0:
                keys0, values0 = k, v
            else:
                diag_keys.append(k)
                diag_values.append(v)
            outputs.append(hidden if return_hidden else self.logits(hidden))
        return outputs

    def forward(self, aux_hidden, token_embeds, num_steps: int, loss_targets: dict | None = None, position_ids=None,
                doc_ids=None):
        """Training forward (what DDP/FSDP/DeepSpeed wrap): the TTT unroll, and with `loss_targets` (the keyword
        arguments of `eagle3.loss.fused_ttt_loss` but the first two) its loss, computed here so that sharded
        wrappers see the head used inside their forward. Returns step logits, or (loss, metrics)."""
        if loss_targets is None:
            return self.forward_ttt(aux_hidden, token_embeds, num_steps, position_ids, doc_ids=doc_ids)
        from draftsmith.models.eagle3.loss import fused_ttt_loss

        step_hidden = self.forward_ttt(aux_hidden, token_embeds, num_steps, position_ids, return_hidden=True,
                                       doc_ids=doc_ids)
        return fused_ttt_loss(self.logits, step_hidden, doc_ids=doc_ids, head_params=self.head_parameters(),
                              head=(self.head_input, self.lm_head.weight), **loss_targets)

    # ---- runtime: cached steps ---------------------------------------------------------------------
    def new_cache(self, batch_size, max_length, dtype, device) -> KVCache:
        attn = self.midlayer.self_attn
        return KVCache(1, batch_size, attn.num_kv_heads, attn.head_dim, max_length, dtype, device)

    def step(self, embeds, hidden, cache: KVCache, attention_mask=None, position_ids=None):
        """Append T pairs (embeds (B,T,H), hidden (B,T,H)) at slots cache.length..; returns output hidden (B,T,H).

        `hidden` is fuse(aux) for committed context and the drafter's previous output hidden while drafting.
        `attention_mask` (B or 1, 1, T, cache.length+T) bool replaces the causal mask and `position_ids` (B, T)
        the slot positions (draft trees, batches with per-row lengths).
        """
        b, t, _ = embeds.shape
        start, end = cache.length, cache.length + t
        if end > cache.max_length:
            raise ValueError(f"draft KV cache overflow: {end} > {cache.max_length}")
        if position_ids is None:
            position_ids = torch.arange(start, end, device=embeds.device).unsqueeze(0).expand(b, -1)
        cos, sin = self.rope(embeds, position_ids)
        attn = self.midlayer.self_attn
        q, k, v = attn.qkv(self.midlayer.attention_input(embeds, hidden), cos, sin)
        cache.keys[0, :, :, start:end] = k
        cache.values[0, :, :, start:end] = v
        mask = attention_mask
        if mask is None and t > 1:
            mask = (torch.arange(end, device=embeds.device)[None, :]
                    <= torch.arange(start, end, device=embeds.device)[:, None])[None, None]
        out = attend(q, cache.keys[0, :, :, :end], cache.values[0, :, :, :end], mask, scale=attn.head_dim ** -0.5)
        cache.length = end
        return self.output_hidden(self.midlayer.finish(out, hidden))

    def step_static(self, embeds, hidden, cache: KVCache, position_ids, attention_mask=None, slots=None):
        """Shape-static `step` for CUDA graphs (B = 1): K/V are scattered at `slots` (T,) (default: the positions
        of `position_ids` (1, T)) and the queries attend over the whole cache, masked by position, or by
        `attention_mask` (1, 1, T, T_max) for a draft tree, so slots past the committed context (stale drafts,
        never written slots) are not seen. Does not move `cache.length`: the caller does."""
        cos, sin = self.rope(embeds, position_ids)
        attn = self.midlayer.self_attn
        q, k, v = attn.qkv(self.midlayer.attention_input(embeds, hidden), cos, sin)
        slots = position_ids[0] if slots is None else slots  # (T,)
        cache.keys[0].index_copy_(2, slots, k)
        cache.values[0].index_copy_(2, slots, v)
        mask = attention_mask
        if mask is None:
            key_pos = torch.arange(cache.max_length, device=embeds.device)
            mask = (key_pos[None, None, :] <= position_ids[:, :, None])[:, None]  # (1, 1, T, T_max)
        out = attend(q, cache.keys[0], cache.values[0], mask, scale=attn.head_dim ** -0.5)
        return self.output_hidden(self.midlayer.finish(out, hidden))

    def chain_static(self, hidden, start, cache: KVCache, embed_tokens, num_tokens: int, choose=None):
        """`num_tokens` drafts from `hidden` (1, 1, H), the drafter's output at the last committed pair; chain step
        i writes its pair at position start + i (start (1, 1) long). `choose(i, logits)` picks step i's draft id
        and its score from the float32 logits (1, V_d); the default is the argmax and its log-prob. No host sync,
        fixed shapes: this is what a CUDA graph records. Returns target token ids (1, k) and scores (1, k)."""
        tokens, scores = [], []
        for i in range(num_tokens):
            logits = self.logits(hidden)[:, -1].float()  # (1, V_d)
            if choose is None:
                score, draft_id = torch.log_softmax(logits, dim=-1).max(dim=-1)
            else:
                draft_id, score = choose(i, logits)
            token = self.draft_to_target(draft_id)  # (1,)
            tokens.append(token)
            scores.append(score)
            if i + 1 < num_tokens:
                hidden = self.step_static(embed_tokens(token[:, None]), hidden, cache, start + i)
        return torch.stack(tokens, dim=1), torch.stack(scores, dim=1)


def init_drafter_from_target(drafter: Eagle3Drafter, target_lm_head_weight: torch.Tensor) -> None:
    """Start the draft head from the target's head rows of the draft vocabulary: it already maps the target's
    final hidden space to tokens, which shortens training."""
    with torch.no_grad():
        ids = torch.arange(drafter.config.draft_vocab_size, device=drafter.d2t.device) + drafter.d2t
        drafter.lm_head.weight.copy_(target_lm_head_weight[ids].to(drafter.lm_head.weight.dtype))


