"""MTP as the registry sees it (models/spec.py)."""

from __future__ import annotations

from draftsmith.models.mtp.section import MtpSection, check_recipe
from draftsmith.models.spec import DrafterSpec, ExportFormat

# The model types vLLM rewrites to method "mtp" (vllm/config/speculative.py MTPModelTypes, vLLM 0.32.0), which
# users still write in a speculative config ("deprecated and replaced with mtp"). Gemma 4's assistant (gemma4_mtp)
# is another drafter, not a native MTP module.
VLLM_MTP_NAMES = ("deepseek_mtp", "dots3_note_mtp", "mimo_mtp", "mimo_v2_mtp", "glm4_moe_mtp", "glm4_moe_lite_mtp",
                  "glm_ocr_mtp", "ernie_mtp", "nemotron_h_mtp", "exaone_moe_mtp", "exaone4_5_mtp", "qwen3_next_mtp",
                  "qwen4_exp_mtp", "qwen3_5_mtp", "longcat_flash_mtp", "bailing_hybrid_v3_mtp", "minimax_m3_mtp",
                  "bailing_hybrid_mtp", "kimi_k3_mtp", "pangu_ultra_moe_mtp", "step3p5_mtp", "hy_v3_mtp",
                  "hy_v4_mtp")

SPEC = DrafterSpec(
    method="mtp",
    title="MTP",
    section=MtpSection,
    training="draftsmith.models.mtp.training:MtpMethod",
    proposer="draftsmith.models.mtp.proposer:MtpProposer",
    formats=(
        ExportFormat(
            name="mtp", layout="mtp",
            help="MTP: the target's native layout (vLLM with method mtp) when it has one, else draftsmith's own format",
            export="draftsmith.models.mtp.export:export_mtp",
        ),
    ),
    layer_convention="capture",
    check_recipe=check_recipe,
    engine_aliases=VLLM_MTP_NAMES,
    model_required=False,  # omitted: the target's own native MTP weights, as vLLM does
)
