"""Hidden-state shards written to disk with and without early writeback, side by side in one process.

    python -m benchmarks.shard_write --work /tmp/shards --out shard_write.json

`store.write_shard` (what `draftsmith collect` runs in its writing thread) over synthetic bf16 shards shaped like a
Llama-3.1-8B collection (3 aux layers + the last, hidden 4096, 512-token samples), each written, fsynced and renamed
as a collection does; once with `store.WRITEBACK_CHUNK` as shipped (the disk asked to write every chunk as it is
copied) and once with None (the page cache keeps a shard dirty until its closing fsync), alternating, --repeats
times each. Reports MB/s per run and the ratio of the medians, with the command, the machine, the kernel's dirty-page
settings and the versions. Disk speeds move from run to run on shared machines: compare the two within one file.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import write_json
from benchmarks.runinfo import run_info
from draftsmith.data import store

HIDDEN, LAYERS, SAMPLE_TOKENS = 4096, 4, 512  # 3 aux layers + the last, as the 8B shape collects


def synthetic_shard(shard_bytes: int, seed: int) -> dict[str, torch.Tensor]:
    """Tensors named and shaped as a collection's shard, random bf16 states, about `shard_bytes` in all."""
    g = torch.Generator().manual_seed(seed)
    per_sample = SAMPLE_TOKENS * HIDDEN * LAYERS * 2
    tensors = {}
    for i in range(max(1, shard_bytes // per_sample)):
        tensors[f"{i}.aux"] = torch.randn(SAMPLE_TOKENS, HIDDEN * (LAYERS - 1), generator=g).to(torch.bfloat16)
        tensors[f"{i}.last"] = torch.randn(SAMPLE_TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
        tensors[f"{i}.input_ids"] = torch.zeros(SAMPLE_TOKENS, dtype=torch.int32)
        tensors[f"{i}.loss_mask"] = torch.ones(SAMPLE_TOKENS, dtype=torch.int8)
    return tensors


def write_shards(shards, folder: Path, chunk: int | None) -> float:
    """Seconds to write every shard one after the other through store.write_shard with WRITEBACK_CHUNK = chunk."""
    shipped = store.WRITEBACK_CHUNK
    store.WRITEBACK_CHUNK = chunk
    try:
        folder.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        for i, (tensors, order, prefix) in enumerate(shards):
            store.write_shard(tensors, order, prefix, folder / f"shard-{i:05d}.safetensors")
        return time.perf_counter() - start
    finally:
        store.WRITEBACK_CHUNK = shipped
        shutil.rmtree(folder, ignore_errors=True)


def dirty_settings() -> dict:
    out = {}
    for key in ("dirty_background_ratio", "dirty_ratio", "dirty_background_bytes", "dirty_expire_centisecs"):
        try:
            out[key] = int(Path(f"/proc/sys/vm/{key}").read_text())
        except OSError:
            pass
    return out


def memory_gib() -> float | None:
    """The machine's memory: the page cache a shard can stay dirty in scales with it."""
    try:
        kib = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return round(kib / 2**20, 1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True, help="a folder on the disk to measure (emptied afterwards)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shard-gb", type=float, default=0.5, help="bytes per shard (GB)")
    p.add_argument("--shards", type=int, default=4, help="shards per run")
    p.add_argument("--repeats", type=int, default=3, help="runs of each writer, alternating")
    args = p.parse_args()
    shards = []
    for i in range(args.shards):
        tensors = synthetic_shard(int(args.shard_gb * 1e9), seed=i)
        order, prefix, _ = store.shard_layout(tensors)
        shards.append((tensors, order, prefix))
    total = sum(len(prefix) + sum(t.numel() * t.element_size() for t in tensors.values())
                for tensors, _, prefix in shards)
    writers = {"writeback": store.WRITEBACK_CHUNK, "page_cache": None}
    runs: dict[str, list[float]] = {name: [] for name in writers}
    for rep in range(args.repeats):
        for name, chunk in writers.items():
            seconds = write_shards(shards, args.work / f"{name}-{rep}", chunk)
            runs[name].append(total / seconds / 1e6)
            print(f"{name:10s} run {rep}: {runs[name][-1]:,.0f} MB/s", flush=True)
    medians = {name: statistics.median(v) for name, v in runs.items()}
    report = {
        **run_info(), "kernel": platform.release(),
        "vm": dirty_settings(), "memory_gib": memory_gib(), "work": str(args.work), "bytes_per_run": total,
        "shards_per_run": args.shards,
        "writeback_chunk_bytes": store.WRITEBACK_CHUNK,
        "mb_per_s": runs, "median_mb_per_s": medians,
        "writeback_over_page_cache": round(medians["writeback"] / medians["page_cache"], 3),
    }
    write_json(report, args.out)
    print(f"writeback {medians['writeback']:,.0f} MB/s against page cache {medians['page_cache']:,.0f} MB/s: "
          f"{report['writeback_over_page_cache']}x; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
