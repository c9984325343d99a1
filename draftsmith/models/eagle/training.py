"""What the trainer needs from EAGLE-1 (models/spec.py TrainingMethod): build the drafter, compute its loss from the
target's final-normed last hidden state."""

from __future__ import annotations

import torch

from draftsmith.kernels.fused_head_loss import resolve_backend as resolve_loss_kernel
from draftsmith.models.flops import target_forward_flops, with_total
from draftsmith.models.eagle.config import EagleConfig
from draftsmith.models.eagle.loss import eagle_loss
from draftsmith.models.eagle.model import EagleDrafter
from draftsmith.models.target import TargetModel


def eagle_flops_per_token(target_config, seq_len: int, attention: str = "causal",
                          loss_share: float = 1.0) -> dict[str, float]:
    """FLOP per trained token of online EAGLE-1 training, by term (models/flops.py), and their total (one MTP
    depth's count, which is EAGLE-1's):

        target_forward   every decoder layer of the target
        teacher_head     the target's head at the `loss_share` of positions under the loss
        drafter          fc (2H -> H) and one decoder layer of the target's shape, forward and backward; the frozen
                         head at the rows under the loss whose x_{t+2} exists, forward and input gradient (the
                         smooth-L1 term is elementwise)
    """
    h, v = target_config.hidden_size, target_config.vocab_size
    layer = target_forward_flops(target_config, seq_len, attention) / target_config.num_hidden_layers
    fc = 2 * 2 * h * h
    heads = loss_share * max(0, seq_len - 2) / seq_len  # head rows a token
    return with_total({"target_forward": target_forward_flops(target_config, seq_len, attention),
                       "teacher_head": loss_share * 2.0 * h * v,
                       "drafter_forward_backward": 3.0 * (fc + layer) + 2.0 * heads * 2 * h * v})


class EagleMethod:
    name = "eagle"

    def __init__(self, recipe, target: TargetModel):
        section = recipe.eagle
        self.target = target
        self.count_mean = None  # unused: the loss is normalised per process (TrainingMethod)
        self.draft_vocab_size = None  # EAGLE-1 reads out with the target's whole head
        self.config = EagleConfig.from_target(target.config, fc_bias=section.fc_bias,
                                              target_name_or_path=recipe.model.target)
        # What capture hooks: id L, the last layer's output; the loss reads `last_hidden`, the same state after the
        # target's final norm (model.py), as MTP does.
        self.aux_layer_ids = [target.num_layers]
        self.noise = section.hidden_noise
        # auto: the kernel, measured for EAGLE-1 (kernels_h200/, call 9: 1.10x at 16 x 2048 and 4 x 8192, 0.94x
        # peak memory)
        self.loss_options = dict(regression_weight=section.regression_weight, ce_weight=section.ce_weight,
                                 chunk_size=recipe.training.loss_chunk_size, loss_grad=recipe.training.loss_grad,
                                 loss_kernel=resolve_loss_kernel(recipe.training.loss_kernel, target.device,
                                                                 recipe.training.loss_grad, measured=True))
        self.notes = [f"eagle: loss {section.regression_weight:g} x smooth-L1 to the target's next hidden state + "
                      f"{section.ce_weight:g} x cross-entropy to its next-token distribution (the EAGLE reference's)"
                      + (f", hidden states read with uniform noise of width {self.noise:g}" if self.noise else "")]

    def flops_per_token(self, seq_len: int, loss_share: float = 1.0) -> dict[str, float]:
        """FLOP per trained token at this sequence length, by term (eagle_flops_per_token), for the MFU log."""
        return eagle_flops_per_token(self.target.config, seq_len, loss_share=loss_share)

    def build_drafter(self, d2t: torch.Tensor, t2d: torch.Tensor) -> EagleDrafter:
        """An fp32 drafter on the target's device, PyTorch's default initialisation (as the reference's). d2t / t2d
        are unused: EAGLE-1 reads out with the target's whole head."""
        return EagleDrafter(self.config).to(self.target.device)

    def apply_training_options(self, drafter: EagleDrafter) -> None:
        """None of the training options (attention kernels, recomputation, compilation) applies to EAGLE-1."""

    def loss(self, drafter, batch: dict[str, torch.Tensor], features):
        """batch: input_ids, attention_mask, loss_mask, each (B, S); features: the target's states (the trainer's
        FeatureSource). Returns (loss, metrics of 0-dim tensors)."""
        captured = features(batch["input_ids"], batch["attention_mask"], self.aux_layer_ids)
        hidden = captured.last_hidden  # (B, S, H) h_t, final-normed
        if self.noise:
            hidden = hidden + (torch.rand_like(hidden) - 0.5) * self.noise
        with torch.no_grad():
            token_embeds = self.target.embed_tokens(batch["input_ids"])  # (B, S, H) frozen
        out = drafter(hidden, token_embeds)  # (B, S, H) o_t
        return eagle_loss(out, captured.last_hidden, batch["loss_mask"], self.target.lm_head, **self.loss_options)
