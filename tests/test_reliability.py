"""Faults a user meets, each as one line and exit 2 (issue 16, items 9 and 11): a missing, broken or truncated
target, a full disk at a checkpoint; and NaN comparisons that must count as wrong in every drafter's metrics."""

from __future__ import annotations

import errno
import re
import shutil

import pytest
import torch
from test_train import tiny_recipe, write_conversations  # shared helpers, same folder

from draftsmith.cli import main
from draftsmith.config import save_recipe


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    """(exit code, the one error line); fails on a traceback or on more than one error line."""
    code = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in re.split(r"[\r\n]", err) if line.startswith(f"draftsmith {argv[0]}: error:")]
    assert len(errors) == 1, err[-3000:]
    return code, errors[0]


def recipe_file(tmp_path, target, **training):
    path = tmp_path / "recipe.yaml"
    save_recipe(tiny_recipe(target, write_conversations(tmp_path / "conv.jsonl"), tmp_path, **training), path)
    return path


def broken_copy(fixture_target_dir, dest):
    shutil.copytree(fixture_target_dir, dest)
    for path in dest.iterdir():
        path.chmod(0o644)
    return dest


def test_train_on_a_missing_target_is_one_line_and_leaves_no_output_folder(tmp_path, capsys):
    missing = tmp_path / "no" / "such-target"
    code, error = run_cli(capsys, "train", str(recipe_file(tmp_path, missing)))
    assert code == 2 and f"model.target {missing}: no such folder" in error
    assert not (tmp_path / "run").exists()


def test_train_on_an_invalid_target_config_names_the_file_and_line(tmp_path, capsys):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text('{\n  "model_type": "llama",\n  oops\n}\n')
    code, error = run_cli(capsys, "train", str(recipe_file(tmp_path, target)))
    assert code == 2 and f"{target / 'config.json'}:3: invalid JSON" in error
    assert not (tmp_path / "run").exists()


def test_a_truncated_target_shard_is_named_by_train_and_generate(tmp_path, capsys, fixture_target_dir):
    target = broken_copy(fixture_target_dir, tmp_path / "target")
    shard = sorted(target.glob("*.safetensors"))[1]
    with shard.open("r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    code, error = run_cli(capsys, "train", str(recipe_file(tmp_path, target)))
    assert code == 2 and f"{shard}: corrupt or truncated safetensors file" in error
    assert not (tmp_path / "run").exists()
    code, error = run_cli(capsys, "generate", "--target", str(target), "--prompt", "hi", "--max-new-tokens", "2")
    assert code == 2 and f"{shard}: corrupt or truncated safetensors file" in error


def test_a_full_disk_at_a_checkpoint_is_one_line_and_removes_the_partial_one(tmp_path, capsys, fixture_target_dir,
                                                                             monkeypatch):
    from draftsmith.models import checkpoint

    real_save = checkpoint.save_file

    def full_at_checkpoints(tensors, filename, metadata=None):
        if ".checkpoint-" in str(filename):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(checkpoint, "save_file", full_at_checkpoints)
    code, error = run_cli(capsys, "train", str(recipe_file(tmp_path, fixture_target_dir)))
    run = tmp_path / "run"
    assert code == 2 and f"{run / 'checkpoint-3' / 'model.safetensors'}: disk full" in error
    assert "removed the partial .checkpoint-3.tmp" in error and "free space" in error
    assert not list(run.glob(".checkpoint-*")) and not list(run.glob("checkpoint-*"))


# ---- a NaN comparison is wrong, never correct (item 9) ------------------------------------------------------------
def test_dflash_metrics_count_nan_predictions_as_wrong():
    """A NaN in the head's row 5 makes every logit row's argmax 5: with labels 5, all looked correct."""
    from draftsmith.models.dflash.loss import dflash_loss

    g = torch.Generator().manual_seed(0)
    head = torch.randn(11, 8, generator=g)
    head[5, 0] = float("nan")
    hidden = torch.randn(1, 2, 4, 8, generator=g)
    labels = torch.full((1, 2, 3), 5)
    valid = torch.ones(1, 2, 3, dtype=torch.bool)
    loss, metrics = dflash_loss(hidden, head, labels, valid, gamma=2.0)
    assert not torch.isfinite(loss)
    assert [float(metrics[f"acc_{i}"]) for i in range(3)] == [0.0, 0.0, 0.0]
    assert float(metrics["sim_accept_len"]) == 1.0


def test_mtp_metrics_count_nan_predictions_as_wrong():
    """NaN target features: every teacher and draft logit row is all NaN, whose argmax is 0 on both sides."""
    from draftsmith.models.mtp.loss import mtp_loss

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 16, bias=False)
    last = torch.randn(1, 8, 8)
    last[..., 0] = float("nan")
    _, metrics = mtp_loss([last.clone() for _ in range(2)], last, torch.ones(1, 8, dtype=torch.long), head)
    assert [float(metrics[f"acc_{i}"]) for i in range(2)] == [0.0, 0.0]
    assert float(metrics["sim_accept_len"]) == 1.0


def test_finite_watch_names_the_first_problem_in_order():
    """Flags gathered over several steps, read in one transfer: the earliest step wins, features before loss
    before gradients within a step."""
    from draftsmith.train.health import FiniteWatch

    watch = FiniteWatch(describe=lambda i: f"training sample {i}")
    nan = torch.tensor(float("nan"))
    watch.observe_micro_batch(1, [4, 9], torch.tensor([True, True]), torch.tensor(1.0))
    watch.observe_step(1, torch.tensor(0.5))
    watch.observe_micro_batch(2, [3, 8], torch.tensor([True, False]), nan)
    watch.observe_step(2, nan)
    watch.observe_micro_batch(3, [1, 2], torch.tensor([True, True]), nan)
    assert watch.first_problem().startswith("step 2: the target's hidden states for training sample 8 are")
    assert watch.first_problem() is None  # flags are read once
    watch.observe_micro_batch(5, [1, 2], None, torch.tensor(1.0))
    watch.observe_step(5, torch.tensor(float("inf")))
    assert watch.first_problem().startswith("step 5: the gradient norm is not finite")


@pytest.mark.parametrize("losses, grad_norms, expected", [
    ([3.0, 2.9, 2.7, 2.8, 2.6, 2.5], [1.0] * 6, []),
    ([11.2289839, 11.2289848, 11.2289829, 11.2289848, 11.2289848], [0.5] * 5, ["the loss has not moved"]),
    ([3.0, 2.0, 1.0], [1.0, 0.0, 0.0], ["gradient norm is exactly 0"]),
])
def test_stuck_watch(losses, grad_norms, expected):
    from draftsmith.train.health import StuckWatch

    watch = StuckWatch()
    warnings = [w for step, (loss, norm) in enumerate(zip(losses, grad_norms), 1)
                for w in watch.observe(step, loss, norm, 1e6)]
    assert len(warnings) == len(expected) and all(e in w for e, w in zip(expected, warnings))


def test_a_rerun_removes_the_partial_checkpoint_of_a_killed_save(tmp_path, fixture_target_dir):
    """kill -9 inside a save leaves `.checkpoint-N.tmp`; the next run of the same output_dir removes it, also when
    it never reaches step N itself (here: a run killed saving step 6, resumed with max_steps=3)."""
    from draftsmith.train import train

    recipe = tiny_recipe(fixture_target_dir, write_conversations(tmp_path / "conv.jsonl"), tmp_path, max_steps=2)
    train(recipe, log=lambda *a: None)
    partial = tmp_path / "run" / ".checkpoint-6.tmp"
    (partial / "training_state").mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(b"half")
    recipe.training.max_steps = 3
    train(recipe, log=lambda *a: None)
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith(".")) == []
