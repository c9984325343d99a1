"""Read the vllm-project/speculators layout of an EAGLE-1 drafter (`speculators_model_type: "eagle"`, speculators'
EagleSpeculator for EAGLE-1/2 and HASS). Import only: vLLM 0.32 no longer serves it (its speculators registry,
transformers_utils/configs/speculators/algos.py, holds eagle3, peagle, dflash, dflash2 and dspark, and refuses any
other type with "Expected one of: ..."), so draftsmith exports the reference layout instead (export.py).

- `config.json`: `transformer_layer_config` (the one layer as a Llama config), `fusion_bias` (fc's bias),
  `layernorms` (three extra norms: the embedding's, the layer's input norm and one before the head, speculators'
  "TTT" variant, which draftsmith does not implement and refuses), `speculators_config.verifier` (the target).
- tensors, named as vLLM's speculators reader once mapped them (`SPECULATORS_WEIGHT_MAP`, `fusion_fc.*` -> `fc.*`)
  and as the speculators converter writes them (`layers.0.*` -> `transformer.*`), read back by `SPECULATORS_PREFIXES`:

        fusion_fc.weight, fusion_fc.bias   ->  fc.weight, fc.bias
        transformer.*                      ->  layers.0.*
        embed_tokens.weight, lm_head.weight    the verifier's: dropped, the target's are used
"""

from __future__ import annotations

from typing import Any

from draftsmith.models.eagle.config import EagleConfig
from draftsmith.models.eagle.export import config_from_native

# {speculators prefix: draftsmith prefix}
SPECULATORS_PREFIXES = {"fusion_fc.": "fc.", "transformer.": "layers.0."}
LAYERNORM_NAMES = ("embedding_layernorm.weight", "transformer.input_layernorm.weight", "pre_lm_head_layernorm.weight")


def from_speculators_name(name: str) -> str:
    for theirs, ours in SPECULATORS_PREFIXES.items():
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return name


def config_from_speculators(raw: dict[str, Any], tensor_names: set[str], target_config: dict[str, Any] | None = None
                            ) -> tuple[EagleConfig, list[str]]:
    """(draftsmith config, notes) of a speculators EAGLE config.json whose file holds `tensor_names`."""
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError("speculators config: transformer_layer_config missing or not an object")
    architecture = raw.get("transformer_layer_architecture", "LlamaDecoderLayer")
    if architecture != "LlamaDecoderLayer":
        raise ValueError(f"speculators config: transformer_layer_architecture {architecture!r}: draftsmith's EAGLE "
                         "layer is a LlamaDecoderLayer")
    norms = sorted(set(LAYERNORM_NAMES) & tensor_names)
    if raw.get("layernorms") or norms:
        held = f" ({', '.join(norms)})" if norms else ""
        raise ValueError(f"speculators config: layernorms true{held}: the extra norms of speculators' TTT variant, "
                         "which draftsmith's EAGLE-1 drafter does not have")
    has_bias = "fusion_fc.bias" in tensor_names
    if bool(raw.get("fusion_bias", False)) != has_bias:
        raise ValueError(f"speculators config: fusion_bias {raw.get('fusion_bias')!r}, but the file "
                         f"{'has' if has_bias else 'has no'} fusion_fc.bias")
    verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
    flat = {**layer, "num_hidden_layers": layer.get("num_hidden_layers", 1), "bias": has_bias,
            "draftsmith": {"target": verifier.get("name_or_path") or "",
                           "target_architectures": verifier.get("architectures") or []}}
    return config_from_native(flat, has_bias, target_config)
