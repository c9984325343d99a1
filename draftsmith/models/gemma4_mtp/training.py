"""What the trainer needs from Gemma 4 MTP: the assistant to start from, and its loss with the target frozen.

Capture (online): the target runs once per micro-batch (the features the trainer hands the loss), recording the
residual stream entering the last sliding and the last full layer that compute K/V (capture ids = those layer indices) and its final-normed
last state. Each source layer's keys and values are then computed from its input with the target's own frozen
projections, norms and RoPE (`model.target_kv`, the math of the runtime's Gemma 4 adapter), so the assistant
trains on exactly the K/V it will read from the runtime's cache. A hidden-state store holds no layer weights to
project with, so training from one is refused in one line.
"""

from __future__ import annotations

import torch

from draftsmith import distributed
from draftsmith.kernels.chunked_loss import loss_chunk_rows
from draftsmith.models.gemma4_mtp.config import TARGET_MODEL_TYPES, Gemma4MtpConfig, source_layers
from draftsmith.models.gemma4_mtp.io import drafter_from, read_folder
from draftsmith.models.gemma4_mtp.loss import StepLoss
from draftsmith.models.gemma4_mtp.model import Gemma4MtpDrafter, causal_masks, target_kv
from draftsmith.models.losses import shift_left, simulated_acceptance_length
from draftsmith.models.target import TargetModel


class Gemma4MtpMethod:
    name = "gemma4_mtp"

    def __init__(self, recipe, target: TargetModel):
        self.target = target
        self.count_mean = None  # unused: each step's loss is normalised per process (TrainingMethod)
        section = recipe.gemma4_mtp
        if target.config.model_type not in TARGET_MODEL_TYPES:
            raise ValueError(f"{recipe.model.target}: gemma4_mtp needs a Gemma 4 target, got "
                             f"{target.config.model_type!r}")
        if next(target.layers.parameters()).device.type == "meta":
            raise ValueError("data.hidden_states_path / data.hidden_states_cache: gemma4_mtp trains on the target's "
                             "K/V, which a hidden-state store does not hold; leave both unset to capture online")
        self.num_steps = section.num_steps
        self.decay = section.step_decay
        self.centroid_weight = section.centroid_weight
        self.loss_chunk_size = recipe.training.loss_chunk_size
        self.sources = source_layers(target.config)  # layer type -> target layer index
        self.aux_layer_ids = sorted(set(self.sources.values()))  # capture id k = input of layer k
        self.draft_vocab_size = None
        start = section.assistant or recipe.model.init_from
        assistant, self.initial = read_folder(start)
        self.config = Gemma4MtpConfig(
            assistant_config=assistant.assistant_config, backbone_hidden_size=assistant.backbone_hidden_size,
            vocab_size=assistant.vocab_size, num_steps=section.num_steps, target_name_or_path=recipe.model.target,
            target_model_type=target.config.model_type,
            target_architectures=list(getattr(target.model.config, "architectures", None) or []), source=start)
        if (self.config.vocab_size, self.config.backbone_hidden_size) != (target.vocab_size, target.hidden_size):
            raise ValueError(f"gemma4_mtp.assistant {start}: an assistant for vocab {self.config.vocab_size} and "
                             f"hidden size {self.config.backbone_hidden_size}; the target has {target.vocab_size} "
                             f"and {target.hidden_size}")
        self.notes = [f"gemma4_mtp: fine-tuning {start}; it reads the K/V of target layers "
                      + ", ".join(f"{i} ({kind})" for kind, i in sorted(self.sources.items()))]

    def flops_per_token(self, seq_len: int, loss_share: float = 1.0) -> dict[str, float]:
        """Rough: the target's forward (2 x its parameters) and 6 x the assistant's parameters per step."""
        target = 2.0 * sum(p.numel() for p in self.target.model.parameters())
        with torch.device("meta"):  # shapes only
            size = sum(p.numel() for p in Gemma4MtpDrafter(self.config).parameters())
        drafter = 6.0 * self.num_steps * size
        return {"target_forward": target, "drafter": drafter, "total": target + drafter}

    def build_drafter(self, d2t: torch.Tensor, t2d: torch.Tensor) -> Gemma4MtpDrafter:
        """The assistant's weights in fp32 on the target's device (d2t / t2d unused: it reads out over the full
        vocabulary with its own head)."""
        drafter = drafter_from(self.config, self.initial, self.config.source).float().to(self.target.device)
        if drafter.masked_embedding is not None and not self.centroid_weight:  # no loss reaches it: keep it as is
            drafter.masked_embedding.centroids.requires_grad_(False)  # (and DDP sees no parameter without a gradient)
        return drafter

    def apply_training_options(self, drafter: Gemma4MtpDrafter) -> None:
        """None of the training options (attention kernels, recomputation, compilation) applies to the assistant."""

    def target_states(self, features, input_ids, attention_mask):
        """(final-normed last hidden (B, S, Hb), K/V per layer type) of the frozen target; `features` captures its
        states (the trainer's FeatureSource, or `target.capture`)."""
        captured = features(input_ids, attention_mask, self.aux_layer_ids)
        width = self.target.hidden_size
        entering = dict(zip(self.aux_layer_ids, captured.aux_hidden.split(width, dim=-1)))
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand(input_ids.shape[0], -1)
        decoder = self.target._decoder
        kv = {}
        with torch.no_grad():
            for kind, index in self.sources.items():
                cos, sin = decoder.rotary_emb(entering[index], positions, kind)
                with distributed.gathered(self.target.layers[index]) as layer:  # sharded with training.shard_target
                    kv[kind] = target_kv(layer, entering[index], cos, sin)
        return captured.last_hidden, kv

    def loss(self, drafter, batch: dict[str, torch.Tensor], features):
        """batch: input_ids, attention_mask, loss_mask (B, S); features: the target's states (the trainer's
        FeatureSource). Returns (loss, metrics of 0-dim tensors), as loss.py draws the alignment."""
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
        last_hidden, kv = self.target_states(features, input_ids, batch["attention_mask"])
        inner = getattr(drafter, "module", drafter)  # under DDP / FSDP: its config only
        with torch.no_grad():
            embeds = self.target.embed_tokens(input_ids)  # (B, S, Hb) scaled by sqrt(Hb), as the runtime feeds it
        num = input_ids.shape[1]
        positions = torch.arange(num, device=input_ids.device)[None].expand(input_ids.shape[0], -1)
        windows = {kind: inner.text_config.sliding_window if kind == "sliding_attention" else None
                   for kind in self.sources}
        masks = causal_masks(num, windows, input_ids.device)
        head = self.target.lm_head.weight
        cap = self.target.config.final_logit_softcapping
        chunk = loss_chunk_rows(head.shape[0], self.loss_chunk_size)
        hidden = last_hidden
        total = 0.0
        metrics: dict[str, torch.Tensor] = {}
        corrects, valids = [], []
        for j in range(1, self.num_steps + 1):
            valid = shift_left(loss_mask, j + 1)  # (B, S) t_{i+j+1} is trained
            rows = valid.nonzero(as_tuple=True)
            step_loss = StepLoss(rows, shift_left(last_hidden, j)[rows], head, cap, chunk)  # teacher z_{i+j}
            hidden, (ce, centroid, agree) = drafter(shift_left(embeds, j), hidden, positions, kv, masks,
                                                   loss=step_loss)  # reads t_{i+j}
            count = valid.sum()
            step = (ce.sum() + self.centroid_weight * centroid.sum()) / count.clamp(min=1)
            total = total + self.decay ** (j - 1) * step
            correct = torch.zeros_like(valid)
            correct[rows] = agree
            metrics[f"loss_{j - 1}"] = (ce.sum() / count.clamp(min=1)).detach()
            metrics[f"acc_{j - 1}"] = agree.sum() / count.clamp(min=1)
            metrics[f"count_{j - 1}"] = count
            corrects.append(correct)
            valids.append(valid)
        metrics["sim_accept_len"] = simulated_acceptance_length(corrects, valids[0])
        return total, metrics
