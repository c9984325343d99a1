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

from typing import Any

import torch

from draftsmith.models.checkpoint import ExportError, draftsmith_version
from draftsmith.models.export_base import ExportSource, FormatExport, FormatFiles, draftsmith_generate, vllm_serve
from draftsmith.models.mtp.config import METHOD, MtpDrafterConfig
from draftsmith.models.mtp.native import NativeMtpError, native_export_tensors, target_embed_and_head
from draftsmith.models.target_files import offline_folder

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
    commands = {"vLLM": vllm_serve(target, METHOD, draft, k)} if config.native_layout is not None else {}
    return {**commands, "draftsmith": draftsmith_generate(target, METHOD, draft, k)}


def mtp_files(source: ExportSource) -> FormatFiles:
    """The target's native MTP layout when it has one (the state mapped back to its names, with copies of its
    embedding and head), else draftsmith's own MTP format (the checkpoint as it is)."""
    config, ckpt, warnings = source.config, source.ckpt, []
    source.refuse(_checked_state(config, source.state))
    state = source.tensors()
    if config.native_layout is not None:
        folder = offline_folder(config.target_name_or_path)
        if folder is None:
            raise ExportError(f"{ckpt}: a native {config.native_layout} MTP export copies the target's embedding "
                              f"and head, but the target {source.target!r} is not available locally; download it "
                              "first")
        try:
            shared = target_embed_and_head(folder)
            embed, head = (source.cast(shared[n]) for n in ("model.embed_tokens.weight", "lm_head.weight"))
            tensors = native_export_tensors(state, config.native_layout, config.num_target_layers,
                                            config.hidden_size, config.num_modules, embed, head)
        except NativeMtpError as e:
            raise ExportError(f"{ckpt}: {e}") from None
        out_config = native_config(config, source.step)
        layout_note = f"native {config.native_layout} MTP layout (vLLM method mtp)"
    else:
        tensors, out_config = state, config.to_dict()
        layout_note = "draftsmith MTP format (draftsmith's runtime only; no engine has an MTP class for this family)"
        warnings.append(f"{config.target_model_type} targets have no native MTP layout: vLLM and SGLang cannot "
                        "serve this export, draftsmith's runtime can")
    return FormatFiles(
        config=out_config,
        tensors=tensors,
        summary={"format": layout_note, "modules": config.num_modules,
                 "depths trained": f"{config.num_depths} ({'recursive' if config.recursive else 'one module each'})",
                 "block": f"one {config.target_model_type} decoder layer per module"},
        aux_layer_ids=[("the target's last hidden state after its final norm (capture id L, normed): what the "
                        "target's forward returns and vLLM and SGLang hand their MTP modules",
                        "num_hidden_layers" if config.native_layout else "num_target_layers",
                        [config.num_target_layers])],
        serve_commands=serve_commands(source.target, source.draft, config),
        warnings=warnings,
    )


MTP_EXPORT = FormatExport(name="MTP", method=METHOD, config_class=MtpDrafterConfig, title="MTP", tags=TAGS,
                          build=mtp_files)
export_mtp = MTP_EXPORT.write  # (checkpoint, out_dir, *, overwrite, dtype) -> ExportResult
