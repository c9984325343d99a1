"""What the trainer needs from DFlash: build the drafter, compute its loss from captured target states."""

from __future__ import annotations

import torch

from draftsmith.kernels.fused_head_loss import resolve_backend as resolve_loss_kernel
from draftsmith.kernels.ttt_attention import resolve_backend
from draftsmith.models.dflash.config import DflashDrafterConfig, spare_token_id
from draftsmith.models.dflash.section import default_loss_gamma
from draftsmith.models.dflash.loss import block_labels, dflash_loss, sample_anchors, teacher_argmax, teacher_rows
from draftsmith.models.dflash.model import DflashDrafter, init_drafter
from draftsmith.models.target import TargetModel
from draftsmith.train.flops import dflash_flops_per_token


def _engine_mask_token_id(target_path: str, vocab_size: int) -> int | None:
    """The spare token id engines will mark mask slots with (config.spare_token_id), or None."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(target_path)
    except (OSError, ValueError):
        return None
    return spare_token_id(tokenizer, vocab_size)


class DflashMethod:
    name = "dflash"

    def __init__(self, recipe, target: TargetModel):
        section = recipe.dflash
        self.target = target
        self.count_mean = None  # unused: the loss is normalised per process (TrainingMethod)
        learned = section.mask_token_id is None
        mask_id = section.mask_token_id if not learned else _engine_mask_token_id(recipe.model.target,
                                                                                 target.vocab_size)
        self.config = DflashDrafterConfig.from_target(
            target.config, num_layers=section.num_layers, block_size=section.block_size,
            target_layer_ids=section.target_layer_ids, num_features=section.num_target_layers,
            mask_token_id=mask_id, learned_mask=learned, target_name_or_path=recipe.model.target,
        )
        self.aux_layer_ids = self.config.aux_layer_ids
        self.draft_vocab_size = None  # read out with the target's whole head
        if learned:
            where = (f"engines substitute it at spare token id {mask_id}" if mask_id is not None
                     else "the target has no spare token id, so engines need the mask_embedding file")
            self.notes = [f"dflash: mask slots use a learned mask embedding ({where})"]
        else:
            self.notes = [f"dflash: mask slots use the target's frozen embedding row of token {mask_id}"]
        self.num_anchors = section.anchors_per_sequence
        self.checkpoint_layers = section.checkpoint_layers
        self.attention = resolve_backend(recipe.training.block_attention, target.device, self.config.head_dim,
                                         key="training.block_attention")
        self.loss_chunk_size = recipe.training.loss_chunk_size  # None: chosen by the head's size
        self.loss_grad = recipe.training.loss_grad
        # auto: the kernel, measured for DFlash (kernels_h200/, call 6: 1.04x at 16 x 2048, same peak memory)
        self.loss_kernel = resolve_loss_kernel(recipe.training.loss_kernel, target.device, self.loss_grad,
                                               measured=True)
        self.soft_targets = section.loss == "soft_ce"
        self.gamma = section.loss_gamma if section.loss_gamma is not None else default_loss_gamma(section.block_size)

    def flops_per_token(self, seq_len: int, loss_share: float = 1.0) -> dict[str, float]:
        """FLOP per trained token at this sequence length, by term (train/flops.py), for the MFU log. Blocks anchor
        only where the next token is under the loss: `loss_share` of the positions (the trainer's data)."""
        anchors = min(self.num_anchors, max(1, round((seq_len - 1) * loss_share)))
        return dflash_flops_per_token(self.target.config, self.config, seq_len, anchors)

    def build_drafter(self, d2t: torch.Tensor, t2d: torch.Tensor) -> DflashDrafter:
        """An fp32 drafter (master weights). d2t/t2d are unused: DFlash reads out with the target's full head."""
        drafter = DflashDrafter(self.config).to(self.target.device)
        drafter.checkpoint_layers = self.checkpoint_layers
        drafter.attention = self.attention
        init_drafter(drafter, self.target.embed_tokens.weight)
        return drafter

    def loss(self, drafter, batch: dict[str, torch.Tensor]):
        """batch: input_ids, attention_mask, loss_mask, each (B, S). Returns (loss, metrics of 0-dim tensors)."""
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        captured = self.target.capture(input_ids, batch["attention_mask"], self.aux_layer_ids)
        teacher = teacher_argmax(captured.last_hidden, self.target.lm_head)  # (B, S)
        anchors, block_valid = sample_anchors(loss_mask, self.num_anchors)  # (B, N)
        with torch.no_grad():
            embed = self.target.embed_tokens
            anchor_embeds = embed(input_ids.gather(1, anchors))  # (B, N, H) frozen
            mask_embed = None if self.config.learned_mask else embed.weight[self.config.mask_token_id]
        hidden = drafter(captured.aux_hidden, anchor_embeds, anchors, mask_embed)  # (B, N, B_k, H)
        labels, valid = block_labels(teacher, loss_mask, anchors, block_valid, self.config.block_size)
        soft = (teacher_rows(captured.last_hidden, anchors, valid, self.config.block_size)
                if self.soft_targets else None)
        return dflash_loss(hidden, self.target.lm_head.weight, labels, valid, self.gamma, soft, self.loss_chunk_size,
                           loss_grad=self.loss_grad, loss_kernel=self.loss_kernel)
