"""EAGLE-3's recipe section (`eagle3:`) and its rules on a recipe: what can be checked before anything loads.

The section holds the drafter's forward-pass variants, named and computed as vLLM's llama_eagle3.py and the
speculators package do; SGLang implements none of them, so a drafter with any of them on exports to vLLM's layouts
only. It also holds `feature_noise`, which only training reads (as `eagle.hidden_noise` is EAGLE-1's). EAGLE-3's
other training keys (TTT depth, loss, attention blocking) stay in the `training:` section, where recipes have always
set them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, model_validator

from draftsmith.models.spec import Section, check_layer_ids, draft_vocab_size_for

ENGINE_AUX_LAYERS = 3  # vLLM's and SGLang's Llama EAGLE-3 build fc for exactly three aux layers


class Eagle3Section(Section):
    """The `eagle3:` section, read only when model.method is eagle3."""

    norm_before_fc: bool = False  # RMSNorm over the concatenated aux features before fc (speculators' default)
    fc_norm: bool = False  # one RMSNorm per aux layer before fc (the EAGLE 3.1 paper's form)
    norm_before_residual: bool = False  # the residual is hidden_norm(h), not h
    norm_output: bool = False  # feed norm(out) back as the next draft step's hidden (EAGLE 3.1)
    # Training only: uniform noise U(-a/2, a/2) times each aux layer's RMS at each position, added to the target
    # states fc reads, a regulariser for runs that see their records many times (EAGLE-1's eagle.hidden_noise, made
    # relative because the aux layers' scales differ by orders of magnitude). 0 keeps the loss deterministic.
    feature_noise: float = Field(0.0, ge=0)

    def variants(self) -> dict[str, bool]:
        """The forward-pass flags, which the drafter's config (and so the export) records."""
        return self.model_dump(exclude={"feature_noise"})

    @model_validator(mode="after")
    def _check(self) -> Eagle3Section:
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("eagle3.norm_before_fc and eagle3.fc_norm are two forms of the same input norm: set one "
                             "of them (speculators refuses both)")
        return self


def default_aux_layer_ids(num_target_layers: int) -> list[int]:
    """EAGLE-3's default capture ids `(2, L//2, L-3)`, the same as vLLM's and the EAGLE reference's."""
    ids = [2, num_target_layers // 2, num_target_layers - 3]
    if num_target_layers < 4 or len(set(ids)) != 3:
        # Tiny targets (tests): spread three distinct ids over the available layers instead.
        ids = sorted({max(0, num_target_layers // 4), num_target_layers // 2, max(0, num_target_layers - 1)})
    return ids


def check_recipe(recipe: Any, target: Mapping[str, Any] | None) -> None:
    """model.aux_layer_ids in the capture convention (DESIGN.md §3), and with the target's config a draft
    vocabulary that fits its vocabulary."""
    layers = target.get("num_hidden_layers") if target else None
    if recipe.model.aux_layer_ids is not None:
        check_layer_ids(recipe.model.aux_layer_ids, "model.aux_layer_ids", layers, "capture")
    vocab = target.get("vocab_size") if target else None
    if isinstance(vocab, int):
        size = draft_vocab_size_for(recipe.model.draft_vocab_size, vocab)
        if size > vocab:
            raise ValueError(f"model.draft_vocab_size ({size}) exceeds the target vocabulary ({vocab}): set "
                             f"model.draft_vocab_size <= {vocab}, or null for min(32000, the target's)")
