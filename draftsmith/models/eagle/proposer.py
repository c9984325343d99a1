"""EAGLE-1/2 as a runtime `Proposer`: EAGLE-3's loop (models/eagle3/proposer.py), unchanged.

vLLM runs both with one proposer, and the loop is the same: the drafter's cache holds the committed pairs
(embed(x_{t+1}), h_t), drafts read the drafter's own output back as h, chains are argmax or sampled, trees are
vLLM's static `speculative_token_tree` or EAGLE-2's dynamic tree (inference/tree.py `dynamic_tree`, EAGLE-2's own
contribution: it changes no weight). Only what the loop reads of the drafter differs, and EagleDrafter provides it
(model.py): `fuse` is the target's final norm instead of fc over aux layers, `logits` the target's head, and draft
ids are target ids.
"""

from __future__ import annotations

from draftsmith.models.eagle.io import load_drafter
from draftsmith.models.eagle.model import EagleDrafter
from draftsmith.models.eagle3.proposer import Eagle3Proposer
from draftsmith.runtime.tree import parse_token_tree


class EagleProposer(Eagle3Proposer):
    def __init__(self, drafter: EagleDrafter, embed_tokens, num_target_layers: int, **options):
        """`num_target_layers`: the running target's L; the runtime hands `extend` its last layer's output (capture
        id L), which `drafter.fuse` normalises. `options` are Eagle3Proposer's (sampling, trees)."""
        super().__init__(drafter, embed_tokens, **options)
        self.aux_layer_ids = (num_target_layers,)

    @classmethod
    def from_config(cls, spec, target) -> "EagleProposer":
        if not spec.model:
            raise ValueError("speculative config: method eagle needs \"model\": the drafter folder")
        drafter = load_drafter(spec.model, device=target.device, dtype=target.dtype)
        cfg = drafter.config
        target.check_drafter_fits(spec.model, "drafter", cfg.vocab_size, cfg.hidden_size)
        drafter.share_target(target.final_norm, target.lm_head)
        tree = getattr(spec, "speculative_token_tree", None)
        return cls(drafter, target.embed_tokens, target.num_layers,
                   draft_sample_method=getattr(spec, "draft_sample_method", None) or "greedy",
                   token_tree=parse_token_tree(tree) if tree else None,
                   dynamic_tree=getattr(spec, "dynamic_tree", None), num_nodes=spec.num_speculative_tokens)
