"""Data-parallel training on two CPU processes (gloo, launched by torchrun as accelerate's multi-CPU mode): the
same global batch gives the same losses, gradient norms and weights as one process, and a checkpoint written by
two processes resumes under one and under two."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.config import save_recipe
from draftsmith.train import train
from test_train import tiny_recipe, write_conversations


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_on_two_processes(recipe_path, *overrides, script=None, expect_ok=True, launcher_config=None):
    """torchrun with two processes; ACCELERATE_USE_CPU makes accelerate's multi-CPU (gloo) data parallelism. With
    `launcher_config`, the user's command instead: accelerate launch --config_file CONFIG (no --cpu)."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    entry = [str(script)] if script else ["-m", "draftsmith.train"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), *entry, str(recipe_path), *overrides]
    if launcher_config is not None:
        env.pop("ACCELERATE_USE_CPU")
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(launcher_config),
               "--num_processes", "2", "--main_process_port", str(free_port()), *entry, str(recipe_path),
               *overrides]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if expect_ok:
        assert run.returncode == 0, run.stderr[-3000:]
    return run


def rows(run_dir):
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r}


def weights(run_dir):
    latest = (run_dir / "latest").read_text().strip()
    return load_file(run_dir / latest / "model.safetensors")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, fixture_target_dir):
    """One process at batch 2 against two processes at batch 1 each (the same global batch), 6 steps."""
    tmp = tmp_path_factory.mktemp("ddp")
    data = write_conversations(tmp / "conv.jsonl")
    one = tiny_recipe(fixture_target_dir, data, tmp / "one", grad_accum_steps=1, batch_size=2)
    train(one, log=lambda *a: None)
    save_recipe(tiny_recipe(fixture_target_dir, data, tmp / "two", grad_accum_steps=1, batch_size=1),
                tmp / "two.yaml")
    train_on_two_processes(tmp / "two.yaml")
    return tmp, data


@pytest.mark.slow
def test_two_processes_train_as_one_on_the_same_global_batch(runs):
    tmp, _ = runs
    one, two = rows(tmp / "one" / "run"), rows(tmp / "two" / "run")
    assert sorted(one) == sorted(two) == [1, 2, 3, 4, 5, 6]
    for step in one:
        assert two[step]["loss"] == pytest.approx(one[step]["loss"], rel=1e-5), step
        assert two[step]["grad_norm"] == pytest.approx(one[step]["grad_norm"], rel=1e-4), step
    w1, w2 = weights(tmp / "one" / "run"), weights(tmp / "two" / "run")
    assert w1.keys() == w2.keys()
    for name in w1:  # float32 sums in another order, through six Adam steps: equal to ~1e-5 of each tensor
        if w1[name].is_floating_point():
            assert (w2[name] - w1[name]).norm() <= 1e-4 * w1[name].norm(), name
        else:
            assert torch.equal(w2[name], w1[name]), name


DIE_AFTER_FIRST_SAVE = """
import os, sys
from draftsmith.train import loop
real = loop.save_checkpoint
def save_then_die(*args, **kwargs):
    real(*args, **kwargs)
    os._exit(17)  # killed right after the step-3 checkpoint landed, on every process
loop.save_checkpoint = save_then_die
from draftsmith.cli import main
sys.exit(main(["train", *sys.argv[1:]]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("resume_on", [1, 2])
def test_a_checkpoint_of_two_processes_resumes_on_one_and_on_two(runs, tmp_path, fixture_target_dir, resume_on):
    tmp, data = runs
    recipe = tiny_recipe(fixture_target_dir, data, tmp_path, grad_accum_steps=1, batch_size=1)
    save_recipe(recipe, tmp_path / "two.yaml")
    (tmp_path / "die.py").write_text(DIE_AFTER_FIRST_SAVE)
    killed = train_on_two_processes(tmp_path / "two.yaml", script=tmp_path / "die.py", expect_ok=False)
    assert killed.returncode != 0
    assert sorted(rows(tmp_path / "run")) == [1, 2, 3]
    if resume_on == 1:  # the same global batch: 2 samples in one process
        train(tiny_recipe(fixture_target_dir, data, tmp_path, grad_accum_steps=1, batch_size=2),
              log=lambda *a: None)
    else:
        train_on_two_processes(tmp_path / "two.yaml")
    want, got = rows(tmp / "two" / "run"), rows(tmp_path / "run")
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in want:
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-5), step
