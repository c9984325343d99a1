"""What the trainer needs from DFlash: build the drafter, compute its loss from captured target states."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from draftsmith.kernels.fused_head_loss import resolve_backend as resolve_loss_kernel
from draftsmith.kernels.ttt_attention import resolve_backend
from draftsmith.models.dflash.config import DflashDrafterConfig, spare_token_id
from draftsmith.models.dflash.section import default_loss_gamma
from draftsmith.models.dflash.loss import block_labels, dflash_loss, sample_anchors, teacher_argmax, teacher_rows
from draftsmith.models.dflash.model import DflashDrafter, init_drafter, training_attention, training_layer
from draftsmith.models.flops import target_forward_flops, target_head_flops, with_total
from draftsmith.models.target import TargetModel


def dflash_flops_per_token(target_config, drafter_config, seq_len: int, anchors: int,
                           attention: str = "causal") -> dict[str, float]:
    """FLOP per context token of online DFlash training with `anchors` blocks a sequence of `seq_len` (every block
    whole inside the sequence and under the loss), by term (models/flops.py), and their total. N anchors a
    sequence, each a block of B_k slots: N*B_k block tokens per S context tokens, and N*(B_k-1) slots read out by
    the target's frozen head.

        target_forward   every decoder layer of the target
        teacher_head     the target's head at every position (the argmax labels)
        drafter          fc and each layer's context K/V once per context token; each layer's projections, MLP and
                         attention (context before the anchor, about S/2 keys, plus the block's B_k) per block
                         token, forward and backward; the head per slot, forward and the gradient of its input (it
                         is frozen)

    attention="full" counts what the masked fused attention multiplies: every query against all S + N*B_k keys."""
    d = drafter_config
    h, heads, head_dim = d.hidden_size, d.num_attention_heads, d.head_dim
    kv = d.num_key_value_heads * head_dim
    bk = d.block_size
    block_tokens = anchors * bk / seq_len  # per context token
    slots = anchors * (bk - 1) / seq_len
    fc = 2 * len(d.target_layer_ids) * h * h
    context_kv = 2 * 2 * h * kv
    block_linear = 2 * (h * heads * head_dim + 2 * h * kv + heads * head_dim * h + 3 * h * d.intermediate_size)
    keys = seq_len + anchors * bk if attention == "full" else seq_len / 2 + bk
    block_attention = 2 * 2 * heads * head_dim * keys
    head = 2 * h * d.vocab_size
    layers = d.num_hidden_layers * (context_kv + block_tokens * (block_linear + block_attention))
    return with_total({"target_forward": target_forward_flops(target_config, seq_len, attention),
                       "teacher_head": target_head_flops(target_config),
                       "drafter_forward_backward": 2.0 * fc + 3.0 * layers + 2.0 * slots * head})


def _engine_mask_token_id(target_path: str, vocab_size: int) -> int | None:
    """The spare token id engines will mark mask slots with (config.spare_token_id), or None."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(target_path)
    except (OSError, ValueError):
        return None
    return spare_token_id(tokenizer, vocab_size)


@dataclass(frozen=True)
class BlockOptions:
    """How DFlash's and DSpark's training forward computes: the recipe's training options, resolved for a device."""

    attention: str = "reference"  # training.block_attention resolved: "flex" or "reference" (kernels/block_attention)
    # <method>.checkpoint_layers: each draft layer recomputed in the backward pass. The memory of a training pass is
    # the layers' activations over N*B_k block tokens per sequence (512 anchors x 16 slots = 4x a 2,048-token
    # sequence), so this is what lets an 8B-shaped batch of 16 x 2,048 fit.
    recompute: bool = False

    @classmethod
    def from_recipe(cls, recipe, section, device, head_dim: int) -> BlockOptions:
        return cls(attention=resolve_backend(recipe.training.block_attention, device, head_dim,
                                             key="training.block_attention"),
                   recompute=section.checkpoint_layers)


class TrainingBlockKernels:
    """`DflashDrafter.block_kernels` as BlockOptions say (model.py PlainBlockKernels is the plain-torch default)."""

    def __init__(self, options: BlockOptions):
        self.options = options

    def attention(self, anchor_positions, context_length: int, block_size: int):
        return training_attention(self.options.attention, anchor_positions, context_length, block_size)

    def layer(self, *args):
        if self.options.recompute and torch.is_grad_enabled():
            return checkpoint(training_layer, *args, use_reentrant=False)
        return training_layer(*args)


def apply_training_options(drafter: DflashDrafter, options: BlockOptions) -> DflashDrafter:
    """The training options applied to a built DFlash or DSpark drafter, from outside and once (as torchtitan
    applies activation checkpointing): its block attention and recomputed layers. Returns the drafter."""
    drafter.block_kernels = TrainingBlockKernels(options)
    return drafter


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
        self.training_options = BlockOptions.from_recipe(recipe, section, target.device, self.config.head_dim)
        self.loss_chunk_size = recipe.training.loss_chunk_size  # None: chosen by the head's size
        self.loss_grad = recipe.training.loss_grad
        # auto: the kernel, measured for DFlash (kernels_h200/, call 6: 1.04x at 16 x 2048, same peak memory)
        self.loss_kernel = resolve_loss_kernel(recipe.training.loss_kernel, target.device, self.loss_grad,
                                               measured=True)
        self.soft_targets = section.loss == "soft_ce"
        self.gamma = section.loss_gamma if section.loss_gamma is not None else default_loss_gamma(section.block_size)

    def flops_per_token(self, seq_len: int, loss_share: float = 1.0) -> dict[str, float]:
        """FLOP per trained token at this sequence length, by term (dflash_flops_per_token), for the MFU log.
        Blocks anchor only where the next token is under the loss: `loss_share` of the positions (the trainer's
        data)."""
        anchors = min(self.num_anchors, max(1, round((seq_len - 1) * loss_share)))
        return dflash_flops_per_token(self.target.config, self.config, seq_len, anchors)

    def build_drafter(self, d2t: torch.Tensor, t2d: torch.Tensor) -> DflashDrafter:
        """An fp32 drafter (master weights). d2t/t2d are unused: DFlash reads out with the target's full head."""
        drafter = DflashDrafter(self.config).to(self.target.device)
        init_drafter(drafter, self.target.embed_tokens.weight)
        return drafter

    def apply_training_options(self, drafter: DflashDrafter) -> None:
        """training.block_attention and dflash.checkpoint_layers, on a built drafter."""
        apply_training_options(drafter, self.training_options)

    def loss(self, drafter, batch: dict[str, torch.Tensor], features):
        """batch: input_ids, attention_mask, loss_mask, each (B, S); features: the target's states (the trainer's
        FeatureSource). Returns (loss, metrics of 0-dim tensors)."""
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        captured = features(input_ids, batch["attention_mask"], self.aux_layer_ids)
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
