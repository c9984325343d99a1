"""Where the time of a real `draftsmith train` step goes: the trainer itself (its data, collate, loss, optimizer and
logging, as a user runs it) under torch.profiler for a few steady steps, after its compilations and time probes.

    python -m benchmarks.profile_train --out OUT/profile_eagle3 recipes/eagle3_fixture.yaml \
        data.path=.devdata/sharegpt_train.jsonl data.max_samples=2500 model.draft_vocab_size=8192

Writes into --out: profile.json (the command, hardware, versions; the wall time of every optimizer step; for the
profiled steps the wall time, the device's busy time (the sum of its kernels' self time; overlapping streams
counted twice) and its share of the wall time, the top kernels by self device time and the top operators by self
CPU time), and device.txt / cpu.txt, torch.profiler's key_averages tables. A step whose device share is far below
1 waits on the host: launches, Python, host syncs or the data; one near 1 is bound by its kernels.

The trainer is not changed: a global optimizer step hook (the first optimizer the trainer steps) advances the
profiler's schedule and takes the step times. The run writes its checkpoints into --out/run (removed at the end
unless --keep-run)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile, schedule

from benchmarks.common import write_json
from benchmarks.runinfo import run_info
from draftsmith import device as dev
from draftsmith.config import load_recipe
from draftsmith.train import train


def _device_time_us(event) -> float:
    return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)))


def _rows(events, key, limit: int) -> list[dict]:
    """The top `limit` events by `key` (microseconds), as name, total ms, calls."""
    ranked = sorted(events, key=key, reverse=True)[:limit]
    return [{"name": e.key[:120], "ms": round(key(e) / 1000, 3), "calls": e.count} for e in ranked if key(e) > 0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="recipe overrides (key=value), as `draftsmith train` takes them")
    p.add_argument("--out", required=True, help="folder for profile.json, device.txt, cpu.txt (and run/)")
    p.add_argument("--skip", type=int, default=40, help="optimizer steps before the profiler records")
    p.add_argument("--active", type=int, default=5, help="optimizer steps it records")
    p.add_argument("--steps", type=int, default=None, help="training.max_steps (default: skip + active + 5)")
    p.add_argument("--keep-run", action="store_true", help="keep the run's checkpoints in --out/run")
    p.add_argument("--tf32", action="store_true", help="float32 matrix products in TF32 "
                                                        "(torch.set_float32_matmul_precision('high'))")
    args = p.parse_intermixed_args(argv)  # flags may follow the overrides
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps = args.steps or args.skip + args.active + 5
    run_dir = out / "run"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: never resume an earlier profile's
    recipe = load_recipe(args.recipe, [*args.overrides, f"training.max_steps={steps}", "training.max_minutes=null",
                                       f"training.eval_every={steps * 10}", f"training.save_every={steps * 10}",
                                       f"output_dir={run_dir}"])
    device = dev.get_device()
    if args.tf32:
        torch.set_float32_matmul_precision("high")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    step_times: list[float] = []
    first: list[int] = []  # id of the optimizer whose steps count (the trainer may step several a step)
    prof = profile(activities=activities, schedule=schedule(wait=args.skip, warmup=2, active=args.active, repeat=1),
                   record_shapes=False)

    def on_step(optimizer, *_):
        if not first:
            first.append(id(optimizer))
        if id(optimizer) == first[0]:
            step_times.append(time.perf_counter())
            prof.step()

    handle = register_optimizer_step_post_hook(on_step)
    prof.start()
    try:
        train(recipe)
    finally:
        prof.stop()
        handle.remove()
    walls = [b - a for a, b in zip(step_times, step_times[1:])]  # step i+1's wall time, from hook to hook
    # steps skip+2+1 .. skip+2+active were recorded (the schedule records after its `skip + 2` steps)
    recorded = walls[args.skip + 2: args.skip + 2 + args.active]
    events = prof.key_averages()
    device_us = sum(_device_time_us(e) for e in events  # the kernels, as torch's table totals them
                    if e.device_type.name in ("CUDA", "PrivateUse1") and not getattr(e, "is_user_annotation", False))
    wall_s = sum(recorded)
    result = {
        **run_info(device=device),
        "recipe": args.recipe, "overrides": args.overrides, "steps": steps, "tf32": args.tf32,
        "cudnn_attention": os.environ.get("DRAFTSMITH_CUDNN_ATTENTION") == "1",
        "step_ms": [round(w * 1000, 2) for w in walls],
        "profiled_steps": args.active,
        "profiled_wall_ms_per_step": round(wall_s * 1000 / max(len(recorded), 1), 2),
        "device_busy_ms_per_step": round(device_us / 1000 / args.active, 2),
        "device_busy_share": round(device_us / 1e6 / wall_s, 3) if wall_s and device_us else None,
        "steady_ms_per_step_median": round(sorted(walls[args.skip:])[len(walls[args.skip:]) // 2] * 1000, 2)
        if len(walls) > args.skip else None,
        "top_device": _rows(events, _device_time_us, 25),
        "top_cpu": _rows(events, lambda e: float(e.self_cpu_time_total), 25),
    }
    write_json(result, out / "profile.json")
    sort_device = "self_device_time_total" if device.type != "cpu" else "self_cpu_time_total"
    (out / "device.txt").write_text(events.table(sort_by=sort_device, row_limit=40))
    (out / "cpu.txt").write_text(events.table(sort_by="self_cpu_time_total", row_limit=40))
    if not args.keep_run:
        shutil.rmtree(run_dir, ignore_errors=True)
    print(json.dumps({k: result[k] for k in ("profiled_wall_ms_per_step", "device_busy_ms_per_step",
                                             "device_busy_share", "steady_ms_per_step_median")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
