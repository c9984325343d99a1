"""MTP drafter configuration: how many modules, how they cycle over depths, and the target they belong to.

Saved as the `config.json` of a draftsmith checkpoint (with `"method": "mtp"`). The transformer block of each
module is one decoder layer *of the target's own class* (LlamaDecoderLayer for Llama, DeepseekV3DecoderLayer for
DeepSeek-V3, ...), so the config keeps the target's whole Hugging Face config: it rebuilds the block without the
target at hand and is the `config.json` of a native export.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from transformers import PretrainedConfig

from draftsmith.models.drafter_config import config_from_dict

METHOD = "mtp"
LAYOUTS = ("deepseek", "qwen3_next")  # native MTP weight layouts (see native.py)
# What depth 1 reads: the target's last hidden state after its final norm, which is what vLLM and SGLang hand their
# MTP modules (model.py). Configs written before draftsmith followed it (pre-norm) lack the key and are refused.
HIDDEN_INPUT = "final_normed"


def target_config_dict(config: PretrainedConfig) -> dict[str, Any]:
    """The target's full config as plain JSON values (every key, not only those that differ from defaults)."""
    return json.loads(config.to_json_string(use_diff=False))


def block_layer_index(config: PretrainedConfig | dict[str, Any]) -> int:
    """Which target layer's type the MTP block copies: the last full-attention layer.

    DeepSeek-V3 and Qwen3-Next build their MTP block like their later layers (MoE, full attention); the
    layer index also picks MoE vs dense MLP in DeepSeek-V3 and the attention type in hybrid models.
    """
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    num_layers = get("num_hidden_layers")
    types = get("layer_types") or []
    for i in range(num_layers - 1, -1, -1):
        if i >= len(types) or types[i] in ("full_attention", "attention"):
            return i
    return num_layers - 1


@dataclass
class MtpDrafterConfig:
    hidden_size: int
    vocab_size: int  # the target's: MTP predicts over the full vocabulary with the target's head
    num_target_layers: int
    target_config: dict[str, Any]  # the target's Hugging Face config (target_config_dict)
    num_modules: int = 1
    recursive: bool = True  # modules may be reused past num_modules (depth d uses module (d-1) % num_modules)
    num_depths: int = 1  # depths trained
    block_layer_idx: int = 0  # see block_layer_index
    rms_norm_eps: float = 1e-6
    mask_position_0: bool = False  # zero the token embedding at position 0, as vLLM's DeepSeek MTP does
    hidden_input: str = HIDDEN_INPUT  # the target hidden state depth 1 reads (see HIDDEN_INPUT)
    native_layout: str | None = None  # "deepseek" / "qwen3_next": the layout `export --format mtp` writes
    target_name_or_path: str = ""
    target_model_type: str = ""
    target_architectures: list[str] = field(default_factory=list)
    method: str = METHOD

    def __post_init__(self) -> None:
        if self.native_layout is not None and self.native_layout not in LAYOUTS:
            raise ValueError(f"MTP config: native_layout {self.native_layout!r} is not one of {LAYOUTS}")
        if self.num_modules < 1 or self.num_depths < 1:
            raise ValueError("MTP config: num_modules and num_depths must be >= 1")
        if self.hidden_input != HIDDEN_INPUT:
            raise ValueError(f"MTP config: hidden_input {self.hidden_input!r}: draftsmith trains and runs MTP on "
                             f"{HIDDEN_INPUT!r} only")

    @classmethod
    def from_target(cls, target: PretrainedConfig, num_modules: int = 1, recursive: bool = True, num_depths: int = 1,
                    native_layout: str | None = None, target_name_or_path: str = "") -> "MtpDrafterConfig":
        return cls(
            hidden_size=target.hidden_size,
            vocab_size=target.vocab_size,
            num_target_layers=target.num_hidden_layers,
            target_config=target_config_dict(target),
            num_modules=num_modules,
            recursive=recursive,
            num_depths=num_depths,
            block_layer_idx=block_layer_index(target),
            rms_norm_eps=float(getattr(target, "rms_norm_eps", 1e-6)),
            mask_position_0=native_layout == "deepseek",
            native_layout=native_layout,
            target_name_or_path=target_name_or_path or getattr(target, "_name_or_path", ""),
            target_model_type=getattr(target, "model_type", ""),
            target_architectures=list(getattr(target, "architectures", None) or []),
        )

    def module_for_depth(self, depth: int) -> int:
        """Index of the module that runs depth `depth` (1-based)."""
        return (depth - 1) % self.num_modules

    @property
    def max_depth(self) -> int | None:
        """Most draft tokens per step: any number when modules are reused, else one per module."""
        return None if self.recursive else self.num_modules

    def hf_config(self) -> PretrainedConfig:
        """The target's config object, rebuilt from the saved dict."""
        from transformers import AutoConfig

        d = dict(self.target_config)
        model_type = d.pop("model_type", None) or self.target_model_type
        try:
            return AutoConfig.for_model(model_type, **d)
        except ValueError as e:
            raise ValueError(f"MTP config: transformers cannot build a {model_type!r} config: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MtpDrafterConfig":
        if d.get("method", METHOD) == METHOD and "hidden_input" not in d:
            raise ValueError("MTP config has no hidden_input: an older draftsmith trained it on the target's pre-norm "
                             "hidden state, which engines never hand MTP; retrain it (model.init_from=<this "
                             "checkpoint> starts from its weights)")
        return config_from_dict(cls, d, "MTP", METHOD)
