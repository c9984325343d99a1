"""Gemma 4 MTP as the registry sees it (models/spec.py)."""

from __future__ import annotations

from draftsmith.models.gemma4_mtp.section import Gemma4MtpSection, check_recipe
from draftsmith.models.spec import DrafterSpec, ExportFormat


def is_assistant_export(config) -> bool:
    """A published Gemma 4 assistant's config.json (what vLLM serves as method mtp)."""
    return isinstance(config, dict) and config.get("model_type") == "gemma4_assistant"


SPEC = DrafterSpec(
    method="gemma4_mtp",  # vLLM's name for the assistant's model type (it rewrites gemma4_assistant to it)
    title="Gemma 4 MTP",
    section=Gemma4MtpSection,
    training="draftsmith.models.gemma4_mtp.training:Gemma4MtpMethod",
    proposer="draftsmith.models.gemma4_mtp.proposer:Gemma4MtpProposer",
    formats=(
        ExportFormat(
            name="gemma4_mtp", layout="gemma4_assistant",
            help="Gemma 4 assistant (gemma4_assistant): vLLM with method mtp, transformers' assisted generation",
            export="draftsmith.models.gemma4_mtp.export:export_gemma4_mtp",
            detect=is_assistant_export,
            read="draftsmith.models.gemma4_mtp.io:import_folder",
            check="draftsmith.models.gemma4_mtp.export:check_export",
            serve_commands="draftsmith.models.gemma4_mtp.export:serve_commands_from_config",
        ),
    ),
    layer_convention="capture",
    check_recipe=check_recipe,
    served_as=("mtp",),  # {"method": "mtp", "model": ASSISTANT}: vLLM's name, chosen by the model's config.json
)
