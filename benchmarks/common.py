"""Helpers several benchmarks share: writing a result, running a benchmark module in a child process, peak memory.

The children run as `python -m benchmarks.NAME` with this process's working directory and environment, which
are what let this process import `benchmarks` (the repository root, or PYTHONPATH naming it).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any


def write_json(obj: Any, path: str | os.PathLike) -> Path:
    """Write `obj` as indented JSON to `path`, all or nothing (a temporary file, then a rename), creating its
    folder; a run cut short keeps the last complete file. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.replace(path)
    return path


def module_command(name: str, *args: str) -> list[str]:
    """The command that runs benchmarks/NAME.py as a module in a child process with this Python."""
    return [sys.executable, "-m", f"benchmarks.{name}", *args]


def child_json(name: str, *args: str) -> dict:
    """Run benchmarks/NAME.py with `args` in a child process (one measurement a process: peak memory is per
    process) and return the JSON object its last line of output prints. A failed child ends this process with
    its exit code, after the end of its error output."""
    child = subprocess.run(module_command(name, *args), capture_output=True, text=True)
    if child.returncode != 0:
        print(child.stderr[-2000:], file=sys.stderr)
        raise SystemExit(child.returncode)
    return json.loads(child.stdout.strip().splitlines()[-1])


def peak_memory(device) -> dict[str, float]:
    """This process's peak resident memory and the device's peak allocated memory so far, in GiB."""
    from draftsmith import device as dev

    return {"peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
            "peak_device_allocated_gib": round(dev.max_memory_allocated(device) / 2**30, 3)}
