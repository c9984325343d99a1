"""`draftsmith export CKPT --format mtp`: native MTP layout when the target has one, else draftsmith's MTP format.

Native (the target checkpoint carries MTP weights: DeepSeek-V3/R1 and GLM-4.5 `model.layers.{L+k}.*`, Qwen3-Next
`mtp.*`; see native.py). The folder holds the target's `config.json` (with `num_nextn_predict_layers` set to the
number of modules and `quantization_config` removed, since the tensors are bf16) and a `model.safetensors` with
only the MTP tensors plus the copies of the target's embedding and head that vLLM loads from the same folder:

    vllm serve TARGET --speculative-config '{"method": "mtp", "model": "EXPORT", "num_speculative_tokens": 1}'

To serve without `model`, replace the target checkpoint's MTP tensors by these (same names) in a copy of it.
SGLang reads the same tensors from the target folder (`--speculative-algorithm EAGLE` with its NEXTN path).

draftsmith format (targets without native MTP, e.g. Llama-3.1): `config.json` is the drafter config (`"method":
"mtp"`, the target's whole config under `target_config`) and `model.safetensors` holds draftsmith's names
(`layers.{j}.{enorm,hnorm,eh_proj,shared_head.norm,block.*}`). Only draftsmith's runtime serves it
(`{"method": "mtp", "model": "EXPORT"}`): vLLM and SGLang have MTP classes only for model families that ship MTP
(DeepSeek, GLM-4.5, Qwen3-Next/3.5, MiMo, ...), not for Llama-family targets.
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
from draftsmith.models.model_card import render_model_card
from draftsmith.models.mtp.config import METHOD, MtpDrafterConfig
from draftsmith.models.mtp.native import NativeMtpError, local_folder, native_export_tensors, target_embed_and_head

TAGS = ["speculative-decoding", "mtp", "draftsmith"]
NUM_SPECULATIVE_TOKENS = 1  # one token per native module, what vLLM defaults to for DeepSeek-V3


def _checked_state(config: MtpDrafterConfig, state: dict[str, torch.Tensor]) -> list[str]:
    """Names and shapes of the checkpoint against the module its config builds (on the meta device: no memory)."""
    from draftsmith.models.mtp.model import MtpDrafter

    with torch.device("meta"):
        expected = {k: v.shape for k, v in MtpDrafter(config).state_dict().items() if not k.startswith("rotary_emb.")}
    problems = []
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing:
        problems.append(f"missing tensors: {', '.join(missing[:8])}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected[:8])}")
    problems += [f"{k}: shape {tuple(state[k].shape)}, expected {tuple(expected[k])}"
                 for k in sorted(set(expected) & set(state)) if state[k].shape != expected[k]]
    return problems


def native_config(config: MtpDrafterConfig, step: int | None) -> dict[str, Any]:
    """The target's config.json as vLLM's `mtp` method reads it for this drafter."""
    out = dict(config.target_config)
    out.pop("quantization_config", None)  # the exported MTP tensors are not quantized
    out["num_nextn_predict_layers"] = config.num_modules
    out["draftsmith"] = {"version": draftsmith_version(), "method": METHOD, "layout": config.native_layout,
                         "target": config.target_name_or_path, "hidden_input": config.hidden_input,
                         "num_depths_trained": config.num_depths,
                         "recursive": config.recursive, "step": step}
    return out


def serve_commands(target: str, draft: str, config: MtpDrafterConfig) -> dict[str, str]:
    k = NUM_SPECULATIVE_TOKENS if not config.recursive else max(NUM_SPECULATIVE_TOKENS, config.num_depths)
    spec = json.dumps({"method": METHOD, "model": draft, "num_speculative_tokens": k}, separators=(",", ":"))
    if config.native_layout is None:
        return {"draftsmith": f"draftsmith generate --target {shlex.quote(target)} --speculative-config "
                              f"{shlex.quote(spec)} --prompt 'Hello'"}
    return {"vLLM": f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(spec)}",
            "draftsmith": f"draftsmith generate --target {shlex.quote(target)} --speculative-config "
                          f"{shlex.quote(spec)} --prompt 'Hello'"}


def export_mtp(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False,
               dtype: torch.dtype | None = torch.bfloat16) -> ExportResult:
    """Validate, then write config.json + model.safetensors + README.md into `out_dir`, all or nothing."""
    out_dir = Path(out_dir)
    ckpt = resolve_checkpoint(checkpoint)
    check_output_dir(out_dir, overwrite, keep=(ckpt,))
    raw, state = load_checkpoint(ckpt)
    config = config_for_export(ckpt, raw, MtpDrafterConfig, METHOD, "MTP")
    problems = _checked_state(config, state)
    if problems:
        raise ExportError(f"{ckpt}: refusing to export as MTP: " + "; ".join(problems))
    state = {k: t.to(dtype) if dtype is not None and t.is_floating_point() else t for k, t in state.items()}
    notes = read_card_inputs(ckpt)
    step = notes.step
    target = config.target_name_or_path or "TARGET"
    warnings = list(notes.warnings)

    if config.native_layout is not None:
        folder = local_folder(config.target_name_or_path)
        if folder is None:
            raise ExportError(f"{ckpt}: a native {config.native_layout} MTP export copies the target's embedding "
                              f"and head, but the target {target!r} is not available locally; download it first")
        try:
            shared = target_embed_and_head(folder)
            embed, head = (shared[n].to(dtype) if dtype is not None else shared[n]
                           for n in ("model.embed_tokens.weight", "lm_head.weight"))
            tensors = native_export_tensors(state, config.native_layout, config.num_target_layers,
                                            config.hidden_size, config.num_modules, embed, head)
        except NativeMtpError as e:
            raise ExportError(f"{ckpt}: {e}") from None
        out_config = native_config(config, step)
        layout_note = f"native {config.native_layout} MTP layout (vLLM method mtp)"
    else:
        tensors, out_config = state, config.to_dict()
        layout_note = "draftsmith MTP format (draftsmith's runtime only; no engine has an MTP class for this family)"
        warnings.append(f"{config.target_model_type} targets have no native MTP layout: vLLM and SGLang cannot "
                        "serve this export, draftsmith's runtime can")

    commands = serve_commands(target, str(out_dir), config)
    card = render_model_card(
        target=target, method="MTP", tags=TAGS,
        summary={"format": layout_note, "modules": config.num_modules,
                 "depths trained": f"{config.num_depths} ({'recursive' if config.recursive else 'one module each'})",
                 "block": f"one {config.target_model_type} decoder layer per module",
                 "training step": step if step is not None else "unknown"},
        aux_layer_ids=[("the target's last hidden state after its final norm (capture id L, normed): what the "
                        "target's forward returns and vLLM and SGLang hand their MTP modules",
                        "num_hidden_layers" if config.native_layout else "num_target_layers",
                        [config.num_target_layers])],
        serve_commands=commands,
        recipe_text=notes.recipe_text,
        eval_result=notes.eval_result,
        version=draftsmith_version(),
    )
    return write_export(out_dir, ckpt, out_config, tensors, card, overwrite=overwrite, warnings=warnings,
                        serve_commands=commands)
