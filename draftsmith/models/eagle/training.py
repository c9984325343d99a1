"""What the trainer needs from EAGLE-1 (models/spec.py TrainingMethod): build the drafter, compute its loss from the
target's final-normed last hidden state."""

from __future__ import annotations

import torch

from draftsmith.kernels.fused_head_loss import resolve_backend as resolve_loss_kernel
from draftsmith.models.eagle.config import EagleConfig
from draftsmith.models.eagle.loss import eagle_loss
from draftsmith.models.eagle.model import EagleDrafter
from draftsmith.models.target import TargetModel
from draftsmith.train.flops import mtp_flops_per_token


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
        """FLOP per trained token (train/flops.py): one MTP depth's count, which is EAGLE-1's (fc 2H -> H, one
        decoder layer of the target's shape, the frozen head and its teacher at the rows under the loss, whose
        x_{t+2} exists); the smooth-L1 term is elementwise."""
        return mtp_flops_per_token(self.target.config, 1, seq_len, loss_share=loss_share)

    def build_drafter(self, d2t: torch.Tensor, t2d: torch.Tensor) -> EagleDrafter:
        """An fp32 drafter on the target's device, PyTorch's default initialisation (as the reference's). d2t / t2d
        are unused: EAGLE-1 reads out with the target's whole head."""
        return EagleDrafter(self.config).to(self.target.device)

    def loss(self, drafter, batch: dict[str, torch.Tensor]):
        """batch: input_ids, attention_mask, loss_mask, each (B, S). Returns (loss, metrics of 0-dim tensors)."""
        captured = self.target.capture(batch["input_ids"], batch["attention_mask"], self.aux_layer_ids)
        hidden = captured.last_hidden  # (B, S, H) h_t, final-normed
        if self.noise:
            hidden = hidden + (torch.rand_like(hidden) - 0.5) * self.noise
        with torch.no_grad():
            token_embeds = self.target.embed_tokens(batch["input_ids"])  # (B, S, H) frozen
        out = drafter(hidden, token_embeds)  # (B, S, H) o_t
        return eagle_loss(out, captured.last_hidden, batch["loss_mask"], self.target.lm_head, **self.loss_options)
