"""Packed EAGLE-3 training rows (training.packing): one row of several samples, positions restarting, attention kept
inside each sample, gives exactly the loss, metrics and gradients of the same samples right-padded in a batch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.config import RecipeError, recipe_from_dict
from draftsmith.models.target import TargetModel
from draftsmith.train.health import FeatureCheck, FiniteWatch
from draftsmith.train.batching import collate, collate_packed, epoch_batches

LENGTHS = [9, 14, 6, 11]


def tiny_target(attn: str):
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=80, max_position_embeddings=128,
                         attn_implementation=attn)
    torch.manual_seed(0)
    return TargetModel(LlamaForCausalLM(config).eval().requires_grad_(False), name_or_path="tiny")


def samples(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        mask = [0] * (n // 3) + [1] * (n - n // 3)  # a prompt, then the answer
        out.append(SimpleNamespace(input_ids=torch.randint(1, 80, (n,), generator=g).tolist(), loss_mask=mask))
    return out


def eagle3(target, query_block=16):
    from draftsmith.models.eagle3.training import Eagle3Method

    recipe = recipe_from_dict({
        "model": {"target": "tiny", "draft_vocab_size": 40}, "data": {"path": "unused.jsonl", "max_length": 64},
        "training": {"ttt_steps": 3, "ttt_query_block": query_block, "loss_chunk_size": 16,
                     "mask_outside_draft_vocab": False},
        "output_dir": "unused"})
    method = Eagle3Method(recipe, target)
    t2d = torch.zeros(80, dtype=torch.bool)
    t2d[::2] = True
    drafter = method.build_drafter(t2d.nonzero().flatten() - torch.arange(40), t2d)
    method.apply_training_options(drafter)  # training.ttt_query_block, as the trainer applies it
    for p in drafter.parameters():
        p.data.add_(0.05 * torch.randn_like(p))
    return method, drafter


def loss_and_grads(method, drafter, batch):
    loss, metrics = method.loss(drafter, batch, method.target.capture)
    grads = torch.autograd.grad(loss, [p for p in drafter.parameters() if p.requires_grad])
    return loss, metrics, grads


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_packed_row_trains_exactly_as_the_padded_batch(attn):
    target = tiny_target(attn)
    method, drafter = eagle3(target)
    padded = loss_and_grads(method, drafter, collate(samples(), 0, "cpu"))
    packed_batch = collate_packed(samples(), "cpu")
    assert packed_batch["input_ids"].shape == (1, sum(LENGTHS))
    packed = loss_and_grads(method, drafter, packed_batch)
    torch.testing.assert_close(packed[0], padded[0], rtol=1e-5, atol=1e-6)
    for key in padded[1]:
        torch.testing.assert_close(packed[1][key].float(), padded[1][key].float(), rtol=1e-5, atol=1e-6, msg=key)
    assert padded[1]["count_0"] > 0
    for a, b in zip(packed[2], padded[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("drop", ["doc_ids", "both"])
def test_without_the_sample_boundaries_the_packed_row_differs(drop):
    """The controls: the drafter attending across samples (no doc ids), or the target too (positions running on),
    is a different computation, so the equality above rests on the boundaries."""
    target = tiny_target("sdpa")
    method, drafter = eagle3(target)
    padded = loss_and_grads(method, drafter, collate(samples(), 0, "cpu"))
    row = collate_packed(samples(), "cpu")
    broken = {**row, "doc_ids": None}
    if drop == "both":
        broken["position_ids"] = torch.arange(row["input_ids"].shape[1])[None]
    assert not torch.allclose(loss_and_grads(method, drafter, broken)[0], padded[0], rtol=1e-4)


def test_the_target_sees_each_packed_sample_alone():
    target = tiny_target("sdpa")
    row = collate_packed(samples(), "cpu")
    packed = target.capture(row["input_ids"], None, [0, 1, 2], position_ids=row["position_ids"])
    start = 0
    for s in samples():
        alone = target.capture(torch.tensor([s.input_ids]), None, [0, 1, 2])
        n = len(s.input_ids)
        torch.testing.assert_close(packed.aux_hidden[:, start:start + n], alone.aux_hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed.last_hidden[:, start:start + n], alone.last_hidden, rtol=1e-5, atol=1e-5)
        start += n


def test_packed_batches_hold_every_sample_once_within_the_budget():
    lengths = [int(x) for x in torch.randint(5, 120, (300,), generator=torch.Generator().manual_seed(1))]
    batches = epoch_batches(lengths, 1, seed=4, epoch=0, rank=0, world=1, tokens_per_step=256, packing=True)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(300))
    assert all(sum(lengths[i] for i in b) <= 256 for b in batches)
    assert sum(lengths) / (256 * len(batches)) > 0.9  # first fit fills the rows
    assert batches == epoch_batches(lengths, 1, seed=4, epoch=0, rank=0, world=1, tokens_per_step=256, packing=True)


def test_a_non_finite_feature_names_the_packed_sample_it_is_in():
    row = collate_packed(samples(), "cpu")

    def capture(input_ids, attention_mask, aux_layer_ids, position_ids=None):
        aux = torch.zeros(1, input_ids.shape[1], 6)
        aux[0, LENGTHS[0] + LENGTHS[1] + 2] = float("nan")  # inside the third sample
        return SimpleNamespace(aux_hidden=aux, last_hidden=torch.zeros(1, input_ids.shape[1], 2))

    check = FeatureCheck(capture)
    check(row["input_ids"], None, [0], position_ids=row["position_ids"])
    watch = FiniteWatch(describe=lambda i: f"sample {i}")
    watch.observe_micro_batch(3, [10, 11, 12, 13], check.take(), torch.tensor(1.0))
    assert watch.first_problem().startswith("step 3: the target's hidden states for sample 12 are not finite")


@pytest.mark.parametrize("training, method, message", [
    ({"packing": True}, "eagle3", "training.packing needs training.tokens_per_step"),
    ({"packing": True, "tokens_per_step": 4096}, "dflash", "training.packing is implemented for EAGLE-3"),
])
def test_packing_that_cannot_run_is_refused(training, method, message):
    with pytest.raises(RecipeError, match=message):
        recipe_from_dict({"model": {"target": "t", "method": method}, "data": {"path": "d.jsonl"},
                          "training": training, "output_dir": "o"})


def test_training_on_every_token_counts_the_prompt_positions_and_keeps_packing_exact():
    """training.loss_on all (collate's every_token): each TTT step trains on every position whose target token lies
    in the same sample, the prompt's too (count_i = sum over samples of n - 2 - i, nothing across sample borders),
    and a packed row still gives the padded batch's loss."""
    target = tiny_target("sdpa")
    method, drafter = eagle3(target)
    answers = loss_and_grads(method, drafter, collate(samples(), 0, "cpu"))
    every = loss_and_grads(method, drafter, collate(samples(), 0, "cpu", every_token=True))
    packed = loss_and_grads(method, drafter, collate_packed(samples(), "cpu", every_token=True))
    for i in range(3):
        assert int(every[1][f"count_{i}"]) == sum(n - 2 - i for n in LENGTHS)
        assert int(packed[1][f"count_{i}"]) == int(every[1][f"count_{i}"])
    assert int(every[1]["count_0"]) > int(answers[1]["count_0"])  # its targets reach into the prompts
    assert not torch.allclose(every[0], answers[0])
    torch.testing.assert_close(packed[0], every[0], rtol=1e-5, atol=1e-6)
