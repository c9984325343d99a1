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

Draft vocabulary (`draft_vocab_size`, vLLM's reduced-vocabulary DSpark): None, the default, reads the drafts out
with the target's whole frozen head over its `vocab_size` tokens. A smaller size gives the drafter a frozen
`lm_head` (draft_vocab_size, H) of the target's head rows of the selected ids, `d2t` (draft id i -> target id
i + d2t[i]) and `t2d` as EAGLE-3 has them, and a Markov W2 over the draft ids; W1 stays over the target's vocabulary
(it embeds the previous token, a target id). A size equal to the target's is the whole vocabulary (None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from transformers import PretrainedConfig

from draftsmith.models.dflash.config import DflashDrafterConfig
from draftsmith.models.drafter_config import config_from_dict
from draftsmith.models.dspark.section import DsparkConfigError

METHOD = "dspark"
SLOT_CONVENTION = "sample_from_anchor"  # slot k predicts the token after position a + k (module docstring)
MARKOV_HEADS = ("vanilla", "gated")


@dataclass
class DsparkDrafterConfig(DflashDrafterConfig):
    markov_rank: int = 256
    markov_head: str = "vanilla"  # MARKOV_HEADS
    confidence_head: bool = True  # a confidence head over [h_k; W1[x_{k-1}]] (confidence_head_with_markov)
    draft_vocab_size: int | None = None  # None: the target's whole vocabulary (module docstring)
    method: str = METHOD
    error: ClassVar[type[ValueError]] = DsparkConfigError  # what the backbone's checks raise too

    def __post_init__(self) -> None:
        if self.learned_mask or self.mask_token_id is None:
            raise DsparkConfigError("dspark: mask slots take the target's embedding row of mask_token_id (a learned "
                                    "mask embedding is DFlash's): set dspark.mask_token_id")
        super().__post_init__()
        if self.markov_head not in MARKOV_HEADS:
            raise DsparkConfigError(f"dspark.markov_head {self.markov_head!r}: one of {', '.join(MARKOV_HEADS)}")
        if self.markov_rank < 1:
            raise DsparkConfigError(f"dspark.markov_rank {self.markov_rank}: must be >= 1")
        if self.draft_vocab_size is not None:
            if isinstance(self.draft_vocab_size, bool) or not isinstance(self.draft_vocab_size, int) \
                    or not 0 < self.draft_vocab_size <= self.vocab_size:
                raise DsparkConfigError(f"model.draft_vocab_size {self.draft_vocab_size!r}: must be an integer in "
                                        f"1..{self.vocab_size} (the target's vocabulary), or null for all of it")
            if self.draft_vocab_size == self.vocab_size:
                self.draft_vocab_size = None  # the whole vocabulary: the target's head, no maps

    @property
    def pruned(self) -> bool:
        """A draft vocabulary smaller than the target's: the drafter holds its own head rows and d2t / t2d."""
        return self.draft_vocab_size is not None

    @property
    def head_size(self) -> int:
        """Outputs of the draft head and of the Markov W2: the draft vocabulary's size."""
        return self.draft_vocab_size or self.vocab_size

    @classmethod
    def from_target(cls, target: PretrainedConfig, *, markov_rank: int = 256, markov_head: str = "vanilla",
                    confidence_head: bool = True, draft_vocab_size: int | None = None,
                    **backbone: Any) -> "DsparkDrafterConfig":
        """Draft layers shaped like the target's (DflashDrafterConfig.from_target's keywords) plus the heads."""
        return super().from_target(target, learned_mask=False, markov_rank=markov_rank, markov_head=markov_head,
                                   confidence_head=confidence_head, draft_vocab_size=draft_vocab_size, **backbone)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DsparkDrafterConfig":
        return config_from_dict(cls, d, "DSpark", METHOD, DsparkConfigError)
