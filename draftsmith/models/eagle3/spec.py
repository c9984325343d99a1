"""EAGLE-3 as the registry sees it (models/spec.py): recipe section, training, runtime, and its two export layouts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from draftsmith.models.eagle3.section import Eagle3Section, check_recipe
from draftsmith.models.spec import DrafterSpec, ExportFormat

NATIVE_ARCHITECTURES = {"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"}


def is_native_eagle3(config: Mapping[str, Any]) -> bool:
    """A Llama-shaped native EAGLE-3 config.json (SGLang, vLLM `method: eagle3`, SpecForge, the EAGLE reference)."""
    return bool(NATIVE_ARCHITECTURES & set(config.get("architectures") or [])) and \
        "speculators_model_type" not in config


def is_speculators_eagle3(config: Mapping[str, Any]) -> bool:
    return config.get("speculators_model_type") == "eagle3"


SPEC = DrafterSpec(
    method="eagle3",
    title="EAGLE-3",
    section=Eagle3Section,
    training="draftsmith.models.eagle3.training:Eagle3Method",
    proposer="draftsmith.models.eagle3.proposer:Eagle3Proposer",
    formats=(
        ExportFormat(
            name="sglang", layout="native-eagle3",
            help="native EAGLE-3 (LlamaForCausalLMEagle3): SGLang, and vLLM with method eagle3",
            export="draftsmith.models.eagle3.export:export_native_eagle3",
            detect=is_native_eagle3,
            read="draftsmith.models.eagle3.io:import_folder",
            check="draftsmith.models.eagle3.export:check_native_eagle3",
            serve_commands="draftsmith.models.eagle3.export:serve_commands_from_config",
        ),
        ExportFormat(
            name="speculators", layout="speculators-eagle3",
            help="speculators EAGLE-3 (speculators_config): `vllm serve DIR`, and the speculators package",
            export="draftsmith.models.eagle3.speculators:export_speculators",
            detect=is_speculators_eagle3,
            read="draftsmith.models.eagle3.io:import_folder",
            check="draftsmith.models.eagle3.speculators:check_speculators",
            serve_commands="draftsmith.models.eagle3.speculators:serve_commands_from_config",
            options=("verifier",),
        ),
    ),
    layer_convention="capture",
    check_recipe=check_recipe,
    draft_vocab=True,
    scored_drafts=True,
    packing=True,
    frozen_head=True,
    losses=("soft_ce", "lk"),
)
