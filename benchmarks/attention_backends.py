"""Why decoding excludes cuDNN attention: the same generations with torch's default SDPA backends and with
`device.sdpa_without_cudnn()` (flash / memory-efficient / math), side by side in one process.

cuDNN attention builds an execution plan per new shape; eager decoding steps (drafters, extend, prefill) change
the key length every step, so each would pay a plan build.

    python -m benchmarks.attention_backends --target .fixture/sharegpt-llama-19m \
        --spec '{"method":"mtp","model":DIR,"num_speculative_tokens":3}' --out attention_backends.json
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.common import write_json
from benchmarks.runinfo import run_info
from draftsmith import device as dev
from draftsmith.inference.eval import eos_token_ids, load_prompts
from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.spec_config import build_proposer, parse_spec_config
from draftsmith.models.target import TargetModel


def measure(target, spec, prompts, max_new_tokens, eos, runtime_backends: bool) -> dict:
    proposer = build_proposer(parse_spec_config(spec), target) if spec else None
    generator = SpeculativeGenerator(target, proposer, spec["num_speculative_tokens"] if spec else 0)
    # _generate_batch is generate_batch without its attention context: the "default backends" arm.
    run = generator.generate_batch if runtime_backends else generator._generate_batch
    run([prompts[0]], 8, eos, None)  # warm-up: graphs, allocator
    tokens = steps = 0
    seconds = 0.0
    for ids in prompts:
        result = run([ids], max_new_tokens, eos, None)[0]
        tokens += len(result.token_ids)
        steps += result.num_target_steps
        seconds += result.seconds
    return {"tokens": tokens, "target_steps": steps, "seconds": seconds, "tokens_per_second": tokens / seconds,
            "ms_per_step": seconds / steps * 1e3}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--spec", action="append", default=[], help="speculative config JSON (repeatable)")
    p.add_argument("--dataset", default=".devdata/question.jsonl")
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    target = TargetModel.from_pretrained(args.target, dtype=args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = load_prompts(args.dataset, tokenizer, limit=args.num_prompts)
    eos = eos_token_ids(target, tokenizer)
    report = {**run_info(target), "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "rows": []}
    for spec in [None, *(json.loads(s) for s in args.spec)]:
        for runtime_backends in (False, True):
            row = measure(target, spec, prompts, args.max_new_tokens, eos, runtime_backends)
            row.update(spec=spec, backends="flash/efficient/math" if runtime_backends else "torch default")
            report["rows"].append(row)
            print(f"{(spec or {}).get('method', 'plain'):6s} {row['backends']:22s} "
                  f"{row['tokens_per_second']:8.1f} tok/s {row['ms_per_step']:7.2f} ms/step", flush=True)
    write_json(report, args.out)
    dev.synchronize(target.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
