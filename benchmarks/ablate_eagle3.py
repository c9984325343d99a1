"""Ablate draftsmith's EAGLE-3 training one change at a time, at a fixed wall-clock budget, and keep what helps.

Each configuration trains from the same recipe and data with `training.max_minutes` (so the schedule fits the
budget), then is scored by the simulated greedy acceptance over the target's own float32 greedy answers to the
80 MT-bench first turns (benchmarks/acceptance.py; exact for temperature 0) and, when given, over its
temperature-1 samples. The search is greedy and staged: stage 1 tries each change alone on the baseline; the
changes that raised tau at k=5 are combined; stage 2 tries each remaining change on that combination, and the
best configuration wins. Every run is saved to the JSON as it finishes.

    python -m benchmarks.ablate_eagle3 --recipe recipes/eagle3_fixture.yaml --minutes 0.67 \
        --answers .devdata/mtbench_greedy_fp32.json --answers-t1 .devdata/mtbench_t1_fp32.json \
        --out benchmarks/results/local/ablation.json data.max_samples=2500 model.draft_vocab_size=8192
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

from benchmarks.acceptance import load_answers, simulate
from benchmarks.common import write_json
from benchmarks.runinfo import run_info
from draftsmith import device as dev

# What the issue names as candidate causes, as recipe overrides on top of the baseline (the recipe as shipped).
STAGE1 = {
    "tokens_per_step_8192": ["training.tokens_per_step=8192"],
    "muon": ["training.optimizer=muon", "training.lr=1e-3"],
    "eagle31_norms": ["eagle3.norm_before_fc=true", "eagle3.norm_before_residual=true", "eagle3.norm_output=true"],
}
STAGE2 = {
    "lr_x2": None,  # twice the combination's learning rate (filled in at run time)
    "decay_1.0": ["training.ttt_decay=1.0"],
    "keep_outside_vocab": ["training.mask_outside_draft_vocab=false"],
    "lk_loss": ["training.loss=lk"],
    "linear_schedule": ["training.lr_schedule=linear"],
    "packing": ["training.packing=true"],  # the same token budget, packed into one row: no padding computed
}


def train_for_minutes(recipe_path: str, overrides: list[str], minutes: float, log=lambda *a: None):
    """Train the recipe with `overrides` to a `minutes` time budget (no step cap, no checkpoints or evaluations on
    the way); returns (recipe, final checkpoint, {steps, tokens, train_seconds, wall_seconds, trainer state})."""
    from draftsmith.config import load_recipe
    from draftsmith.train import train

    recipe = load_recipe(recipe_path, [*overrides, f"training.max_minutes={minutes}", "training.max_steps=null",
                                       "training.save_every=100000", "training.eval_every=100000"])
    started = time.time()
    checkpoint = train(recipe, log=log)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return recipe, checkpoint, {"steps": state["step"], "tokens": state["tokens_seen"],
                                "train_seconds": round(state["train_seconds"], 1),
                                "wall_seconds": round(time.time() - started, 1), "state": state}


def run_one(name: str, recipe_path: str, overrides: list[str], minutes: float, out_dir: Path, answers: dict,
            answers_t1: dict | None, target) -> dict:
    run_dir = out_dir / name
    lines: list[str] = []
    recipe, checkpoint, run = train_for_minutes(
        recipe_path, [*overrides, "training.epochs=1000", f"output_dir={run_dir}"], minutes, log=lines.append)
    state = run.pop("state")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last_train = [r for r in rows if "loss" in r][-1]
    row = {"name": name, "overrides": overrides, **run,
           "plan": state.get("plan"), "final_train_acc": [round(last_train.get(f"train/acc_{i}", 0), 3)
                                                         for i in range(recipe.training.ttt_steps)],
           "log": [x for x in lines if x.startswith(("time budget", "optimizer", "stopping", "done"))]}
    row["t0"] = simulate(target, str(checkpoint), answers)
    if answers_t1 is not None:
        row["t1"] = simulate(target, str(checkpoint), answers_t1)
    row["tau_k5"] = row["t0"]["tau"]["5"]
    gc.collect()
    dev.empty_cache(dev.get_device())
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", required=True)
    p.add_argument("--minutes", type=float, required=True, help="training.max_minutes of every run")
    p.add_argument("--answers", type=Path, required=True)
    p.add_argument("--answers-t1", type=Path, default=None)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--runs-dir", type=Path, default=Path("runs/ablation"))
    p.add_argument("--deadline-minutes", type=float, default=None, help="start no run after this much wall time")
    p.add_argument("--only", default=None, help="comma-separated names to run after the baseline (no search)")
    p.add_argument("--candidate", action="append", default=[], metavar="NAME=OVERRIDES",
                   help="a further candidate for --only: NAME=space-separated recipe overrides, e.g. "
                        "'regenerated=data.path=.devdata/regenerated.jsonl' (repeatable)")
    p.add_argument("overrides", nargs="*", help="recipe overrides shared by every run (data, vocab size)")
    args = p.parse_args(argv)

    from draftsmith.config import load_recipe
    from draftsmith.models.target import TargetModel

    base = load_recipe(args.recipe, args.overrides)
    target = TargetModel.from_pretrained(base.model.target, dtype="float32")
    answers = load_answers(args.answers)
    answers_t1 = load_answers(args.answers_t1) if args.answers_t1 else None
    started = time.time()
    result = {**run_info(), "recipe": args.recipe, "shared_overrides": args.overrides, "minutes_per_run": args.minutes,
              "metric": "simulated greedy tau over the target's float32 answers (exact at T=0)", "runs": []}

    def save():  # after every stage, all or nothing: a run cut short keeps what it measured
        write_json(result, args.out)

    def run(name, overrides):
        if args.deadline_minutes is not None and (time.time() - started) / 60 > args.deadline_minutes:
            print(f"skipping {name}: past the deadline", flush=True)
            return None
        row = run_one(name, args.recipe, [*args.overrides, *overrides], args.minutes, args.runs_dir, answers,
                      answers_t1, target)
        result["runs"].append(row)
        save()
        t1 = f", T=1 k5 {row['t1']['tau']['5']:.3f}" if "t1" in row else ""
        print(f"{name}: {row['steps']} steps, {row['tokens']} tokens, tau k1 {row['t0']['tau']['1']:.3f} "
              f"k5 {row['tau_k5']:.3f}{t1}", flush=True)
        return row

    extra = {}
    for entry in args.candidate:
        name, sep, overrides = entry.partition("=")
        if not sep or not name or not overrides.split():
            p.error(f"--candidate {entry!r}: write NAME=key=value [key=value ...]")
        extra[name] = overrides.split()
    candidates = {**STAGE1, **STAGE2, **extra}
    if args.only is not None and (unknown := [n for n in args.only.split(",") if n not in candidates]):
        p.error(f"--only: unknown candidate(s) {', '.join(unknown)}; known: {', '.join(candidates)}")
    baseline = run("baseline", [])
    if args.only is not None:
        for name in args.only.split(","):
            run(name, candidates[name] or [])
        return 0
    kept = []
    for name, overrides in STAGE1.items():
        row = run(name, overrides)
        if row is not None and row["tau_k5"] > baseline["tau_k5"]:
            kept += overrides
    best_name, best = "baseline", baseline
    if kept:
        combo = run("stage1_combination", kept)
        if combo is not None and combo["tau_k5"] >= best["tau_k5"]:
            best_name, best = "stage1_combination", combo
    best_overrides = kept if best_name != "baseline" else []
    lr = load_recipe(args.recipe, [*args.overrides, *best_overrides]).training.lr
    final = list(best_overrides)
    for name, overrides in STAGE2.items():
        overrides = overrides or [f"training.lr={2 * lr}"]
        row = run(name + "_on_best", [*best_overrides, *overrides])
        if row is not None and row["tau_k5"] > best["tau_k5"]:
            final += overrides
    result["best"] = {"stage1": best_name, "overrides": final}
    if final != best_overrides:
        run("final", final)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
