"""The host-side rates a collection's writer depends on, on this machine: sha256 and the shard checksum, a host copy
out of pinned memory (what `ShardWriter._land` does per batch), a pinned allocation, and a device-to-host copy of
one batch of 8B-shaped bf16 states.

    python benchmarks/host_copy.py --out host_copy.json [--gigabytes 0.5]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from draftsmith import device as dev  # noqa: E402
from draftsmith.data.store import shard_checksum  # noqa: E402


def seconds(fn, repeat: int = 3) -> float:
    """Best of `repeat` timed calls of `fn` (after one untimed call)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--gigabytes", type=float, default=0.5, help="bytes of one batch (0.5: 16k tokens of bf16 states)")
    args = p.parse_args(argv)
    n = int(args.gigabytes * 1e9)
    host = torch.randint(0, 255, (n,), dtype=torch.uint8)
    gb = n / 1e9
    row = {"command": shlex.join(["python", *sys.argv]), "machine": platform.processor() or platform.machine(),
           "cpus": os.cpu_count(), "torch": torch.__version__, "bytes": n,
           "torch_threads": torch.get_num_threads()}
    view = memoryview(host.numpy())
    row["sha256_gb_per_s"] = round(gb / seconds(lambda: hashlib.sha256(view).digest()), 3)
    # the store's shard checksum: sha256 of 64 MiB pieces on the checksum threads, then of their digests
    row["shard_checksum_gb_per_s"] = round(gb / seconds(lambda: shard_checksum({"x": host}, ["x"], b"")), 3)
    row["host_clone_gb_per_s"] = round(gb / seconds(lambda: host.clone()), 3)
    device = dev.get_device()
    if device.type == "cuda":
        start = time.perf_counter()
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        row["pinned_allocation_seconds"] = round(time.perf_counter() - start, 4)
        row["pinned_clone_gb_per_s"] = round(gb / seconds(lambda: pinned.clone()), 3)
        src = host.to(device)

        def d2h():
            pinned.copy_(src, non_blocking=True)
            dev.synchronize(device)

        row["d2h_pinned_gb_per_s"] = round(gb / seconds(d2h), 3)
    print(json.dumps(row, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(row, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
