"""The FLOP count the trainer logs MFU from equals what torch's FlopCounterMode counts on the same training step."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.eagle3.loss import teacher_targets, ttt_loss
from draftsmith.models.dflash.training import dflash_flops_per_token
from draftsmith.models.eagle3.model import Eagle3Drafter
from draftsmith.models.eagle3.training import eagle3_flops_per_token
from draftsmith.models.flops import target_forward_flops
from draftsmith.models.target import TargetModel
from draftsmith.train.flops import describe


def tiny_target(**overrides):
    config = LlamaConfig(hidden_size=64, intermediate_size=112, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=96, max_position_embeddings=128, **overrides)
    torch.manual_seed(0)
    return TargetModel(LlamaForCausalLM(config).eval().requires_grad_(False)), config


def counted(fn) -> int:
    with FlopCounterMode(display=False) as mode:
        fn()
    return mode.get_total_flops()


@pytest.mark.parametrize("head_dim", [None, 24])
def test_target_forward_count_equals_flop_counter(head_dim):
    extra = {"head_dim": head_dim} if head_dim else {}
    target, config = tiny_target(attn_implementation="eager", **extra)
    b, s = 2, 20
    ids = torch.randint(0, 96, (b, s))
    measured = counted(lambda: target.capture(ids, None, [0, 1, 2]))
    # eager attention multiplies the whole S x S square, so compare with the "full" count
    assert measured == pytest.approx(b * s * target_forward_flops(config, s, attention="full"), rel=1e-9)


@pytest.mark.parametrize("loss_path", ["whole_logits", "in_forward", "recompute"])
def test_eagle3_training_step_count_equals_flop_counter(loss_path):
    """The count against the whole-logit reference step; the chunked loss runs the same head products, on the
    rows whose target lies inside the batch, and `recompute` runs each chunk's head product once more."""
    target, config = tiny_target(attn_implementation="eager")
    drafter_config = Eagle3Config.from_target(config, 40, [0, 1, 2])
    drafter = Eagle3Drafter(drafter_config)
    t2d = torch.zeros(96, dtype=torch.bool)
    t2d[:40] = True
    drafter.set_draft_vocab(torch.zeros(40, dtype=torch.long), t2d)
    b, s, steps = 2, 24, 3
    ids = torch.randint(0, 96, (b, s))

    def step():
        captured = target.capture(ids, None, [0, 1, 2])
        teacher, in_draft = teacher_targets(captured.last_hidden, target.lm_head, drafter.t2d)
        embeds = target.embed_tokens(ids)
        loss_mask = torch.ones(b, s, dtype=torch.long)
        if loss_path == "whole_logits":
            logits = drafter.forward_ttt(captured.aux_hidden, embeds, steps, query_block=s)  # no recomputation
            loss, _ = ttt_loss(logits, teacher, in_draft, loss_mask)
        else:
            from draftsmith.models.eagle3.training import TTTOptions, apply_training_options

            apply_training_options(drafter, TTTOptions(query_block=s))
            loss, _ = drafter(captured.aux_hidden, embeds, steps, loss_targets=dict(
                teacher_draft_logits=teacher, teacher_in_draft=in_draft, loss_mask=loss_mask, chunk_size=16,
                loss_grad=loss_path))
        loss.backward()

    measured = counted(step)
    terms = eagle3_flops_per_token(config, drafter_config, s, steps, attention="full")
    # FlopCounterMode counts matrix products only: the diagonal keys' scores and values are elementwise products
    heads_dim = drafter_config.num_attention_heads * drafter_config.head_dim
    diagonal = 3 * sum(2 * 2 * heads_dim * i for i in range(steps))
    head = 2 * config.hidden_size * 40  # one row's draft-head product
    if loss_path == "whole_logits":
        extra = 0
    else:  # step i's last 1 + i flattened rows have no target in the batch: never read out
        extra = -3 * head * sum(1 + i for i in range(steps))
        if loss_path == "recompute":
            extra += head * sum(b * s - 1 - i for i in range(steps))
    assert measured == pytest.approx(b * s * (terms["total"] - diagonal) + extra, rel=1e-9)
    assert drafter.fc.weight.grad is not None


def test_dflash_training_step_count_equals_flop_counter():
    from draftsmith.models.dflash.config import DflashDrafterConfig
    from draftsmith.models.dflash.loss import block_labels, dflash_loss, teacher_argmax
    from draftsmith.models.dflash.model import DflashDrafter, init_drafter

    target, config = tiny_target(attn_implementation="eager")
    drafter_config = DflashDrafterConfig.from_target(config, num_layers=2, block_size=4, num_features=3,
                                                     learned_mask=True)
    drafter = DflashDrafter(drafter_config)
    init_drafter(drafter, target.embed_tokens.weight)
    b, s = 2, 24
    ids = torch.randint(0, 96, (b, s))
    anchors = torch.tensor([[1, 6, 11, 19], [0, 4, 9, 20]])  # every block whole inside the sequence
    loss_mask = torch.ones(b, s, dtype=torch.long)

    def step():
        captured = target.capture(ids, None, drafter_config.aux_layer_ids)
        teacher = teacher_argmax(captured.last_hidden, target.lm_head)
        hidden = drafter(captured.aux_hidden, target.embed_tokens(ids.gather(1, anchors)), anchors)
        labels, valid = block_labels(teacher, loss_mask, anchors, torch.ones_like(anchors, dtype=torch.bool), 4)
        loss, _ = dflash_loss(hidden, target.lm_head.weight, labels, valid, 4.0)
        loss.backward()

    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):  # matrix products FlopCounterMode counts (it has no CPU flash formula)
        measured = counted(step)
    terms = dflash_flops_per_token(config, drafter_config, s, anchors.shape[1], attention="full")
    # the loss takes its gradient in the forward pass (training.loss_grad: in_forward): no head product is run twice
    assert measured == pytest.approx(b * s * terms["total"], rel=1e-9)
    assert drafter.mask_embedding.grad is not None and drafter.fc.weight.grad is not None


def test_llama_8b_shape_matches_the_hand_count():
    """The issue's hand count for Llama-3.1-8B at 2048 tokens, TTT 7, 32k draft vocabulary (in GFLOP)."""
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256)
    terms = eagle3_flops_per_token(config, Eagle3Config.from_target(config, 32000, [2, 16, 29]), 2048, 7)
    assert terms["target_forward"] / 1e9 == pytest.approx(14.5, abs=0.05)
    assert terms["drafter_forward_backward"] / 1e9 == pytest.approx(16.3, abs=0.05)
    assert terms["teacher_head"] == 2 * 4096 * 128256
    assert describe(terms).startswith(f"{terms['total'] / 1e9:.3g} GFLOP per token = target_forward 14.5")


def test_peak_matrix_rate_is_known_for_datasheet_gpus_only(monkeypatch):
    from draftsmith import device as dev

    assert dev.peak_matrix_tflops("cpu") is None
    monkeypatch.setattr(dev, "_accel_module", lambda device: torch.cuda)
    for name, rate in [("NVIDIA H200", 989.0), ("NVIDIA GH200 480GB", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                       ("AMD Instinct MI355X", 2500.0), ("NVIDIA GeForce RTX 4090", None)]:
        monkeypatch.setattr(dev, "device_name", lambda device, name=name: name)
        assert dev.peak_matrix_tflops("cuda") == rate, name


def test_mtp_training_step_count_equals_flop_counter():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from draftsmith.models.mtp.config import MtpDrafterConfig
    from draftsmith.models.mtp.loss import mtp_loss
    from draftsmith.models.mtp.model import MtpDrafter
    from draftsmith.models.mtp.training import mtp_flops_per_token

    target, config = tiny_target(attn_implementation="eager")
    depths = 3
    drafter = MtpDrafter(MtpDrafterConfig.from_target(config, num_depths=depths))
    b, s = 2, 20
    ids = torch.randint(0, 96, (b, s))

    def step():
        captured = target.capture(ids, None, [config.num_hidden_layers])
        hidden = drafter(target.embed_tokens(ids), captured.last_hidden, depths)
        loss, _ = mtp_loss(hidden, captured.last_hidden, torch.ones(b, s, dtype=torch.long), target.lm_head)
        loss.backward()

    with sdpa_kernel([SDPBackend.MATH]):
        measured = counted(step)
    terms = mtp_flops_per_token(config, depths, s, attention="full")
    # the loss computes each depth's teacher rows itself: one head product per row beyond the count's one teacher
    # pass (its gradient is taken in the forward pass, so nothing is recomputed in backward)
    rows = sum(s - 1 - d for d in range(1, depths + 1))
    head = 2 * 64 * 96
    assert measured == pytest.approx(b * s * (terms["total"] - terms["teacher_head"]) + b * rows * head, rel=1e-9)
    assert drafter.layers[0].eh_proj.weight.grad is not None
