"""The host-side rates a collection's writer depends on, on this machine: sha256 and the shard checksum, a host copy
out of pinned memory (what `ShardWriter._land` does per batch), a pinned allocation, and a device-to-host copy of
one batch of 8B-shaped bf16 states.

    python -m benchmarks.host_copy --out host_copy.json [--gigabytes 0.5]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import write_json
from benchmarks.runinfo import run_info
from draftsmith import device as dev
from draftsmith.data.store import shard_checksum


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
    row = {**run_info(), "bytes": n, "torch_threads": torch.get_num_threads()}
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
    write_json(row, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
