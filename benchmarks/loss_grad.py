"""The chunked head losses with each chunk's gradient taken in the forward pass (`training.loss_grad: in_forward`)
against recomputing the chunk in the backward pass (`recompute`), side by side in one run.

    python -m benchmarks.loss_grad --rows 8192 --hidden 384 --draft-vocab 12000 --vocab 16000 --steps 3 \
        --out benchmarks/results/loss_grad_cpu/loss_grad.json

Two losses, each way, each in its own Python process (peak memory is per process): EAGLE-3's TTT loss over its
trainable draft head (`--steps` TTT steps of `--rows` rows) and DFlash's cross-entropy over a frozen full head of
`--vocab` outputs (the MTP soft CE reads the same path). Inputs are random, of the given shapes; every run does
the same forward and backward `--repeats` times and reports the median seconds, the loss and the peak memory
(resident on the CPU, `max_memory_allocated` on a device). Nothing here is asserted by a test.

With `--train RECIPE` (repeatable) and `--train-args "key=value ..."` it also runs `python -m draftsmith.train` on that recipe once
each way (one process at a time, a fresh output folder each) and compares the median tokens/s of its steps after
the first and the per-step losses (the same seed and data: equal within float tolerance), e.g.

    python -m benchmarks.loss_grad --train recipes/eagle3_fixture.yaml --train-args "data.path=... \
        training.max_steps=12 training.max_minutes=null training.log_every=1"
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import child_json, peak_memory, write_json
from benchmarks.runinfo import run_info

LOSSES = {"eagle3": "EAGLE-3 TTT soft CE, trainable draft head (eagle3.loss.fused_ttt_loss)",
          "dflash": "DFlash CE over the frozen target head (dflash.loss.head_cross_entropy)"}
MODES = ("recompute", "in_forward")


def one_run(args) -> dict:
    import draftsmith.device as dev
    from draftsmith.models.dflash.loss import head_cross_entropy
    from draftsmith.models.eagle3.loss import fused_ttt_loss

    device = dev.get_device()
    torch.manual_seed(0)  # the heads' initialisation
    g = torch.Generator(device="cpu").manual_seed(0)
    rows, h = args.rows, args.hidden
    if args.loss == "eagle3":
        head = torch.nn.Linear(h, args.draft_vocab, bias=False).to(device)
        norm = torch.nn.RMSNorm(h).to(device)
        hidden = [torch.randn(1, rows, h, generator=g).to(device).requires_grad_() for _ in range(args.steps)]
        teacher = torch.randn(1, rows, args.draft_vocab, generator=g).to(device)
        targets = dict(teacher_draft_logits=teacher, teacher_in_draft=torch.ones(1, rows, dtype=torch.bool,
                                                                                 device=device),
                       loss_mask=torch.ones(1, rows, dtype=torch.long, device=device), loss_grad=args.mode)
        params = [head.weight, norm.weight]

        def step():
            loss, _ = fused_ttt_loss(lambda x: head(norm(x)), hidden, head_params=params, **targets)
            loss.backward()
            return loss
    else:
        weight = torch.randn(args.vocab, h, generator=g).to(device) * h ** -0.5
        hidden = torch.randn(rows, h, generator=g).to(device).requires_grad_()
        labels = torch.randint(0, args.vocab, (rows,), generator=g).to(device)

        def step():
            ce, _ = head_cross_entropy(hidden, labels, weight, loss_grad=args.mode)
            loss = ce.mean()
            loss.backward()
            return loss
    dev.reset_peak_memory_stats(device)
    seconds = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        loss = step()
        dev.synchronize(device)
        seconds.append(time.perf_counter() - started)
    return {"loss": args.loss, "mode": args.mode, "what": LOSSES[args.loss], "value": float(loss),
            "seconds_median": round(statistics.median(seconds), 3), "seconds": [round(s, 3) for s in seconds],
            **peak_memory(device)}


def train_run(recipe: str, overrides: list[str], mode: str, out_dir: Path) -> dict:
    """One `draftsmith train` run with training.loss_grad=mode; its steps' tokens/s and losses from metrics.jsonl."""
    command = [sys.executable, "-m", "draftsmith.train", recipe, *overrides, f"training.loss_grad={mode}",
               f"output_dir={out_dir}", "training.log_every=1"]
    child = subprocess.run(command, capture_output=True, text=True)
    if child.returncode != 0:
        raise SystemExit(f"{shlex.join(command)} failed:\n{child.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "tokens_per_s" in r]
    return {"mode": mode, "steps": len(steps),
            "tokens_per_s_median": round(statistics.median(r["tokens_per_s"] for r in steps[1:] or steps), 1),
            "losses": [round(r["loss"], 6) for r in steps]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--draft-vocab", type=int, default=12000)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--train", metavar="RECIPE", action="append", default=[],
                        help="also train RECIPE once each way and compare (repeatable)")
    parser.add_argument("--train-args", default="", help="key=value overrides for every such run, in one string")
    parser.add_argument("--loss", choices=sorted(LOSSES), help=argparse.SUPPRESS)  # one child process
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loss:
        print(json.dumps(one_run(args)))
        return 0
    runs = []
    for loss in LOSSES:
        for mode in MODES:  # each in its own process: peak memory is per process
            runs.append(child_json("loss_grad", *sys.argv[1:], "--loss", loss, "--mode", mode))
            print(json.dumps(runs[-1]), flush=True)
    by = {(r["loss"], r["mode"]): r for r in runs}
    ratios = {loss: {"speedup_in_forward": round(by[loss, "recompute"]["seconds_median"]
                                                 / by[loss, "in_forward"]["seconds_median"], 3),
                     "peak_rss_ratio": round(by[loss, "in_forward"]["peak_rss_gib"]
                                             / by[loss, "recompute"]["peak_rss_gib"], 3),
                     "same_loss": abs(by[loss, "in_forward"]["value"] - by[loss, "recompute"]["value"])
                     <= 1e-5 * abs(by[loss, "recompute"]["value"])}
              for loss in LOSSES}
    result = {**run_info(), "threads": torch.get_num_threads(),
              "shape": {"rows": args.rows, "hidden": args.hidden, "draft_vocab": args.draft_vocab,
                        "vocab": args.vocab, "ttt_steps": args.steps, "repeats": args.repeats},
              "runs": runs, "ratios": ratios}
    result["train"] = []
    for recipe in args.train:
        overrides = shlex.split(args.train_args)
        with tempfile.TemporaryDirectory() as work:
            recompute, in_forward = [train_run(recipe, overrides, mode, Path(work) / mode) for mode in MODES]
        result["train"].append({
            "recipe": recipe, "overrides": overrides, "runs": [recompute, in_forward],
            "speedup_in_forward": round(in_forward["tokens_per_s_median"] / recompute["tokens_per_s_median"], 3),
            "max_relative_loss_difference": max(abs(a - b) / abs(b) for a, b in zip(in_forward["losses"],
                                                                                    recompute["losses"]))})
        print(json.dumps({k: v for k, v in result["train"][-1].items() if k != "runs"}), flush=True)
    print(json.dumps(ratios))
    if args.out:
        write_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
