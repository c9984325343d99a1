"""Export a Gemma 4 MTP checkpoint back into the layout it came from (`--format gemma4_mtp`): the assistant's own
`config.json` (`model_type: gemma4_assistant`, `Gemma4AssistantForCausalLM`) and its tensors under the published
names (io.py), the tied head left out as transformers writes it. vLLM 0.32 reads it as `{"method": "mtp", "model":
DIR}` (speculative.py rewrites gemma4_assistant to gemma4_mtp; gemma4_mtp.py loads the tensors), transformers as
`Gemma4AssistantForCausalLM.from_pretrained(DIR)`. A `draftsmith` key records provenance (both ignore it).
"""

from __future__ import annotations

from typing import Any

import torch

from draftsmith.models.checkpoint import draftsmith_version
from draftsmith.models.export_base import ExportSource, FormatExport, FormatFiles, draftsmith_generate, vllm_serve
from draftsmith.models.gemma4_mtp.config import METHOD, MODEL_TYPES, Gemma4MtpConfig
from draftsmith.models.gemma4_mtp.io import check_drafter_tensors
from draftsmith.models.gemma4_mtp.model import Gemma4MtpDrafter

ARCHITECTURE = "Gemma4AssistantForCausalLM"
TAGS = ["speculative-decoding", "gemma4-mtp", "draftsmith", "vllm"]
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def export_config(cfg: Gemma4MtpConfig, dtype: torch.dtype | None, step: int | None = None) -> dict[str, Any]:
    out = dict(cfg.assistant_config)
    out["model_type"] = MODEL_TYPES[0]
    out["architectures"] = [ARCHITECTURE]
    if dtype is not None:
        out["dtype"] = DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
    out["draftsmith"] = {"method": METHOD, "version": draftsmith_version(), "target": cfg.target_name_or_path,
                         "source": cfg.source, "num_steps_trained": cfg.num_steps, "step": step}
    return out


def check_export(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """(problems, warnings) of an assistant config.json + tensors: what vLLM and transformers read."""
    if config.get("model_type") not in MODEL_TYPES:
        return [f"config model_type {config.get('model_type')!r}: vLLM serves only {MODEL_TYPES[0]!r} as "
                "a Gemma 4 assistant"], []
    try:
        cfg = Gemma4MtpConfig.from_assistant(config)
        with torch.device("meta"):
            drafter = Gemma4MtpDrafter(cfg)
    except (TypeError, ValueError, KeyError) as e:
        return [f"config: {e}"], []
    warnings = [] if cfg.hf_config().tie_word_embeddings else [
        "tie_word_embeddings false: vLLM 0.32 ties the head to the embedding whatever the config says"]
    return check_drafter_tensors(drafter, tensors), warnings


def serve_commands(target: str, draft: str, num_speculative_tokens: int = 3) -> dict[str, str]:
    k = num_speculative_tokens  # "mtp": vLLM's method for it (the assistant's config.json picks the proposer)
    return {"vLLM": vllm_serve(target, "mtp", draft, k), "draftsmith": draftsmith_generate(target, "mtp", draft, k)}


def serve_commands_from_config(config: dict[str, Any], draft: str) -> dict[str, str]:
    return serve_commands((config.get("draftsmith") or {}).get("target") or "TARGET", draft)


def assistant_files(source: ExportSource) -> FormatFiles:
    """The assistant's own layout: its config.json (the export's dtype recorded), the weights under the published
    names, the tied head left out as transformers writes it, the card rows."""
    cfg = source.config
    tied = cfg.hf_config().tie_word_embeddings
    text = cfg.hf_config().get_text_config()
    return FormatFiles(
        config=export_config(cfg, source.dtype, source.step),
        tensors=source.tensors(drop=("lm_head.weight",) if tied else ()),
        summary={"architecture": f"{ARCHITECTURE} ({MODEL_TYPES[0]})",
                 "assistant layers": f"{text.num_hidden_layers} ({', '.join(text.layer_types)}), query-only over "
                                     "the target's KV cache",
                 "hidden size": f"{text.hidden_size} (target {cfg.backbone_hidden_size})",
                 "centroid head": "yes" if cfg.assistant_config.get("use_ordered_embeddings") else "no",
                 "fine-tuned from": cfg.source or "unknown"},
        aux_layer_ids=[],
        serve_commands=serve_commands(source.target, source.draft, cfg.num_steps),
    )


ASSISTANT_EXPORT = FormatExport(name="gemma4_mtp", method=METHOD, config_class=Gemma4MtpConfig, title="Gemma 4 MTP",
                                tags=TAGS, build=assistant_files, check=check_export)
export_gemma4_mtp = ASSISTANT_EXPORT.write  # (checkpoint, out_dir, *, overwrite, dtype) -> ExportResult
