"""What the trainer needs from DSpark (models/spec.py TrainingMethod): build the drafter, compute its loss."""

from __future__ import annotations

import torch

from draftsmith.kernels.fused_head_loss import resolve_backend as resolve_loss_kernel
from draftsmith.models.dflash.config import spare_token_id
from draftsmith.models.dflash.loss import sample_anchors
from draftsmith.models.dflash.model import init_drafter
from draftsmith.models.dflash.training import BlockOptions, apply_training_options
from draftsmith.models.dflash.training import dflash_flops_per_token
from draftsmith.models.dspark.config import DsparkDrafterConfig
from draftsmith.models.dspark.loss import block_targets, dspark_loss
from draftsmith.models.dspark.model import DsparkDrafter, init_heads
from draftsmith.models.dspark.section import DsparkConfigError
from draftsmith.models.flops import target_head_flops, with_total
from draftsmith.models.target import TargetModel, load_target_tokenizer


def dspark_flops_per_token(target_config, drafter_config, seq_len: int, anchors: int,
                           attention: str = "causal") -> dict[str, float]:
    """DFlash's count (every one of the B_k slots predicts, not B_k - 1) plus, per slot, the target's head on the
    teacher state and, forward and backward, the Markov head's rank-r product over the (draft) vocabulary; a pruned
    vocabulary reads the drafts out through the draft head of V_d rows."""
    d = drafter_config
    terms = dflash_flops_per_token(target_config, d, seq_len, anchors, attention)
    slots = anchors * d.block_size / seq_len
    extra_slots = anchors / seq_len  # DFlash counts B_k - 1 slots a block
    head = 2 * d.hidden_size * d.head_size  # the draft head: the target's whole one unless the vocabulary is pruned
    markov = 2 * d.markov_rank * d.head_size
    if d.pruned:  # DFlash counted its B_k - 1 slots through the target's whole head, not the draft head
        dropped = 2 * d.hidden_size * (d.vocab_size - d.head_size)
        terms["drafter_forward_backward"] -= 2.0 * (slots - extra_slots) * dropped
    terms["teacher_head"] = target_head_flops(target_config) * slots
    terms["drafter_forward_backward"] += 2.0 * extra_slots * head + 3.0 * slots * markov
    return with_total(terms)


class DsparkMethod:
    name = "dspark"

    def __init__(self, recipe, target: TargetModel):
        section = recipe.dspark
        self.target = target
        self.count_mean = None  # unused: the loss is normalised per process (TrainingMethod)
        mask_id = section.mask_token_id
        if mask_id is None:
            tokenizer = load_target_tokenizer(recipe.model.target, "model.target", DsparkConfigError)
            mask_id = spare_token_id(tokenizer, target.vocab_size)
            if mask_id is None:
                raise DsparkConfigError(f"{recipe.model.target}: the tokenizer uses every token id and has no "
                                        "reserved or pad token to mark mask slots with: set dspark.mask_token_id")
            self.notes = [f"dspark: mask slots take the target's embedding row of spare token id {mask_id} "
                          "(dspark.mask_token_id null)"]
        else:
            self.notes = [f"dspark: mask slots take the target's embedding row of token {mask_id}"]
        self.config = DsparkDrafterConfig.from_target(
            target.config, num_layers=section.num_layers, block_size=section.block_size,
            target_layer_ids=section.target_layer_ids, num_features=section.num_target_layers,
            mask_token_id=mask_id, target_name_or_path=recipe.model.target, markov_rank=section.markov_rank,
            markov_head=section.markov_head, confidence_head=section.confidence_head,
            draft_vocab_size=recipe.model.draft_vocab_size,
        )
        # the trainer builds the draft vocabulary of this size (None: the target's whole vocabulary, no maps)
        self.draft_vocab_size = self.config.draft_vocab_size
        self.aux_layer_ids = self.config.aux_layer_ids
        self.num_anchors = section.anchors_per_sequence
        self.training_options = BlockOptions.from_recipe(recipe, section, target.device, self.config.head_dim)
        self.loss_options = dict(ce_weight=section.ce_weight, l1_weight=section.l1_weight,
                                 confidence_weight=section.confidence_weight if section.confidence_head else 0.0,
                                 gamma=section.loss_gamma, chunk_size=recipe.training.loss_chunk_size,
                                 loss_grad=recipe.training.loss_grad)
        # the kernel reads out over the whole vocabulary: a pruned one stays on the plain-torch chunks. auto takes it,
        # measured for DSpark (kernels_h200/, call 7: 1.26x the tokens/s at the 8B shape at 16 x 2048 with the same
        # peak memory, 1.71x at the fixture's shape with 0.80x the memory, the same losses)
        self.loss_kernel = "reference"
        if self.config.pruned:
            if recipe.training.loss_kernel == "fused":
                raise DsparkConfigError("training.loss_kernel=fused: DSpark's kernel reads drafts out over the whole "
                                        "vocabulary; with model.draft_vocab_size set use training.loss_kernel="
                                        "reference or auto")
        else:
            self.loss_kernel = resolve_loss_kernel(recipe.training.loss_kernel, target.device,
                                                   recipe.training.loss_grad, measured=True)

    def flops_per_token(self, seq_len: int, loss_share: float = 1.0) -> dict[str, float]:
        """FLOP per trained token at this length, by term (dspark_flops_per_token); blocks anchor only inside the
        answers, `loss_share` of the positions."""
        anchors = min(self.num_anchors, max(1, round((seq_len - 1) * loss_share)))
        return dspark_flops_per_token(self.target.config, self.config, seq_len, anchors)

    def build_drafter(self, d2t: torch.Tensor, t2d: torch.Tensor) -> DsparkDrafter:
        """An fp32 drafter (master weights). With the whole vocabulary d2t/t2d are unused (it reads out with the
        target's head); with a pruned one they are the drafter's, its frozen head the target's rows of them."""
        drafter = DsparkDrafter(self.config).to(self.target.device)
        init_drafter(drafter, self.target.embed_tokens.weight)
        init_heads(drafter)
        if self.config.pruned:
            drafter.set_draft_vocab(d2t.to(self.target.device), t2d.to(self.target.device),
                                    self.target.lm_head.weight.float())
        return drafter

    def apply_training_options(self, drafter: DsparkDrafter) -> None:
        """training.block_attention and dspark.checkpoint_layers, on a built drafter (DFlash's)."""
        apply_training_options(drafter, self.training_options)

    def loss(self, drafter, batch: dict[str, torch.Tensor], features):
        """batch: input_ids, attention_mask, loss_mask, each (B, S); features: the target's states (the trainer's
        FeatureSource). Returns (loss, metrics of 0-dim tensors)."""
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        captured = features(input_ids, batch["attention_mask"], self.aux_layer_ids)
        anchors, block_valid = sample_anchors(loss_mask, self.num_anchors, anchor_in_mask=True)  # (B, N)
        with torch.no_grad():
            embed = self.target.embed_tokens
            anchor_embeds = embed(input_ids.gather(1, anchors))  # (B, N, H) frozen
            mask_embed = embed.weight[self.config.mask_token_id]
        hidden = drafter(captured.aux_hidden, anchor_embeds, anchors, mask_embed)  # (B, N, B_k, H)
        labels, prev_ids, teacher_at, valid = block_targets(input_ids, loss_mask, anchors, block_valid,
                                                            self.config.block_size)
        b, s, h = captured.last_hidden.shape
        rows = teacher_at + torch.arange(b, device=teacher_at.device)[:, None, None] * s
        teacher_hidden = captured.last_hidden.reshape(b * s, h)[rows[valid]]  # (M, H)
        model = getattr(drafter, "module", drafter)
        if model.lm_head is None:
            return dspark_loss(hidden, self.target.lm_head.weight, model.markov_head, model.confidence_head, labels,
                               prev_ids, valid, teacher_hidden, loss_kernel=self.loss_kernel, **self.loss_options)
        # a pruned vocabulary: the drafter's head over its draft ids, the target's whole head for the teacher
        return dspark_loss(hidden, model.lm_head.weight, model.markov_head, model.confidence_head,
                           model.target_to_draft(labels), prev_ids, valid, teacher_hidden,
                           teacher_head_weight=self.target.lm_head.weight, draft_ids=model.draft_ids(),
                           **self.loss_options)
