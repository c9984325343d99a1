"""EAGLE-1's recipe section (`eagle:`) and its rules on a recipe.

The loss (loss.py) is the EAGLE reference's (SafeAILab/EAGLE `eagle/train/main.py`, the trainer of every
`yuhuili/EAGLE-*` drafter vLLM serves with `method: eagle`): regression_weight * smooth-L1(drafter output, the
target's next hidden state) + ce_weight * cross-entropy of the head's distribution on the drafter output against the
target's own, with the reference's weights 1.0 and 0.1. EAGLE-1's drafter predicts the target's next *feature*, which
it then feeds back to itself while drafting, so the regression term is what keeps a chain of drafts on the target's
feature manifold; the cross-entropy alone (what EAGLE-3 and vLLM-era trainers such as SpecForge train, with no
feature to regress) trains the next token only. A recipe can set either weight to 0.

`fc_bias` defaults to false, what the reference's LLaMA-3 drafters ship (`"bias": false`) and the only form vLLM 0.32
serves: its EagleLlamaForCausalLM builds fc without a bias, drops a checkpoint's `fc.bias` silently, and reads
`"bias": true` as attention biases the drafter does not have, drafting garbage without a word (export.py). The
reference's own default (its Vicuna and LLaMA-2 drafters) is true.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, model_validator

from draftsmith.models.spec import Section


class EagleSection(Section):
    """The `eagle:` section, read only when model.method is eagle."""

    fc_bias: bool = False  # a bias on fc (the reference config's "bias"; vLLM 0.32 serves only false)
    regression_weight: float = Field(1.0, ge=0)  # smooth-L1 to the target's next hidden state (reference v_w)
    ce_weight: float = Field(0.1, ge=0)  # cross-entropy to the target's next-token distribution (reference p_w)
    # Uniform noise U(-a/2, a/2) added to the target states the drafter reads while training, so it learns to draft
    # from states that are not exactly the target's (its own, while drafting). The reference adds
    # (U - 0.5) * 0.2 * 512 / S; 0 keeps the loss deterministic.
    hidden_noise: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> EagleSection:
        if self.regression_weight + self.ce_weight == 0:
            raise ValueError("eagle.regression_weight and eagle.ce_weight are both 0: the drafter would learn nothing; "
                             "set at least one above 0 (the EAGLE reference: 1.0 and 0.1)")
        return self


def check_recipe(recipe: Any, target: Mapping[str, Any] | None) -> None:
    """EAGLE-1 reads the target's final-normed last hidden state, no aux layer: model.aux_layer_ids stays null."""
    ids = recipe.model.aux_layer_ids
    if ids is not None:
        raise ValueError(f"model.aux_layer_ids {ids}: EAGLE-1 reads only the target's last hidden state after its "
                         "final norm, no aux layer; set model.aux_layer_ids to null (EAGLE-3, method eagle3, reads "
                         "aux layers)")
