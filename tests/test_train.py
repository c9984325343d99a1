"""End-to-end training on the fixture target: the loop learns, checkpoints load, resume is exact."""

import json

import pytest
import torch

from draftsmith.config import recipe_from_dict
from draftsmith.train import trainer as trainer_mod
from draftsmith.train import train

REPLIES = [
    "The capital of France is Paris. It is known for the Eiffel Tower and its museums.",
    "To sort a list in Python, call sorted(items) or items.sort() for an in-place sort.",
    "Water boils at 100 degrees Celsius at sea level, and at lower temperatures at altitude.",
    "A good night's sleep helps memory, mood and health; most adults need seven to nine hours.",
]


def write_conversations(path, n=24):
    with path.open("w") as f:
        for i in range(n):
            reply = REPLIES[i % len(REPLIES)]
            f.write(json.dumps({"conversations": [{"from": "human", "value": f"Question number {i}?"},
                                                  {"from": "gpt", "value": reply}]}) + "\n")
    return path


def tiny_recipe(target_dir, data_path, out_dir, **training):
    return recipe_from_dict({
        "model": {"target": str(target_dir), "draft_vocab_size": 512},
        "data": {"path": str(data_path), "max_length": 96, "eval_samples": 4, "cache_dir": str(out_dir / "cache")},
        "training": {"max_steps": 6, "batch_size": 2, "grad_accum_steps": 2, "ttt_steps": 2, "lr": 1e-3,
                     "log_every": 1, "eval_every": 3, "save_every": 3, "seed": 7, **training},
        "output_dir": str(out_dir / "run"),
    })


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_resume_continues_exactly(tmp_path, fixture_target_dir, monkeypatch):
    data = write_conversations(tmp_path / "conv.jsonl")
    full = tmp_path / "full"
    train(tiny_recipe(fixture_target_dir, data, full), log=lambda *a: None)
    expected = losses(full / "run")
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]

    interrupted = tmp_path / "interrupted"
    real_save = trainer_mod.save_checkpoint

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt  # killed right after the step-3 checkpoint landed

    monkeypatch.setattr(trainer_mod, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_recipe(fixture_target_dir, data, interrupted), log=lambda *a: None)
    monkeypatch.setattr(trainer_mod, "save_checkpoint", real_save)
    assert sorted(losses(interrupted / "run")) == [1, 2, 3]
    train(tiny_recipe(fixture_target_dir, data, interrupted), log=lambda *a: None)
    resumed = losses(interrupted / "run")
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step


def test_training_lowers_loss_and_writes_a_loadable_checkpoint(tmp_path, fixture_target_dir):
    from draftsmith.models.eagle3.io import load_drafter

    data = write_conversations(tmp_path / "conv.jsonl", n=40)
    ckpt = train(tiny_recipe(fixture_target_dir, data, tmp_path, max_steps=30, eval_every=30, save_every=30,
                             grad_accum_steps=1), log=lambda *a: None)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_losses = [r["loss"] for r in rows if "loss" in r]
    assert sum(train_losses[-5:]) / 5 < 0.7 * sum(train_losses[:5]) / 5
    evals = [r for r in rows if "eval/loss" in r]
    assert evals and 1.0 <= evals[-1]["eval/sim_accept_len"] <= 3.0
    assert (tmp_path / "run" / "latest").read_text().strip() == ckpt.name
    drafter = load_drafter(tmp_path / "run")  # an output_dir means its latest checkpoint
    assert drafter.config.draft_vocab_size == 512 and drafter.t2d.sum() == 512
    assert not list((tmp_path / "run").glob(".*tmp*")), "no half-written checkpoint left behind"


def test_init_from_continues_from_a_checkpoint(tmp_path, fixture_target_dir):
    """model.init_from starts a run from an earlier (or imported) drafter: its weights, not fresh ones."""
    from safetensors.torch import load_file

    from draftsmith.train.trainer import TrainingError

    data = write_conversations(tmp_path / "conv.jsonl")
    first = train(tiny_recipe(fixture_target_dir, data, tmp_path / "a", max_steps=2), log=lambda *a: None)
    recipe = tiny_recipe(fixture_target_dir, data, tmp_path / "b", max_steps=1, lr=1e-12, warmup_ratio=0.0)
    recipe.model.init_from = str(first)
    second = train(recipe, log=lambda *a: None)
    a, b = load_file(str(first / "model.safetensors")), load_file(str(second / "model.safetensors"))
    assert torch.allclose(a["fc.weight"], b["fc.weight"], atol=1e-6)  # lr ~ 0: the weights are the loaded ones
    bad = tiny_recipe(fixture_target_dir, data, tmp_path / "c", max_steps=1)
    bad.model.draft_vocab_size = 256
    bad.model.init_from = str(first)
    with pytest.raises(TrainingError, match="does not fit"):
        train(bad, log=lambda *a: None)
