"""DSpark drafter configuration: DFlash's block backbone (models/dflash/config.py) plus the Markov and confidence
heads, saved as the `config.json` of a draftsmith checkpoint (with `"method": "dspark"`).

Slot convention ("sample from anchor", DeepSpec's, the one vLLM and SGLang run): a block of B slots is
[anchor, mask x (B-1)] at positions a .. a+B-1, slot k predicting the token at a+k+1, so B slots draft B tokens:

    slot          0          1          2        ...  B-1
    position      a          a+1        a+2           a+B-1
    input         x_a        MASK       MASK          MASK
    predicts      x_a+1      x_a+2      x_a+3         x_a+B
    Markov prev   x_a        x_a+1      x_a+2         x_a+B-1     (the drafted tokens at run time)

Mask slots are embedded by the target's frozen row of `mask_token_id` (never learned: SGLang always embeds with
the target's own embedding). Target layers are output-of-layer ids, as DFlash's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PretrainedConfig

from draftsmith.models.dflash.config import DflashDrafterConfig
from draftsmith.models.dflash.section import DflashConfigError
from draftsmith.models.drafter_config import config_from_dict

METHOD = "dspark"
SLOT_CONVENTION = "sample_from_anchor"  # slot k predicts the token after position a + k (module docstring)
MARKOV_HEADS = ("vanilla", "gated")


@dataclass
class DsparkDrafterConfig(DflashDrafterConfig):
    markov_rank: int = 256
    markov_head: str = "vanilla"  # MARKOV_HEADS
    confidence_head: bool = True  # a confidence head over [h_k; W1[x_{k-1}]] (confidence_head_with_markov)
    method: str = METHOD

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.learned_mask or self.mask_token_id is None:
            raise DflashConfigError("dspark: mask slots take the target's embedding row of mask_token_id (a learned "
                                    "mask embedding is DFlash's): set dspark.mask_token_id")
        if self.markov_head not in MARKOV_HEADS:
            raise DflashConfigError(f"dspark.markov_head {self.markov_head!r}: one of {', '.join(MARKOV_HEADS)}")
        if self.markov_rank < 1:
            raise DflashConfigError(f"dspark.markov_rank {self.markov_rank}: must be >= 1")

    @classmethod
    def from_target(cls, target: PretrainedConfig, *, markov_rank: int = 256, markov_head: str = "vanilla",
                    confidence_head: bool = True, **backbone: Any) -> "DsparkDrafterConfig":
        """Draft layers shaped like the target's (DflashDrafterConfig.from_target's keywords) plus the heads."""
        base = DflashDrafterConfig.from_target(target, learned_mask=False, **backbone)
        fields = {k: v for k, v in base.to_dict().items() if k != "method"}
        return cls(**fields, markov_rank=markov_rank, markov_head=markov_head, confidence_head=confidence_head)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DsparkDrafterConfig":
        return config_from_dict(cls, d, "DSpark", METHOD, DflashConfigError)
