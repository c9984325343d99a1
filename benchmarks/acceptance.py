"""Greedy acceptance of EAGLE-3 drafters, simulated over the target's own greedy answers (draftsmith.inference.simulate).

    # once: the target's float32 greedy (and temperature-1) answers to the 80 MT-bench first turns
    python -m benchmarks.acceptance answers --target .fixture/sharegpt-llama-19m \
        --dataset .devdata/question.jsonl --max-new-tokens 256 --out .devdata/mtbench_greedy_fp32.json
    python -m benchmarks.acceptance answers ... --temperature 1 --seed 0 --out .devdata/mtbench_t1_fp32.json
    # then any number of drafters (checkpoints, output_dirs or exported / imported folders)
    python -m benchmarks.acceptance sim --target .fixture/sharegpt-llama-19m \
        --answers .devdata/mtbench_greedy_fp32.json --drafter NAME=PATH ... --out sim.json

With greedy verification the committed text is fixed, so the simulated counters equal what `draftsmith eval` counts
at temperature 0 in the same precision (tests/test_simulate.py), for every k from one drafter forward per answer;
over sampled answers they follow the runtime's law at that temperature with greedy drafts (simulate.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import write_json
from benchmarks.runinfo import run_info

KS = (1, 2, 3, 4, 5, 6, 7)


def write_answers(target_path: str, dataset: str, max_new_tokens: int, out: Path, device: str | None,
                  limit: int | None = None, temperature: float = 0.0, seed: int = 0) -> dict:
    from transformers import AutoTokenizer

    from draftsmith.inference.eval import eos_token_ids, load_prompts
    from draftsmith.inference.simulate import plain_answers
    from draftsmith.models.target import TargetModel

    tokenizer = AutoTokenizer.from_pretrained(target_path)
    target = TargetModel.from_pretrained(target_path, dtype="float32", device=device)
    eos = eos_token_ids(target, tokenizer)
    prompts = load_prompts(dataset, tokenizer, limit)
    started = time.time()
    lookahead = max(KS) if temperature == 0 else 0  # the target's tokens past each answer (runtime's last drafts)
    answers = plain_answers(target, prompts, max_new_tokens, eos, temperature, seed, lookahead=lookahead)
    answers, extended = answers if lookahead else (answers, None)
    record = {**run_info(target), "target": str(target_path), "dataset": str(dataset), "dtype": "float32",
              "temperature": temperature, "seed": seed if temperature > 0 else None,
              "device": str(target.device), "max_new_tokens": max_new_tokens, "eos_token_ids": sorted(eos),
              "seconds": round(time.time() - started, 1), "prompts": prompts, "answers": answers,
              "extended": extended}
    write_json(record, out)
    return record


def load_answers(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def simulate(target, drafter_path: str, answers: dict, ks=KS) -> dict:
    """{"tau": {k: mean acceptance length}, "per_position": ..., "counters": ...} of one drafter, float32."""
    from draftsmith.inference.simulate import simulate_greedy_chains
    from draftsmith.models.eagle3.io import load_drafter

    drafter = load_drafter(drafter_path, device=target.device, dtype=torch.float32)
    target.check_drafter_fits(drafter_path, "drafter", drafter.config.vocab_size, drafter.config.target_hidden_size)
    counters = simulate_greedy_chains(target, drafter, answers["prompts"], answers["answers"], ks,
                                      extended=answers.get("extended"))
    return {"tau": {str(k): round(m.mean_acceptance_length, 4) for k, m in counters.items()},
            "per_position_acceptance_k7": [round(x, 4) for x in counters[max(ks)].per_position_acceptance],
            "counters": {str(k): m.to_dict() for k, m in counters.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("answers", help="write the target's float32 greedy answers")
    a.add_argument("--target", required=True)
    a.add_argument("--dataset", required=True)
    a.add_argument("--max-new-tokens", type=int, default=256)
    a.add_argument("--num-prompts", type=int, default=None)
    a.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampled, seed + i per prompt")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--device", default=None)
    a.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("sim", help="simulated greedy acceptance of drafters over those answers")
    s.add_argument("--target", required=True)
    s.add_argument("--answers", type=Path, required=True)
    s.add_argument("--drafter", action="append", required=True, help="NAME=PATH, repeatable")
    s.add_argument("--device", default=None)
    s.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.command == "answers":
        record = write_answers(args.target, args.dataset, args.max_new_tokens, args.out, args.device,
                               args.num_prompts, args.temperature, args.seed)
        print(f"wrote {len(record['answers'])} answers ({sum(map(len, record['answers']))} tokens) to {args.out}")
        return 0
    from draftsmith.models.target import TargetModel

    target = TargetModel.from_pretrained(args.target, dtype="float32", device=args.device)
    answers = load_answers(args.answers)
    results = {**run_info(target), "answers": str(args.answers), "drafters": {}}
    for entry in args.drafter:
        name, _, path = entry.partition("=")
        results["drafters"][name] = row = {"path": path, **simulate(target, path, answers)}
        print(f"{name}: tau " + " ".join(f"k{k}={v:.2f}" for k, v in row["tau"].items()))
        write_json(results, args.out)  # after every drafter: a run cut short keeps what it measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
