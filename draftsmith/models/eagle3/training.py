"""What the trainer needs from EAGLE-3: build the drafter, compute its loss from captured target states."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from draftsmith import device as dev
from draftsmith.kernels.fused_head_loss import resolve_backend as resolve_loss_kernel
from draftsmith.kernels.ttt_attention import resolve_backend, unroll_attention
from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.eagle3.loss import teacher_targets
from draftsmith.models.eagle3.model import Eagle3Drafter, init_drafter_from_target
from draftsmith.models.flops import attention_keys, target_forward_flops, target_head_flops, with_total
from draftsmith.models.spec import draft_vocab_size_for
from draftsmith.models.target import TargetModel


def eagle3_flops_per_token(target_config, drafter_config, seq_len: int, ttt_steps: int,
                           attention: str = "causal") -> dict[str, float]:
    """FLOP per trained token of online EAGLE-3 training, by term (models/flops.py), and their total:

        target_forward   every decoder layer of the target
        teacher_head     the target's head on the last hidden state, over the whole vocabulary (the in-draft mask
                         needs the full argmax; the soft targets then take the draft vocabulary's columns)
        drafter          fc once, then per TTT step the decoder layer and the draft head, forward and backward
                         (backward = 2 x forward, but fc's input carries no gradient: 1 x); step i also attends
                         to its i diagonal keys
    """
    d = drafter_config
    h, heads, head_dim = d.hidden_size, d.num_attention_heads, d.head_dim
    kv = d.num_key_value_heads * head_dim
    fc = 2 * len(d.aux_layer_ids) * d.target_hidden_size * h
    layer = 2 * (2 * h * heads * head_dim + 2 * 2 * h * kv + heads * head_dim * h + 3 * h * d.intermediate_size)
    head = 2 * h * d.draft_vocab_size
    steps_forward = 0.0
    for i in range(ttt_steps):
        steps_forward += layer + head + 2 * 2 * heads * head_dim * (attention_keys(seq_len, attention) + i)
    return with_total({"target_forward": target_forward_flops(target_config, seq_len, attention),
                       "teacher_head": target_head_flops(target_config),
                       "drafter_forward_backward": 2.0 * fc + 3.0 * steps_forward})


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
        self.count_mean = None  # data-parallel: the trainer sets the mean over processes (train/setup.py)
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
        self.training_options = TTTOptions.from_recipe(training, target.device, self.config.head_dim)

    def flops_per_token(self, seq_len: int, loss_share: float = 1.0) -> dict[str, float]:
        """FLOP per trained token at this sequence length, by term (eagle3_flops_per_token), for the MFU log. The
        TTT steps and their head run at every position, so the share of positions under the loss does not change
        it."""
        return eagle3_flops_per_token(self.target.config, self.config, seq_len, self.ttt_steps)

    def build_drafter(self, d2t: torch.Tensor, t2d: torch.Tensor) -> Eagle3Drafter:
        """An fp32 drafter (master weights) with the draft vocab and the head started from the target's rows."""
        drafter = Eagle3Drafter(self.config).to(self.target.device)
        drafter.set_draft_vocab(d2t.to(self.target.device), t2d.to(self.target.device))
        init_drafter_from_target(drafter, self.target.lm_head.weight.float())
        drafter.lm_head.weight.requires_grad_(self.train_head)  # frozen: the target's rows, as speculators has it
        return drafter

    def apply_training_options(self, drafter: Eagle3Drafter) -> None:
        """training.ttt_attention, ttt_query_block, checkpoint_ttt_steps and compile_drafter, on a built drafter."""
        apply_training_options(drafter, self.training_options)

    def loss(self, drafter, batch: dict[str, torch.Tensor], features):
        """batch: input_ids, attention_mask, loss_mask, each (B, S); features: the target's states (the trainer's
        FeatureSource). Returns (loss, metrics of 0-dim tensors)."""
        positions, docs = batch.get("position_ids"), batch.get("doc_ids")  # a packed row (batching.collate_packed)
        captured = features(batch["input_ids"], batch["attention_mask"], self.aux_layer_ids, position_ids=positions)
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


@dataclass(frozen=True)
class TTTOptions:
    """How EAGLE-3's TTT unroll computes in training: the recipe's training options, resolved for a device."""

    attention: str = "reference"  # training.ttt_attention resolved: "flex" or "reference" (kernels/ttt_attention.py)
    query_block: int | None = None  # training.ttt_query_block: the reference's queries per block (None: chosen)
    recompute: bool = False  # training.checkpoint_ttt_steps: each step's layer recomputed in the backward pass
    compile: bool = False  # training.compile_drafter resolved: each step's two elementwise halves compiled
    compile_backend: str = "inductor"  # torch.compile's (the tests take aot_eager on the CPU)

    @classmethod
    def from_recipe(cls, training, device, head_dim: int) -> TTTOptions:
        return cls(attention=resolve_backend(training.ttt_attention, device, head_dim),
                   query_block=training.ttt_query_block, recompute=training.checkpoint_ttt_steps,
                   compile=(auto_compile(device, training.sharding) if training.compile_drafter == "auto"
                            else training.compile_drafter))


class TrainingTTTKernels:
    """`Eagle3Drafter.ttt_kernels` as TTTOptions say (model.py PlainTTTKernels is the plain-torch default)."""

    def __init__(self, drafter: Eagle3Drafter, options: TTTOptions):
        self.options = options
        self.halves = (drafter.step_qkv, drafter.step_finish)
        if options.compile:  # the norms, RoPE, residuals and gated MLP around each step's matrix products fused;
            # the attention stays out (FlexAttention compiles on its own)
            self.halves = tuple(torch.compile(half, backend=options.compile_backend, dynamic=dev.compile_dynamic())
                                for half in self.halves)

    def attention(self, batch: int, heads: int, seq_len: int, num_steps: int, device, query_block=None,
                  doc_ids=None):
        block = self.options.query_block if query_block is None else query_block
        attend = unroll_attention(self.options.attention, batch, heads, seq_len, num_steps, device, block, doc_ids)
        return attend, self.options.attention == "reference"

    def step(self, drafter: Eagle3Drafter, *args):
        if self.options.recompute and torch.is_grad_enabled():  # keeps the step's inputs only; its layer's
            return checkpoint(drafter.ttt_step, *self.halves, *args, use_reentrant=False)  # recomputed in backward
        return drafter.ttt_step(*self.halves, *args)


def apply_training_options(drafter: Eagle3Drafter, options: TTTOptions) -> Eagle3Drafter:
    """The training options applied to a built drafter, from outside and once (as torchtitan applies compilation and
    activation checkpointing): how its TTT unroll attends, recomputes and compiles. Returns the drafter."""
    drafter.ttt_kernels = TrainingTTTKernels(drafter, options)
    return drafter


def with_relative_noise(aux_hidden: torch.Tensor, num_layers: int, width: float) -> torch.Tensor:
    """aux_hidden (B, S, n*H), n layers' states side by side, plus U(-width/2, width/2) times each layer's RMS at
    each position (eagle3.feature_noise): the same relative disturbance for a quiet early layer and a loud late one."""
    states = aux_hidden.float().unflatten(-1, (num_layers, -1))  # (B, S, n, H)
    rms = states.pow(2).mean(-1, keepdim=True).sqrt()
    noisy = states + (torch.rand_like(states) - 0.5) * (width * rms)
    return noisy.flatten(-2).to(aux_hidden.dtype)


def auto_compile(device, sharding: str = "auto") -> bool:
    """`training.compile_drafter: auto`: compiled on CUDA and ROCm (device.compiled_drafter), but not under FSDP2 or
    DeepSpeed (training.sharding, or the accelerate launcher's config), where it has not been measured."""
    from draftsmith.distributed import requested_sharding

    return dev.compiled_drafter(device) and requested_sharding(sharding)[0] == "ddp"


def _unwrap(module):
    return getattr(module, "module", module)
