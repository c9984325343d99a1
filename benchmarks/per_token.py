"""Learning per token: draftsmith's EAGLE-3 ablations and the `speculators` trainer at equal tokens, on one GPU.

Issue 27's measurement in one process tree that fits one device call. Every training is its own process on the one
GPU (the fixture target is tiny, so one run leaves the GPU mostly idle), all started together:

- draftsmith: the recipe with each of `--configs` (one change at a time, CONFIGS below), each at every seed of
  `--seeds`, for exactly `--steps` optimizer steps (a fixed schedule: no time probe, warmup and decay over those
  steps), checkpoints every `--save-every` steps for the learning curve of the `--curve-configs`;
- speculators 0.9 (benchmarks/speculators_curve.py: its unchanged trainer, saving at the curve's steps), one run per
  `--peers` variant (PEERS below), on the same tokenized samples, draft vocabulary, TTT depth and aux layers, hidden
  states written with transformers (benchmarks/speculators_data.py), the last one before the final norm.

Each checkpoint is scored like every drafter of these benchmarks: simulated greedy chains over the target's float32
greedy answers to the MT-bench first turns (benchmarks/acceptance.py, exact at T=0), k = 1..7. Runs still training at
the deadline are stopped and scored at their last checkpoint (the JSON says so). Equal-token comparisons are valid
under the contention of the shared GPU; seconds are measured under it too (the JSON gives the number of runs that
shared the GPU), so an equal-time reading is only fair between runs that shared it alike.

    python benchmarks/per_token.py --recipe recipes/eagle3_fixture.yaml --work /tmp/pt --out OUT/per_token.json \
        --answers .devdata/mtbench_greedy_fp32.json --deadline-seconds 480 \
        data.path=.devdata/sharegpt_train.jsonl data.max_samples=2500 model.draft_vocab_size=8192
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# One change at a time against the recipe as shipped (issue 27). What speculators 0.9 does differently, with its
# source: lm_head frozen at the target's rows (model.py _init_vocab / load_verifier_weights: requires_grad False);
# Muon for the hidden matrices, lr 1e-3 (train/optimizers.py); linear schedule, 1% warmup (train/trainer.py
# _resolve_scheduler_steps); grad clip 1.0 (trainer.py train_epoch); KL summed over TTT steps with no decay
# (eagle3/core.py, losses/utils.py loss_function: per step the mean over masked positions; KL and soft CE have the
# same gradient); 8,192 real tokens packed per step (train/data.py CollateFn); AdamW betas (0.9, 0.999) and weight
# decay 0.01, Muon weight decay 0.1 (train/config/schema.py OptimizerArgs).
CONFIGS: dict[str, list[str]] = {
    "baseline": [],
    "freeze_head": ["training.train_draft_head=false"],
    "muon": ["training.optimizer=muon"],
    "muon_lr2e-3": ["training.optimizer=muon", "training.lr=2e-3"],
    "lr_2e-3": ["training.lr=2e-3"],
    "linear_warmup1": ["training.lr_schedule=linear", "training.warmup_ratio=0.01"],
    "decay_1.0": ["training.ttt_decay=1.0"],
    "clip_1.0": ["training.max_grad_norm=1.0"],
    "packing": ["training.packing=true"],
    "lk": ["training.loss=lk"],
    "keep_outside_vocab": ["training.mask_outside_draft_vocab=false"],
    "adamw_torch_defaults": ["training.adam_betas=[0.9,0.999]", "training.weight_decay=0.01"],
    # all of speculators' choices at once (not one change: the check that they add up to the peer)
    "speculators_like": ["training.train_draft_head=false", "training.optimizer=muon", "training.lr_schedule=linear",
                         "training.warmup_ratio=0.01", "training.ttt_decay=1.0", "training.max_grad_norm=1.0",
                         "training.packing=true"],
}
# speculators' side: `--epochs 2` made its linear schedule decay to 0 at the end of the measured steps (the old
# peer harness); its default is 20 epochs (train/config/schema.py TrainerArgs.epochs), so after ~850 steps a run
# with its defaults is still near lr 1e-3. "default_lr" keeps that schedule (total steps of 20 epochs) and stops
# after 2 epochs, which is what a run with its defaults has done after ~850 steps.
PEERS: dict[str, str] = {
    "decay_to_0": "",
    "default_lr": "--scheduler-total-steps {total20}",
}


def run_bg(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    with log.open("w") as f:  # the child holds its own handle
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    """End a run we started (its whole process group: speculators' data-loader workers too)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass


def draftsmith_points(run_dir: Path) -> list[dict]:
    """(step, tokens, seconds, checkpoint) of every checkpoint a draftsmith run left."""
    points = []
    for ckpt in sorted(run_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1])):
        state_file = ckpt / "trainer_state.json"
        if state_file.is_file():
            state = json.loads(state_file.read_text())
            points.append({"step": state["step"], "tokens": state["tokens_seen"],
                           "seconds": round(state["train_seconds"], 1), "checkpoint": str(ckpt)})
    return points


def speculators_points(save_dir: Path, tokens_per_step: float) -> list[dict]:
    """The curve checkpoints of benchmarks/speculators_curve.py; tokens = steps x the mean real tokens a step."""
    curve = save_dir / "curve.jsonl"
    rows = [json.loads(line) for line in curve.read_text().splitlines()] if curve.is_file() else []
    return [{"step": r["step"], "tokens": round(r["step"] * tokens_per_step), "seconds": r["seconds"],
             "checkpoint": r["checkpoint"]} for r in rows]


def score(items: list[dict], target_path: str, answers_path: str, out: Path) -> None:
    """Worker: simulate every item's drafter (imported first when it is a speculators checkpoint); JSON lines."""
    from acceptance import load_answers, simulate

    from draftsmith.models.target import TargetModel

    target = TargetModel.from_pretrained(target_path, dtype="float32")
    answers = load_answers(answers_path)
    for item in items:
        path = item["checkpoint"]
        started = time.time()
        try:
            if item["trainer"] == "speculators":
                imported = path.rstrip("/") + "_draftsmith"
                subprocess.run([sys.executable, "-m", "draftsmith.cli", "import", path, "--out", imported,
                                "--target", target_path, "--overwrite"], check=True, capture_output=True, text=True)
                path = imported
            sim = simulate(target, path, answers)
            row = {**item, "tau": sim["tau"], "per_position_acceptance_k7": sim["per_position_acceptance_k7"]}
        except Exception as e:  # one bad checkpoint must not lose the others' scores
            detail = getattr(e, "stderr", "") or ""
            row = {**item, "error": f"{type(e).__name__}: {str(e)[:300]} {detail[-500:]}"}
        row["score_seconds"] = round(time.time() - started, 1)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "score":  # internal: one scoring worker
        items = json.loads(Path(argv[1]).read_text())
        score(items, argv[2], argv[3], Path(argv[4]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", required=True)
    p.add_argument("--work", type=Path, required=True, help="fresh folder for data, runs and logs")
    p.add_argument("--out", type=Path, required=True, help="the result JSON")
    p.add_argument("--answers", required=True, help="the target's float32 greedy answers (acceptance.py answers)")
    p.add_argument("--deadline-seconds", type=float, required=True,
                   help="the whole script ends by then: training is stopped early enough to score what it left")
    p.add_argument("--score-seconds", type=float, default=90, help="kept for scoring at the end")
    p.add_argument("--steps", type=int, default=834, help="draftsmith's optimizer steps (speculators: 2 epochs)")
    p.add_argument("--configs", default="baseline,freeze_head,muon,speculators_like")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--curve-configs", default="baseline", help="draftsmith configs scored at every checkpoint")
    p.add_argument("--save-every", type=int, default=135, help="draftsmith's checkpoint period of the curve runs")
    p.add_argument("--peers", default="decay_to_0,default_lr")
    p.add_argument("--spec-epochs", type=int, default=2)
    p.add_argument("--spec-save-steps", default="135,270,405,540,675,810",
                   help="speculators' curve steps (its last step is always saved too)")
    p.add_argument("--spec-flags", default="--loss-implementation eager --num-workers 2",
                   help="extra `speculators train` flags for every peer run")
    p.add_argument("--score-workers", type=int, default=4)
    p.add_argument("--skip-speculators", action="store_true", help="draftsmith only (no speculators installed)")
    p.add_argument("overrides", nargs="*", help="recipe overrides for both trainers (data, draft vocabulary)")
    args = p.parse_args(argv)

    from ablate_eagle3 import hardware, versions
    from transformers import AutoTokenizer

    from draftsmith import device as dev
    from draftsmith.config import load_recipe
    from draftsmith.data import prepare_dataset
    from draftsmith.models.checkpoint import write_json_atomic

    t_start = time.time()
    deadline = t_start + args.deadline_seconds
    train_deadline = deadline - args.score_seconds
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    recipe = load_recipe(args.recipe, args.overrides)
    target_path = str(recipe.model.target)
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; known: {', '.join(CONFIGS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    peers = [] if args.skip_speculators else [x for x in args.peers.split(",") if x]
    result = {"command": shlex.join(["python", *sys.argv]), "hardware": hardware(), "versions": versions(),
              "recipe": args.recipe, "overrides": args.overrides, "steps": args.steps, "seeds": seeds,
              "configs": {c: CONFIGS[c] for c in configs}, "peers": {x: PEERS[x] for x in peers},
              "ttt_steps": recipe.training.ttt_steps, "draft_vocab_size": recipe.model.draft_vocab_size}

    def save():
        write_json_atomic(result, args.out)

    def log(msg):
        print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    runs: list[dict] = []
    # 1. draftsmith: every config at every seed, started at once
    curve_configs = set(args.curve_configs.split(","))
    for config in configs:
        for seed in seeds:
            name = f"{config}_s{seed}"
            out_dir = work / "draftsmith" / name
            curve = config in curve_configs and seed == seeds[0]
            cmd = [sys.executable, "-m", "draftsmith.cli", "train", args.recipe, *args.overrides, *CONFIGS[config],
                   f"training.max_steps={args.steps}", "training.max_minutes=null", "training.epochs=1000",
                   f"training.seed={seed}", f"training.save_every={args.save_every if curve else args.steps}",
                   "training.keep_checkpoints=50", f"training.eval_every={args.steps}", f"output_dir={out_dir}"]
            runs.append({"name": name, "trainer": "draftsmith", "config": config, "seed": seed, "curve": curve,
                         "dir": str(out_dir), "cmd": shlex.join(cmd[2:]),
                         "proc": run_bg(cmd, work / f"{name}.log", env), "started": time.time() - t_start})
    log(f"started {len(runs)} draftsmith runs: {', '.join(r['name'] for r in runs)}")

    # 2. speculators: the same samples, hidden states written here (on the GPU, beside the runs above)
    if peers:
        from speculators_data import write_speculators_dataset

        tokenizer = AutoTokenizer.from_pretrained(target_path)
        data = prepare_dataset(recipe.data, tokenizer, log=lambda *a: None)
        samples = [*data.train, *data.eval]
        spec_data = work / "speculators_data"
        started = time.time()
        write_speculators_dataset(target_path, samples, spec_data, recipe.model.aux_layer_ids, dev.get_device(), 16,
                                  vocab_samples=len(data.train), draft_vocab_size=recipe.model.draft_vocab_size,
                                  log=lambda *a: None)
        # speculators drops the first token of every sample (shift_batch): the tokens it trains on per epoch
        epoch_tokens = sum(len(s.input_ids) - 1 for s in data.train)
        result["data"] = {"train_samples": len(data.train), "eval_samples": len(data.eval),
                          "tokens": sum(len(s.input_ids) for s in data.train), "speculators_epoch_tokens": epoch_tokens,
                          "speculators_data_seconds": round(time.time() - started, 1)}
        log(f"speculators data written in {result['data']['speculators_data_seconds']} s")
        meta = json.loads((spec_data / "speculators_data.json").read_text())
        steps_per_epoch = args.steps / 2  # refined from the sampler below when it imports
        try:
            from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

            lengths = [len(s.input_ids) for s in data.train]
            steps_per_epoch = len(MultipackDistributedBatchSamplerV2(batch_max_length=8192, lengths=lengths,
                                                                     num_replicas=1, rank=0, seed=42))
        except Exception as e:  # noqa: BLE001 - an estimate is enough for the schedule of default_lr
            log(f"speculators' sampler: {type(e).__name__}: {e}; {steps_per_epoch} steps an epoch assumed")
        result["data"]["speculators_steps_per_epoch"] = steps_per_epoch
        ratio = (len(data.train) + 0.5) / len(samples)  # its validation split = draftsmith's held-out samples
        for peer in peers:
            name = f"speculators_{peer}"
            save_dir = work / "speculators" / name
            last = int(round(args.spec_epochs * steps_per_epoch))
            save_steps = sorted({int(s) for s in args.spec_save_steps.split(",") if s and int(s) < last})
            flags = ["--speculator-type", "eagle3", "--verifier-name-or-path", str(Path(target_path).resolve()),
                     "--data-path", str(spec_data.resolve()), "--target-layer-ids", *map(str, meta["aux_layer_ids"]),
                     "--draft-vocab-size", str(recipe.model.draft_vocab_size), "--ttt-steps",
                     str(recipe.training.ttt_steps), "--total-seq-len", "8192", "--epochs", str(args.spec_epochs),
                     "--train-data-ratio", f"{ratio:.6f}", "--on-missing", "raise", "--log-freq", "50",
                     "--save-path", str(save_dir), "--log-dir", str(work / f"{name}_logs"),
                     *shlex.split(args.spec_flags),
                     *shlex.split(PEERS[peer].format(total20=int(round(20 * steps_per_epoch))))]
            cmd = [sys.executable, str(HERE / "speculators_curve.py"), *flags]
            peer_env = {**env, "SPEC_SAVE_STEPS": ",".join(map(str, save_steps))}
            runs.append({"name": name, "trainer": "speculators", "config": peer, "seed": 42, "curve": True,
                         "dir": str(save_dir), "cmd": shlex.join(flags), "epoch_tokens": epoch_tokens,
                         "tokens_per_step": epoch_tokens / steps_per_epoch,
                         "proc": run_bg(cmd, work / f"{name}.log", peer_env), "started": time.time() - t_start})
        log(f"started {len(peers)} speculators runs")
    result["concurrent_runs"] = len(runs)

    # 3. wait, stopping whatever still trains when scoring must begin
    while any(r["proc"].poll() is None for r in runs) and time.time() < train_deadline:
        time.sleep(2)
    for r in runs:
        r["stopped_at_deadline"] = r["proc"].poll() is None
        stop(r["proc"])
        r["exit"] = r["proc"].returncode
        r["ended"] = round(time.time() - t_start, 1)
        if r["exit"] not in (0, None) and not r["stopped_at_deadline"]:
            r["log_tail"] = (work / f"{r['name']}.log").read_text(errors="replace").splitlines()[-12:]
    log("training over: " + ", ".join(f"{r['name']} exit {r['exit']}" + (" (stopped)" if r["stopped_at_deadline"]
                                                                      else "") for r in runs))

    # 4. score: the final checkpoint of every run first, then the curve points
    finals, curve_items = [], []
    for r in runs:
        points = draftsmith_points(Path(r["dir"])) if r["trainer"] == "draftsmith" else \
            speculators_points(Path(r["dir"]), r["tokens_per_step"])
        r["points"] = points
        for i, point in enumerate(points):
            item = {"run": r["name"], "trainer": r["trainer"], **point}
            if i == len(points) - 1:
                finals.append(item)
            elif r["curve"]:
                curve_items.append(item)
    items = finals + curve_items
    while not Path(args.answers).is_file() and time.time() < deadline - 30:  # written beside the runs
        time.sleep(2)
    if not Path(args.answers).is_file():
        raise SystemExit(f"{args.answers}: no answers to score with (acceptance.py answers)")
    workers = max(1, min(args.score_workers, len(items)))
    procs = []
    for w in range(workers):
        shard = work / f"score_items_{w}.json"
        shard.write_text(json.dumps(items[w::workers]))
        part = work / f"score_{w}.jsonl"
        part.unlink(missing_ok=True)
        procs.append((run_bg([sys.executable, str(Path(__file__).resolve()), "score", str(shard), target_path,
                              args.answers, str(part)], work / f"score_{w}.log", env), part))
    while any(proc.poll() is None for proc, _ in procs) and time.time() < deadline - 5:
        time.sleep(1)
    for proc, _ in procs:
        stop(proc)
    scored = {}
    for _, part in procs:
        if part.is_file():
            for line in part.read_text().splitlines():
                row = json.loads(line)
                scored[(row["run"], row["step"])] = row
    log(f"scored {len(scored)} of {len(items)} checkpoints")

    # 5. the JSON: every run with its points, then the comparisons
    result["runs"] = []
    for r in runs:
        points = [{**pt, **{k: v for k, v in scored.get((r["name"], pt["step"]), {}).items()
                            if k in ("tau", "per_position_acceptance_k7", "error")}} for pt in r["points"]]
        result["runs"].append({k: v for k, v in r.items() if k not in ("proc", "points")} | {"points": points})
    result["summary"] = summarize(result["runs"])
    result["seconds"] = round(time.time() - t_start, 1)
    save()
    for line in result["summary"]["lines"]:
        print(line)
    return 0


def tau5(point: dict) -> float | None:
    return (point.get("tau") or {}).get("5")


def summarize(runs: list[dict]) -> dict:
    """Per config: each seed's final tau at k=5 and step-0 acceptance, their mean; the learning curves (tokens,
    seconds, tau k=5) of the curve runs; draftsmith's baseline against each peer at equal tokens (its curve read
    at the peer's final tokens, linearly between checkpoints) and at equal time (likewise at the peer's seconds)."""
    by_config: dict[str, dict] = {}
    lines = []
    for r in runs:
        final = r["points"][-1] if r["points"] else {}
        key = f"{r['trainer']}:{r['config']}"
        entry = by_config.setdefault(key, {"seeds": {}, "steps": {}, "tokens": {}})
        entry["seeds"][str(r["seed"])] = {"tau_k5": tau5(final), "tau": final.get("tau"),
                                          "acc_pos1": (final.get("per_position_acceptance_k7") or [None])[0]}
        entry["steps"][str(r["seed"])] = final.get("step")
        entry["tokens"][str(r["seed"])] = final.get("tokens")
    for key, entry in by_config.items():
        values = [v["tau_k5"] for v in entry["seeds"].values() if v["tau_k5"] is not None]
        entry["mean_tau_k5"] = round(sum(values) / len(values), 4) if values else None
        lines.append(f"{key:40s} tau k=5 " + " / ".join(f"{v['tau_k5']}" for v in entry["seeds"].values())
                     + f"  mean {entry['mean_tau_k5']}  steps {list(entry['steps'].values())}")
    curves = {r["name"]: [{"step": pt["step"], "tokens": pt["tokens"], "seconds": pt["seconds"], "tau_k5": tau5(pt)}
                          for pt in r["points"] if tau5(pt) is not None] for r in runs if r["curve"]}
    comparisons = {}
    base = next((c for name, c in curves.items() if name.startswith("baseline_")), None)
    for name, curve in curves.items():
        if not name.startswith("speculators_") or not curve or not base:
            continue
        peer = curve[-1]
        at_tokens = interpolate(base, "tokens", peer["tokens"])
        at_seconds = interpolate(base, "seconds", peer["seconds"])
        comparisons[name] = {
            "peer_tau_k5": peer["tau_k5"], "peer_tokens": peer["tokens"], "peer_seconds": peer["seconds"],
            "draftsmith_at_equal_tokens": at_tokens, "ratio_equal_tokens": ratio(at_tokens, peer["tau_k5"]),
            "draftsmith_at_equal_seconds": at_seconds, "ratio_equal_seconds": ratio(at_seconds, peer["tau_k5"])}
        lines.append(f"baseline vs {name}: equal tokens {comparisons[name]['ratio_equal_tokens']}x, equal time "
                     f"{comparisons[name]['ratio_equal_seconds']}x (seconds under shared-GPU contention)")
    return {"by_config": by_config, "curves": curves, "comparisons": comparisons, "lines": lines}


def interpolate(curve: list[dict], key: str, x: float) -> float | None:
    """tau k=5 of `curve` at `key` = x, linear between its points; None outside them."""
    pts = sorted((p[key], p["tau_k5"]) for p in curve)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return round(y0 + (y1 - y0) * (x - x0) / max(x1 - x0, 1e-9), 4)
    if pts and abs(pts[-1][0] - x) <= 0.02 * max(abs(x), 1):  # the same budget within 2%
        return pts[-1][1]
    return None


def ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


if __name__ == "__main__":
    sys.exit(main())
