"""`draftsmith export CHECKPOINT --format FORMAT --out DIR [--overwrite]`: write a checkpoint in an engine's format.

Formats are a table, format name -> exporter; each exporter takes (checkpoint, out_dir, overwrite=..., dtype=...), checks the
checkpoint's method itself, validates before writing, writes all or nothing, and returns an `ExportResult`.
Adding a format (speculators, dflash) means adding a row here and an exporter in its drafter's folder.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from draftsmith.models.checkpoint import CheckpointError, ExportError, ExportResult
from draftsmith.models.dflash.export import export_dflash
from draftsmith.models.eagle3.export import export_native_eagle3

Exporter = Callable[..., ExportResult]  # (checkpoint, out_dir, *, overwrite: bool, dtype) -> ExportResult

EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "keep": None}
EXPORTERS: dict[str, Exporter] = {
    "sglang": export_native_eagle3,  # native EAGLE-3: SGLang, and vLLM with "method": "eagle3"
}
FORMAT_HELP = {
    "sglang": "native EAGLE-3 (LlamaForCausalLMEagle3): SGLang, and vLLM with method eagle3",
}


def add_export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path,
                   help="a checkpoint-N folder, or a training output_dir (meaning its latest checkpoint)")
    p.add_argument("--format", required=True, choices=sorted(EXPORTERS),
                   help="; ".join(f"{k}: {v}" for k, v in FORMAT_HELP.items()))
    p.add_argument("--out", required=True, type=Path, help="folder to write (created; must be empty or absent)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists and is not empty")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(EXPORT_DTYPES),
                   help="dtype of the exported weights (default bfloat16; 'keep' writes the fp32 master weights)")


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def run_export(args: argparse.Namespace) -> int:
    try:
        result = EXPORTERS[args.format](args.checkpoint, args.out, overwrite=args.overwrite,
                                        dtype=EXPORT_DTYPES[args.dtype])
    except (CheckpointError, ExportError) as e:
        print(f"draftsmith export: error: {e}", file=sys.stderr)
        return 2
    for warning in result.warnings:
        print(f"draftsmith export: warning: {warning}", file=sys.stderr)
    print(f"wrote {result.out_dir} ({args.format}):")
    for path in result.files:
        print(f"  {path.name:<20} {_size(path.stat().st_size)}")
    for engine, command in result.serve_commands.items():
        print(f"\nserve with {engine}:\n  {command}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="draftsmith export", description=__doc__.splitlines()[0])
    add_export_args(parser)
    return run_export(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
