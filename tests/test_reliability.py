"""Faults a user meets, each as one line and exit 2 (issue 16, items 9 and 11): a missing, broken or truncated
target, a full disk at a checkpoint; and NaN comparisons that must count as wrong in every drafter's metrics."""

from __future__ import annotations

import errno
import os
import re
import shlex
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

    watch = StuckWatch("training.lr=1e+06")
    warnings = [w for step, (loss, norm) in enumerate(zip(losses, grad_norms), 1)
                for w in watch.observe(step, loss, norm)]
    assert len(warnings) == len(expected) and all(e in w for e, w in zip(expected, warnings))
    assert all("training.lr=1e+06" in w for w in warnings)  # the recipe's rate, not the decayed one of the step


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


# ---- issue 25: resuming never unpickles (item 1), a stuck run stops (item 6), the same-run check (item 8) ---------
class MarkerPayload:
    """A pickle that, once loaded with torch.load(weights_only=False), creates `marker` (a stand-in for any code)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


def run_cli_ok(capsys, *argv: str) -> bool:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    return True


@pytest.mark.slow
@pytest.mark.parametrize("planted", ["custom_checkpoint_0.pkl", "optimizer.bin", "optimizer_0.safetensors"])
def test_a_planted_pickle_in_a_run_folder_is_refused_and_never_loaded(tmp_path, capsys, fixture_target_dir, planted):
    """`cp -r runs/base runs/evil`, a crafted pickle in its training_state/, `draftsmith train` on it: accelerate read
    custom_checkpoint_0.pkl (the scheduler) with weights_only=False and ran it. Now the checkpoint holds no pickle at
    all, and one that turns up, under any name, is refused in one line naming it before anything is loaded."""
    recipe = recipe_file(tmp_path, fixture_target_dir, max_steps=2)
    assert run_cli_ok(capsys, "train", str(recipe))
    checkpoint = tmp_path / "run" / "checkpoint-2"
    clean = sorted(p.relative_to(checkpoint) for p in checkpoint.rglob("*") if p.is_file())
    marker = tmp_path / "PWNED"
    torch.save(MarkerPayload(marker), checkpoint / "training_state" / planted)
    code, error = run_cli(capsys, "train", str(recipe), "training.max_steps=3")
    assert not marker.exists()
    assert code == 2 and f"{checkpoint / 'training_state' / planted}: a pickle draftsmith did not write" in error

    from draftsmith.train.state import looks_pickled

    written = [p for p in clean if p.name != planted]  # what draftsmith wrote holds no pickle
    assert written and not [p for p in written if looks_pickled(checkpoint / p)], written


@pytest.mark.slow
def test_a_run_folder_of_accelerate_pickles_is_refused_with_what_to_do(tmp_path, capsys, fixture_target_dir):
    """A folder written before draftsmith kept its own training state (optimizer.bin, random_states_0.pkl, ...)."""
    recipe = recipe_file(tmp_path, fixture_target_dir, max_steps=1)
    assert run_cli_ok(capsys, "train", str(recipe))
    state = tmp_path / "run" / "checkpoint-1" / "training_state"
    for path in state.iterdir():
        path.unlink()
    for name in ("optimizer.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl"):
        torch.save({}, state / name)
    code, error = run_cli(capsys, "train", str(recipe), "training.max_steps=2")
    assert code == 2 and "set output_dir to a new folder" in error
    assert f"model.init_from={tmp_path / 'run' / 'checkpoint-1'}" in error and "trust_run_folder" in error


@pytest.mark.slow
def test_a_stuck_run_stops_naming_the_recipes_rate(tmp_path, capsys, fixture_target_dir):
    """training.lr=1e-30 over the whole training set each step: a loss that does not move (the gradient does not
    vanish, so it is not a saturation). The run stops with exit 2 once stuck for training.stop_when_stuck_steps
    steps, naming training.lr=1e-30 (not the decayed rate of its last step); checkpoints stop once it is known to
    be stuck."""
    recipe = recipe_file(tmp_path, fixture_target_dir, lr=1e-30, batch_size=20, grad_accum_steps=1, max_steps=40,
                         stop_when_stuck_steps=4, save_every=1, eval_every=100)
    code, error = run_cli(capsys, "train", str(recipe))
    assert code == 2 and "training.lr=1e-30 is too high or too low" in error, error
    assert "training.stop_when_stuck_steps=4" in error and "its loss has stayed at" in error
    since, stopped = map(int, re.search(r"steps (\d+)\.\.(\d+): the drafter has not learned", error).groups())
    assert stopped - since == 4 and stopped < 40
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "run").glob("checkpoint-*"))
    assert saved and max(saved) < stopped  # nothing written once it was known to be stuck


@pytest.mark.slow
def test_a_saturated_run_stops_at_once_and_keeps_only_good_checkpoints(tmp_path, capsys, fixture_target_dir):
    """Issue 47 item 7: training.lr=1e6 saturates the drafter after one step (gradient norm exactly 0 from step 2,
    the loss stuck). It exited 0 with dead checkpoints; now it stops at step 2 with exit 2 naming the rate, and the
    checkpoint of step 1 (the weights that no longer learn) is removed, with `latest`."""
    recipe = recipe_file(tmp_path, fixture_target_dir, lr=1e6, max_steps=40, save_every=1, eval_every=100)
    code, error = run_cli(capsys, "train", str(recipe))
    assert code == 2 and error.count("\n") <= 1, error
    assert "step 2: the gradient norm is exactly 0 while the loss is not: training.lr=1e+06 saturated" in error
    assert "removed checkpoint-1" in error
    assert not list((tmp_path / "run").glob("checkpoint-*")) and not (tmp_path / "run" / "latest").exists()


def test_discarding_checkpoints_from_a_step_points_latest_at_the_last_good_one(tmp_path):
    from draftsmith.train.checkpoint import discard_checkpoints_from, latest_checkpoint

    for step in (3, 6, 9):
        (tmp_path / f"checkpoint-{step}").mkdir()
        for name in ("config.json", "model.safetensors"):  # what makes a checkpoint folder
            (tmp_path / f"checkpoint-{step}" / name).write_text("{}")
    (tmp_path / "latest").write_text("checkpoint-9\n")
    said = discard_checkpoints_from(tmp_path, 6)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3"]
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-3"
    assert "removed checkpoint-6, checkpoint-9" in said and f"model.init_from={tmp_path / 'checkpoint-3'}" in said


@pytest.mark.slow
def test_a_resume_that_would_change_the_optimizer_or_schedule_is_refused_before_the_target_loads(
        tmp_path, fixture_target_dir, monkeypatch):
    """Resuming with another training.optimizer failed after the whole data and target load with torch's "loaded
    state dict contains a parameter group that doesn't match"; other rates, betas or schedules were silently
    replaced by the checkpoint's. The check reads only the checkpoint's recipe and trainer_state.json."""
    from draftsmith.train import TrainingError, train
    from draftsmith.train import setup as setup_mod

    data = write_conversations(tmp_path / "conv.jsonl")
    train(tiny_recipe(fixture_target_dir, data, tmp_path, max_steps=1), log=lambda *a: None)

    def no_tokenizer(*args, **kwargs):
        raise AssertionError("the target was loaded before the same-run check")

    monkeypatch.setattr(setup_mod, "load_tokenizer", no_tokenizer)
    for changed, named in [
        ({"optimizer": "muon"}, 'training.optimizer "adamw" there, "muon" now'),
        ({"lr": 2e-3}, "training.lr 0.001 there, 0.002 now"),
        ({"warmup_ratio": 0.5, "lr_schedule": "linear"}, 'training.lr_schedule "cosine" there, "linear" now'),
        ({"batch_size": 4}, "training.batch_size 2 x 1 processes there, 4 x 1 now"),
        ({"grad_accum_steps": 1}, "training.grad_accum_steps 2 there, 1 now"),
    ]:
        with pytest.raises(TrainingError) as raised:
            train(tiny_recipe(fixture_target_dir, data, tmp_path, max_steps=2, **changed), log=lambda *a: None)
        message = str(raised.value)
        assert named in message and "\n" not in message and "set output_dir to a new folder" in message, changed
    with pytest.raises(AssertionError, match="before the same-run check"):  # max_steps may change
        train(tiny_recipe(fixture_target_dir, data, tmp_path, max_steps=2), log=lambda *a: None)


def test_stuck_watch_stops_after_the_configured_steps():
    from draftsmith.train.health import StuckWatch

    watch = StuckWatch("training.lr=1e+06", stop_after=6)
    for step in range(1, 4):
        watch.observe(step, 10.0 - step, 1.0)
    assert watch.stuck_since is None and watch.stop_message(3) is None
    for step in range(4, 10):
        watch.observe(step, 16.177, 0.0)
    assert watch.stuck_since == 4 and watch.stopping_soon() and watch.stop_message(9) is None
    watch.observe(10, 16.177, 0.0)
    assert watch.stop_message(10).startswith("steps 4..10: the drafter has not learned for 6 steps")
    assert "training.lr=1e+06" in watch.stop_message(10)
    watch.observe(11, 15.0, 0.3)  # learning again: the stretch is over
    assert watch.stuck_since is None and watch.stop_message(11) is None
    assert StuckWatch("training.lr=1", stop_after=None).stop_message(100) is None
