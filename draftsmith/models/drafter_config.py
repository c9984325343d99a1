"""What every drafter's config shares: the target facts it records and a strict way to read it back."""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import PretrainedConfig


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
