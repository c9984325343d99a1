"""DFlash as the registry sees it (models/spec.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from draftsmith.models.dflash.section import DflashSection, check_recipe
from draftsmith.models.spec import DrafterSpec, ExportFormat

ARCHITECTURE = "DFlashDraftModel"  # vLLM: qwen3_dflash.DFlashQwen3ForCausalLM; SGLang: models/dflash.py


def is_dflash(config: Mapping[str, Any]) -> bool:
    return ARCHITECTURE in (config.get("architectures") or [])


SPEC = DrafterSpec(
    method="dflash",
    title="DFlash",
    section=DflashSection,
    training="draftsmith.models.dflash.training:DflashMethod",
    proposer="draftsmith.models.dflash.proposer:DflashProposer",
    formats=(
        ExportFormat(
            name="dflash", layout="dflash",
            help="DFlashDraftModel: vLLM with method dflash, SGLang with DFLASH",
            export="draftsmith.models.dflash.export:export_dflash",
            detect=is_dflash,
            read="draftsmith.models.dflash.io:import_folder",
            check="draftsmith.models.dflash.export:check_dflash_export",
            serve_commands="draftsmith.models.dflash.export:serve_commands_from_config",
        ),
    ),
    layer_convention="output",
    check_recipe=check_recipe,
)
