"""FSDP2 and DeepSpeed ZeRO-2 / ZeRO-3 on two CPU processes (gloo, torchrun: the very code a GPU run takes,
draftsmith/distributed.py): the drafter sharded trains as one process does on the same global batch; the frozen
target sharded over the processes captures the unsharded target's states; a sharded run's checkpoint (safetensors +
JSON, no pickle) resumes under 1 and 2 processes; a sharding the run cannot do is one line before the target
loads.

Every 2-process run goes through PROBE below, which writes what each process holds (DTensors, bytes) before the
first step: a silent fallback to DDP (whole parameters, or a whole optimizer state, on each process) fails the
tests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from draftsmith.config import save_recipe
from draftsmith.train import train
from draftsmith.train.errors import TrainingError
from test_multiprocess import rows, train_on_two_processes, weights
from test_train import tiny_recipe, write_conversations

STEPS = 9  # checkpoints at 3, 6 and 9

# A torchrun entry: draftsmith's own `train` command, with each process writing what it holds of the drafter and
# the target to PROBE_DIR/rank{N}.json before the first step, and, with DIE_AT_STEP, every process killed right
# after that step's checkpoint landed.
PROBE = """
import json, os, sys
from pathlib import Path
import torch
from draftsmith import distributed
from draftsmith.train import loop

def held(module):
    params = list(module.parameters())
    return {"dtensors": sum(type(p).__name__ == "DTensor" for p in params), "params": len(params),
            "zero3": sum(hasattr(p, "ds_id") for p in params),
            "local_bytes": distributed.local_bytes(module),
            "whole_bytes": distributed.whole_bytes(module)}

real_train_run, real_save = loop.train_run, loop.save_checkpoint

def probe_then_train(run, *args, **kwargs):
    target = run.target
    facts = {"drafter": held(run.drafter), "sharding": run.sharding,
             "target_layers": held(target.layers), "target_embeddings": held(target.embed_tokens),
             "trainable_bytes": sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in run.trainable),
             "torch_linear": torch.nn.functional.linear is torch._C._nn.linear}
    if run.sharding in distributed.ZERO_STAGES:  # what this process's optimizer steps (and keeps state for)
        facts["zero_partition_bytes"] = sum(flat.nbytes for flat in distributed.zero_partitions(run.drafter))
    Path(os.environ["PROBE_DIR"], f"rank{run.accelerator.process_index}.json").write_text(json.dumps(facts))
    return real_train_run(run, *args, **kwargs)

def save_then_die(*args, **kwargs):
    real_save(*args, **kwargs)
    if args[5]["step"] == int(os.environ.get("DIE_AT_STEP", "0")):
        os._exit(17)

loop.train_run, loop.save_checkpoint = probe_then_train, save_then_die
from draftsmith.cli import main
sys.exit(main(["train", *sys.argv[1:]]))
"""


def two_processes(folder: Path, recipe, *, die_at: int | None = None, expect_ok: bool = True,
                  launcher_config: Path | None = None):
    """The recipe trained by 2 torchrun processes (or `accelerate launch --config_file launcher_config`) through
    PROBE; (the run, each rank's probe facts)."""
    save_recipe(recipe, folder / "recipe.yaml")
    (folder / "probe.py").write_text(PROBE)
    probe_dir = folder / "probe"
    probe_dir.mkdir(exist_ok=True)
    os.environ["PROBE_DIR"] = str(probe_dir)
    if die_at is not None:
        os.environ["DIE_AT_STEP"] = str(die_at)
    try:
        run = train_on_two_processes(folder / "recipe.yaml", script=folder / "probe.py", expect_ok=expect_ok,
                                     launcher_config=launcher_config)
    finally:
        os.environ.pop("PROBE_DIR")
        os.environ.pop("DIE_AT_STEP", None)
    facts = [json.loads((probe_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    return run, facts


def assert_about_half(facts, part):
    """Each of the 2 processes holds about half of `part`'s parameter bytes (FSDP2 pads a shard by a row at most),
    every parameter a DTensor (FSDP2) or a ZeRO-3 partition."""
    whole = facts[0][part]["whole_bytes"]
    for rank in facts:
        assert 0.45 * whole <= rank[part]["local_bytes"] <= 0.55 * whole, (part, rank[part], whole)
        assert max(rank[part]["dtensors"], rank[part]["zero3"]) == rank[part]["params"] > 0, (part, rank[part])


def assert_same_steps(got, want, steps, loss_rel=1e-5, norm_rel=1e-4):
    assert sorted(got) == sorted(want) == list(steps)
    for step in steps:
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=loss_rel), step
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=norm_rel), step


def assert_same_weights(got_run, want_run):
    """The final weights of two runs: each floating tensor within 1e-4 of its norm, the rest equal."""
    w1, w2 = weights(want_run), weights(got_run)
    assert w1.keys() == w2.keys()
    for name in w1:
        if w1[name].is_floating_point():
            assert (w2[name] - w1[name]).norm() <= 1e-4 * w1[name].norm(), name
        else:
            assert torch.equal(w2[name], w1[name]), name


def kill_and_resume_under_one_then_two(folder: Path, recipe, sharding: str, uninterrupted_run: Path):
    """`recipe(processes)` on 2 processes killed after the step-3 checkpoint, resumed by 1 process and stopped after
    step 6, resumed by 2 processes to step STEPS: the losses of `uninterrupted_run`, and no pickle in the folder."""
    killed, facts = two_processes(folder, recipe(2), die_at=3, expect_ok=False)
    assert killed.returncode != 0 and facts[0]["sharding"] == sharding
    assert sorted(rows(folder / "run")) == [1, 2, 3]

    import draftsmith.train.loop as loop_mod

    real_save = loop_mod.save_checkpoint

    def save_then_stop(*args, **kwargs):
        real_save(*args, **kwargs)
        if args[5]["step"] == 6:
            raise KeyboardInterrupt

    loop_mod.save_checkpoint = save_then_stop
    try:
        with pytest.raises(KeyboardInterrupt):
            train(recipe(1), log=lambda *a: None)
    finally:
        loop_mod.save_checkpoint = real_save
    assert sorted(rows(folder / "run")) == list(range(1, 7))

    two_processes(folder, recipe(2))
    assert_same_steps(rows(folder / "run"), rows(uninterrupted_run), range(1, STEPS + 1))
    assert not_safetensors_or_text(folder / "run") == []


@pytest.fixture(scope="module")
def runs(tmp_path_factory, fixture_target_dir):
    """EAGLE-3, 9 steps at a global batch of 2: one process (batch 2), and FSDP2 over two processes (batch 1 each)
    with the target's decoder layers sharded too."""
    tmp = tmp_path_factory.mktemp("fsdp2")
    data = write_conversations(tmp / "conv.jsonl")
    train(tiny_recipe(fixture_target_dir, data, tmp / "one", grad_accum_steps=1, batch_size=2, max_steps=STEPS),
          log=lambda *a: None)
    (tmp / "two").mkdir()
    _, facts = two_processes(tmp / "two", tiny_recipe(fixture_target_dir, data, tmp / "two", grad_accum_steps=1,
                                                      batch_size=1, max_steps=STEPS, sharding="fsdp2",
                                                      shard_target=True))
    return tmp, data, facts


@pytest.mark.slow
def test_fsdp2_over_two_processes_trains_as_one_process(runs):
    """Losses to 1e-5 and gradient norms to 1e-4 of one process's, every step (the 1e-5 / 1e-4 of the DDP test:
    float32 sums in another order); a gloo reduction that summed instead of averaging (pytorch issue 162338) would
    double every gradient norm. Final weights to 1e-4 of each tensor's norm."""
    tmp, _, facts = runs
    assert [f["sharding"] for f in facts] == ["fsdp2", "fsdp2"]
    assert_about_half(facts, "drafter")
    assert_same_steps(rows(tmp / "two" / "run"), rows(tmp / "one" / "run"), range(1, STEPS + 1))
    assert_same_weights(tmp / "two" / "run", tmp / "one" / "run")


@pytest.mark.slow
def test_the_target_sharded_over_two_processes_holds_half_its_layers(runs):
    """Each process holds half of the target's decoder-layer bytes; the embeddings (tied to the head here) stay
    whole, read outside the forward by every loss. The states it captured are the unsharded target's: the losses
    above equal one process's, whose target was whole (test_sharded_capture_equals_the_whole_target pins them
    directly)."""
    _, _, facts = runs
    assert_about_half(facts, "target_layers")
    for rank in facts:
        embeddings = rank["target_embeddings"]
        assert embeddings["dtensors"] == 0 and embeddings["local_bytes"] == embeddings["whole_bytes"] > 0


CAPTURE = """
import json, sys
import torch
import torch.distributed as dist
from draftsmith import distributed
from draftsmith.models.target import TargetModel

dist.init_process_group("gloo")
path, out = sys.argv[1], sys.argv[2]
sharded = TargetModel.sharded(path, distributed.device_mesh(torch.device("cpu")), dtype="float32", device="cpu")
whole = TargetModel.from_pretrained(path, dtype="float32", device="cpu")
torch.manual_seed(dist.get_rank())  # each process its own batch: the processes run their forwards together
ids = torch.randint(0, whole.vocab_size, (2, 40))
mask = torch.ones_like(ids)
mask[1, 30:] = 0
layers = [1, 4, whole.num_layers]
a, b = sharded.capture(ids, mask, layers), whole.capture(ids, mask, layers)
facts = {"aux_equal": torch.equal(a.aux_hidden, b.aux_hidden), "last_equal": torch.equal(a.last_hidden, b.last_hidden),
         "aux_max_diff": (a.aux_hidden - b.aux_hidden).abs().max().item(),
         "layer_bytes": distributed.local_bytes(sharded.layers),
         "whole_layer_bytes": distributed.local_bytes(whole.layers)}
open(f"{out}/rank{dist.get_rank()}.json", "w").write(json.dumps(facts))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_sharded_capture_equals_the_whole_target(tmp_path, fixture_target_dir):
    (tmp_path / "capture.py").write_text(CAPTURE)
    train_on_two_processes(fixture_target_dir, str(tmp_path), script=tmp_path / "capture.py")
    for rank in (0, 1):
        facts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert facts["aux_equal"] and facts["last_equal"], facts
        assert facts["layer_bytes"] == pytest.approx(facts["whole_layer_bytes"] / 2, rel=0.05), facts


def not_safetensors_or_text(folder: Path) -> list[str]:
    """Files in `folder` other than safetensors (each opened by the safetensors reader) and JSON / YAML / text
    that is not a zip archive (torch.save) or a pickle: what a resume could have to unpickle."""
    from safetensors import safe_open

    found = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt"):
                continue
        head = path.read_bytes()[:2]
        if path.suffix not in (".json", ".jsonl", ".yaml", "") or head == b"PK" or head[:1] == b"\x80":
            found.append(str(path))
    return found


@pytest.mark.slow
def test_a_sharded_run_killed_resumes_under_one_then_two_processes(runs, tmp_path, fixture_target_dir):
    """2 processes (FSDP2) killed after the step-3 checkpoint, resumed by 1 process and killed after step 6, resumed
    by 2 processes (FSDP2) to step 9: the losses of the uninterrupted 2-process run, and no pickle written."""
    tmp, data, _ = runs

    def recipe(processes):
        return tiny_recipe(fixture_target_dir, data, tmp_path, grad_accum_steps=1, batch_size=2 // processes,
                           max_steps=STEPS, sharding="fsdp2", shard_target=processes == 2)

    kill_and_resume_under_one_then_two(tmp_path, recipe, "fsdp2", tmp / "two" / "run")


@pytest.fixture(scope="module", params=["zero2", "zero3"])
def zero_runs(request, tmp_path_factory, fixture_target_dir):
    """EAGLE-3, 9 steps of 2 accumulated micro-batches at a global batch of 2 each: one process (batch 2), and
    DeepSpeed ZeRO-2 / ZeRO-3 over two processes (batch 1 each), launched as a user does: accelerate launch
    --config_file recipes/accelerate/deepspeed_zero{2,3}.yaml (made for GPUs; on this CPU host draftsmith joins the
    processes)."""
    stage = request.param
    tmp = tmp_path_factory.mktemp(stage)
    data = write_conversations(tmp / "conv.jsonl")
    train(tiny_recipe(fixture_target_dir, data, tmp / "one", grad_accum_steps=2, batch_size=2, max_steps=STEPS),
          log=lambda *a: None)
    (tmp / "two").mkdir()
    config = Path(__file__).resolve().parents[1] / "recipes" / "accelerate" / f"deepspeed_{stage}.yaml"
    run, facts = two_processes(tmp / "two", tiny_recipe(fixture_target_dir, data, tmp / "two", grad_accum_steps=2,
                                                        batch_size=1, max_steps=STEPS), launcher_config=config)
    return stage, tmp, data, facts, run


@pytest.mark.slow
def test_zero_over_two_processes_trains_as_one_process(zero_runs):
    """DeepSpeed ZeRO-2 / ZeRO-3 (deepspeed.initialize called by draftsmith, gloo): losses to 1e-5 and gradient norms
    to 1e-4 of one process's every step, through gradient accumulation (DeepSpeed's boundary set from accelerate's
    count), final weights to 1e-4 of each tensor's norm; each process steps about half the drafter's parameters
    (its partition of the fp32 master weights and optimizer state). Under ZeRO-2 its forward holds them whole;
    under ZeRO-3 each process holds about half of them too (a fallback to ZeRO-2 or DDP fails here), and torch's
    F.linear stays torch's (DeepSpeed's ZeRO-3 "memory efficient linear" would replace it for the whole process)."""
    stage, tmp, _, facts, run = zero_runs
    assert [f["sharding"] for f in facts] == [stage, stage]
    assert all(f["torch_linear"] for f in facts)
    assert f"sharding: DeepSpeed ZeRO-{stage[-1]} over 2 processes" in run.stdout
    for rank in facts:
        assert 0.45 * rank["trainable_bytes"] <= rank["zero_partition_bytes"] <= 0.55 * rank["trainable_bytes"], rank
        drafter = rank["drafter"]
        if stage == "zero2":
            assert drafter["local_bytes"] == drafter["whole_bytes"], rank
        else:
            assert 0.45 * drafter["whole_bytes"] <= drafter["local_bytes"] <= 0.55 * drafter["whole_bytes"], rank
    assert_same_steps(rows(tmp / "two" / "run"), rows(tmp / "one" / "run"), range(1, STEPS + 1))
    assert_same_weights(tmp / "two" / "run", tmp / "one" / "run")


@pytest.mark.slow
def test_a_zero_run_killed_resumes_under_one_then_two_processes(zero_runs, tmp_path, fixture_target_dir):
    """ZeRO-2 / ZeRO-3 on 2 processes killed after the step-3 checkpoint, resumed by 1 process and stopped after
    step 6, resumed by 2 processes (the same stage) to step 9: the losses of the uninterrupted run (the weights and
    optimizer state gathered from the partitions, then carried into them again), with no pickle and no trust
    flag."""
    stage, tmp, data, _, _ = zero_runs

    def recipe(processes):
        return tiny_recipe(fixture_target_dir, data, tmp_path, grad_accum_steps=2, batch_size=2 // processes,
                           max_steps=STEPS, sharding=stage)

    kill_and_resume_under_one_then_two(tmp_path, recipe, stage, tmp / "two" / "run")


METHODS = ["eagle", "mtp", "dflash", "dspark", "gemma4_mtp"]


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_every_method_trains_sharded_as_under_ddp(method, tmp_path, fixture_target_dir):
    """Each other method's pinned recipe (tests/test_pinned_losses.py), 4 steps on 2 processes: FSDP2 with the
    target sharded, and DeepSpeed ZeRO-3, give DDP's losses and gradient norms. (Against one process these methods
    differ under DDP as well: they normalise each process's loss by its own tokens, or draw their anchors per
    process.)"""
    from test_pinned_losses import OVERRIDES, TRAINING, tiny_gemma4
    from test_pinned_losses import write_conversations as chats

    from draftsmith.config import recipe_from_dict

    target = fixture_target_dir
    extra = {}
    if method == "gemma4_mtp":
        target, assistant = tiny_gemma4(tmp_path, fixture_target_dir)
        extra = {"gemma4_mtp": {"assistant": str(assistant)}}
    data = chats(tmp_path / "chats.jsonl")
    got = {}
    for sharding in ("ddp", "fsdp2", "zero3"):
        folder = tmp_path / sharding
        folder.mkdir()
        recipe = {"model": {"target": str(target), "method": method, "dtype": "float32"},
                  "data": {"path": str(data), "max_length": 96, "eval_samples": 0, "cache_dir": str(folder / "c")},
                  "training": {**TRAINING, "max_steps": 4, "batch_size": 1, "sharding": sharding,
                               "shard_target": sharding == "fsdp2"},
                  "output_dir": str(folder / "run"), **extra}
        for section, values in OVERRIDES[method].items():
            recipe.setdefault(section, {}).update(values)
        _, facts = two_processes(folder, recipe_from_dict(recipe))
        if sharding != "ddp":
            assert_about_half(facts, "drafter")
        if sharding == "fsdp2":
            assert_about_half(facts, "target_layers")
        got[sharding] = rows(folder / "run")
    assert_same_steps(got["fsdp2"], got["ddp"], range(1, 5))
    assert_same_steps(got["zero3"], got["ddp"], range(1, 5))


# ---- refused in one line, before the target loads ------------------------------------------------------------------
@pytest.fixture
def no_target(monkeypatch):
    """Loading the target fails the test: a refusal must come before it."""
    import draftsmith.train.setup as setup_mod

    def loaded(*args, **kwargs):
        raise AssertionError("the target was loaded before the refusal")

    monkeypatch.setattr(setup_mod, "_load_target", loaded)


@pytest.mark.parametrize("case, env, training, words", [
    ("fsdp1", {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, {}, "FSDP1 is not supported"),
    ("zero stage 4 launcher", {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "4"}, {},
     "DeepSpeed ZeRO stages 1, 2 and 3"),
    ("muon under zero2", {}, {"sharding": "zero2", "optimizer": "muon"}, "DeepSpeed takes one"),
    ("optimizer offload", {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
                           "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"}, {}, "offload_optimizer_device"),
    ("muon sharded", {}, {"sharding": "fsdp2", "optimizer": "muon"}, "training.optimizer=muon"),
    ("muon under the fsdp launcher", {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, {"optimizer": "muon"},
     "fsdp_version: 2"),
    ("a sharded target on one process", {}, {"shard_target": True}, "one process has nothing to share"),
])
def test_a_sharding_the_run_cannot_do_is_one_line(case, env, training, words, tmp_path, fixture_target_dir,
                                                   monkeypatch, no_target):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    data = write_conversations(tmp_path / "conv.jsonl")
    with pytest.raises(TrainingError) as refused:
        train(tiny_recipe(fixture_target_dir, data, tmp_path, **training), log=lambda *a: None)
    message = str(refused.value)
    assert words in message and "\n" not in message, message
    assert not (tmp_path / "run" / "checkpoint-3").exists()


def test_processes_that_accelerate_left_apart_are_refused(monkeypatch):
    """torchrun started 2 processes but accelerate made each its own run (a GPU launcher config on a host without
    GPUs, before draftsmith asked for its multi-CPU mode): one line, not two runs writing one folder."""
    from types import SimpleNamespace

    from draftsmith.train.setup import check_processes

    monkeypatch.setenv("WORLD_SIZE", "2")
    alone = SimpleNamespace(num_processes=1, distributed_type="NO")
    with pytest.raises(TrainingError, match="the launcher started 2 processes, but accelerate made each its own run"):
        check_processes(tiny_recipe(Path("t"), Path("d"), Path("o")), "ddp", "", alone)
    check_processes(tiny_recipe(Path("t"), Path("d"), Path("o")), "ddp", "", SimpleNamespace(num_processes=2))


def test_deepspeed_missing_is_one_line(tmp_path, fixture_target_dir, monkeypatch, no_target):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "deepspeed" else real_find_spec(name, *a, **k))
    data = write_conversations(tmp_path / "conv.jsonl")
    with pytest.raises(TrainingError, match=r"DeepSpeed is not installed: pip install 'draftsmith\[deepspeed\]'"):
        train(tiny_recipe(fixture_target_dir, data, tmp_path, sharding="zero2"), log=lambda *a: None)


def test_a_sharded_target_is_refused_when_training_reads_a_store(tmp_path, fixture_target_dir, no_target):
    data = write_conversations(tmp_path / "conv.jsonl")
    recipe = tiny_recipe(fixture_target_dir, data, tmp_path, shard_target=True)
    recipe.data.hidden_states_path = str(tmp_path / "store")
    with pytest.raises(TrainingError, match="the target's layers do not run when training reads the store"):
        train(recipe, log=lambda *a: None)


@pytest.mark.slow
def test_the_scale_benchmark_measures_sharded_runs_on_cpu_processes(tmp_path, fixture_target_dir):
    """benchmarks/scale_train.py, the script the multi-GPU machine runs, at the fixture's shape on 1 and 2 CPU
    processes: each world size it can run is measured (the trainer said it sharded), the rest recorded as not run."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "scale.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.scale_train", "--cpu", "--gpus", "1,2,100000",
                           "--runs", "fixture:ddp fixture:fsdp2+shard_target fixture:zero3", "--seq", "64",
                           "--batch", "1", "--steps", "2", "--warmup", "1", "--draft-vocab", "512", "--tokenizer",
                           str(fixture_target_dir), "--workdir", str(tmp_path / "work"), "--out", str(out)],
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = {r["run"]: r for r in json.loads(out.read_text())["runs"]}
    assert runs["fixture:ddp@1"]["scaling_efficiency"] == 1.0
    assert "needs 2 processes" in runs["fixture:fsdp2+shard_target@1"]["not_run"]
    sharded = runs["fixture:fsdp2+shard_target@2"]
    assert sharded["tokens_per_s_per_gpu"] > 0 and sharded["steps_measured"] == 2
    assert any(line.startswith("sharding: FSDP2 over 2 processes") for line in sharded["trainer_says"])
    assert any(line.startswith("target: decoder layers sharded over 2") for line in sharded["trainer_says"])
    assert "this host has" in runs["fixture:ddp@100000"]["not_run"]
    zero3 = runs["fixture:zero3@2"]
    assert zero3["tokens_per_s_per_gpu"] > 0
    assert any(line.startswith("sharding: DeepSpeed ZeRO-3 over 2 processes") for line in zero3["trainer_says"])
