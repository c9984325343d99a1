"""DFlash's recipe section (`dflash:`), its defaults that depend on the target, and its rules on a recipe.

Target layers are listed in the *output-of-layer* convention of `dflash_config.target_layer_ids` (id i = output of
layer i = capture id i + 1; config.py's docstring draws the table). DSpark (models/dspark) shares these rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, model_validator

from draftsmith.models.spec import Section, check_layer_ids

# Loss decay per block size from the DFlash paper (methods.md §2.2): w_k = exp(-(k - 1) / gamma).
PAPER_LOSS_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


class DflashConfigError(ValueError):
    """A DFlash setting that cannot work with this target; the message says which key to change."""


class DflashSection(Section):
    """The `dflash:` section, read only when model.method is dflash."""

    num_layers: int = Field(5, ge=1)  # draft decoder layers
    block_size: int = Field(16, ge=2)  # anchor + (block_size - 1) masks; drafts up to block_size - 1 tokens
    num_target_layers: int = Field(5, ge=1)  # how many target layers' features are fused (not the target's depth)
    # Output-of-layer convention, as dflash_config.target_layer_ids in the export (id i = output of layer i =
    # capture id i + 1); None = num_target_layers ids spread evenly from layer 1 to L-3.
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = Field(None, ge=0)  # None = a learned mask embedding
    anchors_per_sequence: int = Field(512, ge=1)
    loss_gamma: float | None = Field(None, gt=0)  # None = 7 / 5 / 4 for block 16 / 10 / 8, else block_size / 2
    # each slot's target: the target's argmax (ce, as SpecForge trains; measured best on the fixture), or its
    # whole next-token distribution (soft_ce)
    loss: Literal["ce", "soft_ce"] = "ce"
    checkpoint_layers: bool = False  # recompute each draft layer in the backward pass (long contexts, big batches)

    @model_validator(mode="after")
    def _check(self) -> DflashSection:
        check_target_layers(self, "dflash")
        return self


def check_target_layers(section: Any, name: str) -> None:
    """The layer-id rules a block drafter's section (dflash, dspark) applies on its own: ordered ids, agreeing
    with num_target_layers when both are given (a saved recipe then reads back the same)."""
    ids = section.target_layer_ids
    if ids is None:
        return
    check_layer_ids(ids, f"{name}.target_layer_ids", None, "output")
    if "num_target_layers" in section.model_fields_set and section.num_target_layers != len(ids):
        raise ValueError(f"{name}.num_target_layers is {section.num_target_layers} but {name}.target_layer_ids "
                         f"lists {len(ids)} layers: drop num_target_layers or make them agree")
    section.num_target_layers = len(ids)


def default_target_layer_ids(num_target_layers: int, num_features: int, key: str = "dflash",
                             error: type[ValueError] = DflashConfigError) -> list[int]:
    """`num_features` output-of-layer ids spread evenly from layer 1 to L-3, as z-lab's and SGLang's
    `build_target_layer_ids` do ([1, 9, 17, 25, 33] for 36-layer Qwen3-8B); `key` names the recipe section and
    `error` is its method's error class."""
    if num_features == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    ids = [int(round(start + i * (end - start) / (num_features - 1))) for i in range(num_features)]
    if end < start or len(set(ids)) < num_features:  # tiny targets (tests): spread over all layers instead
        last = num_target_layers - 1
        ids = sorted({int(round(i * last / (num_features - 1))) for i in range(num_features)})
    if len(ids) < num_features:
        raise error(
            f"{key}.num_target_layers={num_features} distinct layers do not exist in a {num_target_layers}-layer "
            f"target: set {key}.num_target_layers <= {num_target_layers} or list {key}.target_layer_ids"
        )
    return ids


def default_loss_gamma(block_size: int) -> float:
    return PAPER_LOSS_GAMMA.get(block_size, block_size / 2)


def check_block_recipe(recipe: Any, target: Mapping[str, Any] | None, name: str,
                       error: type[ValueError] = DflashConfigError) -> None:
    """The rules of a block drafter (dflash, dspark) on a recipe: target layers come from `<name>.target_layer_ids`
    (not model.aux_layer_ids), inside the target, and a mask token inside its vocabulary; `error` is the method's
    error class."""
    section = getattr(recipe, name)
    if recipe.model.aux_layer_ids is not None:
        raise ValueError(
            f"model.aux_layer_ids is EAGLE-3's setting; for model.method {name} set {name}.target_layer_ids "
            "(output-of-layer ids, i.e. capture id - 1) and leave model.aux_layer_ids null"
        )
    if recipe.training.loss_on != "answers":
        raise ValueError(f"training.loss_on {recipe.training.loss_on!r}: {name} trains its blocks on the data's "
                         "tokens, which on a user turn are not the target's; leave it at answers")
    if not target:
        return
    layers, vocab = target.get("num_hidden_layers"), target.get("vocab_size")
    if isinstance(layers, int):
        if section.target_layer_ids is not None:
            check_layer_ids(section.target_layer_ids, f"{name}.target_layer_ids", layers, "output")
        else:
            default_target_layer_ids(layers, section.num_target_layers, name, error)
    if isinstance(vocab, int) and section.mask_token_id is not None and section.mask_token_id >= vocab:
        raise ValueError(f"{name}.mask_token_id {section.mask_token_id}: outside the target vocabulary "
                         f"0..{vocab - 1}")


def check_recipe(recipe: Any, target: Mapping[str, Any] | None) -> None:
    check_block_recipe(recipe, target, "dflash")
