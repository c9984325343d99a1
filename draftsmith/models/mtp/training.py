"""What the trainer needs from MTP: build the drafter (from native weights when the target has them) and its loss."""

from __future__ import annotations

import torch

from draftsmith import distributed
from draftsmith.kernels.fused_head_loss import resolve_backend as resolve_loss_kernel
from draftsmith.models.flops import target_forward_flops, with_total
from draftsmith.models.mtp.config import MtpDrafterConfig
from draftsmith.models.mtp.loss import mtp_loss
from draftsmith.models.mtp.model import MtpDrafter
from draftsmith.models.mtp.native import NativeMtp, find_native_mtp
from draftsmith.models.target import TargetModel


def mtp_flops_per_token(target_config, num_depths: int, seq_len: int, attention: str = "causal",
                        loss_share: float = 1.0) -> dict[str, float]:
    """FLOP per token of online MTP training with `num_depths` depths over sequences of `seq_len`, by term
    (models/flops.py), and their total: D depths, each one module over every position.

        target_forward   every decoder layer of the target
        teacher_head     the target's head at the positions under the loss, once (depth d's teacher is position
                         i+d's distribution)
        drafter          per depth: eh_proj (2H -> H) and one decoder layer of the target's shape, forward and
                         backward; the frozen head at the positions under that depth's loss, forward and input
                         gradient

    Depth d's head reads the seq_len - 1 - d positions whose t_{i+1+d} exists, times `loss_share`, the share of
    them under the loss (1: the whole sequence), and so does its teacher. The block is counted as one of the
    target's own (Llama-style) decoder layers."""
    h, v = target_config.hidden_size, target_config.vocab_size
    block = target_forward_flops(target_config, seq_len, attention) / target_config.num_hidden_layers
    eh_proj = 2 * 2 * h * h
    heads = loss_share * sum(max(0, seq_len - 1 - d) for d in range(1, num_depths + 1)) / seq_len  # rows a token
    return with_total({"target_forward": target_forward_flops(target_config, seq_len, attention),
                       "teacher_head": loss_share * 2.0 * h * v,
                       "drafter_forward_backward": 3.0 * num_depths * (eh_proj + block) + 2.0 * heads * 2 * h * v})


class MtpMethod:
    name = "mtp"

    def __init__(self, recipe, target: TargetModel):
        self.target = target
        self.count_mean = None  # unused: the loss is normalised per process (TrainingMethod)
        mtp = recipe.mtp
        self.num_depths = mtp.num_depths
        self.decay = mtp.depth_decay
        self.loss_chunk_size = recipe.training.loss_chunk_size  # None: chosen by the head's size
        self.loss_grad = recipe.training.loss_grad
        # auto: the kernel, measured for MTP (kernels_h200/, call 6: 1.20x at 16 x 2048, 0.96x peak memory)
        self.loss_kernel = resolve_loss_kernel(recipe.training.loss_kernel, target.device, self.loss_grad,
                                               measured=True)
        # MTP reads the target's last hidden state after its final norm (model.py), no aux layer; id L (that state
        # before the norm) is what the runtime captures and normalises itself (proposer.py).
        self.aux_layer_ids = [target.num_layers]
        self.draft_vocab_size = None  # MTP reads out with the target's whole head
        self.notes: list[str] = []
        self.native: NativeMtp | None = find_native_mtp(recipe.model.target, target.config)
        layout = self.native.layout if self.native is not None else None
        if self.native is not None and mtp.init_from_native and self.native.num_modules != mtp.num_modules:
            raise ValueError(
                f"{recipe.model.target}: the target carries {self.native.num_modules} native MTP module(s) but "
                f"mtp.num_modules is {mtp.num_modules}: set mtp.num_modules={self.native.num_modules}, or "
                "mtp.init_from_native=false to train new modules"
            )
        self.config = MtpDrafterConfig.from_target(
            target.config, num_modules=mtp.num_modules, recursive=mtp.recursive, num_depths=mtp.num_depths,
            native_layout=layout, target_name_or_path=recipe.model.target,
        )
        self.init_from_native = self.native is not None and mtp.init_from_native

    def flops_per_token(self, seq_len: int, loss_share: float = 1.0) -> dict[str, float]:
        """FLOP per trained token at this sequence length, by term (mtp_flops_per_token), for the MFU log; the heads
        read only the `loss_share` of positions under the loss."""
        return mtp_flops_per_token(self.target.config, self.num_depths, seq_len, loss_share=loss_share)

    def build_drafter(self, d2t: torch.Tensor, t2d: torch.Tensor) -> MtpDrafter:
        """An fp32 drafter: native MTP weights when present, else freshly initialised modules (on the fixture,
        fresh modules learned faster than blocks copied from the target's last layer or its final norm).
        d2t / t2d are ignored: MTP predicts over the full vocabulary with the target's own head."""
        # the class it was built as (training.shard_target makes it an FSDP2 subclass)
        layer_cls = distributed.module_class(self.target.layers[self.config.block_layer_idx])
        drafter = MtpDrafter(self.config, layer_cls=layer_cls)
        if self.init_from_native:
            drafter.load_state_dict(self.native.drafter_state_dict(self.config.num_modules, drafter))
        return drafter.float().to(self.target.device)

    def apply_training_options(self, drafter: MtpDrafter) -> None:
        """None of the training options (attention kernels, recomputation, compilation) applies to MTP."""

    def loss(self, drafter, batch: dict[str, torch.Tensor], features):
        """batch: input_ids, attention_mask, loss_mask, each (B, S); features: the target's states (the trainer's
        FeatureSource). Returns (loss, metrics of 0-dim tensors)."""
        captured = features(batch["input_ids"], batch["attention_mask"], self.aux_layer_ids)
        with torch.no_grad():
            token_embeds = self.target.embed_tokens(batch["input_ids"])  # (B, S, H) frozen
        # h^0 = captured.last_hidden, after the final norm: what the engines hand MTP (and the teacher's input)
        depth_hidden = drafter(token_embeds, captured.last_hidden, self.num_depths)
        return mtp_loss(depth_hidden, captured.last_hidden, batch["loss_mask"], self.target.lm_head, self.decay,
                        self.loss_chunk_size, loss_grad=self.loss_grad, loss_kernel=self.loss_kernel)
