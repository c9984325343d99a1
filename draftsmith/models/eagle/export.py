"""Export an EAGLE-1 checkpoint in the EAGLE reference's layout, which vLLM loads with `method: eagle`.

The layout of the `yuhuili/EAGLE-*` drafters (SafeAILab/EAGLE `eagle/train/*.json`, `eagle/model/cnets1.py`):

- `config.json`: a plain one-layer Llama config, `"architectures": ["LlamaForCausalLM"]` as the reference ships it
  (vLLM's EAGLEConfig, `method: eagle`, prefixes it: `EagleLlamaForCausalLM`, its llama_eagle.py), the target's layer
  sizes, and the reference's `"bias"` for fc's bias (a missing key means true to the reference code, so it is always
  written). A `draftsmith` block records the method, the target and the training step.
- tensors: `fc.weight` (H, 2H) (+ `fc.bias` (H,)), and `layers.0.*` without `input_layernorm` (the reference's layer
  0 has none). No embedding and no head: vLLM shares the target's (`process_eagle_weight` finds none in the file),
  as draftsmith does.

vLLM 0.32 builds fc without a bias, ignores a `fc.bias` it finds (its weight loader drops unexpected biases) and
reads `"bias": true` as attention biases (llama.py `attention_bias or bias`), which the file does not have and which
nothing checks were loaded (EagleLlamaForCausalLM.load_weights returns no names): it serves such a drafter without a
word and drafts garbage (tests/interop/test_vllm_eagle.py measured a mean acceptance length of 1.0 where draftsmith's
runtime got 1.77). A drafter trained with `eagle.fc_bias: true` exports for the reference code, with a warning, not
for vLLM. SGLang's LlamaForCausalLMEagle always builds fc *with* a bias; draftsmith has not run it, so its command is
not printed.
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
    check_tensors,
    config_for_export,
    draftsmith_version,
    load_checkpoint,
    read_card_inputs,
    resolve_checkpoint,
    write_export,
)
from draftsmith.models.drafter_config import is_int, one_layer_llama_json
from draftsmith.models.eagle.config import METHOD, EagleConfig
from draftsmith.models.model_card import render_model_card

ARCHITECTURE = "LlamaForCausalLM"  # the reference's; vLLM serves it as EagleLlamaForCausalLM under method eagle
NUM_SPECULATIVE_TOKENS = 3  # what the printed serve commands ask for
TAGS = ["speculative-decoding", "eagle", "draftsmith", "vllm"]
HIDDEN_INPUT = "the target's last hidden state after its final norm (what its head reads)"

# {draftsmith name: reference name}: draftsmith adopted the reference's names, so the map is the identity; it is
# spelled out because it is the contract (a tensor outside it is refused, a missing one reported).
_LAYER = "layers.0."
_WEIGHT_NAMES = ("fc.weight", *(f"{_LAYER}{name}.weight" for name in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "post_attention_layernorm",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")))
_ATTENTION_BIAS_NAMES = tuple(f"{_LAYER}self_attn.{p}_proj.bias" for p in "qkvo")
_MLP_BIAS_NAMES = tuple(f"{_LAYER}mlp.{p}_proj.bias" for p in ("gate", "up", "down"))
NATIVE_KEY_MAP: dict[str, str] = {name: name for name in
                                  (*_WEIGHT_NAMES, "fc.bias", *_ATTENTION_BIAS_NAMES, *_MLP_BIAS_NAMES)}

_REQUIRED_INTS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "vocab_size", "max_position_embeddings")


def native_config(config: EagleConfig, step: int | None = None) -> dict[str, Any]:
    """The reference's config.json of this drafter (module docstring)."""
    return {
        "architectures": [ARCHITECTURE],
        **one_layer_llama_json(config),
        "bias": config.fc_bias,  # the reference's fc bias (missing = true there)
        "draftsmith": {
            "version": draftsmith_version(),
            "method": METHOD,
            "target": config.target_name_or_path,
            "target_architectures": list(config.target_architectures),
            "target_model_type": config.target_model_type,
            "num_target_layers": config.num_target_layers,
            "target_max_position_embeddings": config.max_position_embeddings,
            "hidden_input": HIDDEN_INPUT,
            "step": step,
        },
    }


def expected_native_shapes(config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Reference tensor name -> (shape, how the shape follows from the config)."""
    h, i = config["hidden_size"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    shapes = {
        "fc.weight": ((h, 2 * h), "(hidden_size, 2 x hidden_size): cat(embedding, hidden)"),
        f"{_LAYER}self_attn.q_proj.weight": ((q, h), "(heads x head_dim, hidden_size)"),
        f"{_LAYER}self_attn.k_proj.weight": ((kv, h), "(kv_heads x head_dim, hidden_size)"),
        f"{_LAYER}self_attn.v_proj.weight": ((kv, h), "(kv_heads x head_dim, hidden_size)"),
        f"{_LAYER}self_attn.o_proj.weight": ((h, q), "(hidden_size, heads x head_dim)"),
        f"{_LAYER}post_attention_layernorm.weight": ((h,), "(hidden_size,)"),
        f"{_LAYER}mlp.gate_proj.weight": ((i, h), "(intermediate_size, hidden_size)"),
        f"{_LAYER}mlp.up_proj.weight": ((i, h), "(intermediate_size, hidden_size)"),
        f"{_LAYER}mlp.down_proj.weight": ((h, i), "(hidden_size, intermediate_size)"),
    }
    if config.get("bias"):
        shapes["fc.bias"] = ((h,), "(hidden_size,) (\"bias\": true)")
    if config.get("attention_bias"):
        for name, width in zip(_ATTENTION_BIAS_NAMES, (q, kv, kv, h)):
            shapes[name] = ((width,), "bias of the matching projection (attention_bias)")
    if config.get("mlp_bias"):
        for name, width in zip(_MLP_BIAS_NAMES, (i, i, h)):
            shapes[name] = ((width,), "bias of the matching projection (mlp_bias)")
    return shapes


def check_native_eagle(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """(problems, warnings) of a reference-layout config + tensors; no problem means vLLM (`method: eagle`) and the
    reference code read it as draftsmith trained it."""
    problems: list[str] = []
    warnings: list[str] = []
    if config.get("architectures") != [ARCHITECTURE]:
        problems.append(f"config architectures: {config.get('architectures')!r}, expected [{ARCHITECTURE!r}] (vLLM "
                        "prefixes it with Eagle; an Eagle3 or other name loads another model)")
    if config.get("model_type") != "llama":
        problems.append(f"config model_type: {config.get('model_type')!r}, expected 'llama'")
    if config.get("num_hidden_layers") != 1:
        problems.append(f"config num_hidden_layers: {config.get('num_hidden_layers')!r}, expected 1")
    for key in _REQUIRED_INTS:
        if not is_int(config.get(key)) or config[key] <= 0:
            problems.append(f"config {key}: {config.get(key)!r}, expected a positive integer")
    for key in ("rms_norm_eps", "hidden_act", "rope_theta"):
        if key not in config:
            problems.append(f"config: missing {key}")
    if config.get("tie_word_embeddings") is not False:
        problems.append("config tie_word_embeddings: must be false (the drafter has no head of its own)")
    if not isinstance(config.get("bias"), bool):
        problems.append(f"config bias: {config.get('bias')!r}, expected true or false (the reference reads a missing "
                        "key as true and builds an fc bias the file would not have)")
    elif config["bias"]:
        warnings.append("\"bias\": true (eagle.fc_bias): vLLM 0.32 builds fc without a bias and reads \"bias\" as "
                        "attention biases this drafter does not have; it loads this export without a word and drafts "
                        "garbage (lossless, but nothing accepted). The EAGLE reference code serves it; for vLLM, "
                        "train with eagle.fc_bias false")
    if "draft_vocab_size" in config or "eagle_aux_hidden_state_layer_ids" in config:
        problems.append("config: EAGLE-3 keys (draft_vocab_size, eagle_aux_hidden_state_layer_ids) in an EAGLE-1 "
                        "config")
    provenance = config.get("draftsmith") or {}
    target_max, max_pos = provenance.get("target_max_position_embeddings"), config.get("max_position_embeddings")
    if is_int(target_max) and is_int(max_pos) and max_pos < target_max:
        problems.append(f"config max_position_embeddings {max_pos} < the target's {target_max}")
    if not all(is_int(config.get(k)) and config[k] > 0 for k in _REQUIRED_INTS):
        return problems + ["tensors not checked: their shapes follow from the config sizes above"], warnings
    return problems + check_tensors(expected_native_shapes(config), tensors), warnings


def eagle_serve_commands(target: str, draft: str, num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS
                         ) -> dict[str, str]:
    spec = json.dumps({"method": METHOD, "model": draft, "num_speculative_tokens": num_speculative_tokens},
                      separators=(",", ":"))
    t, s = shlex.quote(target), shlex.quote(spec)
    return {"vLLM": f"vllm serve {t} --speculative-config {s}",
            "draftsmith": f"draftsmith generate --target {t} --speculative-config {s} --prompt 'Hello'"}


def serve_commands_from_config(config: dict[str, Any], draft: str) -> dict[str, str]:
    """The serve commands of an exported folder's config.json (push re-renders its card with them)."""
    return eagle_serve_commands((config.get("draftsmith") or {}).get("target") or "TARGET", draft)


def export_native_eagle(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False,
                        dtype: torch.dtype | None = torch.bfloat16) -> ExportResult:
    """Build, validate and write config.json + model.safetensors + README.md into `out_dir`, all or nothing;
    floating-point weights in `dtype` (bf16 by default), None keeps the fp32 master weights."""
    out_dir = Path(out_dir)
    ckpt = resolve_checkpoint(checkpoint)
    check_output_dir(out_dir, overwrite, keep=(ckpt,))
    raw, state = load_checkpoint(ckpt)
    cfg = config_for_export(ckpt, raw, EagleConfig, METHOD, "native EAGLE")
    notes = read_card_inputs(ckpt)
    config = native_config(cfg, step=notes.step)
    tensors = {NATIVE_KEY_MAP.get(name, name): t.to(dtype) if dtype is not None and t.is_floating_point() else t
               for name, t in state.items()}  # unknown names kept, then refused
    problems, warnings = check_native_eagle(config, tensors)
    if problems:
        raise ExportError(f"{ckpt}: refusing to export as native EAGLE: " + "; ".join(problems))
    warnings += notes.warnings
    target = cfg.target_name_or_path or "TARGET"
    commands = eagle_serve_commands(target, str(out_dir))
    card = render_model_card(
        target=target,
        method="EAGLE",
        tags=TAGS,
        summary={
            "architecture": f"{ARCHITECTURE} (vLLM: EagleLlamaForCausalLM, method eagle)",
            "draft layers": 1,
            "hidden_size": cfg.hidden_size,
            "fc bias": cfg.fc_bias,
            "vocabulary": f"the target's {cfg.vocab_size} tokens, through the target's own head",
            "training step": notes.step if notes.step is not None else "unknown",
        },
        aux_layer_ids=[(f"{HIDDEN_INPUT}: capture id L, normed; no aux layer", "draftsmith.num_target_layers",
                        [cfg.num_target_layers] if cfg.num_target_layers else [])],
        serve_commands=commands,
        recipe_text=notes.recipe_text,
        eval_result=notes.eval_result,
        version=config["draftsmith"]["version"],
    )
    return write_export(out_dir, ckpt, config, tensors, card, overwrite=overwrite, warnings=warnings,
                        serve_commands=commands)


# ---- reading the layout back ---------------------------------------------------------------------------------
SHARED_WITH_TARGET = ("embed_tokens.weight", "lm_head.weight")  # draftsmith (and vLLM) use the target's


def rope_of(cfg: dict[str, Any]) -> dict[str, Any]:
    """`rope_parameters`, or transformers 4's rope_theta + rope_scaling ("type" read as "rope_type")."""
    if isinstance(cfg.get("rope_parameters"), dict):
        return dict(cfg["rope_parameters"])
    scaling = dict(cfg.get("rope_scaling") or {})
    scaling["rope_type"] = scaling.pop("rope_type", scaling.pop("type", "default"))
    scaling["rope_theta"] = float(cfg.get("rope_theta", 10000.0))
    return scaling


def config_from_native(cfg: dict[str, Any], has_fc_bias: bool, target_config: dict[str, Any] | None = None
                       ) -> tuple[EagleConfig, list[str]]:
    """(draftsmith config, notes on what had to be assumed) of a reference-layout (or flattened speculators)
    config; `has_fc_bias`: whether the file holds `fc.bias`, which decides the bias (the config may disagree)."""
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in cfg]
    if missing:
        raise ValueError(f"EAGLE config: missing {', '.join(missing)}")
    if cfg.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"EAGLE config: num_hidden_layers {cfg['num_hidden_layers']}: draftsmith's EAGLE drafter "
                         "has one decoder layer, as the reference's")
    notes: list[str] = []
    prov = cfg.get("draftsmith") if isinstance(cfg.get("draftsmith"), dict) else {}
    target_config = target_config or {}
    said = cfg.get("bias", True)  # the reference's default
    if said != has_fc_bias:
        notes.append(f"config \"bias\": {str(said).lower()}, but the file {'has' if has_fc_bias else 'has no'} "
                     "fc.bias: read as the file has it")
    max_pos = cfg.get("max_position_embeddings", 4096)
    target_max = target_config.get("max_position_embeddings")
    if is_int(target_max) and target_max > max_pos:  # the reference's configs ship 2048; vLLM raises it too
        notes.append(f"max_position_embeddings raised from {max_pos} to the target's {target_max}")
        max_pos = target_max
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    num_layers = prov.get("num_target_layers") or target_config.get("num_hidden_layers")
    return EagleConfig(
        hidden_size=hidden, intermediate_size=cfg["intermediate_size"], num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads, head_dim=cfg.get("head_dim") or hidden // heads,
        vocab_size=cfg["vocab_size"], num_target_layers=num_layers if is_int(num_layers) else None,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), hidden_act=cfg.get("hidden_act", "silu"),
        max_position_embeddings=max_pos, rope_parameters=rope_of(cfg),
        attention_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
        fc_bias=has_fc_bias,
        target_name_or_path=prov.get("target") or "",
        target_architectures=list(prov.get("target_architectures") or target_config.get("architectures") or []),
        target_model_type=prov.get("target_model_type") or target_config.get("model_type", ""),
        bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"),
        pad_token_id=cfg.get("pad_token_id"),
    ), notes


def tensors_from_native(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(draftsmith's tensors, the ones shared with the target that the file also ships) of a reference state dict
    (names as the reference saves them, or with vLLM's `model.` prefix)."""
    ours, shared = {}, {}
    for name, t in tensors.items():
        name = name.removeprefix("model.")
        (shared if name in SHARED_WITH_TARGET else ours)[name] = t
    return ours, shared
