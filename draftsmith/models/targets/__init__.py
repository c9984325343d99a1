"""The target families draftsmith's runtime serves, and how each is run (`TargetModel.step`).

    model_type                          adapter                    CUDA graphs   sliding windows
    llama, mistral, qwen2, qwen3        llama.LlamaFamily          yes           refused past the window
    qwen3_moe                           llama.LlamaFamily          no (MoE)      exact, every layer
    gpt_oss                             gpt_oss.GptOssFamily       no (MoE)      exact, per layer type
    gemma4_text, gemma4 (its text)      gemma4.Gemma4Family        dense only    exact, per layer type
    any other causal LM                 generic.TransformersForward (transformers' own forward and cache: exact,
                                        one request at a time, chains only, a one-line note says so)

Adding a family is adding a module with a `TargetFamily` (base.py) and a line in `ADAPTERS`.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from draftsmith.models.targets import gemma4
from draftsmith.models.targets.base import TargetFamily
from draftsmith.models.targets.gpt_oss import GptOssFamily
from draftsmith.models.targets.llama import LlamaFamily

DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # the families with the compiled layer too


def _qwen3_moe(model: nn.Module) -> LlamaFamily:
    """Qwen3-MoE's layer is Qwen3's with the sparse block as its MLP; a window (use_sliding_window) on every layer."""
    return LlamaFamily(model, window=model.config.sliding_window, graphs=False)


ADAPTERS: dict[str, Callable[[nn.Module], TargetFamily]] = {
    **{model_type: LlamaFamily for model_type in DENSE_MODEL_TYPES},
    "qwen3_moe": _qwen3_moe,
    "gpt_oss": GptOssFamily,
    "gemma4_text": gemma4.Gemma4Family,
    "gemma4": gemma4.Gemma4Family,  # the multimodal checkpoints: their text model
}
UNSUPPORTED: dict[str, Callable[[object], str | None]] = {"gemma4_text": gemma4.unsupported}  # by text config


def family_for(model: nn.Module) -> TargetFamily | None:
    """The adapter that runs `model` in the runtime, or None: no adapter, transformers' own forward serves it."""
    make = ADAPTERS.get(getattr(model.config, "model_type", ""))
    return make(model) if make is not None else None


def unsupported_reason(config) -> str | None:
    """Why the runtime cannot serve a target of this (text) config exactly (to be said in one line), or None."""
    check = UNSUPPORTED.get(getattr(config, "model_type", ""))
    return check(config) if check is not None else None


__all__ = ["ADAPTERS", "DENSE_MODEL_TYPES", "TargetFamily", "family_for", "unsupported_reason"]
