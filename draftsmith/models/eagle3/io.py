"""Load an EAGLE-3 drafter from a draftsmith checkpoint, a native (SGLang / vLLM) folder or a speculators folder.

Every public layout is turned into draftsmith's config and tensor names here, in one place, so the runtime
(`load_drafter`) and `draftsmith import` read the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftsmith.models.drafter_config import (
    DrafterLoadError,
    load_drafter_weights,
    load_for_inference,
    local_folder,
    read_drafter_config,
)
from draftsmith.models.eagle3.config import FORWARD_FLAGS, Eagle3Config
from draftsmith.models.eagle3.export import AUX_IDS_KEY, output_of_layer_to_capture
from draftsmith.models.eagle3.model import Eagle3Drafter

NATIVE_ARCHITECTURES = {"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"}


def is_native_eagle3(cfg: dict[str, Any]) -> bool:
    return bool(NATIVE_ARCHITECTURES & set(cfg.get("architectures") or [])) and "speculators_model_type" not in cfg


def is_speculators_eagle3(cfg: dict[str, Any]) -> bool:
    return cfg.get("speculators_model_type") == "eagle3"


def eagle3_config_from_native(
    cfg: dict[str, Any], target_config: dict[str, Any] | None = None
) -> tuple[Eagle3Config, list[str]]:
    """(draftsmith config, notes on what had to be assumed) of a Llama-shaped native EAGLE-3 config.

    Aux ids, in order of trust: the top-level capture ids (vLLM), SGLang's nested output-of-layer ids + 1, then
    the engines' shared default (2, L//2, L-3) when the target's layer count L is known.
    """
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in cfg]
    if missing:
        raise DrafterLoadError(f"native EAGLE-3 config: missing {', '.join(missing)}")
    notes: list[str] = []
    prov = cfg.get("draftsmith") if isinstance(cfg.get("draftsmith"), dict) else {}
    target_config = target_config or {}
    num_layers = prov.get("num_target_layers") or cfg.get("num_target_layers") or target_config.get("num_hidden_layers")
    ids = cfg.get(AUX_IDS_KEY)
    nested = (cfg.get("eagle_config") or {}).get(AUX_IDS_KEY) if isinstance(cfg.get("eagle_config"), dict) else None
    if not ids and nested:
        ids = output_of_layer_to_capture(list(nested))
        notes.append(f"only SGLang's eagle_config.{AUX_IDS_KEY} {nested} given: read as output-of-layer ids, "
                     f"capture ids {ids}")
    if not ids:
        if not num_layers:
            raise DrafterLoadError(
                f"native EAGLE-3 config has no {AUX_IDS_KEY} and the target's layer count is unknown: give the "
                "target (a local folder or a cached Hub id) so the engines' default aux layers can be used"
            )
        ids = [2, num_layers // 2, num_layers - 3]
        notes.append(f"no aux layer ids in the config: assumed vLLM's and SGLang's default {ids}")
    if not num_layers:
        num_layers = max(ids) + 3
        notes.append(f"the target's layer count is unknown: assumed {num_layers} (last aux id + 3)")
    max_pos = cfg.get("max_position_embeddings", 4096)
    target_max = target_config.get("max_position_embeddings")
    if isinstance(target_max, int) and target_max > max_pos:  # yuhuili's configs ship 2048 for 128k targets
        notes.append(f"max_position_embeddings raised from {max_pos} to the target's {target_max}")
        max_pos = target_max
    rope = cfg.get("rope_parameters") or {
        **(cfg.get("rope_scaling") or {}),
        "rope_type": (cfg.get("rope_scaling") or {}).get("rope_type", "default"),
        "rope_theta": cfg.get("rope_theta", 10000.0),
    }
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    return Eagle3Config(
        hidden_size=hidden, intermediate_size=cfg["intermediate_size"], num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads, head_dim=cfg.get("head_dim") or hidden // heads,
        vocab_size=cfg["vocab_size"], draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
        target_hidden_size=cfg.get("target_hidden_size") or hidden,
        num_target_layers=num_layers, aux_layer_ids=list(ids),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), hidden_act=cfg.get("hidden_act", "silu"),
        max_position_embeddings=max_pos, rope_parameters=dict(rope),
        attention_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
        target_name_or_path=prov.get("target") or prov.get("target_name_or_path") or "",
        target_architectures=list(prov.get("target_architectures") or target_config.get("architectures") or []),
        target_model_type=prov.get("target_model_type") or target_config.get("model_type", ""),
        bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"),
        pad_token_id=cfg.get("pad_token_id"),
        **forward_flags_of(cfg),
    ), notes


def forward_flags_of(cfg: dict[str, Any]) -> dict[str, bool]:
    """The forward-pass flags of a native (or flattened speculators) config, read as vLLM's llama_eagle3.py does:
    `norm_before_fc` from eagle_config first, then the top level; a missing flag is false."""
    eagle = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    flags = {flag: bool(cfg.get(flag, False)) for flag in FORWARD_FLAGS}
    flags["norm_before_fc"] = bool(eagle.get("norm_before_fc", cfg.get("norm_before_fc", False)))
    return flags


def tensors_from_native(
    tensors: dict[str, torch.Tensor], draft_vocab_size: int, vocab_size: int
) -> dict[str, torch.Tensor]:
    """draftsmith names of a native state dict (`midlayer.*`, or vLLM's `model.layers.0.*`); the embedding is
    dropped (draftsmith uses the target's) and a full-vocab drafter without maps gets the identity d2t / t2d."""
    renamed = {}
    for name, t in tensors.items():
        name = name.removeprefix("model.")
        name = "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name
        if name != "embed_tokens.weight":
            renamed[name] = t
    if "d2t" not in renamed and "t2d" not in renamed and draft_vocab_size == vocab_size:
        renamed["d2t"] = torch.zeros(draft_vocab_size, dtype=torch.long)  # draft id i = target id i
        renamed["t2d"] = torch.ones(vocab_size, dtype=torch.bool)
    return renamed


def read_public_eagle3(
    cfg: dict[str, Any], tensors: dict[str, torch.Tensor], target_config: dict[str, Any] | None = None
) -> tuple[Eagle3Config, dict[str, torch.Tensor], list[str]]:
    """(config, tensors in draftsmith names, notes) of a native or speculators EAGLE-3 config + state dict."""
    from draftsmith.models.eagle3.speculators import (
        SpeculatorsFormatError,
        eagle3_config_from_speculators,
        tensors_from_speculators,
    )

    if is_speculators_eagle3(cfg):
        try:
            config, notes = eagle3_config_from_speculators(cfg, target_config)
        except SpeculatorsFormatError as e:
            raise DrafterLoadError(f"speculators config: {e}") from None
        return config, tensors_from_speculators(tensors, config.draft_vocab_size, config.vocab_size), notes
    if is_native_eagle3(cfg):
        config, notes = eagle3_config_from_native(cfg, target_config)
        return config, tensors_from_native(tensors, config.draft_vocab_size, config.vocab_size), notes
    raise DrafterLoadError(f"not a native or speculators EAGLE-3 config (architectures {cfg.get('architectures')}, "
                           f"speculators_model_type {cfg.get('speculators_model_type')!r})")


def read_drafter_folder(path: str | Path) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """Config and tensors (draftsmith names) of a drafter folder in draftsmith's, the native or speculators layout."""
    cfg, config_path, weights_path = read_drafter_config(Path(path), "EAGLE-3")
    tensors = load_drafter_weights(weights_path)
    if cfg.get("method") == "eagle3":
        return Eagle3Config.from_dict(cfg), tensors
    if is_native_eagle3(cfg) or is_speculators_eagle3(cfg):
        try:
            config, renamed, _ = read_public_eagle3(cfg, tensors)
        except DrafterLoadError as e:
            raise DrafterLoadError(f"{config_path}: {e}") from None
        return config, renamed
    raise DrafterLoadError(f"{config_path}: not an EAGLE-3 drafter (no \"method\": \"eagle3\", architectures "
                           f"{cfg.get('architectures')} are not {sorted(NATIVE_ARCHITECTURES)} and no "
                           "\"speculators_model_type\": \"eagle3\")")


def load_drafter(path: str | Path, device="cpu", dtype=torch.float32) -> Eagle3Drafter:
    """An eval-mode drafter; a draftsmith output_dir means its latest checkpoint."""
    from draftsmith.models.checkpoint import resolve_checkpoint

    config, tensors = read_drafter_folder(resolve_checkpoint(local_folder(path)))
    return load_for_inference(Eagle3Drafter(config), tensors, path, device, dtype, DrafterLoadError)
