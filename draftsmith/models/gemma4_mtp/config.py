"""Gemma 4 MTP drafter configuration: the assistant's own Hugging Face config, kept whole, and the target facts.

A draftsmith checkpoint (`"method": "gemma4_mtp"`) stores the assistant's `Gemma4AssistantConfig` as a dict
(`assistant_config`), so the export writes it back unchanged but for the sizes training cannot change, and the
model is rebuilt from it without the assistant folder at hand. Which target layers the assistant reads is not
stored: like vLLM (`Gemma4Proposer._setup_gemma4_kv_sharing`), it follows from the target's config at run time
(`source_layers`), so a checkpoint stays the published one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from draftsmith.models.drafter_config import config_from_dict

METHOD = "gemma4_mtp"
MODEL_TYPES = ("gemma4_assistant",)  # what vLLM 0.32 rewrites to gemma4_mtp (gemma4_unified_assistant: multimodal)
TARGET_MODEL_TYPES = ("gemma4_text", "gemma4")


def text_config_of(assistant_config: Mapping[str, Any]) -> dict[str, Any]:
    text = assistant_config.get("text_config")
    if not isinstance(text, dict):
        raise ValueError("Gemma 4 assistant config: no text_config object")
    return text


def source_layers(target_config) -> dict[str, int]:
    """Layer type -> the target layer whose K/V the assistant's layers of that type read: the last layer of that
    type that computes its own K/V (before the `num_kv_shared_layers` that reuse them), vLLM's rule and
    transformers' "store" layers."""
    get = target_config.get if isinstance(target_config, Mapping) else (lambda k, d=None: getattr(target_config, k, d))
    types = list(get("layer_types") or [])
    own = len(types) - int(get("num_kv_shared_layers") or 0)
    out: dict[str, int] = {}
    for index, kind in enumerate(types[:own]):
        out[kind] = index
    return out


@dataclass
class Gemma4MtpConfig:
    assistant_config: dict[str, Any]  # the assistant's Gemma4AssistantConfig.to_dict() (config.json as published)
    backbone_hidden_size: int  # the target's hidden size: pre_projection reads cat(embed, h), each this wide
    vocab_size: int  # shared by target and assistant
    num_steps: int = 1  # draft steps trained (the proposer may run more: every step reads the same target K/V)
    target_name_or_path: str = ""
    target_model_type: str = ""
    target_architectures: list[str] = field(default_factory=list)
    source: str = ""  # the assistant checkpoint training started from
    method: str = METHOD

    def __post_init__(self) -> None:
        if self.assistant_config.get("model_type") not in MODEL_TYPES:
            raise ValueError(f"Gemma 4 MTP config: assistant model_type {self.assistant_config.get('model_type')!r} "
                             f"is not one of {MODEL_TYPES}")
        text = text_config_of(self.assistant_config)
        if text.get("vocab_size") != self.vocab_size:
            raise ValueError(f"Gemma 4 MTP config: assistant vocab_size {text.get('vocab_size')} != {self.vocab_size}")
        if self.assistant_config.get("backbone_hidden_size") != self.backbone_hidden_size:
            raise ValueError("Gemma 4 MTP config: assistant backbone_hidden_size "
                             f"{self.assistant_config.get('backbone_hidden_size')} != {self.backbone_hidden_size}")
        if self.num_steps < 1:
            raise ValueError("Gemma 4 MTP config: num_steps must be >= 1")
        if self.assistant_config.get("use_ordered_embeddings"):  # the same rules at import and at load
            centroids = self.assistant_config.get("num_centroids")
            top = self.assistant_config.get("centroid_intermediate_top_k")
            if isinstance(centroids, bool) or not isinstance(centroids, int) or centroids < 1 \
                    or self.vocab_size % centroids:
                raise ValueError(f"Gemma 4 MTP config: num_centroids {centroids!r} must be a positive integer "
                                 f"dividing vocab_size {self.vocab_size}")
            if isinstance(top, bool) or not isinstance(top, int) or not 1 <= top <= centroids:
                raise ValueError(f"Gemma 4 MTP config: centroid_intermediate_top_k {top!r} must be an integer in "
                                 f"1..num_centroids ({centroids})")

    @classmethod
    def from_assistant(cls, assistant_config: Mapping[str, Any], **kwargs) -> "Gemma4MtpConfig":
        assistant_config = dict(assistant_config)
        return cls(assistant_config=assistant_config,
                   backbone_hidden_size=int(assistant_config.get("backbone_hidden_size", 1536)),
                   vocab_size=int(text_config_of(assistant_config)["vocab_size"]), **kwargs)

    def hf_config(self):
        """The assistant's transformers config object."""
        from transformers.models.gemma4_assistant import Gemma4AssistantConfig

        d = {k: v for k, v in self.assistant_config.items() if k not in ("model_type", "transformers_version")}
        return Gemma4AssistantConfig(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Gemma4MtpConfig":
        return config_from_dict(cls, d, "Gemma 4 MTP", METHOD)
