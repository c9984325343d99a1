"""DFlash drafter configuration: the shape of the draft layers, the block, and the link to the target.

One flat dataclass, saved as the `config.json` of a draftsmith checkpoint (with `"method": "dflash"`), from which
the `--format dflash` export is derived. Target layers are kept in the *output-of-layer* convention that
`dflash_config.target_layer_ids` uses in vLLM's and SGLang's DFlash loaders and in z-lab's checkpoints:

    output-of-layer id i (dflash_config)    0       1       2     ...  i
    capture id (DESIGN.md §3, vLLM aux)     1       2       3     ...  i + 1
    Hugging Face output_hidden_states       [1]     [2]     [3]   ...  [i + 1]

The mask token: with `mask_token_id` set, mask slots are embedded by the target's (frozen) embedding row of that
id, as the reference does. Without it, the drafter learns its own `mask_embedding`; `mask_token_id` then records
the spare id engines substitute it at (vLLM reads the vector from `mask_embedding.pt`), or None if there is none.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from transformers import LlamaConfig, PretrainedConfig

from draftsmith.models.dflash.section import DflashConfigError, default_target_layer_ids
from draftsmith.models.drafter_config import config_from_dict, rope_parameters_of, target_provenance
from draftsmith.models.spec import capture_from_output, check_layer_ids

METHOD = "dflash"


def spare_token_id(tokenizer, vocab_size: int) -> int | None:
    """A token id the target never generates, for engines to mark mask slots with.

    First choice: an embedding row no token maps to (Qwen3: 151669, the id z-lab's checkpoints use); then the
    last `reserved` special token (Llama 3); then the pad token when it is neither EOS nor BOS. None otherwise.
    """
    used = set(tokenizer.get_vocab().values())
    for i in range(vocab_size):
        if i not in used:
            return i
    reserved = [i for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items()
                if "reserved" in str(tok).lower() and i < vocab_size]
    if reserved:
        return max(reserved)
    pad = tokenizer.pad_token_id
    if pad is not None and pad not in (tokenizer.eos_token_id, tokenizer.bos_token_id) and pad < vocab_size:
        return pad
    return None


@dataclass
class DflashDrafterConfig:
    hidden_size: int  # = the target's: the block is embedded by the target's embedding, read out by its head
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocabulary
    num_hidden_layers: int  # draft decoder layers
    block_size: int
    target_layer_ids: list[int]  # output-of-layer convention (module docstring)
    num_target_layers: int  # the target's depth
    mask_token_id: int | None
    learned_mask: bool  # True: mask slots use the drafter's own `mask_embedding`
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    target_name_or_path: str = ""
    target_architectures: list[str] = field(default_factory=list)
    target_model_type: str = ""
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    method: str = METHOD
    # what a bad value raises; a method built on this config (DSpark) names its own, and `method` its recipe section
    error: ClassVar[type[ValueError]] = DflashConfigError

    def __post_init__(self) -> None:
        key = self.method
        try:
            check_layer_ids(self.target_layer_ids, "target_layer_ids", self.num_target_layers, "output")
        except ValueError as e:
            raise self.error(str(e)) from None
        if self.block_size < 2:
            raise self.error(f"{key}.block_size {self.block_size}: a block needs the anchor and >= 1 mask")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise self.error(
                f"{key}.mask_token_id {self.mask_token_id}: outside the target vocabulary 0..{self.vocab_size - 1}"
            )
        if not self.learned_mask and self.mask_token_id is None:
            raise self.error(f"{key}: mask slots need {key}.mask_token_id or a learned mask embedding")

    @property
    def aux_layer_ids(self) -> list[int]:
        """Capture ids (DESIGN.md §3) of the target features: output of layer i = capture id i + 1."""
        return capture_from_output(self.target_layer_ids)

    @classmethod
    def from_target(
        cls,
        target: PretrainedConfig,
        num_layers: int = 5,
        block_size: int = 16,
        target_layer_ids: list[int] | None = None,
        num_features: int = 5,
        mask_token_id: int | None = None,
        learned_mask: bool = False,
        target_name_or_path: str = "",
        **extra: Any,
    ) -> "DflashDrafterConfig":
        """Draft layers shaped like the target's decoder layers, in the Qwen3 layout (q/k norm, no biases);
        `extra`: the fields of a config built on this one (DSpark's heads)."""
        depth = target.num_hidden_layers
        ids = (list(target_layer_ids) if target_layer_ids is not None
               else default_target_layer_ids(depth, num_features, cls.method, cls.error))
        heads = target.num_attention_heads
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(target, "num_key_value_heads", None) or heads,
            head_dim=getattr(target, "head_dim", None) or target.hidden_size // heads,
            vocab_size=target.vocab_size,
            num_hidden_layers=num_layers,
            block_size=block_size,
            target_layer_ids=ids,
            num_target_layers=depth,
            mask_token_id=mask_token_id,
            learned_mask=learned_mask,
            rms_norm_eps=getattr(target, "rms_norm_eps", 1e-6),
            max_position_embeddings=getattr(target, "max_position_embeddings", 4096),
            rope_parameters=rope_parameters_of(target),
            **target_provenance(target, target_name_or_path),
            **extra,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DflashDrafterConfig":
        return config_from_dict(cls, d, "DFlash", METHOD, cls.error)

    def llama_config(self) -> LlamaConfig:
        """A `LlamaConfig` for the transformers building blocks (RoPE, gated MLP) the draft layers reuse."""
        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            num_hidden_layers=self.num_hidden_layers,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            hidden_act="silu",
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=dict(self.rope_parameters),
        )
