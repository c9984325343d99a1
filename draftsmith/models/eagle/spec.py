"""EAGLE-1/2 as the registry sees it (models/spec.py): recipe section, training, runtime, and one export layout (the
EAGLE reference's, which vLLM serves with `method: eagle`), whose reader also takes speculators' eagle layout."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from draftsmith.models.eagle.section import EagleSection, check_recipe
from draftsmith.models.spec import DrafterSpec, ExportFormat

# The names engines give the EAGLE-1 drafter class: vLLM's (EAGLEConfig prefixes the reference's LlamaForCausalLM)
# and SGLang's.
ENGINE_ARCHITECTURES = {"EagleLlamaForCausalLM", "LlamaForCausalLMEagle"}
EAGLE3_KEYS = ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "target_hidden_size")


def is_native_eagle(config: Mapping[str, Any]) -> bool:
    """A reference-layout EAGLE-1 config.json: draftsmith's export, an engine's class name, or the reference's own
    one-layer `LlamaForCausalLM` config (no EAGLE-3 key: its drafters name their own class)."""
    if "speculators_model_type" in config:
        return False
    provenance = config.get("draftsmith")
    if isinstance(provenance, Mapping):
        return provenance.get("method") == "eagle"
    architectures = set(config.get("architectures") or [])
    if architectures & ENGINE_ARCHITECTURES:
        return True
    return (architectures == {"LlamaForCausalLM"} and config.get("num_hidden_layers") == 1
            and not any(key in config for key in EAGLE3_KEYS))


def is_speculators_eagle(config: Mapping[str, Any]) -> bool:
    return config.get("speculators_model_type") == "eagle"


def is_eagle_layout(config: Mapping[str, Any]) -> bool:
    return is_native_eagle(config) or is_speculators_eagle(config)


SPEC = DrafterSpec(
    method="eagle",
    title="EAGLE",
    builds_on="eagle3",  # the runtime loop: EAGLE-3's proposer, unchanged (proposer.py)
    section=EagleSection,
    training="draftsmith.models.eagle.training:EagleMethod",
    proposer="draftsmith.models.eagle.proposer:EagleProposer",
    formats=(
        ExportFormat(
            name="eagle", layout="native-eagle",
            help="the EAGLE-1/2 reference layout (yuhuili/EAGLE-*): vLLM with method eagle; import also reads "
                 "speculators' eagle layout",
            export="draftsmith.models.eagle.export:export_native_eagle",
            detect=is_eagle_layout,
            read="draftsmith.models.eagle.io:import_folder",
            check="draftsmith.models.eagle.export:check_native_eagle",
            serve_commands="draftsmith.models.eagle.export:serve_commands_from_config",
        ),
    ),
    layer_convention="capture",
    check_recipe=check_recipe,
    scored_drafts=True,  # per-token scores: sampled chains and EAGLE-2's dynamic tree, as EAGLE-3's
)
