"""DSpark as the registry sees it (models/spec.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from draftsmith.models.dspark.section import DsparkSection, check_recipe
from draftsmith.models.spec import DrafterSpec, ExportFormat


def is_dspark(config: Mapping[str, Any]) -> bool:
    """A published DSpark config.json: DeepSpec's and ours (Qwen3DSparkModel), SpecForge's raw DSparkDraftModel
    (qwen3, the DeepSeek-V4 architecture of that name is another model), or speculators' dspark."""
    architectures = set(config.get("architectures") or [])
    return ("Qwen3DSparkModel" in architectures
            or ("DSparkDraftModel" in architectures and config.get("model_type") == "qwen3")
            or config.get("speculators_model_type") == "dspark")


def _confidence_threshold(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(f"confidence_threshold must be a number in (0, 1), got {value!r}")
    return float(value)


SPEC = DrafterSpec(
    method="dspark",
    title="DSpark",
    builds_on="dflash",  # DFlash's block drafter (config, layers, proposer, export config) plus the two heads
    section=DsparkSection,
    training="draftsmith.models.dspark.training:DsparkMethod",
    proposer="draftsmith.models.dspark.proposer:DsparkProposer",
    formats=(
        ExportFormat(
            name="dspark", layout="dspark",
            help="Qwen3DSparkModel: vLLM with method dspark, SGLang with DSPARK (DeepSpec's layout; a pruned "
                 "draft vocabulary serves in vLLM only)",
            export="draftsmith.models.dspark.export:export_dspark",
            detect=is_dspark,
            read="draftsmith.models.dspark.io:import_folder",
            check="draftsmith.models.dspark.export:check_dspark_export",
            serve_commands="draftsmith.models.dspark.export:serve_commands_from_config",
        ),
    ),
    layer_convention="output",
    check_recipe=check_recipe,
    draft_vocab=True,  # model.draft_vocab_size prunes it (vLLM's reduced-vocabulary DSpark); null keeps the whole
    # draftsmith's own: cut each proposal before its first slot the confidence head doubts (vLLM does not serve
    # it, so `draftsmith eval` never recommends it)
    runtime_keys={"confidence_threshold": _confidence_threshold},
)
