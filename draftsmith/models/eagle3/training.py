"""What the trainer needs from EAGLE-3: build the drafter, compute its loss from captured target states."""

from __future__ import annotations

import os

import torch

from draftsmith import device as dev
from draftsmith.kernels.fused_head_loss import resolve_backend as resolve_loss_kernel
from draftsmith.kernels.ttt_attention import resolve_backend
from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.eagle3.loss import teacher_targets
from draftsmith.models.eagle3.model import Eagle3Drafter, init_drafter_from_target
from draftsmith.models.spec import draft_vocab_size_for
from draftsmith.models.target import TargetModel
from draftsmith.train.flops import eagle3_flops_per_token


class Eagle3Method:
    name = "eagle3"

    def __init__(self, recipe, target: TargetModel):
        self.target = target
        training = recipe.training
        self.ttt_steps = training.ttt_steps
        self.loss_options = dict(decay=training.ttt_decay, kind=training.loss, lk_eta=training.lk_eta,
                                 mask_outside_draft_vocab=training.mask_outside_draft_vocab,
                                 chunk_size=training.loss_chunk_size, loss_grad=training.loss_grad,
                                 # auto: the kernel, measured for EAGLE-3 (kernels_h200/, call 3)
                                 loss_kernel=resolve_loss_kernel(training.loss_kernel, target.device,
                                                                 training.loss_grad, measured=True))
        self.query_block = training.ttt_query_block
        self.count_mean = None  # data-parallel: the trainer sets the mean over processes (train.trainer)
        self.checkpoint_steps = training.checkpoint_ttt_steps
        self.compile_steps = (auto_compile(target.device) if training.compile_drafter == "auto"
                              else training.compile_drafter)
        self.train_head = training.train_draft_head
        variants = recipe.eagle3.variants()
        self.config = Eagle3Config.from_target(
            target.config, draft_vocab_size_for(recipe.model.draft_vocab_size, target.vocab_size), recipe.model.aux_layer_ids,
            target_name_or_path=recipe.model.target, **variants,
        )
        self.draft_vocab_size = self.config.draft_vocab_size
        on = [name for name, value in variants.items() if value]
        self.notes = [f"eagle3: {', '.join(on)} on (vLLM's speculators layout serves them, SGLang does not)"] if on \
            else []
        self.feature_noise = recipe.eagle3.feature_noise
        if self.feature_noise:
            self.notes.append(f"eagle3: target states read with uniform noise of width {self.feature_noise:g} x "
                              f"each aux layer's RMS")
        self.aux_layer_ids = self.config.aux_layer_ids
        self.ttt_attention = resolve_backend(training.ttt_attention, target.device, self.config.head_dim)

    def flops_per_token(self, seq_len: int, loss_share: float = 1.0) -> dict[str, float]:
        """FLOP per trained token at this sequence length, by term (train/flops.py), for the MFU log. The TTT steps
        and their head run at every position, so the share of positions under the loss does not change it."""
        return eagle3_flops_per_token(self.target.config, self.config, seq_len, self.ttt_steps)

    def build_drafter(self, d2t: torch.Tensor, t2d: torch.Tensor) -> Eagle3Drafter:
        """An fp32 drafter (master weights) with the draft vocab and the head started from the target's rows."""
        drafter = Eagle3Drafter(self.config).to(self.target.device)
        drafter.query_block = self.query_block
        drafter.ttt_attention = self.ttt_attention
        drafter.checkpoint_steps = self.checkpoint_steps
        if self.compile_steps:
            drafter.compile_steps()
        drafter.set_draft_vocab(d2t.to(self.target.device), t2d.to(self.target.device))
        init_drafter_from_target(drafter, self.target.lm_head.weight.float())
        drafter.lm_head.weight.requires_grad_(self.train_head)  # frozen: the target's rows, as speculators has it
        return drafter

    def loss(self, drafter, batch: dict[str, torch.Tensor]):
        """batch: input_ids, attention_mask, loss_mask, each (B, S). Returns (loss, metrics of 0-dim tensors)."""
        positions, docs = batch.get("position_ids"), batch.get("doc_ids")  # a packed row (trainer.collate_packed)
        captured = self.target.capture(batch["input_ids"], batch["attention_mask"], self.aux_layer_ids,
                                       position_ids=positions)
        model = _unwrap(drafter)
        draft_ids = torch.arange(model.d2t.numel(), device=model.d2t.device) + model.d2t  # ascending target ids
        teacher, in_draft = teacher_targets(captured.last_hidden, self.target.lm_head, model.t2d,
                                            draft_ids=draft_ids)
        with torch.no_grad():
            token_embeds = self.target.embed_tokens(batch["input_ids"])  # (B, S, H) frozen
        targets = dict(teacher_draft_logits=teacher, teacher_in_draft=in_draft, loss_mask=batch["loss_mask"],
                       count_mean=self.count_mean, **self.loss_options)
        aux = captured.aux_hidden
        if self.feature_noise:
            aux = with_relative_noise(aux, len(self.aux_layer_ids), self.feature_noise)
        return drafter(aux, token_embeds, self.ttt_steps, loss_targets=targets, position_ids=positions, doc_ids=docs)


def with_relative_noise(aux_hidden: torch.Tensor, num_layers: int, width: float) -> torch.Tensor:
    """aux_hidden (B, S, n*H), n layers' states side by side, plus U(-width/2, width/2) times each layer's RMS at
    each position (eagle3.feature_noise): the same relative disturbance for a quiet early layer and a loud late one."""
    states = aux_hidden.float().unflatten(-1, (num_layers, -1))  # (B, S, n, H)
    rms = states.pow(2).mean(-1, keepdim=True).sqrt()
    noisy = states + (torch.rand_like(states) - 0.5) * (width * rms)
    return noisy.flatten(-2).to(aux_hidden.dtype)


def auto_compile(device) -> bool:
    """`training.compile_drafter: auto`: compiled on CUDA and ROCm (device.compiled_drafter), but not under FSDP or
    DeepSpeed, where it has not been measured (`accelerate launch` marks them in the environment)."""
    sharded = any(os.environ.get(key, "").lower() in ("true", "1")
                  for key in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"))
    return dev.compiled_drafter(device) and not sharded


def _unwrap(module):
    return getattr(module, "module", module)
