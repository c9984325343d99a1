"""MTP's recipe section (`mtp:`) and its rules on a recipe."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, model_validator

from draftsmith.models.spec import Section


class MtpSection(Section):
    """The `mtp:` section, read only when model.method is mtp. Depth d (1-based) predicts the token d + 1 ahead
    with module (d - 1) % num_modules, the way vLLM cycles MTP layers."""

    num_modules: int = Field(1, ge=1)  # distinct MTP modules (DeepSeek-V3 ships 1)
    num_depths: int = Field(3, ge=1)  # depths trained per position (FastMTP: 3)
    recursive: bool = True  # FastMTP: modules reused past num_modules; false: one module per depth (DeepSeek-V3)
    depth_decay: float = Field(0.8, gt=0, le=1)  # loss weight of depth d is depth_decay**(d-1)
    init_from_native: bool = True  # start from the target checkpoint's own MTP weights when it has them

    @model_validator(mode="after")
    def _check(self) -> MtpSection:
        if not self.recursive and self.num_depths != self.num_modules:
            raise ValueError(
                f"mtp.num_depths ({self.num_depths}) must equal mtp.num_modules ({self.num_modules}) when "
                "mtp.recursive is false (one module per depth): set them equal, or set mtp.recursive=true"
            )
        if self.num_depths < self.num_modules:
            raise ValueError(
                f"mtp.num_depths ({self.num_depths}) < mtp.num_modules ({self.num_modules}) leaves modules "
                f"untrained: set mtp.num_depths >= {self.num_modules}"
            )
        return self


def check_recipe(recipe: Any, target: Mapping[str, Any] | None) -> None:
    """MTP reads the target's final-normed last hidden state, no aux layer: model.aux_layer_ids stays null."""
    ids = recipe.model.aux_layer_ids
    layers = target.get("num_hidden_layers") if target else None
    if ids is not None and not (layers is not None and list(ids) == [layers]):
        raise ValueError(f"model.aux_layer_ids {ids}: MTP always reads the target's final-normed last hidden "
                         "state, no aux layer; set model.aux_layer_ids to null")
