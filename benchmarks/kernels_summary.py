"""gpu_kernels.sh's summary: OUT/gpu_kernels.json from the GPU tests' JUnit XML and train_8b_shape.json, with the
run information (`benchmarks.runinfo`, the command being gpu_kernels.sh's) and `nvidia-smi`'s line (OUT/gpu.txt),
and FlexAttention against the plain-torch reference at each shape (ratios of runs measured side by side in one
process).

    python -m benchmarks.kernels_summary OUT     (COMMAND in the environment: the command that made OUT)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from benchmarks.common import write_json
from benchmarks.runinfo import run_info


def test_outcome(path: Path) -> dict:
    """Counts, seconds and the failing tests' names and first lines from pytest's JUnit XML."""
    if not path.is_file():
        return {"error": f"{path.name} not written (the tests timed out or did not start)"}
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    cases = suite.findall("testcase")
    failed = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
    skipped = [c for c in cases if c.find("skipped") is not None]
    return {"passed": len(cases) - len(failed) - len(skipped), "failed": len(failed), "skipped": len(skipped),
            "seconds": float(suite.get("time", 0)),
            "failures": {f"{c.get('classname')}::{c.get('name')}":
                         ((c.find("failure") if c.find("failure") is not None else c.find("error")).get("message")
                          or "")[:500] for c in failed},
            "tests": [f"{c.get('classname')}::{c.get('name')}" for c in cases]}


FIGURES = ("method", "ttt_attention", "block_attention", "loss_kernel", "query_block", "loss_chunk_rows",
           "tokens_per_s", "peak_memory_gib", "mfu_vs_790", "mfu_vs_measured_matmul", "ratio_to_forward_only",
           "target_forward_only_tokens_per_s", "step_seconds", "error", "message")


def side_by_side(runs: list[dict]) -> list[dict]:
    """flex / reference tokens/s and peak memory for each method, seq and batch measured both ways (EAGLE-3's TTT
    attention, DFlash's block attention)."""
    by_shape: dict[tuple, dict] = {}
    for r in runs:
        kernel = r.get("ttt_attention") or r.get("block_attention")
        if "error" not in r and kernel in ("flex", "reference"):
            by_shape.setdefault((r.get("method"), r["seq"], r["batch"], r.get("loss_kernel")), {})[kernel] = r
    return [{"method": method, "seq": seq, "batch": batch,
             "tokens_per_s_flex_over_reference": pair["flex"]["tokens_per_s"] / pair["reference"]["tokens_per_s"],
             "peak_gib_flex_over_reference": pair["flex"]["peak_memory_gib"] / pair["reference"]["peak_memory_gib"]
             if pair["reference"]["peak_memory_gib"] else None}
            for (method, seq, batch, _), pair in by_shape.items() if len(pair) == 2]


def fused_loss_side_by_side(runs: list[dict]) -> list[dict]:
    """The head losses' Triton kernel against the plain-torch chunked loss: each run measured with and without
    +fusedloss, its tokens/s and peak memory ratios and both MFUs."""
    by_name = {r["run"]: r for r in runs if "error" not in r}
    pairs = []
    for name, fused in by_name.items():
        plain = by_name.get(name.replace("+fusedloss", "")) if "+fusedloss" in name else None
        if plain is not None:
            pairs.append({"run": plain["run"], "seq": plain["seq"], "batch": plain["batch"],
                          "tokens_per_s_fused_over_reference": fused["tokens_per_s"] / plain["tokens_per_s"],
                          "peak_gib_fused_over_reference": fused["peak_memory_gib"] / plain["peak_memory_gib"]
                          if plain["peak_memory_gib"] else None,
                          "mfu_vs_790_fused": fused.get("mfu_vs_790"), "mfu_vs_790_reference": plain.get("mfu_vs_790")})
    return pairs


def main(out: Path) -> int:
    gpu = (out / "gpu.txt").read_text().strip() if (out / "gpu.txt").is_file() else None
    train_path = out / "train_8b_shape.json"
    train = json.loads(train_path.read_text()) if train_path.is_file() else {}
    runs = [{"run": r["run"], "seq": r["seq"], "batch": r["batch"], **{k: r[k] for k in FIGURES if k in r}}
            for r in train.get("runs", [])]
    summary = {**run_info(command=os.environ.get("COMMAND", "bash benchmarks/gpu_kernels.sh")), "gpu": gpu,
               "gpu_tests": test_outcome(out / "gpu_tests.xml"),
               "train_8b_shape": {"command": train.get("command"), "measured_matmul_tflops":
                                  train.get("measured_matmul_tflops"), "runs": runs},
               "flex_vs_reference": side_by_side(runs), "fused_loss_vs_reference": fused_loss_side_by_side(runs)}
    write_json(summary, out / "gpu_kernels.json")
    tests = summary["gpu_tests"]
    print(f"gpu tests: {tests.get('passed')} passed, {tests.get('failed')} failed, {tests.get('skipped')} skipped"
          if "error" not in tests else f"gpu tests: {tests['error']}")
    for name, message in tests.get("failures", {}).items():
        print(f"  FAILED {name}: {message.splitlines()[0] if message else ''}")
    print(f"{'run':28} {'attention':>10} {'block':>6} {'tok/s':>9} {'peak GiB':>9} {'MFU790':>7}")
    for r in runs:
        kernel = r.get("ttt_attention") or r.get("block_attention") or "-"
        if "error" in r:
            print(f"{r['run']:28} {kernel:>10} {r['error']}: {r.get('message', '')[:80]}")
        else:
            print(f"{r['run']:28} {kernel:>10} {str(r.get('query_block')):>6} "
                  f"{r['tokens_per_s']:9.0f} {r['peak_memory_gib']:9.1f} {r.get('mfu_vs_790', float('nan')):7.1%}")
    for pair in summary["flex_vs_reference"]:
        memory = pair["peak_gib_flex_over_reference"] or 0.0
        print(f"{pair['method']} flex / reference at {pair['batch']} x {pair['seq']}: tokens/s "
              f"{pair['tokens_per_s_flex_over_reference']:.2f}x, peak memory {memory:.2f}x")
    for pair in summary["fused_loss_vs_reference"]:
        memory = pair["peak_gib_fused_over_reference"] or 0.0
        print(f"{pair['run']} fused loss / reference: tokens/s {pair['tokens_per_s_fused_over_reference']:.2f}x, "
              f"peak memory {memory:.2f}x, MFU {pair['mfu_vs_790_fused'] or 0:.1%} vs "
              f"{pair['mfu_vs_790_reference'] or 0:.1%}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="gpu_kernels.sh's output folder (gpu_kernels.json is written there)")
    sys.exit(main(parser.parse_args().out))
