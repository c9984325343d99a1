"""Where a speculative step spends its time: target steps, drafter steps, propose/extend, and whole generations,
timed side by side in one process, plus the torch profiler's top operators for one EAGLE-3 generation.

    python -m benchmarks.profile_runtime --target .fixture/sharegpt-llama-19m --drafter DIR [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.common import write_json
from benchmarks.runinfo import run_info
from draftsmith import device as dev
from draftsmith.inference.eval import load_prompts
from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.spec_config import build_proposer, parse_spec_config
from draftsmith.models.target import TargetModel


@dev.sdpa_without_cudnn()  # it times target and drafter steps directly: same attention backends as decoding
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--dataset", default=".devdata/question.jsonl")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from transformers import AutoTokenizer

    device = dev.get_device()
    target = TargetModel.from_pretrained(args.target, dtype=args.dtype, device=device)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = load_prompts(args.dataset, tokenizer, limit=4)
    ids = torch.tensor([prompts[0]], device=device)
    report = {**run_info(target), "k": args.k, "ms": {}}
    ms = report["ms"]

    cache = target.new_cache(1, 2048)
    target.step(ids, cache)
    base = cache.length
    aux = tuple(range(2, 5))

    def target_step(width, aux_ids=None):
        def run():
            cache.rollback(base)
            target.step(ids[:, :width], cache, aux_layer_ids=aux_ids)
        return run

    ms["target_step_T1"] = dev.time_ms(target_step(1), device)
    ms[f"target_step_T{args.k + 1}"] = dev.time_ms(target_step(args.k + 1), device)
    ms[f"target_step_T{args.k + 1}_aux"] = dev.time_ms(target_step(args.k + 1, aux), device)

    eagle = parse_spec_config({"method": "eagle3", "model": args.drafter, "num_speculative_tokens": args.k})
    proposer = build_proposer(eagle, target)
    proposer.begin(ids)
    out = target.step(ids, target.new_cache(1, 2048), aux_layer_ids=proposer.aux_layer_ids)
    first = out.logits[:, -1].argmax(-1, keepdim=True)
    proposer.extend(torch.cat([ids[:, 1:], first], 1), out.aux_hidden)
    committed = proposer.committed
    ms[f"propose_k{args.k}"] = dev.time_ms(lambda: proposer.propose(args.k), device)
    aux_step = out.aux_hidden[:, -2:]

    def extend_two():
        proposer.cache.rollback(committed - 2)
        proposer.committed = committed - 2
        proposer.extend(ids[:, -2:], aux_step)
    ms["extend_2"] = dev.time_ms(extend_two, device)

    eos = {tokenizer.eos_token_id}
    gens = {
        "plain": SpeculativeGenerator(target, None, 0),
        f"eagle3_k{args.k}": SpeculativeGenerator(target, build_proposer(eagle, target), args.k),
        f"ngram_k{args.k}": SpeculativeGenerator(target, build_proposer(parse_spec_config(
            {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 1, "num_speculative_tokens": args.k}),
            target), args.k),
    }
    report["generate"] = {}
    for name, gen in gens.items():
        gen.generate(ids, 16, eos)
        total_tokens, total_s, steps = 0, 0.0, 0
        for prompt in prompts:
            r = gen.generate(torch.tensor([prompt], device=device), 128, eos)
            total_tokens += len(r.token_ids)
            total_s += r.seconds
            steps += r.num_target_steps
        report["generate"][name] = {"tokens_per_s": total_tokens / total_s, "ms_per_step": total_s / steps * 1e3,
                                    "tokens": total_tokens, "steps": steps}

    with torch.profiler.profile() as prof:
        gens[f"eagle3_k{args.k}"].generate(ids, 64, eos)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    report["profile_top"] = table
    print(json.dumps({k: v for k, v in report.items() if k != "profile_top"}, indent=1))
    print(table)
    if args.out:
        write_json(report, args.out)


if __name__ == "__main__":
    main()
