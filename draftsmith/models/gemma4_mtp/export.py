"""Export a Gemma 4 MTP checkpoint back into the layout it came from (`--format gemma4_mtp`): the assistant's own
`config.json` (`model_type: gemma4_assistant`, `Gemma4AssistantForCausalLM`) and its tensors under the published
names (io.py), the tied head left out as transformers writes it. vLLM 0.32 reads it as `{"method": "mtp", "model":
DIR}` (speculative.py rewrites gemma4_assistant to gemma4_mtp; gemma4_mtp.py loads the tensors), transformers as
`Gemma4AssistantForCausalLM.from_pretrained(DIR)`. A `draftsmith` key records provenance (both ignore it).
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

import torch

from draftsmith.models.checkpoint import (
    ExportError,
    ExportResult,
    check_output_dir,
    config_for_export,
    draftsmith_version,
    load_checkpoint,
    read_card_inputs,
    resolve_checkpoint,
    write_export,
)
from draftsmith.models.gemma4_mtp.config import METHOD, MODEL_TYPES, Gemma4MtpConfig
from draftsmith.models.gemma4_mtp.io import check_drafter_tensors
from draftsmith.models.gemma4_mtp.model import Gemma4MtpDrafter
from draftsmith.models.model_card import render_model_card

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
    spec = json.dumps({"method": "mtp", "model": draft, "num_speculative_tokens": num_speculative_tokens},
                      separators=(",", ":"))
    return {"vLLM": f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(spec)}",
            "draftsmith": f"draftsmith generate --target {shlex.quote(target)} --speculative-config "
                          f"{shlex.quote(spec)}"}


def serve_commands_from_config(config: dict[str, Any], draft: str) -> dict[str, str]:
    return serve_commands((config.get("draftsmith") or {}).get("target") or "TARGET", draft)


def export_gemma4_mtp(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False,
                      dtype: torch.dtype | None = torch.bfloat16) -> ExportResult:
    """Build, validate and write config.json + model.safetensors + README.md, all or nothing; floating-point
    weights in `dtype` (bf16 by default; None keeps fp32), token_ordering int64."""
    out_dir = Path(out_dir)
    ckpt = resolve_checkpoint(checkpoint)
    check_output_dir(out_dir, overwrite, keep=(ckpt,))
    raw, state = load_checkpoint(ckpt)
    cfg = config_for_export(ckpt, raw, Gemma4MtpConfig, METHOD, "gemma4_mtp")
    notes = read_card_inputs(ckpt)
    config = export_config(cfg, dtype, notes.step)
    tensors = {name: t.to(dtype) if dtype is not None and t.is_floating_point() else t for name, t in state.items()
               if not (name == "lm_head.weight" and cfg.hf_config().tie_word_embeddings)}
    problems, warnings = check_export(config, tensors)
    if problems:
        raise ExportError(f"{ckpt}: refusing to export as gemma4_mtp: " + "; ".join(problems))
    warnings += notes.warnings
    target = cfg.target_name_or_path or "TARGET"
    commands = serve_commands(target, str(out_dir), cfg.num_steps)
    text = cfg.hf_config().get_text_config()
    card = render_model_card(
        target=target, method="Gemma 4 MTP", tags=TAGS,
        summary={"architecture": f"{ARCHITECTURE} ({MODEL_TYPES[0]})",
                 "assistant layers": f"{text.num_hidden_layers} ({', '.join(text.layer_types)}), query-only over "
                                     "the target's KV cache",
                 "hidden size": f"{text.hidden_size} (target {cfg.backbone_hidden_size})",
                 "centroid head": "yes" if cfg.assistant_config.get("use_ordered_embeddings") else "no",
                 "fine-tuned from": cfg.source or "unknown",
                 "training step": notes.step if notes.step is not None else "unknown"},
        aux_layer_ids=[], serve_commands=commands, recipe_text=notes.recipe_text, eval_result=notes.eval_result,
        version=config["draftsmith"]["version"])
    return write_export(out_dir, ckpt, config, tensors, card, overwrite=overwrite, warnings=warnings,
                        serve_commands=commands)
