"""The DSpark drafter: DFlash's block backbone (models/dflash/model.py) read out through the target's frozen head
plus a Markov bias, and a confidence head (config.py draws the slot layout).

Shapes: H hidden size, V the target's vocabulary, V_d the draft vocabulary (V unless `draft_vocab_size` prunes
it), r the Markov rank; h_k the backbone's final-normed state of slot k, x_{k-1} the token before slot k's
prediction (the anchor for slot 0), always a target id.

    logits_k = lm_head(h_k) + markov_w2(g_k * markov_w1[x_{k-1}])     (V_d,) g_k = 1 (vanilla) or
               g_k = sigmoid(gate_proj([h_k; markov_w1[x_{k-1}]]))   (r,)   (gated)
    c_k      = sigmoid(confidence_head.proj([h_k; markov_w1[x_{k-1}]]))     predicted P(slot k is accepted)

lm_head is the target's whole frozen head (not part of this module) or, with a pruned vocabulary, the drafter's
own frozen `lm_head` (V_d, H) holding the target's rows of the draft ids; draft id i is target id i + d2t[i]
(`d2t`, int64 offsets, and `t2d`, a bool mask over V, as EAGLE-3 names them and vLLM reads d2t).

Tensor names are the engines' (vLLM's qwen3_dspark.py, SGLang's dspark.py, DeepSpec's): `markov_head.markov_w1`
(an embedding of V rows), `markov_head.markov_w2` (V_d x r), `markov_head.gate_proj`, `confidence_head.proj`, and
for a pruned vocabulary `lm_head.weight` and `d2t` (vLLM's reduced-vocabulary Qwen3DSparkForCausalLM).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.models.dflash.model import DflashDrafter
from draftsmith.models.dspark.config import DsparkDrafterConfig


class MarkovHead(nn.Module):
    """The low-rank transition bias of the previous token (a target id) over the draft vocabulary (M, V_d)."""

    def __init__(self, config: DsparkDrafterConfig):
        super().__init__()
        r = config.markov_rank
        self.markov_w1 = nn.Embedding(config.vocab_size, r)  # the previous token: a target id
        self.markov_w2 = nn.Linear(r, config.head_size, bias=False)  # a bias over the draft ids
        self.gated = config.markov_head == "gated"
        if self.gated:
            self.gate_proj = nn.Linear(config.hidden_size + r, r)

    def embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """W1[x_{k-1}]: (...,) token ids -> (..., r)."""
        return self.markov_w1(prev_ids)

    def bias_input(self, hidden: torch.Tensor, prev_embed: torch.Tensor) -> torch.Tensor:
        """What markov_w2 reads (M, r): the Markov embeddings, gated by the states for `gated`."""
        if self.gated:
            prev_embed = prev_embed * torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_embed], dim=-1)))
        return prev_embed

    def bias(self, hidden: torch.Tensor, prev_embed: torch.Tensor) -> torch.Tensor:
        """The (M, V_d) logit bias of rows with final-normed states `hidden` (M, H) and Markov embeddings (M, r)."""
        return self.markov_w2(self.bias_input(hidden, prev_embed))


class Float32Linear(nn.Linear):
    """A Linear that computes in float32 whatever its weights' dtype. Its own forward reads the weights, so DeepSpeed
    ZeRO-3 gathers them around it (a parent reading `proj.weight` would get an empty partition)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float(), self.bias.float())


class ConfidenceHead(nn.Module):
    """One logit per slot from [h_k; W1[x_{k-1}]]: the predicted acceptance of slot k given its prefix."""

    def __init__(self, config: DsparkDrafterConfig):
        super().__init__()
        self.proj = Float32Linear(config.hidden_size + config.markov_rank, 1)

    def forward(self, hidden: torch.Tensor, prev_embed: torch.Tensor) -> torch.Tensor:
        """(M,) float32 logits; the engines run this head in float32."""
        return self.proj(torch.cat([hidden, prev_embed.to(hidden.dtype)], dim=-1)).squeeze(-1)


class DsparkDrafter(DflashDrafter):
    """The backbone's forward (training, all blocks at once) and draft_block (runtime) are DFlash's; every slot,
    the anchor's included, predicts (config.py)."""

    adamw_only = ("markov_head.markov_w",)  # vocabulary tables stay with AdamW under training.optimizer=muon (optim.py)

    def __init__(self, config: DsparkDrafterConfig):
        super().__init__(config)
        self.markov_head = MarkovHead(config)
        self.confidence_head = ConfidenceHead(config) if config.confidence_head else None
        self.lm_head: nn.Linear | None = None  # the target's whole head, shared, unless the vocabulary is pruned
        if config.pruned:
            self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
            self.lm_head.weight.requires_grad_(False)  # the target's rows, frozen (vLLM loads them as they are)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor, target_head_weight: torch.Tensor) -> None:
        """Take the draft vocabulary (d2t offsets, t2d mask) and start the head from the target's rows of it."""
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"draft vocab of shapes {tuple(d2t.shape)}/{tuple(t2d.shape)} does not fit "
                             f"{tuple(self.d2t.shape)}/{tuple(self.t2d.shape)}")
        with torch.no_grad():
            self.d2t.copy_(d2t)
            self.t2d.copy_(t2d)
            self.lm_head.weight.copy_(target_head_weight[self.draft_ids()].to(self.lm_head.weight.dtype))

    def draft_ids(self) -> torch.Tensor:
        """The target id of every draft id (V_d,): arange + d2t."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target ids of draft ids (vLLM's map_draft_to_target); the identity for the whole vocabulary."""
        return draft_ids if self.lm_head is None else draft_ids + self.d2t[draft_ids]

    def target_to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids of target ids, -1 where a target id is outside the draft vocabulary (pruned only)."""
        index = torch.full((self.t2d.numel(),), -1, dtype=torch.long, device=self.d2t.device)
        index[self.draft_ids()] = torch.arange(self.d2t.numel(), device=self.d2t.device)
        return index[target_ids]


def init_heads(drafter: DsparkDrafter, std: float = 0.02) -> None:
    """Normal(0, std) weights and zero biases, as Hugging Face initialises the DeepSpec heads (post_init)."""
    heads = [drafter.markov_head] + ([drafter.confidence_head] if drafter.confidence_head is not None else [])
    with torch.no_grad():
        for head in heads:
            for module in head.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, std=std)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)
