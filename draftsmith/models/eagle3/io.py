"""Load an EAGLE-3 drafter from a draftsmith checkpoint or from a native (SGLang / vLLM) EAGLE-3 folder."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.eagle3.model import Eagle3Drafter

NATIVE_ARCHITECTURES = {"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"}


class DrafterLoadError(ValueError):
    """A folder that holds no EAGLE-3 drafter draftsmith can read."""


def _config_from_native(cfg: dict) -> Eagle3Config:
    """Rebuild our config from a Llama-shaped native EAGLE-3 config (vLLM's reading of its keys)."""
    rope = cfg.get("rope_parameters") or {
        **(cfg.get("rope_scaling") or {}),
        "rope_type": (cfg.get("rope_scaling") or {}).get("rope_type", "default"),
        "rope_theta": cfg.get("rope_theta", 10000.0),
    }
    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    prov = cfg.get("draftsmith", {})
    num_target_layers = prov.get("num_target_layers") or cfg.get("num_target_layers")
    if ids is None:
        raise DrafterLoadError("native EAGLE-3 config has no eagle_aux_hidden_state_layer_ids: the target layers it "
                               "was trained on are unknown")
    return Eagle3Config(
        hidden_size=hidden, intermediate_size=cfg["intermediate_size"], num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads", heads), head_dim=cfg.get("head_dim") or hidden // heads,
        vocab_size=cfg["vocab_size"], draft_vocab_size=cfg.get("draft_vocab_size", cfg["vocab_size"]),
        target_hidden_size=cfg.get("target_hidden_size") or hidden,
        num_target_layers=num_target_layers or max(ids) + 3, aux_layer_ids=list(ids),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), hidden_act=cfg.get("hidden_act", "silu"),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096), rope_parameters=rope,
        attention_bias=cfg.get("attention_bias", False), mlp_bias=cfg.get("mlp_bias", False),
        target_name_or_path=prov.get("target_name_or_path", ""),
    )


def read_drafter_folder(path: str | Path) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """Config and tensors (draftsmith names) of a drafter folder in draftsmith's or the native layout."""
    folder = Path(path)
    config_path, weights_path = folder / "config.json", folder / "model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise DrafterLoadError(f"{folder}: expected config.json and model.safetensors of an EAGLE-3 drafter")
    cfg = json.loads(config_path.read_text())
    tensors = load_file(str(weights_path))
    if cfg.get("method") == "eagle3":
        return Eagle3Config.from_dict(cfg), tensors
    if NATIVE_ARCHITECTURES & set(cfg.get("architectures") or []):
        renamed = {}
        for name, t in tensors.items():
            name = name.removeprefix("model.")
            name = "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name
            if name != "embed_tokens.weight":  # the target's embedding is shared at run time
                renamed[name] = t
        return _config_from_native(cfg), renamed
    raise DrafterLoadError(f"{config_path}: not an EAGLE-3 drafter (no \"method\": \"eagle3\" and architectures "
                           f"{cfg.get('architectures')} are not {sorted(NATIVE_ARCHITECTURES)})")


def load_drafter(path: str | Path, device="cpu", dtype=torch.float32) -> Eagle3Drafter:
    """An eval-mode drafter; a draftsmith output_dir means its latest checkpoint."""
    from draftsmith.models.checkpoint import resolve_checkpoint

    config, tensors = read_drafter_folder(resolve_checkpoint(path))
    drafter = Eagle3Drafter(config)
    missing, unexpected = drafter.load_state_dict(tensors, strict=False)
    missing = [m for m in missing if not m.startswith("rotary_emb.")]
    if missing or unexpected:
        raise DrafterLoadError(f"{path}: drafter tensors do not match its config (missing {missing}, "
                               f"unexpected {unexpected})")
    drafter.to(device=device, dtype=dtype)
    # .to(dtype) also rounds RoPE's inverse frequencies; rebuild them in float32.
    drafter.rotary_emb = LlamaRotaryEmbedding(config.llama_config()).to(device)
    return drafter.eval()
