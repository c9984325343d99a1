"""Learning per token: draftsmith's EAGLE-3 ablations and the `speculators` trainer at equal tokens, on one GPU.

Issue 27's measurement, staged over device calls (benchmarks/gpu_per_token.sh; `--merge` folds earlier calls' JSON
into this one's). Every training is its own process on the one GPU:

- draftsmith: the recipe with each of `--configs` (one change at a time, CONFIGS below), each at every seed of
  `--seeds`, for exactly `--steps` optimizer steps (a fixed schedule: no time probe, warmup and decay over those
  steps), a checkpoint every `--save-every` steps (the learning curve, and what a run stopped at the deadline is
  scored at); at most `--max-parallel` at a time, started in the order given (configs, then seeds);
- speculators 0.9 (benchmarks/speculators_curve.py: its unchanged trainer, saving at `--spec-save-steps`), one run
  per `--peers` variant (PEERS below), on the same tokenized samples, draft vocabulary, TTT depth and aux layers,
  hidden states written with transformers (benchmarks/speculators_data.py), the last one before the final norm.

Each checkpoint is scored like every drafter of these benchmarks: simulated greedy chains over the target's float32
greedy answers to the MT-bench first turns (benchmarks/acceptance.py, exact at T=0), k = 1..7. One scoring worker
scores the curve checkpoints while the runs train (the curve runs: the first seed of each `--curve-configs` config,
and every peer); when training is over, more workers score what is left, each run's last checkpoint first. A run
still training at the training deadline (`--deadline-seconds` less `--score-seconds`) is stopped and scored at its
last checkpoint: the JSON marks it `"partial": true` with the step it reached and the steps it was planned for.

The GPU is time-shared, not split: in the first attempt (benchmarks/results/per_token_h200/) ten processes on it
made 11k tokens/s each where one alone makes ~57k, so the runs of one call share a nearly fixed throughput, and
what fits in a call is set by the number of runs, not by how many run at once. Equal-token comparisons are valid
under that contention; seconds are measured under it (the JSON gives the runs that shared the GPU), so an
equal-time reading is only fair between runs that shared it alike.

    python -m benchmarks.per_token --recipe recipes/eagle3_fixture.yaml --work /tmp/pt --out OUT/per_token.json \
        --answers .devdata/mtbench_greedy_fp32.json --deadline-seconds 520 --configs baseline,freeze_head \
        --peers default_lr data.path=.devdata/sharegpt_train.jsonl data.max_samples=2500 model.draft_vocab_size=8192
    python -m benchmarks.per_token merge CALL1/per_token.json CALL2/per_token.json --out per_token.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import module_command, write_json
from benchmarks.runinfo import KEYS as RUN_INFO_KEYS, run_info

# One change at a time against the recipe as shipped (issue 27). What speculators 0.9 does differently, with its
# source: lm_head frozen at the target's rows (model.py _init_vocab / load_verifier_weights: requires_grad False);
# Muon for the hidden matrices, lr 1e-3 (train/optimizers.py); linear schedule, 1% warmup (train/trainer.py
# _resolve_scheduler_steps); grad clip 1.0 (trainer.py train_epoch); KL summed over TTT steps with no decay
# (eagle3/core.py, losses/utils.py loss_function: per step the mean over masked positions; KL and soft CE have the
# same gradient); 8,192 real tokens packed per step (train/data.py CollateFn); AdamW betas (0.9, 0.999) and weight
# decay 0.01, Muon weight decay 0.1 (train/config/schema.py OptimizerArgs). Its data has one row per assistant turn
# of a conversation where draftsmith has one sample per conversation with every assistant turn under the loss.
# Every config starts from the recipe's training keys as they were at call 1 (every config below changes them one
# at a time); pinned here, so that later recipe changes (Muon, wsd and the frozen head after call 2; AdamW at
# 32,768 tokens and lr 2e-3 after call 6) leave each config meaning what its results in per_token_h200/ measured.
RECIPE_AT_CALL_1 = ["training.optimizer=adamw", "training.lr=1e-3", "training.tokens_per_step=8192",
                    "training.lr_schedule=cosine", "training.train_draft_head=true", "training.compile_drafter=false"]
FH_MUON_WSD = ["training.train_draft_head=false", "training.optimizer=muon", "training.lr_schedule=wsd"]
KERNELS = ["training.ttt_attention=flex", "training.loss_kernel=fused"]  # what auto takes on a GPU, forced
FHW_KERNELS = ["training.train_draft_head=false", "training.lr_schedule=wsd", *KERNELS]
FHW_32K_COMPILE = [*FHW_KERNELS, "training.tokens_per_step=32768", "training.lr=2e-3", "training.compile_drafter=true"]
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
    # a schedule that holds the rate (speculators' default plans 20 epochs, so ~850 steps run near its peak), on top
    # of the frozen head; with Muon; with warmup-stable-decay (the last 20% of the steps decay to 0)
    "fh_constant": ["training.train_draft_head=false", "training.lr_schedule=constant"],
    "fh_muon_constant": ["training.train_draft_head=false", "training.optimizer=muon", "training.lr_schedule=constant"],
    "fh_muon_wsd": FH_MUON_WSD,
    "fh_wsd": ["training.train_draft_head=false", "training.lr_schedule=wsd"],
    # one change at a time against the winner at equal steps (fh_muon_wsd: the recipe's training keys from call 2 to
    # call 6):
    # the peer's flat TTT weighting, the LK loss, 8,192 real (packed) tokens a step in place of 8,192 padded ones
    "fhmw_decay_1.0": [*FH_MUON_WSD, "training.ttt_decay=1.0"],
    "fhmw_lk": [*FH_MUON_WSD, "training.loss=lk"],
    "fhmw_packing": [*FH_MUON_WSD, "training.packing=true"],
    "fhmw_muon_lr2e-3": [*FH_MUON_WSD, "training.lr=2e-3"],
    # the shipped winner with issue 28's kernels forced (FlexAttention TTT attention, fused Triton head loss; what
    # auto takes on a GPU unless DRAFTSMITH_FLEX_ATTENTION=0, which gpu_per_token.sh sets by default): for the
    # equal-time reading, where the step's speed counts
    "fhmw_kernels": [*FH_MUON_WSD, *KERNELS],
    # the same with AdamW in place of Muon (fh_wsd + the kernels): Muon's orthogonalisation costs ~14% of the step,
    # which counts at equal time
    "fhw_kernels": FHW_KERNELS,
    # at equal time the fixture's step is launch-bound (2% MFU at 8,192 tokens): four times the tokens a step cost
    # little time; at the same rate, and at twice it
    "fhw_kernels_32k": [*FHW_KERNELS, "training.tokens_per_step=32768"],
    "fhw_kernels_32k_lr2e-3": [*FHW_KERNELS, "training.tokens_per_step=32768", "training.lr=2e-3"],
    "fhw_kernels_32k_lr3e-3": [*FHW_KERNELS, "training.tokens_per_step=32768", "training.lr=3e-3"],
    # the shipped recipe with its TTT steps compiled (compile_drafter: auto on a GPU since call 9); every config from
    # call 9 on also runs without cuDNN attention (device.py): together 158 to 110 ms a step (profile_train_h200/)
    "fhw_kernels_32k_lr2e-3_compile": FHW_32K_COMPILE,
    # at equal time the run sees each of the 2,500 records ~15 times and its train accuracy pulls away from the
    # held-out one (call 9: step-0 0.63 against 0.54): decoupled weight decay as a regulariser, two strengths
    "fhw_kernels_32k_lr2e-3_compile_wd0.1": [*FHW_32K_COMPILE, "training.weight_decay=0.1"],
    "fhw_kernels_32k_lr2e-3_compile_wd0.5": [*FHW_32K_COMPILE, "training.weight_decay=0.5"],
    # weight decay changed nothing (call 10); noise on the target states fc reads (eagle3.feature_noise, relative to
    # each aux layer's RMS) is the regulariser EAGLE-1 trained with: two widths
    "fhw_kernels_32k_lr2e-3_compile_noise0.2": [*FHW_32K_COMPILE, "eagle3.feature_noise=0.2"],
    "fhw_kernels_32k_lr2e-3_compile_noise0.5": [*FHW_32K_COMPILE, "eagle3.feature_noise=0.5"],
    # neither regulariser helped (calls 10, 11): more supervision from the same records instead. loss_on all trains
    # every position against the target's distribution, the user turns' too (+28% positions on these records:
    # 2.43M of 3.10M tokens are answers); max_length 4096 keeps what 2,048 cut off (+10% tokens, +7% answers)
    "fhw_kernels_32k_lr2e-3_compile_all": [*FHW_32K_COMPILE, "training.loss_on=all"],
    "fhw_kernels_32k_lr2e-3_compile_all_4k": [*FHW_32K_COMPILE, "training.loss_on=all", "data.max_length=4096"],
    # Muon at 32,768 tokens a step: its orthogonalisation costs the same per step whatever the tokens, so its share
    # of the step shrinks as the step grows, while it learns more per step (+0.09 at k=5 at equal steps)
    "fhmw_kernels_32k_lr2e-3": [*FH_MUON_WSD, *KERNELS, "training.tokens_per_step=32768", "training.lr=2e-3"],
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
# Fields of a run that describe the call it ran in, not the run; the rest of a run's record is kept as written.
RUN_DROP = ("proc", "points", "argv")


def run_bg(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    with log.open("w") as f:  # the child holds its own handle
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop(proc: subprocess.Popen | None) -> None:
    """End a process we started (its whole process group: speculators' data-loader workers too)."""
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass


def draftsmith_points(run_dir: Path) -> list[dict]:
    """(step, tokens, seconds, checkpoint) of every checkpoint a draftsmith run left, by step."""
    points = []
    for ckpt in sorted(run_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1])):
        state_file = ckpt / "trainer_state.json"  # written last, then the folder renamed: complete
        if state_file.is_file():
            state = json.loads(state_file.read_text())
            points.append({"step": state["step"], "tokens": state["tokens_seen"],
                           "seconds": round(state["train_seconds"], 1), "checkpoint": str(ckpt)})
    return points


def speculators_points(save_dir: Path, tokens_per_step: float) -> list[dict]:
    """The curve checkpoints of benchmarks/speculators_curve.py; tokens = steps x the mean real tokens a step."""
    curve = save_dir / "curve.jsonl"
    lines = curve.read_text().split("\n")[:-1] if curve.is_file() else []  # a line is complete once its \n is in
    rows = sorted((json.loads(line) for line in lines if line), key=lambda r: r["step"])
    return [{"step": r["step"], "tokens": round(r["step"] * tokens_per_step), "seconds": r["seconds"],
             "checkpoint": r["checkpoint"]} for r in rows]


def run_points(r: dict) -> list[dict]:
    return draftsmith_points(Path(r["dir"])) if r["trainer"] == "draftsmith" else \
        speculators_points(Path(r["dir"]), r["tokens_per_step"])


def score_one(target, answers, target_path: str, item: dict) -> dict:
    """tau (k = 1..7) and per-position acceptance of one checkpoint (a speculators one imported first)."""
    from acceptance import simulate

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
    return row


def score_worker(work: Path, target_path: str, answers_path: str, worker: int) -> None:
    """Score the checkpoints queued in WORK/score_queue.jsonl, each once over all workers (the first to create its
    claim file takes it), finals (priority 0) before curve points; return once WORK/score_done exists and nothing
    is left. Rows go to WORK/scored_<worker>.jsonl as they are done, so a stopped worker loses only its current one."""
    from benchmarks.acceptance import load_answers
    from draftsmith.models.target import TargetModel

    while not Path(answers_path).is_file():  # written beside the runs (acceptance.py answers)
        time.sleep(2)
    target = TargetModel.from_pretrained(target_path, dtype="float32")
    answers = load_answers(answers_path)
    queue, claims, out = work / "score_queue.jsonl", work / "score_claims", work / f"scored_{worker}.jsonl"
    claims.mkdir(exist_ok=True)
    while True:
        done = (work / "score_done").is_file()  # read before the queue: what was queued before it is seen below
        lines = queue.read_text().split("\n")[:-1] if queue.is_file() else []
        items = sorted((json.loads(line) for line in lines if line), key=lambda it: it["priority"])
        for item in items:
            try:
                os.close(os.open(claims / f"{item['run']}@{item['step']}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                continue
            row = score_one(target, answers, target_path, item)
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            break  # read the queue again: a final queued meanwhile goes before the remaining curve points
        else:
            if done:
                return
            time.sleep(2)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "score-worker":  # internal: one scoring worker
        score_worker(Path(argv[1]), argv[2], argv[3], int(argv[4]))
        return 0
    if argv and argv[0] == "merge":
        m = argparse.ArgumentParser(description="merge per_token.json files of several calls (later files win)")
        m.add_argument("files", nargs="+", type=Path)
        m.add_argument("--out", type=Path, required=True)
        a = m.parse_args(argv[1:])
        result = merge([json.loads(f.read_text()) for f in a.files])
        write_json(result, a.out)
        for line in result["summary"]["lines"]:
            print(line)
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", required=True)
    p.add_argument("--work", type=Path, required=True, help="fresh folder for data, runs and logs")
    p.add_argument("--out", type=Path, required=True, help="the result JSON")
    p.add_argument("--answers", required=True, help="the target's float32 greedy answers (acceptance.py answers)")
    p.add_argument("--deadline-seconds", type=float, required=True,
                   help="the whole script ends by then: training is stopped early enough to score what it left")
    p.add_argument("--score-seconds", type=float, default=60,
                   help="kept after training for scoring what was not scored during it (the finals)")
    p.add_argument("--steps", type=int, default=834, help="draftsmith's optimizer steps (speculators: 2 epochs)")
    p.add_argument("--configs", default="baseline,freeze_head",
                   help="comma-separated CONFIGS names; name@0+1 runs that one at those seeds only")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="draftsmith runs under training.max_minutes instead of --steps (an equal-time comparison)")
    p.add_argument("--max-parallel", type=int, default=0, help="draftsmith runs at a time (0: all at once)")
    p.add_argument("--curve-configs", default="baseline,freeze_head",
                   help="draftsmith configs whose first seed is scored at every checkpoint")
    p.add_argument("--save-every", type=int, default=139, help="draftsmith's checkpoint period (every run)")
    p.add_argument("--peers", default="default_lr")
    p.add_argument("--spec-epochs", type=int, default=2)
    p.add_argument("--spec-save-steps", default="139,278,417,556,695",
                   help="speculators' curve steps (its last step is always saved too)")
    p.add_argument("--spec-flags", default="--loss-implementation eager --num-workers 2",
                   help="extra `speculators train` flags for every peer run")
    p.add_argument("--score-workers", type=int, default=3, help="scoring workers once training is over")
    p.add_argument("--skip-speculators", action="store_true", help="draftsmith only (no speculators installed)")
    p.add_argument("--merge", type=Path, action="append", default=[],
                   help="an earlier call's per_token.json: its runs are kept unless this call reruns them")
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="first train the first config this many steps, thrown away, so that no measured run pays "
                        "the compilation of a cold machine (its caches then serve every run)")
    p.add_argument("overrides", nargs="*", help="recipe overrides for both trainers (data, draft vocabulary)")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from draftsmith import device as dev
    from draftsmith.config import load_recipe
    from draftsmith.data import prepare_dataset

    t_start = time.time()
    deadline = t_start + args.deadline_seconds
    train_deadline = deadline - args.score_seconds
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    earlier = [json.loads(f.read_text()) for f in args.merge]  # read first: a bad path fails before any GPU time
    recipe = load_recipe(args.recipe, args.overrides)
    target_path = str(recipe.model.target)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    config_seeds = {}  # "name@0+1" runs that config at those seeds only, others at --seeds
    for item in (c for c in args.configs.split(",") if c):
        name, _, only = item.partition("@")
        config_seeds[name] = [int(x) for x in only.split("+")] if only else seeds
    configs = list(config_seeds)
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; known: {', '.join(CONFIGS)}")
    peers = [] if args.skip_speculators else [x for x in args.peers.split(",") if x]
    unknown = [x for x in peers if x not in PEERS]
    if unknown:
        raise SystemExit(f"--peers: unknown {unknown}; known: {', '.join(PEERS)}")
    result = {**run_info(), "recipe": args.recipe, "overrides": args.overrides, "steps": args.steps, "seeds": seeds,
              "base_overrides": RECIPE_AT_CALL_1, "configs": {c: CONFIGS[c] for c in configs},
              "peers": {x: PEERS[x] for x in peers},
              "ttt_steps": recipe.training.ttt_steps, "draft_vocab_size": recipe.model.draft_vocab_size}

    def log(msg):
        print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    score_cmd = module_command("per_token", "score-worker", str(work), target_path, args.answers)
    scorers = [run_bg([*score_cmd, "0"], work / "score_0.log", env)]  # scores curve points while the runs train

    # 0. the warm-up: compile what the runs will compile (kernels, the TTT steps) on the clock of no measured run
    if args.warmup_steps:
        warm = [sys.executable, "-m", "draftsmith.cli", "train", args.recipe, *RECIPE_AT_CALL_1, *args.overrides,
                *CONFIGS[configs[0]], f"training.max_steps={args.warmup_steps}", "training.max_minutes=null",
                "training.eval_every=100000", "training.save_every=100000", f"output_dir={work / 'warmup'}"]
        started = time.time()
        with open(work / "warmup.log", "w") as f:
            code = subprocess.run(warm, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
        result["warmup"] = {"config": configs[0], "steps": args.warmup_steps, "exit": code,
                            "seconds": round(time.time() - started, 1)}
        log(f"warm-up: {args.warmup_steps} steps of {configs[0]} in {result['warmup']['seconds']} s (exit {code})")
        shutil.rmtree(work / "warmup", ignore_errors=True)

    # 1. draftsmith: every config at every seed, the first --max-parallel of them now, the rest as slots free
    curve_configs = set(args.curve_configs.split(","))
    runs: list[dict] = []
    for config in configs:
        for seed in config_seeds[config]:
            timed = args.max_minutes is not None  # a time budget (the equal-time protocol), not a step count
            name = f"{config}_{args.max_minutes:g}min_s{seed}" if timed else f"{config}_s{seed}"
            out_dir = work / "draftsmith" / name
            length = (["training.max_steps=null", f"training.max_minutes={args.max_minutes}", "training.eval_every=100000"]
                      if timed else [f"training.max_steps={args.steps}", "training.max_minutes=null",
                                     f"training.eval_every={args.steps}"])
            cmd = [sys.executable, "-m", "draftsmith.cli", "train", args.recipe, *RECIPE_AT_CALL_1, *args.overrides,
                   *CONFIGS[config],
                   *length, "training.epochs=1000", f"training.seed={seed}", f"training.save_every={args.save_every}",
                   "training.keep_checkpoints=50", f"output_dir={out_dir}"]
            runs.append({"name": name, "trainer": "draftsmith", "config": config, "seed": seed,
                         "curve": config in curve_configs and seed == config_seeds[config][0],
                         "planned_steps": None if timed else args.steps, "max_minutes": args.max_minutes,
                         "dir": str(out_dir), "cmd": shlex.join(cmd[2:]), "argv": cmd, "proc": None})

    def start_queued():
        running = sum(r["proc"] is not None and r["proc"].poll() is None for r in runs if r["trainer"] == "draftsmith")
        for r in runs:
            if r["trainer"] == "draftsmith" and r["proc"] is None and time.time() < train_deadline and (
                    args.max_parallel <= 0 or running < args.max_parallel):
                r["proc"] = run_bg(r.pop("argv"), work / f"{r['name']}.log", env)
                r["started"] = round(time.time() - t_start, 1)
                running += 1
                log(f"started {r['name']}")

    start_queued()

    # 2. speculators: the same samples, hidden states written here (on the GPU, beside the runs above)
    if peers:
        from benchmarks.speculators_data import write_speculators_dataset

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
            cmd = module_command("speculators_curve", *flags)
            peer_env = {**env, "SPEC_SAVE_STEPS": ",".join(map(str, save_steps))}
            runs.append({"name": name, "trainer": "speculators", "config": peer, "seed": 42, "curve": True,
                         "planned_steps": last, "dir": str(save_dir), "cmd": shlex.join(flags),
                         "epoch_tokens": epoch_tokens, "tokens_per_step": epoch_tokens / steps_per_epoch,
                         "proc": run_bg(cmd, work / f"{name}.log", peer_env),
                         "started": round(time.time() - t_start, 1)})
        log(f"started {len(peers)} speculators runs")
    result["concurrent_runs"] = len(runs) if args.max_parallel <= 0 else min(len(runs), args.max_parallel + len(peers))

    # 3. wait, queueing the curve points for scoring as they appear; stop whatever still trains at the deadline
    queue, queued = work / "score_queue.jsonl", {}

    def enqueue(r: dict, point: dict, priority: int) -> None:
        """Queue a checkpoint for the scoring workers (again if it becomes a final: a claim file keeps it once)."""
        if queued.get((r["name"], point["step"]), 2) > priority:
            queued[(r["name"], point["step"])] = priority
            with queue.open("a") as f:  # one write of one line: a worker reads only lines that end in \n
                f.write(json.dumps({"run": r["name"], "trainer": r["trainer"], "priority": priority, **point}) + "\n")

    def alive(r):
        return r["proc"] is not None and r["proc"].poll() is None

    while time.time() < train_deadline and any(alive(r) or r["proc"] is None for r in runs):
        start_queued()
        for r in runs:
            if r["proc"] is None:
                continue
            done = r["proc"].poll() is not None
            points = run_points(r) if r["curve"] or done else []
            for point in points if r["curve"] else points[-1:]:
                enqueue(r, point, 0 if done and point is points[-1] else 1)  # a finished run's last: its final
        time.sleep(2)
    for r in runs:
        r["stopped_at_deadline"] = alive(r)
        stop(r["proc"])
        r["exit"] = r["proc"].returncode if r["proc"] is not None else None
        r["ended"] = round(time.time() - t_start, 1) if r["proc"] is not None else None
        if r["exit"] not in (0, None) and not r["stopped_at_deadline"]:
            r["log_tail"] = (work / f"{r['name']}.log").read_text(errors="replace").splitlines()[-12:]
    log("training over: " + ", ".join(f"{r['name']} exit {r['exit']}" + (" (stopped)" if r["stopped_at_deadline"]
                                                                      else "") for r in runs))

    # 4. score what is left: every run's last checkpoint first, then the curve points not reached yet
    for r in runs:
        r["points"] = run_points(r) if r["proc"] is not None else []
        if r["points"]:
            enqueue(r, r["points"][-1], 0)
        if r["curve"]:
            for point in r["points"]:
                enqueue(r, point, 1)
    (work / "score_done").touch()
    scorers += [run_bg([*score_cmd, str(w)], work / f"score_{w}.log", env) for w in range(1, args.score_workers)]
    while any(proc.poll() is None for proc in scorers) and time.time() < deadline - 5:
        time.sleep(1)
    for proc in scorers:
        stop(proc)
    scored = {}
    for part in work.glob("scored_*.jsonl"):
        for line in part.read_text().split("\n")[:-1]:
            row = json.loads(line)
            scored[(row["run"], row["step"])] = row
    log(f"scored {len(scored)} of {len(queued)} checkpoints"
        + ("" if Path(args.answers).is_file() else f" ({args.answers} never written: see answers.log)"))

    # 5. the JSON: every run with its points, the earlier calls' runs it does not rerun, then the comparisons
    result["runs"] = []
    for r in runs:
        points = [{**pt, **{k: v for k, v in scored.get((r["name"], pt["step"]), {}).items()
                            if k in ("tau", "per_position_acceptance_k7", "error", "score_seconds")}}
                  for pt in r["points"]]
        last = points[-1]["step"] if points else None
        # speculators' epochs differ by a step or two (its packing sampler), so its plan is a count, not a promise
        partial = bool(r["stopped_at_deadline"] or r["exit"] != 0 or (r["trainer"] == "draftsmith" and r["planned_steps"]
                                                                  and last != r["planned_steps"]))
        result["runs"].append({k: v for k, v in r.items() if k not in RUN_DROP}
                              | {"partial": partial, "last_step": last, "points": points})
    result["seconds"] = round(time.time() - t_start, 1)
    result = merge([*earlier, result])
    write_json(result, args.out)
    for line in result["summary"]["lines"]:
        print(line)
    return 0


def call_record(result: dict) -> dict:
    """What describes one device call of this benchmark (the runs' records point at it by index)."""
    return {k: result.get(k) for k in (*RUN_INFO_KEYS, "recipe", "overrides", "steps", "seeds", "configs", "peers",
                                       "concurrent_runs", "data", "seconds")}


def merge(results: list[dict]) -> dict:
    """One result from several calls' (oldest first): the newest call's top-level fields, `calls` (each call's
    command, hardware, versions, ...), every run of the newest call that ran it (its `call` is the index in
    `calls`), the configs and peers of them all, and the summary over them all."""
    calls, runs = [], {}
    for result in results:
        earlier_calls = result.get("calls") or [call_record(result)]
        offset = len(calls)
        calls += earlier_calls
        for r in result.get("runs", []):
            runs[r["name"]] = {**r, "call": offset + r.get("call", len(earlier_calls) - 1)}
    merged = {**results[-1], "calls": calls, "runs": list(runs.values()),
              "configs": {k: v for result in results for k, v in result.get("configs", {}).items()},
              "peers": {k: v for result in results for k, v in result.get("peers", {}).items()}}
    merged["summary"] = summarize(merged["runs"])
    return merged


def tau5(point: dict) -> float | None:
    return (point.get("tau") or {}).get("5")


def summarize(runs: list[dict]) -> dict:
    """Per config: each seed's last scored tau at k=5 and step-0 acceptance (with its step, and whether the run was
    stopped short of its plan), their mean; the learning curves (tokens, seconds, tau k=5) of the curve runs; each
    peer against every draftsmith curve run at equal tokens (the curve read at the peer's last tokens, linearly
    between checkpoints) and at equal time (likewise at the peer's seconds), and against each config's mean."""
    by_config: dict[str, dict] = {}
    lines = []
    for r in runs:
        scored = [pt for pt in r["points"] if tau5(pt) is not None]
        final = scored[-1] if scored else {}
        key = f"{r['trainer']}:{r['config']}" + (f"@{r['max_minutes']:g}min" if r.get("max_minutes") else "")
        entry = by_config.setdefault(key, {"seeds": {}, "steps": {}, "tokens": {}})
        # stopped short of its plan, or its last checkpoint not scored in time (then an earlier one stands in)
        partial = bool(r.get("partial", r.get("stopped_at_deadline"))) or (bool(scored)
                                                                         and scored[-1] is not r["points"][-1])
        entry["seeds"][str(r["seed"])] = {"tau_k5": tau5(final), "tau": final.get("tau"), "step": final.get("step"),
                                          "partial": partial if final else None,
                                          "acc_pos1": (final.get("per_position_acceptance_k7") or [None])[0]}
        entry["steps"][str(r["seed"])] = final.get("step")
        entry["tokens"][str(r["seed"])] = final.get("tokens")
    for key, entry in by_config.items():
        values = [v["tau_k5"] for v in entry["seeds"].values() if v["tau_k5"] is not None]
        entry["mean_tau_k5"] = round(sum(values) / len(values), 4) if values else None
        entry["partial"] = any(v["partial"] for v in entry["seeds"].values())
        cells = [f"{v['tau_k5']}" + (f" (partial: step {v['step']})" if v["partial"] else "")
                 for v in entry["seeds"].values()]
        lines.append(f"{key:32s} tau k=5 " + " / ".join(cells) + f"  mean {entry['mean_tau_k5']}"
                     f"  steps {list(entry['steps'].values())}")
    curves = {r["name"]: [{"step": pt["step"], "tokens": pt["tokens"], "seconds": pt["seconds"], "tau_k5": tau5(pt)}
                          for pt in r["points"] if tau5(pt) is not None] for r in runs if r["curve"]}
    comparisons = {}
    draftsmith_curves = {name: c for name, c in curves.items() if not name.startswith("speculators_") and c}
    for name, curve in curves.items():
        if not name.startswith("speculators_") or not curve:
            continue
        peer = curve[-1]
        by_run = {}
        for other, base in draftsmith_curves.items():
            at_tokens = interpolate(base, "tokens", peer["tokens"])
            at_seconds = interpolate(base, "seconds", peer["seconds"])
            by_run[other] = {"at_equal_tokens": at_tokens, "ratio_equal_tokens": ratio(at_tokens, peer["tau_k5"]),
                             "at_equal_seconds": at_seconds, "ratio_equal_seconds": ratio(at_seconds, peer["tau_k5"])}
            lines.append(f"{other} vs {name} (its step {peer['step']}): equal tokens "
                         f"{by_run[other]['ratio_equal_tokens']}x, equal time {by_run[other]['ratio_equal_seconds']}x "
                         "(seconds under shared-GPU contention)")
        finals = {key: {"mean_tau_k5": e["mean_tau_k5"], "ratio": ratio(e["mean_tau_k5"], peer["tau_k5"]),
                        "partial": e["partial"]}
                  for key, e in by_config.items() if key.startswith("draftsmith:")}
        base = by_run.get(next((n for n in by_run if n.startswith("baseline_")), ""), {})
        comparisons[name] = {"peer_tau_k5": peer["tau_k5"], "peer_step": peer["step"], "peer_tokens": peer["tokens"],
                             "peer_seconds": peer["seconds"],
                             "draftsmith_at_equal_tokens": base.get("at_equal_tokens"),
                             "ratio_equal_tokens": base.get("ratio_equal_tokens"),
                             "draftsmith_at_equal_seconds": base.get("at_equal_seconds"),
                             "ratio_equal_seconds": base.get("ratio_equal_seconds"),
                             "by_run": by_run, "finals": finals}
        lines += [f"{key} last checkpoints vs {name}: {f['ratio']}x" + (" (partial)" if f["partial"] else "")
                  for key, f in finals.items()]
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
