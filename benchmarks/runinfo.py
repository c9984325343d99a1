"""Where and how a benchmark result was measured: the block every benchmark's JSON starts with.

    from benchmarks.runinfo import run_info
    report = {**run_info(), "runs": [...]}            # or run_info(target): also its device, dtype and path

Keys (`KEYS`): `command` (as typed, quoted to paste back into a shell: `python -m benchmarks.NAME ...`),
`git_commit` and `git_dirty` (the checkout's HEAD, and whether its files differ from it), `versions` (python and
PACKAGES, None where one is not installed), `hardware` (`draftsmith.device.device_name` of the device the
benchmarks run on), `gpu_count` (accelerators of that kind, 0 on the CPU), `cpu`, `cpus`, `date` (UTC, ISO 8601).

The lent GPU machine receives the checkout without `.git`: there, `git_commit` is the BENCHMARK_GIT_COMMIT
environment variable (write the commit into the command you send, e.g. `BENCHMARK_GIT_COMMIT=a44ddc3 bash
benchmarks/gpu_kernels.sh`) and `git_dirty` BENCHMARK_GIT_DIRTY (0 or 1); None where they are not set either.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]  # the checkout the benchmarks run from
PACKAGES = ("draftsmith", "torch", "transformers", "accelerate", "triton", "vllm", "speculators")
KEYS = ("command", "git_commit", "git_dirty", "versions", "hardware", "gpu_count", "cpu", "cpus", "date")
TARGET_KEYS = ("device", "dtype", "target")  # added by run_info(target)
COMMIT_VARIABLE, DIRTY_VARIABLE = "BENCHMARK_GIT_COMMIT", "BENCHMARK_GIT_DIRTY"


def command_line(argv: list[str] | None = None) -> str:
    """The command that started this process, quoted: `python -m benchmarks.NAME ARGS` when it runs as a module."""
    if argv is not None:
        return shlex.join(argv)
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name.startswith("benchmarks."):
        return shlex.join(["python", "-m", spec.name, *sys.argv[1:]])
    return shlex.join(["python", *sys.argv])


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):  # no git on the machine, or it hangs
        return None
    return done.stdout if done.returncode == 0 else None


def git_state() -> dict[str, Any]:
    """{"git_commit", "git_dirty"} of the checkout; from the environment where it is not a git checkout."""
    head = _git("rev-parse", "HEAD")
    if head is None:
        dirty = os.environ.get(DIRTY_VARIABLE)
        return {"git_commit": os.environ.get(COMMIT_VARIABLE) or None,
                "git_dirty": None if dirty is None else dirty not in ("0", "", "false")}
    status = _git("status", "--porcelain")  # tracked changes and untracked files that git does not ignore
    return {"git_commit": head.strip(), "git_dirty": None if status is None else bool(status.strip())}


def versions() -> dict[str, str | None]:
    """Python's version and each of PACKAGES' (the imported module's own where it is imported, else the
    installed distribution's; None where it is neither). Nothing is imported here: vLLM's import is slow."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        module = sys.modules.get(name)
        version = getattr(module, "__version__", None) if module is not None else None
        if version is None:
            try:
                version = metadata.version(name)
            except metadata.PackageNotFoundError:
                version = None
        found[name] = None if version is None else str(version)
    return found


def hardware(device: Any = None) -> dict[str, Any]:
    """{"hardware": its name, "gpu_count": accelerators of its kind} for `device` (default: the one
    draftsmith.device picks)."""
    import torch

    from draftsmith import device as dev

    device = dev.get_device() if device is None else torch.device(device)
    module = getattr(torch, device.type, None) if device.type != "cpu" else None
    count = module.device_count() if module is not None and hasattr(module, "device_count") else 0
    return {"hardware": dev.device_name(device), "gpu_count": int(count)}


def run_info(target: Any = None, *, device: Any = None, command: str | None = None) -> dict[str, Any]:
    """Command, git commit, versions, hardware and date of this run (KEYS); with `target` (a TargetModel) also
    its device, dtype and path (TARGET_KEYS). `command` replaces the process's own (a shell script's summary)."""
    if device is None and target is not None:
        device = target.device
    info = {"command": command if command is not None else command_line(), **git_state(), "versions": versions(),
            **hardware(device), "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if target is not None:
        info.update(device=str(target.device), dtype=str(target.dtype).removeprefix("torch."),
                    target=str(getattr(target, "name_or_path", "")))
    return info
