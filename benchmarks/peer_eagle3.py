"""draftsmith against the `speculators` trainer: EAGLE-3 on the same records, TTT depth, draft vocabulary and time.

1. draftsmith tokenizes the records once (the recipe's data section); speculators gets exactly those token ids
   and loss masks as its offline data folder, hidden states written with transformers
   (benchmarks/speculators_data.py), and holds out the same eval samples as its validation split.
2. `speculators train` runs with its own defaults (Muon, lr 1e-3, 8192 packed tokens a step, EAGLE 3.1 norms)
   for `--spec-epochs` epochs; its training loop with validation is timed from its log lines.
3. `draftsmith train` runs the recipe with `training.max_minutes` set to that time, so both get the same budget.
4. `draftsmith import` reads speculators' checkpoint; both drafters are scored on the same answers: simulated
   greedy chains over the target's float32 greedy answers (exact at T=0) and temperature-1 samples (in law),
   k = 1..7 (benchmarks/acceptance.py), and optionally `draftsmith eval` in the runtime at `--runtime-ks`.

    python -m benchmarks.peer_eagle3 --recipe recipes/eagle3_fixture.yaml --work runs/peer \
        --answers .devdata/mtbench_greedy_fp32.json --answers-t1 .devdata/mtbench_t1_fp32.json \
        --out benchmarks/results/peer_eagle3_h200/peer_eagle3.json data.max_samples=2500 model.draft_vocab_size=8192
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

from benchmarks.acceptance import load_answers, simulate
from benchmarks.common import write_json
from benchmarks.runinfo import run_info
from draftsmith import device as dev

EPOCH_STARTED = "Training epoch 1/"
VALIDATION_DONE = "Validation epoch {n}/{n} completed"


def run_logged(cmd: list[str], log_path: Path, env: dict | None = None, timeout: float | None = None):
    """Run `cmd`, streaming its merged output into `log_path` with a wall-clock time per line; returns
    (return code, [(seconds since start, line)])."""
    started = time.time()
    lines = []
    with log_path.open("w") as log, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                     text=True, env=env, bufsize=1) as proc:
        for line in proc.stdout:
            t = time.time() - started
            lines.append((t, line.rstrip("\n")))
            log.write(f"[{t:8.1f}] {line}")
            log.flush()
            if timeout is not None and t > timeout:
                proc.kill()
                break
        proc.wait()
    return proc.returncode, lines


def loop_seconds(lines, epochs: int) -> float | None:
    """Seconds from speculators' first training epoch start to its last validation's end, from its log lines."""
    start = next((t for t, x in lines if EPOCH_STARTED in x), None)
    end = next((t for t, x in reversed(lines) if VALIDATION_DONE.format(n=epochs) in x), None)
    return None if start is None or end is None else end - start


def latest_speculators_checkpoint(save_path: Path, epochs: int) -> Path:
    final = save_path / str(epochs - 1)
    if (final / "config.json").is_file():
        return final
    found = sorted((p for p in save_path.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    if not found:
        raise FileNotFoundError(f"{save_path}: speculators wrote no checkpoint")
    return found[-1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", required=True)
    p.add_argument("--work", type=Path, required=True, help="folder for data, runs and logs (fresh)")
    p.add_argument("--answers", type=Path, required=True)
    p.add_argument("--answers-t1", type=Path, default=None)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--spec-epochs", type=int, default=2)
    p.add_argument("--spec-tokens-per-step", type=int, default=8192)
    p.add_argument("--spec-flags", default="", help="extra `speculators train` flags (one shell-quoted string)")
    p.add_argument("--spec-entry", default=None,
                   help="command that runs `speculators train` with the flags after it (default: this python -m "
                        "speculators train)")
    p.add_argument("--budget-seconds", type=float, default=None,
                   help="draftsmith's budget; default: speculators' measured training loop")
    p.add_argument("--deadline-seconds", type=float, default=None,
                   help="the whole run must end by then: draftsmith's budget is cut to fit (and the JSON says so)")
    p.add_argument("--runtime-ks", default="",
                   help="comma-separated k: also `draftsmith eval` both drafters at these (and --runtime-temperatures)")
    p.add_argument("--runtime-temperatures", default="0", help="comma-separated temperatures of --runtime-ks")
    p.add_argument("--dataset", default=".devdata/question.jsonl", help="prompts of the runtime evaluation")
    p.add_argument("overrides", nargs="*", help="recipe overrides for both sides (data, draft vocabulary)")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from draftsmith.config import load_recipe
    from draftsmith.data import prepare_dataset
    from draftsmith.models.target import TargetModel
    from benchmarks.speculators_data import write_speculators_dataset

    script_started = time.time()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    recipe = load_recipe(args.recipe, args.overrides)
    target_path = recipe.model.target
    ttt, vocab = recipe.training.ttt_steps, recipe.model.draft_vocab_size
    result = {**run_info(), "ttt_steps": ttt, "draft_vocab_size": vocab, "recipe": args.recipe,
              "overrides": args.overrides}

    def save():  # after every stage, all or nothing: a run cut short keeps what it measured
        write_json(result, args.out)

    # 1. the same samples for both
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    data = prepare_dataset(recipe.data, tokenizer, log=print)
    samples = [*data.train, *data.eval]
    result["data"] = {"records": len(data.train) + len(data.eval), "train_samples": len(data.train),
                      "eval_samples": len(data.eval), "tokens": sum(len(s.input_ids) for s in data.train),
                      "loss_tokens": sum(sum(s.loss_mask) for s in data.train)}
    spec_data = work / "speculators_data"
    t0 = time.time()
    write_speculators_dataset(target_path, samples, spec_data, recipe.model.aux_layer_ids, dev.get_device(), 16,
                              vocab_samples=len(data.train), draft_vocab_size=vocab, log=lambda *a: None)
    result["speculators_data_seconds"] = round(time.time() - t0, 1)
    save()

    # 2. speculators, its defaults, timed
    ratio = (len(data.train) + 0.5) / len(samples)
    meta = json.loads((spec_data / "speculators_data.json").read_text())
    aux = meta["aux_layer_ids"]
    spec_save = work / "speculators_run"
    entry = shlex.split(args.spec_entry) if args.spec_entry else [sys.executable, "-m", "speculators", "train"]
    spec_cmd = [*entry, "--speculator-type", "eagle3",
                "--verifier-name-or-path", str(Path(target_path).resolve()), "--data-path", str(spec_data.resolve()),
                "--target-layer-ids", *map(str, aux), "--draft-vocab-size", str(vocab), "--ttt-steps", str(ttt),
                "--total-seq-len", str(args.spec_tokens_per_step), "--epochs", str(args.spec_epochs),
                "--train-data-ratio", f"{ratio:.6f}", "--on-missing", "raise", "--num-workers", "4",
                "--log-freq", "25", "--save-path", str(spec_save), "--log-dir", str(work / "speculators_logs"),
                *shlex.split(args.spec_flags)]
    started = time.time()
    code, lines = run_logged(spec_cmd, work / "speculators_train.log")
    spec_wall = time.time() - started
    if code != 0:
        result["speculators"] = {"error": f"exit {code}", "log_tail": [x for _, x in lines[-30:]]}
        save()
        print("\n".join(x for _, x in lines[-30:]))
        return 1
    spec_loop = loop_seconds(lines, args.spec_epochs)
    spec_ckpt = latest_speculators_checkpoint(spec_save, args.spec_epochs)
    spec_state = json.loads((spec_ckpt / "training_state.json").read_text()) if (
        spec_ckpt / "training_state.json").is_file() else {}
    result["speculators"] = {
        "flags": shlex.join(spec_cmd[len(entry):]), "train_seconds": round(spec_loop or spec_wall, 1),
        "process_seconds": round(spec_wall, 1), "checkpoint": str(spec_ckpt), "training_state": spec_state,
        "config_flags": {k: json.loads((spec_ckpt / "config.json").read_text()).get(k)
                         for k in ("norm_before_fc", "norm_before_residual", "norm_output", "fc_norm")},
        "train_tokens_approx": args.spec_epochs * result["data"]["tokens"]}
    save()

    # 3. draftsmith, the same budget
    budget = args.budget_seconds or result["speculators"]["train_seconds"]
    if args.deadline_seconds is not None:
        room = args.deadline_seconds - (time.time() - script_started) - 60  # startup, final save, simulation
        if budget > room:
            result["budget_note"] = (f"draftsmith's budget cut from {budget:.0f} s to {room:.0f} s to end within "
                                     f"the {args.deadline_seconds:.0f} s of the call: the comparison is unequal")
            budget = room
    result["budget_seconds"] = round(budget, 1)
    ours_dir = work / "draftsmith_run"
    ours_cmd = [sys.executable, "-m", "draftsmith.cli", "train", args.recipe, *args.overrides,
                f"training.max_minutes={budget / 60:.4f}", "training.max_steps=null", "training.epochs=1000",
                f"output_dir={ours_dir}"]
    started = time.time()
    code, lines = run_logged(ours_cmd, work / "draftsmith_train.log", env={**os.environ, "TQDM_MININTERVAL": "30"})
    ours_wall = time.time() - started
    if code != 0:
        result["draftsmith"] = {"error": f"exit {code}", "log_tail": [x for _, x in lines[-30:]]}
        save()
        print("\n".join(x for _, x in lines[-30:]))
        return 1
    from draftsmith.train.checkpoint import latest_checkpoint

    ours_ckpt = latest_checkpoint(ours_dir)
    state = json.loads((ours_ckpt / "trainer_state.json").read_text())
    ours_recipe = load_recipe(ours_dir / "recipe.yaml")
    result["draftsmith"] = {
        "recipe": args.recipe + " " + " ".join(args.overrides), "train_seconds": round(state["train_seconds"], 1),
        "process_seconds": round(ours_wall, 1), "train_tokens": state["tokens_seen"], "steps": state["step"],
        "plan": state.get("plan"), "checkpoint": str(ours_ckpt),
        "settings": {"optimizer": ours_recipe.training.optimizer, "lr": ours_recipe.training.lr,
                     "tokens_per_step": ours_recipe.training.tokens_per_step,
                     "batch_size": ours_recipe.training.batch_size, "loss": ours_recipe.training.loss,
                     **ours_recipe.eagle3.model_dump()}}
    save()

    # 4. both drafters on the same answers
    imported = work / "speculators_imported"
    code, lines = run_logged([sys.executable, "-m", "draftsmith.cli", "import", str(spec_ckpt), "--out",
                              str(imported), "--target", str(target_path), "--overwrite"], work / "import.log")
    if code != 0:
        result["speculators"]["import_error"] = [x for _, x in lines[-10:]]
        save()
        return 1
    target = TargetModel.from_pretrained(target_path, dtype="float32")
    answers = load_answers(args.answers)
    answers_t1 = load_answers(args.answers_t1) if args.answers_t1 else None
    for side, path in (("draftsmith", ours_ckpt), ("speculators", imported)):
        sim = simulate(target, str(path), answers)
        result[side]["tau"] = sim["tau"]
        result[side]["per_position_acceptance_k7"] = sim["per_position_acceptance_k7"]
        if answers_t1 is not None:
            result[side]["tau_t1"] = simulate(target, str(path), answers_t1)["tau"]
        save()
    ratio_k5 = result["draftsmith"]["tau"]["5"] / result["speculators"]["tau"]["5"]
    result["tau_k5_ratio_draftsmith_over_speculators"] = round(ratio_k5, 3)
    save()
    print(f"tau k5: draftsmith {result['draftsmith']['tau']['5']:.3f}, speculators "
          f"{result['speculators']['tau']['5']:.3f} ({ratio_k5:.2f}x)", flush=True)

    # 5. optional: the runtime itself
    runtime_ks = [int(k) for k in args.runtime_ks.split(",") if k]
    for temperature in [float(t) for t in args.runtime_temperatures.split(",")] if runtime_ks else []:
        for side, path in (("draftsmith", ours_ckpt), ("speculators", imported)):
            out = work / f"eval_{side}_t{temperature:g}"
            cmd = [sys.executable, "-m", "draftsmith.cli", "eval", "--target", str(target_path), "--dataset",
                   args.dataset, "--max-new-tokens", str(answers["max_new_tokens"]), "--out", str(out),
                   "--num-speculative-tokens", *map(str, runtime_ks),
                   "--speculative-config", json.dumps({"method": "eagle3", "model": str(path)})]
            if temperature > 0:
                cmd += ["--temperature", str(temperature), "--seed", "0"]
            code, _ = run_logged(cmd, work / f"eval_{side}_t{temperature:g}.log")
            if code == 0:
                result[side].setdefault("runtime", {})[f"t{temperature:g}"] = json.loads(
                    (out / "eval.json").read_text())
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
