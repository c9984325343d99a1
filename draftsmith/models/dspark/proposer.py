"""DSpark as a runtime `Proposer`: DFlash's cached context and one block a step (models/dflash/proposer.py), then
the Markov head left to right.

To draft k tokens the block is [last, mask x (k-1)]: k slots, each predicting the token after its own position,
as vLLM queries it (`sample_from_anchor`: k queries, not the whole trained block). Then, slot by slot,

    d_i = argmax(lm_head(h_i) + markov_w2(markov_w1[d_{i-1}]))      d_{-1} = last (the anchor)

so each draft conditions on the ones before it. Drafts are argmax (one-hot), lossless at any temperature.

A pruned draft vocabulary (vLLM's `_sample_sequential`): lm_head is the drafter's own head over the draft ids and
the Markov bias is over them too; the argmax, a draft id, is mapped to its target id (i + d2t[i], vLLM's
map_draft_to_target), and that target id is both the draft and d_{i-1}, the token markov_w1 embeds next.

`confidence_threshold` (draftsmith's key, not served by vLLM): a row's proposal ends before its first slot whose
confidence sigmoid(w [h_i; markov_w1[d_{i-1}]]) is below the threshold, as DeepSpec's evaluation cuts it; the
runtime then verifies (and counts) only the drafts kept.
"""

from __future__ import annotations

import torch

from draftsmith.models.dflash.proposer import DflashProposer
from draftsmith.models.dspark.io import load_drafter
from draftsmith.models.dspark.model import DsparkDrafter
from draftsmith.models.dspark.section import DsparkConfigError
from draftsmith.runtime.proposer import PAD_DRAFT_TOKEN


class DsparkProposer(DflashProposer):
    name = "DSpark"
    error = DsparkConfigError

    def __init__(self, drafter: DsparkDrafter, embed_tokens: torch.nn.Module, lm_head: torch.nn.Module,
                 confidence_threshold: float | None = None):
        # a pruned vocabulary reads out with the drafter's own head rows, the whole one with the target's
        super().__init__(drafter, embed_tokens, lm_head if drafter.lm_head is None else drafter.lm_head)
        self.max_drafts = self.block_size  # every slot, the anchor's included, drafts
        if confidence_threshold is not None and drafter.confidence_head is None:
            raise DsparkConfigError("speculative config: confidence_threshold needs the drafter's confidence head, "
                                    "and this drafter was trained without one (dspark.confidence_head false)")
        self.confidence_threshold = confidence_threshold

    @classmethod
    def from_config(cls, spec, target) -> "DsparkProposer":
        if not spec.model:
            raise DsparkConfigError("speculative config: method dspark needs \"model\": the drafter folder")
        drafter = load_drafter(spec.model, device=target.device, dtype=target.dtype)
        cfg = drafter.config
        target.check_drafter_fits(spec.model, "drafter", cfg.vocab_size, cfg.hidden_size, error=DsparkConfigError)
        target.check_aux_layer_ids(cfg.aux_layer_ids)
        proposer = cls(drafter, target.embed_tokens, target.lm_head, spec.options.get("confidence_threshold"))
        proposer.check_num_tokens(spec.num_speculative_tokens)
        return proposer

    def block_width(self, num_tokens: int) -> int:
        """Slots run to draft k tokens: the anchor and k - 1 masks."""
        return num_tokens

    def _draft(self, last: torch.Tensor, lengths: torch.Tensor, key_length: int, num_tokens: int):
        """(log-probs, tokens, lengths) of the k drafts, the Markov head applied left to right."""
        hidden = self._block_hidden(last, lengths, key_length, num_tokens)  # (B, k, H)
        base = self.lm_head(hidden).float()  # (B, k, V)
        markov, confidence_head = self.drafter.markov_head, self.drafter.confidence_head
        prev = last[:, 0]  # (B,) the anchor
        scores, tokens, confident = [], [], []
        for i in range(num_tokens):
            prev_embed = markov.embed(prev)  # (B, r)
            logits = base[:, i] + markov.bias(hidden[:, i], prev_embed).float()
            score, prev = torch.log_softmax(logits, dim=-1).max(dim=-1)
            prev = self.drafter.draft_to_target(prev)  # a target id: the draft, and the next slot's Markov input
            if self.confidence_threshold is not None:
                confident.append(torch.sigmoid(confidence_head(hidden[:, i], prev_embed)) >= self.confidence_threshold)
            scores.append(score)
            tokens.append(prev)
        token_ids = torch.stack(tokens, dim=1)
        count = torch.full_like(lengths, num_tokens)
        if confident:
            count = torch.stack(confident, dim=1).long().cumprod(dim=1).sum(dim=1)  # slots before the first doubt
            kept = torch.arange(num_tokens, device=token_ids.device)[None, :] < count[:, None]
            token_ids = token_ids.masked_fill(~kept, PAD_DRAFT_TOKEN)
        return torch.stack(scores, dim=1), token_ids, count
