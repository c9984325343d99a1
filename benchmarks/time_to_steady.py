"""Time to the first steady training step, per method's shipped fixture recipe (issue 47 item 15): how long the
first steps take (torch.compile, FlexAttention, new batch shapes, allocator warm-up) before steps run at their
steady time, as the trainer's time budget measures it, in one JSON.

    python -m benchmarks.time_to_steady --out time_to_steady.json \
        --runs "eagle3 eagle3:auto eagle mtp dflash dflash:auto dspark"

A run is METHOD[:VARIANT]: `draftsmith train recipes/METHOD_fixture.yaml` on --data (ShareGPT records the fixture
target saw), its own recipe but for --steps optimizer steps under a --minutes budget (the budget's 10-step probe
times every step) and --eval-samples held out. VARIANT sets DRAFTSMITH_COMPILE_DYNAMIC (device.compile_dynamic):
`dynamic` (1: shapes dynamic from the first compilation, draftsmith's default), `static` (0: one compilation per
shape), `auto` (torch's default: static until a shape changes, then recompiled dynamic); none leaves it unset.

Per run, from the trainer's own lines: `steady_from` (the first probe step after which every step ran within 1.5x
of the steady time), `to_steady_s` (seconds from the first step's start to that step's start: the compilation and
warm-up a user waits through), `steady_ms` (the median step time over the probe's second half), `early_replan`
(whether the step time five steps after the probe was off by more than a quarter and re-planned the run), and
`wall_s` of the whole command (process start, data and target loading included). Every run is its own process,
one after another on one device; the data's tokenization is cached by the first run (data.cache_dir), torch's
compile caches are not (each run has its own inductor and Triton cache folders, as a first run has, unless
--warm-cache). --log-dir keeps each run's whole output (set TORCH_LOGS=recompiles to see what recompiled).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.runinfo import run_info

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"": None, "dynamic": "1", "static": "0", "auto": "auto"}
PLAN_LINE = re.compile(r"time budget [\d.]+ min: (?P<ms>[\d.]+) ms/step "
                       r"\(median of probe steps (?P<a>\d+)\.\.(?P<b>\d+)\).*?schedule to step (?P<total>\d+)"
                       r"(?:.*?steady from step (?P<steady>\d+), (?P<to>[\d.]+) s)?")
EARLY_LINE = re.compile(r"time budget: (?P<ms>[\d.]+) ms/step over steps \d+\.\.\d+, not the probe's")


def parse_runs(text: str) -> list[tuple[str, str]]:
    runs = []
    for item in text.split():
        method, _, variant = item.partition(":")
        if variant not in VARIANTS or not (ROOT / "recipes" / f"{method}_fixture.yaml").is_file():
            raise SystemExit(f"--runs: {item!r} is not METHOD[:VARIANT] with a recipes/METHOD_fixture.yaml and "
                             f"VARIANT one of {sorted(v for v in VARIANTS if v)}")
        runs.append((method, variant))
    return runs


def read_trainer_lines(lines: list[str]) -> dict:
    """The probe's figures from the trainer's log lines (draftsmith/train/budget.py)."""
    found: dict = {}
    for line in lines:
        plan = PLAN_LINE.search(line)
        if plan and "steady_ms" not in found:
            found.update(steady_ms=float(plan["ms"]), median_steps=f"{plan['a']}..{plan['b']}",
                         planned_total=int(plan["total"]), steady_from=int(plan["steady"] or 1),
                         to_steady_s=float(plan["to"] or 0.0))
        early = EARLY_LINE.search(line)
        if early:
            found.update(early_replan=True, early_ms=float(early["ms"]))
    if "steady_ms" in found:
        found.setdefault("early_replan", False)
    return found


def run_one(method: str, variant: str, args) -> dict:
    name = f"{method}:{variant}" if variant else method
    out = args.workdir / name.replace(":", "-")
    command = [sys.executable, "-m", "draftsmith.cli", "train", str(ROOT / "recipes" / f"{method}_fixture.yaml"),
               f"data.path={args.data}", f"data.cache_dir={args.workdir / 'cache'}", f"output_dir={out}",
               f"data.eval_samples={args.eval_samples}", f"training.max_steps={args.steps}",
               f"training.max_minutes={args.minutes}", "training.save_every=1000000", "training.eval_every=1000000",
               *args.overrides]
    env = dict(os.environ)
    env.pop("DRAFTSMITH_COMPILE_DYNAMIC", None)
    if VARIANTS[variant] is not None:
        env["DRAFTSMITH_COMPILE_DYNAMIC"] = VARIANTS[variant]
    env.setdefault("TQDM_MININTERVAL", "30")
    if not args.warm_cache:  # a cold compile, as a user's first run has: no kernels cached by an earlier run
        env["TORCHINDUCTOR_CACHE_DIR"] = str(out / "inductor-cache")
        env["TRITON_CACHE_DIR"] = str(out / "triton-cache")
    print(f"{name}: {' '.join(command)}", flush=True)
    started = time.time()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout,
                              check=False)
        code, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        code, text = "timeout", (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    row = {"run": name, "method": method, "compile_dynamic": VARIANTS[variant], "command": " ".join(command),
           "wall_s": round(time.time() - started, 1), "returncode": code}
    if args.log_dir is not None:  # the whole output, for TORCH_LOGS=recompiles and the like
        args.log_dir.mkdir(parents=True, exist_ok=True)
        (args.log_dir / f"{name.replace(':', '-')}.log").write_text(text)
    lines = text.splitlines()
    row.update(read_trainer_lines(lines))
    if code != 0:
        row["error"] = next((line for line in reversed(lines) if line.strip()), "")[-500:]
    row["trainer_says"] = [line for line in lines if line.startswith(("time budget", "done:"))]
    print(json.dumps({k: v for k, v in row.items() if k not in ("command", "trainer_says")}), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="eagle3 eagle mtp dflash dspark")
    parser.add_argument("--data", type=Path, default=ROOT / ".devdata" / "sharegpt_train.jsonl")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run (the probe is the first 10)")
    parser.add_argument("--minutes", type=float, default=5.0, help="training.max_minutes: the budget that probes")
    parser.add_argument("--eval-samples", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/time_to_steady"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--log-dir", type=Path, help="write each run's whole output (stdout and stderr) here")
    parser.add_argument("--warm-cache", action="store_true",
                        help="share torch's compile caches between runs (default: each run compiles cold, in its "
                             "own cache folders under --workdir)")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for every run (key=value)")
    args = parser.parse_args(argv)
    runs = parse_runs(args.runs)
    args.workdir.mkdir(parents=True, exist_ok=True)
    report = {**run_info(), "runs": []}
    for method, variant in runs:
        report["runs"].append(run_one(method, variant, args))
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(args.out)  # what was measured so far survives a cut-off call
    return 0 if all(r["returncode"] == 0 for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
