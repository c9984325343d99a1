"""What every drafter shares: the target facts its config records, a strict way to read the config back, and
loading its weights for the runtime."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers import LlamaConfig, PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from draftsmith.models.checkpoint import check_finite


def is_int(x: Any) -> bool:
    """An int in a JSON config, not a bool (which Python counts as an int)."""
    return isinstance(x, int) and not isinstance(x, bool)


def legacy_rope(rope_parameters: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) as transformers 4 and older engines read them; scaling is None for plain RoPE."""
    theta = float(rope_parameters.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    return theta, scaling if scaling.get("rope_type", "default") != "default" else None


def one_layer_llama_config(config) -> LlamaConfig:
    """A one-layer `LlamaConfig` of an EAGLE-style drafter config (EAGLE-1 and EAGLE-3 name their fields alike), for
    the transformers building blocks (RoPE, MLP, norms) the draft layer reuses."""
    return LlamaConfig(
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        num_hidden_layers=1,
        vocab_size=config.vocab_size,
        rms_norm_eps=config.rms_norm_eps,
        hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters=dict(config.rope_parameters),
        attention_bias=config.attention_bias,
        mlp_bias=config.mlp_bias,
    )


def one_layer_llama_json(config) -> dict[str, Any]:
    """The draft layer as a Llama config, as an EAGLE-style drafter's exports write it: the top level of EAGLE-1's
    reference layout and EAGLE-3's native one, and speculators' `transformer_layer_config` (which vLLM merges into
    the model config it builds). RoPE both as transformers 5 and as older readers take it; each method adds its own
    keys."""
    rope = {"rope_type": "default", **config.rope_parameters}
    rope_theta, rope_scaling = legacy_rope(rope)
    rope["rope_theta"] = rope_theta
    return {
        "model_type": "llama",  # "qwen3" would make newer vLLM build q/k norms the draft layer does not have
        "num_hidden_layers": 1,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,  # explicit: speculators doubles hidden_size for its RoPE module
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "attention_bias": config.attention_bias,
        "mlp_bias": config.mlp_bias,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope,
        "tie_word_embeddings": False,  # True would make SGLang use the embedding as lm_head
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
    }


def layer_bias_shapes(config: Mapping[str, Any], attention_names: Sequence[str], mlp_names: Sequence[str], q: int,
                      kv: int, h: int, i: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """The biases of an EAGLE-style draft layer that an exported config asks for, name -> (shape, why): q, k, v, o
    (`attention_bias`; widths q, kv, kv, h) and gate, up, down (`mlp_bias`; i, i, h), named as the layout does."""
    shapes = {}
    if config.get("attention_bias"):
        for name, width in zip(attention_names, (q, kv, kv, h)):
            shapes[name] = ((width,), "bias of the matching projection (attention_bias)")
    if config.get("mlp_bias"):
        for name, width in zip(mlp_names, (i, i, h)):
            shapes[name] = ((width,), "bias of the matching projection (mlp_bias)")
    return shapes


def rope_parameters_of(target: PretrainedConfig) -> dict[str, Any]:
    """The target's RoPE settings as a `rope_parameters` dict, across transformers 4-style and 5-style configs. A
    target with RoPE per layer type (Gemma 4) gives its plain (default) RoPE, which every engine's drafter builds."""
    params = getattr(target, "rope_parameters", None)
    if params and all(isinstance(v, dict) for v in params.values()):  # {layer type: rope_parameters}
        plain = [v for v in params.values() if v.get("rope_type", "default") == "default"]
        return dict(plain[0] if plain else next(iter(params.values())))
    if params:
        return dict(params)
    scaling = dict(getattr(target, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    scaling["rope_theta"] = float(getattr(target, "rope_theta", 10000.0))
    return scaling


def target_provenance(target: PretrainedConfig, name_or_path: str = "") -> dict[str, Any]:
    """The target's identity and special tokens, as every drafter config stores them (exports and cards use them)."""
    return {
        "target_name_or_path": name_or_path or getattr(target, "_name_or_path", ""),
        "target_architectures": list(getattr(target, "architectures", None) or []),
        "target_model_type": getattr(target, "model_type", ""),
        "bos_token_id": getattr(target, "bos_token_id", None),
        "eos_token_id": getattr(target, "eos_token_id", None),
        "pad_token_id": getattr(target, "pad_token_id", None),
    }


def config_from_dict(cls, d: dict[str, Any], label: str, method: str, error: type[Exception] = ValueError):
    """`cls(**d)` for a drafter config dataclass, refusing unknown keys and another method's config."""
    unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise error(f"{label} config: unknown keys {unknown}")
    if d.get("method", method) != method:
        raise error(f"{label} config: method {d.get('method')!r}, expected {method!r}")
    return cls(**d)


def load_for_inference(drafter, tensors, source, device, dtype, error: type[Exception] = ValueError):
    """Load `tensors` into a freshly built drafter (every tensor but RoPE's must match), move it to `device` and
    `dtype`, and return it in eval mode. `.to(dtype)` also rounds RoPE's inverse frequencies, so they are rebuilt
    in float32."""
    missing, unexpected = drafter.load_state_dict(tensors, strict=False)
    missing = [m for m in missing if not m.startswith("rotary_emb.")]
    if missing or unexpected:
        raise error(f"{source}: drafter tensors do not match its config (missing {missing}, unexpected {unexpected})")
    drafter.to(device=device, dtype=dtype)
    drafter.rotary_emb = LlamaRotaryEmbedding(drafter.config.llama_config()).to(device)
    return drafter.eval()


class DrafterLoadError(ValueError):
    """A folder that holds no drafter draftsmith can read."""


DRAFTER_FILES = ["*.json", "*.safetensors", "*.pt", "*.md"]  # what a drafter repo holds that draftsmith reads
HUB_PROBE_TIMEOUT_S = 5.0  # one HEAD request to the Hub; a reachable Hub answers well within it


def hub_unreachable(name: str) -> str | None:
    """Why the Hugging Face repo id `name` cannot be resolved, when it is neither cached nor reachable; else None
    (a local path, a cached id, or a Hub that answers, whose own errors the normal path reports).

    Offline, huggingface_hub retries each uncached file for about 20 s before giving up, and a target needs several
    files (92 to 114 s in all); one HEAD request without retries tells the same at once."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError

    from draftsmith.models.model_card import looks_like_hub_id

    if not looks_like_hub_id(str(name)):
        return None
    try:
        snapshot_download(str(name), local_files_only=True)
        return None  # cached: read from there
    except Exception:  # noqa: BLE001 - not cached (or no valid id, which the normal path reports)
        pass
    missing = f"{name}: not a local folder and not cached locally"
    if constants.HF_HUB_OFFLINE:
        return f"{missing}, and HF_HUB_OFFLINE=1 forbids downloading it: download it first or unset HF_HUB_OFFLINE"
    try:
        get_hf_file_metadata(hf_hub_url(str(name), "config.json"), timeout=HUB_PROBE_TIMEOUT_S)
    except (HfHubHTTPError, HFValidationError):
        return None  # the Hub answered: a missing or gated repo gets the normal path's message
    except Exception as e:  # noqa: BLE001 - DNS, refused connection, timeout, proxy: the Hub cannot be reached
        reason = (str(e).splitlines() or [""])[0] or type(e).__name__
        return (f"{missing}, and the Hugging Face Hub cannot be reached ({reason}): download it where there is "
                "network or give a local folder (HF_HUB_OFFLINE=1 skips the Hub and reads only the cache)")
    return None


def local_folder(name: str | Path, allow_patterns: list[str] | None = None) -> Path:
    """`name` as a local folder: the path itself, or a Hugging Face repo id (ORG/NAME that is no local path)
    resolved through huggingface_hub, from its cache first and downloaded when online, as transformers resolves
    a target's id. Anything else is returned as a path, for the caller's own "no such folder" message."""
    from draftsmith.models.model_card import looks_like_hub_id

    if Path(name).exists() or not looks_like_hub_id(str(name)):
        return Path(name)
    why_not = hub_unreachable(str(name))
    if why_not:  # fail at once rather than after huggingface_hub's retries
        raise DrafterLoadError(why_not)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(name), allow_patterns=allow_patterns or DRAFTER_FILES))
    except Exception as e:  # offline and not cached, auth, missing repo: one line either way
        raise DrafterLoadError(f"{name}: no such folder, and not found on the Hugging Face Hub or in its cache "
                               f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def read_drafter_config(folder: Path, family: str) -> tuple[dict[str, Any], Path, Path]:
    """(config dict, config path, weights path) of a drafter folder; a one-line error naming the missing file or
    the config's bad line. `family` names the drafter in the messages ("EAGLE-3", "DFlash")."""
    config_path, weights_path = folder / "config.json", folder / "model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        article = "an" if family[0] in "AEIOU" else "a"
        raise DrafterLoadError(f"{folder}: expected config.json and model.safetensors of {article} {family} drafter")
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DrafterLoadError(f"{config_path}:{e.lineno}: invalid JSON: {e.msg}") from None
    return raw, config_path, weights_path


def load_drafter_weights(weights_path: Path) -> dict[str, Any]:
    """The tensors of a drafter's model.safetensors, on the CPU; a DrafterLoadError naming the file otherwise."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError) as e:
        raise DrafterLoadError(f"{weights_path}: cannot load: {e}") from None
    check_finite(tensors, weights_path, DrafterLoadError)
    return tensors
