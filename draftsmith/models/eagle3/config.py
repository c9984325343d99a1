"""EAGLE-3 drafter configuration: the shape of the draft layer and its link to the target.

One flat dataclass, saved as the `config.json` of a draftsmith checkpoint (with `"method": "eagle3"`), from which
every export format is derived. Aux layer ids are kept in draftsmith's *capture* convention (DESIGN.md §3: id k is
the residual stream entering decoder layer k, i.e. Hugging Face `output_hidden_states[k]`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from transformers import LlamaConfig, PretrainedConfig

from draftsmith.models.drafter_config import (config_from_dict, one_layer_llama_config, rope_parameters_of,
                                             target_provenance)
from draftsmith.models.eagle3.section import default_aux_layer_ids
from draftsmith.models.spec import check_layer_ids
from draftsmith.models.targets.base import config_attribute

METHOD = "eagle3"
# The forward-pass flags of vLLM's and speculators' EAGLE-3 that draftsmith implements (config.json names).
FORWARD_FLAGS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    num_target_layers: int
    aux_layer_ids: list[int]  # capture convention (DESIGN.md §3)
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    attention_bias: bool = False
    mlp_bias: bool = False
    target_name_or_path: str = ""
    target_architectures: list[str] = field(default_factory=list)
    target_model_type: str = ""
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # Forward-pass variants of vLLM's llama_eagle3.py and the speculators package (EAGLE 3.1), all False in the
    # EAGLE-3 reference and in SGLang (which reads none of them):
    norm_before_fc: bool = False  # one RMSNorm (`input_norm`) over the concatenated aux features before fc
    fc_norm: bool = False  # one RMSNorm per aux layer (`fc_norm.{i}`) before fc
    norm_before_residual: bool = False  # the residual is hidden_norm(h), not h
    norm_output: bool = False  # the hidden fed back to the next draft step is norm(out), not out
    method: str = METHOD

    @classmethod
    def from_target(
        cls,
        target: PretrainedConfig,
        draft_vocab_size: int,
        aux_layer_ids: list[int] | None = None,
        target_name_or_path: str = "",
        **variants: bool,
    ) -> "Eagle3Config":
        """A draft layer shaped like one decoder layer of the target, as the EAGLE-3 reference does; `variants` are
        the forward-pass flags (norm_before_fc, fc_norm, norm_before_residual, norm_output)."""
        num_layers = target.num_hidden_layers
        ids = default_aux_layer_ids(num_layers) if aux_layer_ids is None else \
            check_layer_ids(aux_layer_ids, "model.aux_layer_ids", num_layers, "capture")
        head_dim = config_attribute(target, "head_dim") or target.hidden_size // target.num_attention_heads
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=config_attribute(target, "num_key_value_heads") or target.num_attention_heads,
            head_dim=head_dim,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=target.hidden_size,
            num_target_layers=num_layers,
            aux_layer_ids=ids,
            rms_norm_eps=getattr(target, "rms_norm_eps", 1e-5),
            hidden_act=getattr(target, "hidden_act", "silu"),
            max_position_embeddings=getattr(target, "max_position_embeddings", 4096),
            rope_parameters=rope_parameters_of(target),
            **target_provenance(target, target_name_or_path),
            **variants,
        )

    def variants(self) -> dict[str, bool]:
        """The forward-pass flags, as vLLM and speculators name them in config.json."""
        return {name: getattr(self, name) for name in FORWARD_FLAGS}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Eagle3Config":
        return config_from_dict(cls, d, "EAGLE-3", METHOD)

    def llama_config(self) -> LlamaConfig:
        """A `LlamaConfig` for the transformers building blocks (RoPE, MLP, norms) the draft layer reuses."""
        return one_layer_llama_config(self)
