"""Gemma 4 MTP's recipe section (`gemma4_mtp:`) and its rules on a recipe."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field

from draftsmith.models.gemma4_mtp.config import TARGET_MODEL_TYPES
from draftsmith.models.spec import Section


class Gemma4MtpSection(Section):
    """The `gemma4_mtp:` section, read only when model.method is gemma4_mtp."""

    # The assistant checkpoint to fine-tune (a published gemma4_assistant folder or Hub id in the local cache, or a
    # draftsmith export / checkpoint of one); its config decides the architecture. Required unless
    # model.init_from names a draftsmith gemma4_mtp checkpoint.
    assistant: str | None = None
    num_steps: int = Field(3, ge=1)  # draft steps trained per position (each reads the same target K/V)
    step_decay: float = Field(0.8, gt=0, le=1)  # loss weight of step j is step_decay**(j-1)
    centroid_weight: float = Field(0.1, ge=0)  # cross-entropy of the centroid head to the teacher's cluster


def check_recipe(recipe: Any, target: Mapping[str, Any] | None) -> None:
    """The assistant reads the target's own K/V and final-normed state, chosen by the target's config (no aux
    layer ids to set); it needs a Gemma 4 target and an assistant to start from."""
    if recipe.model.aux_layer_ids is not None:
        raise ValueError(f"model.aux_layer_ids {recipe.model.aux_layer_ids}: gemma4_mtp reads the K/V of the "
                         "target's last sliding and full layers, chosen by its config; set model.aux_layer_ids to null")
    if recipe.data.hidden_states_path or recipe.data.hidden_states_cache:
        raise ValueError("data.hidden_states_path / data.hidden_states_cache: gemma4_mtp trains on the target's K/V, "
                         "which a hidden-state store does not hold; leave both unset to capture them online")
    if not recipe.gemma4_mtp.assistant and not recipe.model.init_from:
        raise ValueError("gemma4_mtp.assistant is not set: name the Gemma 4 assistant checkpoint to fine-tune "
                         "(e.g. google/gemma-4-E2B-it-assistant), or set model.init_from to a draftsmith gemma4_mtp "
                         "checkpoint")
    if target is not None and target.get("model_type") not in TARGET_MODEL_TYPES:
        raise ValueError(f"model.target is a {target.get('model_type')!r} model: gemma4_mtp drafts for Gemma 4 "
                         f"targets ({', '.join(TARGET_MODEL_TYPES)}) only")
