"""The runtime issue's measurement in one process: draftsmith's plain, n-gram, suffix, EAGLE-3 chain (k = 1..7)
and EAGLE-3 dynamic trees, next to Hugging Face `generate` (plain and prompt-lookup assisted), at each
temperature, on the same prompts; plus the fraction of the ideal speedup tau / (1 + k c) each EAGLE-3 chain
reaches, with c = (one drafter step) / (one target step) measured here (`draft_step_cost`).

    python -m benchmarks.runtime_benchmark --target .fixture/sharegpt-llama-19m --drafter DRAFTER \
        --dataset .devdata/question.jsonl --temperatures 0 1 --out benchmarks/results/runtime_h200

Writes runtime.json (command, hardware, versions, every figure) and one PNG per temperature.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import write_json
from benchmarks.runinfo import run_info
from draftsmith import device as dev
from draftsmith.inference.eval import format_table, load_prompts, run_sweep
from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.report import dataset_result, write_plots
from draftsmith.inference.spec_config import build_proposer, parse_spec_config
from draftsmith.models.target import TargetModel
from draftsmith.runtime.sampling import SamplingParams

TREES = [(4, 4, 16), (6, 8, 48)]  # (depth, top_k, total nodes): a small and an EAGLE-2-sized tree


# chain, tree, hybrid, sampled_chain: EAGLE-3 (hybrid: + suffix; sampled_chain: draft_sample_method probabilistic)
METHODS = ("ngram", "chain", "suffix", "tree", "hybrid", "sampled_chain")
DEFAULT_METHODS = ("ngram", "chain", "suffix", "tree")
HYBRID_MIN_SCORE = 1.0


def spec_configs(drafter: str, ks: list[int], methods=DEFAULT_METHODS) -> list:
    configs = []
    for k in ks:
        if "ngram" in methods:
            configs.append({"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 1,
                            "num_speculative_tokens": k})
        if "chain" in methods:
            configs.append({"method": "eagle3", "model": drafter, "num_speculative_tokens": k})
        if "sampled_chain" in methods:
            configs.append({"method": "eagle3", "model": drafter, "num_speculative_tokens": k,
                            "draft_sample_method": "probabilistic"})
        if "hybrid" in methods:
            configs.append({"method": "eagle3", "model": drafter, "num_speculative_tokens": k,
                            "suffix_hybrid": {"min_score": HYBRID_MIN_SCORE}})
    if "suffix" in methods:
        configs.append({"method": "suffix"})
    if "tree" in methods:
        for depth, top_k, nodes in TREES:
            configs.append({"method": "eagle3", "model": drafter, "num_speculative_tokens": nodes,
                            "dynamic_tree": {"depth": depth, "top_k": top_k}})
    return [parse_spec_config(c) for c in configs]


def hf_generate(target: TargetModel, prompts, max_new_tokens, temperature, eos, assisted_k: int | None):
    """tokens/s of transformers' own `generate` on the same prompts (prompt lookup when `assisted_k`)."""
    model = target.model
    tokens, seconds = 0, 0.0
    extra = {"prompt_lookup_num_tokens": assisted_k} if assisted_k else {}
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature > 0 else {"do_sample": False}
    for ids in prompts:
        x = torch.tensor([ids], device=target.device)
        dev.synchronize(target.device)
        start = time.perf_counter()
        out = model.generate(x, max_new_tokens=max_new_tokens, eos_token_id=sorted(eos), pad_token_id=sorted(eos)[0],
                             **sampling, **extra)
        dev.synchronize(target.device)
        seconds += time.perf_counter() - start
        tokens += out.shape[1] - x.shape[1]
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds}


@dev.sdpa_without_cudnn()
def draft_cost_ratio(target: TargetModel, drafter: str, prompt, k: int) -> dict[str, float]:
    """c = per-token cost of the drafter chain / cost of one plain target step, both timed here (attention
    backends as in decoding)."""
    spec = parse_spec_config({"method": "eagle3", "model": drafter, "num_speculative_tokens": k})
    proposer = build_proposer(spec, target)
    ids = torch.tensor([prompt], device=target.device)
    cache = target.new_cache(1, ids.shape[1] + 64)
    out = target.step(ids, cache, aux_layer_ids=proposer.aux_layer_ids)
    proposer.begin(ids)
    proposer.extend(torch.cat([ids[:, 1:], out.logits[:, -1:].argmax(-1)], 1), out.aux_hidden)
    base = cache.length

    def target_step():
        cache.rollback(base)
        target.step(ids[:, -1:], cache)

    step_ms = dev.time_ms(target_step, target.device, repeat=100)
    chain_ms = dev.time_ms(lambda: proposer.propose(k), target.device, repeat=100)
    return {"target_step_ms": step_ms, "draft_chain_ms": chain_ms, "c": chain_ms / k / step_ms}


def draft_step_cost(cost_ratio: dict) -> dict[str, float] | None:
    """c of one drafter step: the slope of the chain's time over k (least squares) over the target step.

    A chain of k drafts runs k - 1 drafter forwards plus k heads (its first draft comes from the extend step's
    output), so chain time / k undercounts a step at small k; the slope is the cost each further draft adds."""
    if len(cost_ratio) < 2:
        return None
    ks = [float(k) for k in cost_ratio]
    ms = [r["draft_chain_ms"] for r in cost_ratio.values()]
    mean_k, mean_ms = sum(ks) / len(ks), sum(ms) / len(ms)
    slope = sum((k - mean_k) * (m - mean_ms) for k, m in zip(ks, ms)) / sum((k - mean_k) ** 2 for k in ks)
    step_ms = sum(r["target_step_ms"] for r in cost_ratio.values()) / len(cost_ratio)
    return {"draft_step_ms": slope, "target_step_ms": step_ms, "c": slope / step_ms}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True, help="EAGLE-3 drafter folder (export or checkpoint)")
    p.add_argument("--dataset", required=True)
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7])
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(DEFAULT_METHODS),
                   help="what to run besides plain decoding (chain, tree: EAGLE-3; not run by default: hybrid, "
                        f"EAGLE-3 chains with suffix_hybrid min_score {HYBRID_MIN_SCORE}, and sampled_chain, "
                        "EAGLE-3 chains with draft_sample_method probabilistic)")
    p.add_argument("--hf-num-prompts", type=int, default=16, help="prompts for Hugging Face generate (slow)")
    p.add_argument("--hf-temperatures", type=float, nargs="*", default=None,
                   help="temperatures at which to run Hugging Face generate (default: all)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = dev.get_device()
    target = TargetModel.from_pretrained(args.target, dtype=args.dtype, device=device)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = load_prompts(args.dataset, tokenizer, limit=args.num_prompts)
    eos = {tokenizer.eos_token_id} | set(target.config.eos_token_id if isinstance(target.config.eos_token_id, list)
                                         else [target.config.eos_token_id] if target.config.eos_token_id is not None
                                         else [])
    report = {**run_info(target), "max_new_tokens": args.max_new_tokens, "num_prompts": len(prompts),
              "cost_ratio": ({k: draft_cost_ratio(target, args.drafter, prompts[0], k) for k in args.ks}
                             if "chain" in args.methods else {}),
              "runs": {}}
    report["draft_step"] = draft_step_cost(report["cost_ratio"])  # the c of the ideal speedup
    specs = spec_configs(args.drafter, args.ks, args.methods)
    hf_temperatures = args.temperatures if args.hf_temperatures is None else args.hf_temperatures
    for temperature in args.temperatures:
        sampling = SamplingParams(temperature=temperature, seed=args.seed) if temperature > 0 else None
        key = f"temperature_{temperature:g}"

        hf = None
        if temperature in hf_temperatures:  # before the sweep, so that a sweep cut short still leaves this measured
            hf_prompts = prompts[: args.hf_num_prompts]  # HF generate is slow: a subset, with our plain decoding on it
            plain = SpeculativeGenerator(target, None, 0)
            plain.generate(torch.tensor([hf_prompts[0]]), 16, eos, sampling=sampling)  # untimed: graphs recorded
            ours = [plain.generate(torch.tensor([ids]), args.max_new_tokens, eos, sampling=sampling)
                    for ids in hf_prompts]
            hf = {
                "num_prompts": len(hf_prompts),
                "plain": hf_generate(target, hf_prompts, args.max_new_tokens, temperature, eos, None),
                "prompt_lookup_k3": hf_generate(target, hf_prompts, args.max_new_tokens, temperature, eos, 3),
                "draftsmith_plain_tokens_per_second": (sum(len(r.token_ids) for r in ours)
                                                       / sum(r.seconds for r in ours)),
            }
            print(f"temperature {temperature:g}: HF generate on {len(hf_prompts)} prompts: plain "
                  f"{hf['plain']['tokens_per_second']:.1f} tok/s, prompt lookup "
                  f"{hf['prompt_lookup_k3']['tokens_per_second']:.1f} tok/s; draftsmith plain there "
                  f"{hf['draftsmith_plain_tokens_per_second']:.1f} tok/s")
            report["runs"][key] = {"hf_generate": hf}
            write_json(report, out / "runtime.json")

        def save_partial(partial, key=key):  # after every config: a run cut short keeps what it measured
            report["runs"][key] = {**partial, "hf_generate": hf} if hf else partial
            write_json(report, out / "runtime.json")

        sweep = run_sweep(target, tokenizer, {"mt_bench": prompts}, specs, args.max_new_tokens, sampling=sampling,
                          on_progress=save_partial)
        base = sweep["datasets"]["mt_bench"]["baseline"]["tokens_per_second"]
        for row in sweep["results"]:
            k = row["num_speculative_tokens"]
            tau = row["metrics"].get("mean_acceptance_length")
            chain = not {"dynamic_tree", "suffix_hybrid", "draft_sample_method"} & row["spec_config"].keys()
            if row["method"] == "eagle3" and chain and tau and \
                    report["draft_step"]:
                ideal = tau / (1 + k * report["draft_step"]["c"])
                row["ideal_speedup"] = ideal
                row["fraction_of_ideal"] = row["speedup"] / ideal
        if hf:
            sweep["hf_generate"] = {**hf, "draftsmith_plain_tokens_per_second_all_prompts": base}
        report["runs"][key] = sweep
        write_plots(sweep, out / f"t{temperature:g}")
        print(f"\ntemperature {temperature:g}\n" + format_table(dataset_result(sweep, "mt_bench")))
        for row in sweep["results"]:
            if "fraction_of_ideal" in row:
                print(f"eagle3 k={row['num_speculative_tokens']}: c={report['draft_step']['c']:.3f} "
                      f"ideal {row['ideal_speedup']:.2f}x, reached {row['speedup']:.2f}x = "
                      f"{100 * row['fraction_of_ideal']:.0f}% of ideal")
        write_json(report, out / "runtime.json")
    print(f"wrote {out / 'runtime.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
