"""EAGLE-1 drafter configuration: the shape of the draft layer and its link to the target.

One flat dataclass, saved as the `config.json` of a draftsmith checkpoint (with `"method": "eagle"`), from which the
export formats are derived. The draft layer has the target's width (fc maps cat(embedding, hidden), 2H, back to H,
and the head it reads out through is the target's), so the layer sizes default to the target's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from transformers import LlamaConfig, PretrainedConfig

from draftsmith.models.drafter_config import (config_from_dict, one_layer_llama_config, rope_parameters_of,
                                             target_provenance)

METHOD = "eagle"


@dataclass
class EagleConfig:
    hidden_size: int  # the target's: fc reads cat(embed(x), h) of width 2H and the target's head reads H
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's: EAGLE-1 reads out through the target's whole head
    num_target_layers: int | None = None  # provenance; the runtime reads the running target's last layer
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    attention_bias: bool = False
    mlp_bias: bool = False
    fc_bias: bool = False  # the EAGLE reference config's "bias" (section.py says why false is the default)
    target_name_or_path: str = ""
    target_architectures: list[str] = field(default_factory=list)
    target_model_type: str = ""
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    method: str = METHOD

    def __post_init__(self) -> None:
        """The layer transformers builds from these sizes must exist: refused here in one line (a ValueError the
        readers name the file in), not as transformers' validation traceback."""
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "vocab_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EAGLE config: {key} {value!r} must be a positive integer")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"EAGLE config: hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                             f"{self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"EAGLE config: num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")

    @classmethod
    def from_target(cls, target: PretrainedConfig, fc_bias: bool = False, target_name_or_path: str = ""
                    ) -> "EagleConfig":
        """A draft layer shaped like one decoder layer of the target, as the EAGLE reference trains it."""
        head_dim = getattr(target, "head_dim", None) or target.hidden_size // target.num_attention_heads
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=getattr(target, "num_key_value_heads", None) or target.num_attention_heads,
            head_dim=head_dim,
            vocab_size=target.vocab_size,
            num_target_layers=target.num_hidden_layers,
            rms_norm_eps=getattr(target, "rms_norm_eps", 1e-5),
            hidden_act=getattr(target, "hidden_act", "silu"),
            max_position_embeddings=getattr(target, "max_position_embeddings", 4096),
            rope_parameters=rope_parameters_of(target),
            fc_bias=fc_bias,
            **target_provenance(target, target_name_or_path),
        )

    # What the runtime's EAGLE loop (models/eagle3/proposer.py, shared) reads of a drafter config:
    @property
    def aux_layer_ids(self) -> list[int]:
        """Capture id L (the last layer's output, before the final norm), which the drafter normalises with the
        target's own norm; the proposer uses the running target's L (proposer.py)."""
        return [self.num_target_layers] if self.num_target_layers else []

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab_size  # no draft vocabulary: the target's head

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EagleConfig":
        return config_from_dict(cls, d, "EAGLE", METHOD)

    def llama_config(self) -> LlamaConfig:
        """A `LlamaConfig` for the transformers building blocks (RoPE, MLP) the draft layer reuses."""
        return one_layer_llama_config(self)
