"""Peak memory of one EAGLE-3 TTT training step: the reference path (whole S x S scores, whole-step logits) against
the blocked attention + fused chunked loss that training now uses, side by side in one run.

    python -m benchmarks.ttt_memory --target ../shared/fixtures/targets/sharegpt-llama-19m \
        --batch 2 --seq 4096 --ttt-steps 7 --draft-vocab 8192 --out benchmarks/results/ttt_memory_cpu/ttt_memory.json

Each path runs in its own Python process (peak resident memory is per process; on a GPU, `max_memory_allocated`),
with the same random inputs of the target's shapes: aux features, token embeddings, a teacher from a random head.
It times nothing that a test relies on; the seconds are one step each, for orientation.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import child_json, peak_memory, write_json
from benchmarks.runinfo import run_info

PATHS = {"reference": "S x S scores and whole-step logits kept for the backward pass (the earlier training path)",
         "blocked_fused": "blocked TTT attention (recomputed per query block) + fused chunked loss (training now)"}


def one_step(args) -> dict:
    import draftsmith.device as dev
    from draftsmith.models.eagle3.config import Eagle3Config
    from draftsmith.models.eagle3.loss import teacher_targets, ttt_loss
    from draftsmith.models.eagle3.model import Eagle3Drafter
    from transformers import AutoConfig

    device = dev.get_device()
    target_config = AutoConfig.from_pretrained(args.target)
    layers = target_config.num_hidden_layers
    config = Eagle3Config.from_target(target_config, args.draft_vocab, [2, layers // 2, layers - 3])
    torch.manual_seed(0)
    drafter = Eagle3Drafter(config).to(device)
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[: args.draft_vocab] = True
    drafter.set_draft_vocab(torch.zeros(args.draft_vocab, dtype=torch.long, device=device), t2d.to(device))
    h, b, s = target_config.hidden_size, args.batch, args.seq
    aux = torch.randn(b, s, 3 * h, device=device)
    embeds = torch.randn(b, s, h, device=device)
    head = torch.nn.Linear(h, config.vocab_size, bias=False).to(device)
    teacher, in_draft = teacher_targets(torch.randn(b, s, h, device=device), head, drafter.t2d)
    loss_mask = torch.ones(b, s, dtype=torch.long, device=device)
    del head
    dev.reset_peak_memory_stats(device)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.time()
    if args.path == "reference":
        logits = drafter.forward_ttt(aux, embeds, args.ttt_steps, query_block=s)
        loss, _ = ttt_loss(logits, teacher, in_draft, loss_mask)
    else:
        loss, _ = drafter(aux, embeds, args.ttt_steps, loss_targets=dict(
            teacher_draft_logits=teacher, teacher_in_draft=in_draft, loss_mask=loss_mask))
    loss.backward()
    dev.synchronize(device)
    return {"path": args.path, "what": PATHS[args.path], "loss": float(loss), "seconds": round(time.time() - started, 2),
            **peak_memory(device), "rss_before_step_gib": round(base_rss / 2**20, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--path", choices=sorted(PATHS), help=argparse.SUPPRESS)  # one child process
    args = parser.parse_args()
    if args.path:
        print(json.dumps(one_step(args)))
        return 0
    runs = []
    for path in PATHS:  # each in its own process: peak memory is per process
        runs.append(child_json("ttt_memory", *sys.argv[1:], "--path", path))
        print(json.dumps(runs[-1]))
    reference, fused = runs
    result = {**run_info(), "shape": {"batch": args.batch, "seq": args.seq, "ttt_steps": args.ttt_steps,
                        "draft_vocab": args.draft_vocab, "target": args.target},
              "runs": runs,
              "peak_rss_ratio_fused_over_reference": round(fused["peak_rss_gib"] / reference["peak_rss_gib"], 3),
              "same_loss": abs(fused["loss"] - reference["loss"]) <= 1e-4 * abs(reference["loss"])}
    print(json.dumps({k: result[k] for k in ("peak_rss_ratio_fused_over_reference", "same_loss")}))
    if args.out:
        write_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
