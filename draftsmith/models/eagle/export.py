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

from typing import Any

import torch

from draftsmith.models.checkpoint import check_tensors
from draftsmith.models.drafter_config import is_int, layer_bias_shapes, one_layer_llama_json
from draftsmith.models.eagle.config import METHOD, EagleConfig
from draftsmith.models.export_base import (
    ExportSource,
    FormatExport,
    FormatFiles,
    draftsmith_generate,
    one_layer_llama_problems,
    provenance,
    vllm_serve,
)

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
        "draftsmith": provenance(config, METHOD, step, num_target_layers=config.num_target_layers,
                                 target_max_position_embeddings=config.max_position_embeddings,
                                 hidden_input=HIDDEN_INPUT),
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
    shapes.update(layer_bias_shapes(config, _ATTENTION_BIAS_NAMES, _MLP_BIAS_NAMES, q, kv, h, i))
    return shapes


def check_native_eagle(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """(problems, warnings) of a reference-layout config + tensors; no problem means vLLM (`method: eagle`) and the
    reference code read it as draftsmith trained it."""
    problems: list[str] = []
    warnings: list[str] = []
    if config.get("architectures") != [ARCHITECTURE]:
        problems.append(f"config architectures: {config.get('architectures')!r}, expected [{ARCHITECTURE!r}] (vLLM "
                        "prefixes it with Eagle; an Eagle3 or other name loads another model)")
    problems += one_layer_llama_problems(config, _REQUIRED_INTS, ("rms_norm_eps", "hidden_act", "rope_theta"))
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
    k = num_speculative_tokens
    return {"vLLM": vllm_serve(target, METHOD, draft, k), "draftsmith": draftsmith_generate(target, METHOD, draft, k)}


def serve_commands_from_config(config: dict[str, Any], draft: str) -> dict[str, str]:
    """The serve commands of an exported folder's config.json (push re-renders its card with them)."""
    return eagle_serve_commands((config.get("draftsmith") or {}).get("target") or "TARGET", draft)


def native_files(source: ExportSource) -> FormatFiles:
    """The reference layout of an EAGLE-1 checkpoint: its config, the weights under NATIVE_KEY_MAP, the card rows."""
    cfg = source.config
    return FormatFiles(
        config=native_config(cfg, step=source.step),
        tensors=source.tensors(NATIVE_KEY_MAP),
        summary={
            "architecture": f"{ARCHITECTURE} (vLLM: EagleLlamaForCausalLM, method eagle)",
            "draft layers": 1,
            "hidden_size": cfg.hidden_size,
            "fc bias": cfg.fc_bias,
            "vocabulary": f"the target's {cfg.vocab_size} tokens, through the target's own head",
        },
        aux_layer_ids=[(f"{HIDDEN_INPUT}: capture id L, normed; no aux layer", "draftsmith.num_target_layers",
                        [cfg.num_target_layers] if cfg.num_target_layers else [])],
        serve_commands=eagle_serve_commands(source.target, source.draft),
    )


NATIVE_EXPORT = FormatExport(name="native EAGLE", method=METHOD, config_class=EagleConfig, title="EAGLE", tags=TAGS,
                             build=native_files, check=check_native_eagle)
export_native_eagle = NATIVE_EXPORT.write  # (checkpoint, out_dir, *, overwrite, dtype) -> ExportResult


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
