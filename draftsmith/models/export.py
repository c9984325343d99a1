"""`draftsmith export CHECKPOINT --format FORMAT --out DIR [--overwrite]`: write a checkpoint in an engine's format.

The formats are those the methods' specs declare (models/registry.py); each exporter takes (checkpoint, out_dir,
overwrite=..., dtype=..., plus the options its format lists), checks the checkpoint's method itself, validates
before writing, writes all or nothing, and returns an `ExportResult`: every one is the `write` of the format's
`FormatExport` (models/export_base.py), which runs that sequence once for all of them. `--format all` runs every format of the
checkpoint's method, each into `DIR/<format>`, all of them built in a temporary sibling of DIR that is renamed to
DIR once every format is in. Every folder written holds EXPORT_MARKER, and `--overwrite` replaces only such a folder.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from draftsmith.models import registry
from draftsmith.models.checkpoint import (
    CONFIG_FILE,
    CheckpointError,
    ExportError,
    ExportResult,
    FormatNotApplicable,
    check_output_dir,
    human_size,
    read_json,
    resolve_checkpoint,
    staged_output_dir,
    write_export_marker,
)
from draftsmith.models.spec import resolve

Exporter = Callable[..., ExportResult]  # (checkpoint, out_dir, *, overwrite: bool, dtype, **options) -> ExportResult

EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "keep": None}
ALL = "all"  # every format that applies to the checkpoint's method, each into DIR/<format>


def exporter(name: str) -> Exporter:
    """The export function of format `name` (an `export --format` choice)."""
    return resolve(registry.formats()[name][1].export)


def _options(name: str, options: dict) -> dict:
    """The keyword options of `options` that format `name` takes (its spec's `options`), unset ones dropped."""
    wanted = registry.formats()[name][1].options
    return {k: v for k, v in options.items() if k in wanted and v is not None}


def add_export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path,
                   help="a checkpoint-N folder, or a training output_dir (meaning its latest checkpoint)")
    formats = registry.formats()
    p.add_argument("--format", required=True, choices=[*sorted(formats), ALL],
                   help="; ".join(f"{name}: {fmt.help}" for name, (_, fmt) in formats.items())
                   + f"; {ALL}: every format for the checkpoint's method, into DIR/<format>")
    p.add_argument("--out", required=True, type=Path,
                   help="folder to write (created; must be absent or empty, or an earlier export with --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out if it holds an earlier export (a folder of other files is never replaced)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(EXPORT_DTYPES),
                   help="dtype of the exported weights (default bfloat16; 'keep' writes the fp32 master weights)")
    p.add_argument("--verifier", default=None, metavar="ORG/NAME",
                   help="speculators: the target's Hugging Face id to record as the verifier (default: the recipe's "
                        "target when it is a Hub id or in the Hub cache; a plain local path is kept, with a warning)")


def export_all(
    checkpoint: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False,
    dtype: torch.dtype | None = torch.bfloat16, **options,
) -> tuple[dict[str, ExportResult], list[str]]:
    """({format: result}, skipped notes): every format the checkpoint's method declares (models/registry.py).

    The formats are written into one temporary sibling of `out_dir` that becomes `out_dir` once all of them are
    in (staged_output_dir): a refused format, a full disk or a kill leaves no half set under `out_dir`.
    """
    out_dir = Path(out_dir)
    ckpt = resolve_checkpoint(checkpoint)
    raw = read_json(ckpt / CONFIG_FILE)
    method = raw.get("method") if isinstance(raw, dict) else None
    check_output_dir(out_dir, overwrite, keep=(ckpt,), exports_only=True)
    spec = registry.find(method) if isinstance(method, str) else None
    if spec is None:
        raise ExportError(f"{ckpt / CONFIG_FILE}: no export format for method {method!r} (known methods: "
                          f"{', '.join(registry.methods())})")
    formats = [fmt.name for fmt in spec.formats]
    skipped = [f"{name}: skipped, it exports {other.method} drafters and this is {method}"
               for name, (other, _) in registry.formats().items() if other is not spec]

    results: dict[str, ExportResult] = {}
    with staged_output_dir(out_dir, overwrite=overwrite, keep=(ckpt,), exports_only=True) as staged:
        write_export_marker(staged)
        for name in formats:
            try:
                results[name] = exporter(name)(ckpt, out_dir / name, overwrite=overwrite, dtype=dtype,
                                               **_options(name, options))
            except FormatNotApplicable as e:
                skipped.append(f"{name}: skipped: {e}")
            except (CheckpointError, ExportError) as e:
                raise ExportError(f"format {name}: {e}") from None
        if not results:  # every format declined: write nothing rather than an empty folder
            raise ExportError(f"{ckpt}: no format applies to this checkpoint: " + "; ".join(skipped))
    return results, skipped


def _report(result: ExportResult, fmt: str) -> None:
    for warning in result.warnings:
        print(f"draftsmith export: warning: {fmt}: {warning}", file=sys.stderr)
    print(f"wrote {result.out_dir} ({fmt}):")
    for path in result.files:
        print(f"  {path.name:<20} {human_size(path.stat().st_size)}")
    for engine, command in result.serve_commands.items():
        print(f"\nserve with {engine}:\n  {command}")


def run_export(args: argparse.Namespace) -> int:
    dtype = EXPORT_DTYPES[args.dtype]
    try:
        options = {"verifier": args.verifier}
        if args.format == ALL:
            results, skipped = export_all(args.checkpoint, args.out, overwrite=args.overwrite, dtype=dtype,
                                          **options)
        else:
            # the exporter refuses a folder that is not an export too, but only once the weights are converted
            check_output_dir(args.out, args.overwrite, keep=(resolve_checkpoint(args.checkpoint),), exports_only=True)
            results = {args.format: exporter(args.format)(args.checkpoint, args.out, overwrite=args.overwrite,
                                                          dtype=dtype, **_options(args.format, options))}
            skipped = []
    except (CheckpointError, ExportError) as e:
        print(f"draftsmith export: error: {e}", file=sys.stderr)
        return 2
    for i, (fmt, result) in enumerate(results.items()):
        if i:
            print()
        _report(result, fmt)
    for note in skipped:
        print(f"draftsmith export: note: {note}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="draftsmith export", description=__doc__.splitlines()[0])
    add_export_args(parser)
    return run_export(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
