"""The DSpark drafter: DFlash's block backbone (models/dflash/model.py) read out through the target's frozen head
plus a Markov bias, and a confidence head (config.py draws the slot layout).

Shapes: H hidden size, V the target's vocabulary, r the Markov rank; h_k the backbone's final-normed state of slot
k, x_{k-1} the token before slot k's prediction (the anchor for slot 0).

    logits_k = lm_head(h_k) + markov_w2(g_k * markov_w1[x_{k-1}])     (V,)   g_k = 1 (vanilla) or
               g_k = sigmoid(gate_proj([h_k; markov_w1[x_{k-1}]]))   (r,)   (gated)
    c_k      = sigmoid(confidence_head.proj([h_k; markov_w1[x_{k-1}]]))     predicted P(slot k is accepted)

Tensor names are the engines' (vLLM's qwen3_dspark.py, SGLang's dspark.py, DeepSpec's): `markov_head.markov_w1`
(an embedding of V rows), `markov_head.markov_w2` (V x r), `markov_head.gate_proj`, `confidence_head.proj`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.models.dflash.model import DflashDrafter
from draftsmith.models.dspark.config import DsparkDrafterConfig


class MarkovHead(nn.Module):
    """The low-rank transition bias of the previous token; `bias` adds it to logits (M, V) or returns it."""

    def __init__(self, config: DsparkDrafterConfig):
        super().__init__()
        r = config.markov_rank
        self.markov_w1 = nn.Embedding(config.vocab_size, r)
        self.markov_w2 = nn.Linear(r, config.vocab_size, bias=False)
        self.gated = config.markov_head == "gated"
        if self.gated:
            self.gate_proj = nn.Linear(config.hidden_size + r, r)

    def embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """W1[x_{k-1}]: (...,) token ids -> (..., r)."""
        return self.markov_w1(prev_ids)

    def bias(self, hidden: torch.Tensor, prev_embed: torch.Tensor) -> torch.Tensor:
        """The (M, V) logit bias of rows with final-normed states `hidden` (M, H) and Markov embeddings (M, r)."""
        if self.gated:
            prev_embed = prev_embed * torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_embed], dim=-1)))
        return self.markov_w2(prev_embed)


class ConfidenceHead(nn.Module):
    """One logit per slot from [h_k; W1[x_{k-1}]]: the predicted acceptance of slot k given its prefix."""

    def __init__(self, config: DsparkDrafterConfig):
        super().__init__()
        self.proj = nn.Linear(config.hidden_size + config.markov_rank, 1)

    def forward(self, hidden: torch.Tensor, prev_embed: torch.Tensor) -> torch.Tensor:
        """(M,) float32 logits; the engines run this head in float32."""
        x = torch.cat([hidden, prev_embed.to(hidden.dtype)], dim=-1).float()
        return F.linear(x, self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)


class DsparkDrafter(DflashDrafter):
    """The backbone's forward (training, all blocks at once) and draft_block (runtime) are DFlash's; every slot,
    the anchor's included, predicts (config.py)."""

    def __init__(self, config: DsparkDrafterConfig):
        super().__init__(config)
        self.markov_head = MarkovHead(config)
        self.confidence_head = ConfidenceHead(config) if config.confidence_head else None


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
