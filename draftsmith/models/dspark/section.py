"""DSpark's recipe section (`dspark:`) and its rules on a recipe.

Defaults are DeepSpec's (`config/dspark/dspark_qwen3_8b.py`): blocks of 7, 5 draft layers over 5 target layers,
512 anchors a sequence, a vanilla Markov head of rank 256, a confidence head that sees the Markov embedding, and
the loss 0.1 CE + 0.9 L1 + 1.0 BCE with slot weights exp(-k / 4) (models/dspark/loss.py). Target layers are
output-of-layer ids, as DFlash's (models/dflash/section.py), whose rules DSpark shares.

`model.draft_vocab_size` (null by default: the target's whole vocabulary, read out with its own head) prunes the
draft vocabulary to the most frequent answer tokens, as EAGLE-3's: vLLM serves such a drafter (its reduced-vocabulary
Qwen3DSparkForCausalLM), SGLang does not (it always reads out with the target's whole head).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, model_validator

from draftsmith.models.dflash.section import check_block_recipe, check_target_layers
from draftsmith.models.spec import Section


class DsparkConfigError(ValueError):
    """A DSpark setting that cannot work with this target or drafter; the message says which key to change."""


class DsparkSection(Section):
    """The `dspark:` section, read only when model.method is dspark."""

    num_layers: int = Field(5, ge=1)  # draft decoder layers
    # Slots per block: the anchor and block_size - 1 masks, each predicting the token after its own position, so a
    # block drafts up to block_size tokens ("sample from anchor", as DeepSpec, vLLM and SGLang run it).
    block_size: int = Field(7, ge=2)
    num_target_layers: int = Field(5, ge=1)  # how many target layers' features are fused (not the target's depth)
    target_layer_ids: list[int] | None = None  # output-of-layer ids; None = spread from layer 1 to L-3 (DFlash's)
    # The token whose (frozen) embedding row fills the mask slots, as the engines feed it; None = a token id the
    # tokenizer never produces (an unused embedding row, a reserved special token), found at training start.
    mask_token_id: int | None = Field(None, ge=0)
    anchors_per_sequence: int = Field(512, ge=1)
    markov_rank: int = Field(256, ge=1)  # r of the Markov head's W1 (vocab -> r) and W2 (r -> vocab)
    # vanilla: bias = W2 W1[x_{k-1}] (what vLLM serves); gated: bias = W2 (g * W1[x_{k-1}]),
    # g = sigmoid(G [h_k; W1[x_{k-1}]]) (SGLang serves it, vLLM does not)
    markov_head: Literal["vanilla", "gated"] = "vanilla"
    confidence_head: bool = True  # sigmoid(w [h_k; W1[x_{k-1}]]) per slot, trained to predict acceptance
    ce_weight: float = Field(0.1, ge=0)  # cross-entropy to the data token
    l1_weight: float = Field(0.9, ge=0)  # ||p_draft - p_target||_1 (twice the total variation)
    confidence_weight: float = Field(1.0, ge=0)  # BCE of the confidence head against 1 - ||.||_1 / 2 (detached)
    loss_gamma: float = Field(4.0, gt=0)  # slot k (0-based) weighs exp(-k / gamma)
    checkpoint_layers: bool = False  # recompute each draft layer in the backward pass (long contexts, big batches)

    @model_validator(mode="after")
    def _check(self) -> DsparkSection:
        check_target_layers(self, "dspark")
        if self.confidence_weight > 0 and not self.confidence_head:
            raise ValueError("dspark.confidence_weight trains the confidence head, which dspark.confidence_head "
                             "false leaves out: set dspark.confidence_weight=0 or dspark.confidence_head=true")
        if self.ce_weight + self.l1_weight == 0:
            raise ValueError("dspark.ce_weight and dspark.l1_weight are both 0: the drafter would learn nothing; "
                             "set at least one above 0 (DeepSpec: 0.1 and 0.9)")
        return self


def check_recipe(recipe: Any, target: Mapping[str, Any] | None) -> None:
    """DFlash's block rules, and with the target's config a model.draft_vocab_size inside its vocabulary (null,
    the default, reads out over the whole of it)."""
    check_block_recipe(recipe, target, "dspark", DsparkConfigError)
    vocab = target.get("vocab_size") if target else None
    size = recipe.model.draft_vocab_size
    if isinstance(vocab, int) and size is not None and size > vocab:
        raise ValueError(f"model.draft_vocab_size ({size}) exceeds the target vocabulary ({vocab}): set "
                         f"model.draft_vocab_size < {vocab} to prune DSpark's draft vocabulary (served by vLLM only), "
                         "or null for the whole vocabulary")
