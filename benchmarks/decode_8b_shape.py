"""Plain decoding of a Llama-3.1-8B-shaped target with random bf16 weights: draftsmith's runtime against
Hugging Face `generate` in one process, against the bound of reading every weight once per token, with and without
the decoder layers fused by torch.compile (DRAFTSMITH_COMPILE=1; the warm-up that compiles is timed apart), plus
the cost of a verification step of width T = k + 1 relative to a one-token step (what the ideal speedup assumes).

    python -m benchmarks.decode_8b_shape --out decode_8b_shape.json [--layers 32]

Needs an accelerator with about 20 GB free. Random weights make the output meaningless but not the timing.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks.common import write_json
from benchmarks.runinfo import run_info
from benchmarks.shapes import LLAMA_31_8B, random_target
from draftsmith import device as dev
from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.models.target import TargetModel


def copy_bandwidth(device, gigabytes: float = 2.0) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read plus written."""
    src = torch.empty(int(gigabytes * 2**30) // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = dev.time_ms(lambda: dst.copy_(src), device, repeat=10)
    return 2 * src.numel() * src.element_size() / (ms / 1e3)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--hf-new-tokens", type=int, default=64)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    device = dev.get_device()
    shape = {**LLAMA_31_8B, "num_hidden_layers": args.layers, "max_position_embeddings": 8192}
    target = random_target(shape, torch.bfloat16, device, f"random Llama-3.1-8B shape ({args.layers} layers)")
    model = target.model
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    bandwidth = copy_bandwidth(device)
    prompt = torch.randint(0, shape["vocab_size"], (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    report = {**run_info(target), "weight_bytes": weight_bytes, "copy_bandwidth_bytes_per_s": bandwidth,
              "bound_tokens_per_s": bandwidth / weight_bytes}

    report["draftsmith"] = measure(target, prompt, args.new_tokens, device)
    try:  # the same target with its decoder layers fused by torch.compile (DRAFTSMITH_COMPILE=1)
        compiled = TargetModel(model, name_or_path=target.name_or_path, compile_layers=True)
        report["draftsmith_compiled"] = measure(compiled, prompt, args.new_tokens, device)
    except Exception as e:  # noqa: BLE001 - a failed compile is a result to report, not a reason to lose the rest
        report["draftsmith_compiled"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}

    ids = prompt.to(device)
    model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up
    dev.synchronize(device)
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=args.hf_new_tokens, min_new_tokens=args.hf_new_tokens, do_sample=False)
    dev.synchronize(device)
    seconds = time.perf_counter() - start
    report["hf_generate"] = {"tokens": out.shape[1] - ids.shape[1], "seconds": seconds,
                             "tokens_per_second": (out.shape[1] - ids.shape[1]) / seconds}
    print(f"weights {weight_bytes / 1e9:.2f} GB, copy bandwidth {bandwidth / 1e12:.2f} TB/s, "
          f"bound {report['bound_tokens_per_s']:.0f} tok/s")
    for name in ("draftsmith", "draftsmith_compiled", "hf_generate"):
        r = report[name]
        if "tokens_per_second" not in r:
            print(f"{name:20s} failed: {r.get('error')}")
            continue
        r["fraction_of_bound"] = r["tokens_per_second"] / report["bound_tokens_per_s"]
        print(f"{name:20s} {r['tokens_per_second']:7.1f} tok/s  {100 * r['fraction_of_bound']:5.1f}% of the bound"
              + (f"  (warm-up {r['warmup_seconds']:.1f} s)" if "warmup_seconds" in r else ""))
        if "step_ms_by_width" in r:
            print("  step ms by width: " + " ".join(f"T={w}:{ms:.2f}" for w, ms in r["step_ms_by_width"].items()))
    write_json(report, args.out)
    return 0


def measure(target: TargetModel, prompt: torch.Tensor, new_tokens: int, device) -> dict:
    """Plain decoding tok/s (after an untimed warm-up that records the graphs, and compiles when asked), and one
    target step of width T over a cache of the prompt for T = 1 .. 8 (k = 0 .. 7), graphed as decoding runs it."""
    plain = SpeculativeGenerator(target, None, 0)
    start = time.perf_counter()
    plain.generate(prompt, 8)
    warmup = time.perf_counter() - start
    result = plain.generate(prompt, new_tokens)
    ids = prompt.to(device)
    cache = target.new_cache(1, ids.shape[1] + 64)
    step_ms = {}
    with dev.sdpa_without_cudnn():
        target.step(ids, cache)
        base = cache.length
        for width in range(1, 9):
            def step():
                cache.rollback(base)
                target.step(ids[:, :width], cache)
            step_ms[width] = dev.time_ms(step, device, repeat=20)
    return {"compiled_layers_used": target._compiled_layer is not None and target._graphs_on,  # graphed steps only
            "tokens": len(result.token_ids), "seconds": result.seconds, "warmup_seconds": warmup,
            "tokens_per_second": len(result.token_ids) / result.seconds, "step_ms_by_width": step_ms}


if __name__ == "__main__":
    sys.exit(main())
