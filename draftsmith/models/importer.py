"""`draftsmith import SRC --out CHECKPOINT [--target T] [--overwrite]`: a published drafter as a draftsmith checkpoint.

So a drafter trained elsewhere can be fine-tuned (a recipe's `model.init_from: CHECKPOINT`), evaluated or
re-exported. SRC is a folder, or a Hugging Face repo id (downloaded). The layouts it reads are the export formats
whose spec gives a reader (`ExportFormat.detect` and `.read`, models/registry.py); the first format that claims
the folder's config.json reads it.

The checkpoint written is what the trainer writes (config.json, model.safetensors, trainer_state.json when the
source recorded its step) plus `import.json`: where it came from, what had to be assumed, and the source's
proposal length, which a later speculators export keeps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.models import registry
from draftsmith.models.checkpoint import (
    CONFIG_FILE,
    IMPORT_FILE,
    TRAINER_STATE_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    CheckpointImportError,
    ExportError,
    atomic_output_dir,
    check_finite,
    check_output_dir,
    save_safetensors_atomic,
    write_json_atomic,
)
from draftsmith.models.drafter_config import DrafterLoadError, local_folder
from draftsmith.models.model_card import looks_like_hub_id
from draftsmith.models.spec import ExportFormat, resolve


@dataclass
class ImportResult:
    out_dir: Path
    format: str
    files: list[Path]
    notes: list[str]


def importable_formats() -> list[ExportFormat]:
    """The layouts `draftsmith import` reads: formats with both a detector and a reader."""
    return [fmt for _, fmt in registry.formats().values() if fmt.detect is not None and fmt.read is not None]


# ---- reading a folder --------------------------------------------------------------------------------------
def read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise CheckpointImportError(f"{folder}: no {CONFIG_FILE}; give the folder of a published drafter")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointImportError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
    if not isinstance(config, dict):
        raise CheckpointImportError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def detect_format(config: dict[str, Any]) -> ExportFormat | None:
    """The importable layout a config.json is in, or None."""
    return next((fmt for fmt in importable_formats() if fmt.detect(config)), None)


# ---- the command -------------------------------------------------------------------------------------------
def _local_source(src: str) -> Path:
    """SRC as a folder; a Hub repo id that is not a local path is downloaded (config, weights, json files)."""
    path = Path(src)
    if path.exists():
        if not path.is_dir():
            raise CheckpointImportError(f"{src}: is a file; give the folder holding config.json and the weights")
        return path
    if not looks_like_hub_id(src):
        raise CheckpointImportError(f"{src}: no such folder (and not a Hugging Face repo id)")
    try:
        return local_folder(src, ["*.json", "*.safetensors", "*.pt"])
    except DrafterLoadError as e:
        raise CheckpointImportError(str(e)) from None


def import_checkpoint(
    src: str | os.PathLike, out_dir: str | os.PathLike, *, target: str | None = None, overwrite: bool = False
) -> ImportResult:
    """Read SRC in whichever public format it is and write a draftsmith checkpoint to `out_dir`, all or nothing."""
    out_dir = Path(out_dir)
    folder = _local_source(str(src))
    check_output_dir(out_dir, overwrite, keep=(folder,))
    public = read_config(folder)
    if public.get("method") is not None and "architectures" not in public:
        raise CheckpointImportError(f"{folder}: already a draftsmith checkpoint (\"method\": "
                                    f"{public['method']!r}); use it as is")
    fmt = detect_format(public)
    if fmt is None:
        known = ", ".join(f.layout for f in importable_formats())
        raise CheckpointImportError(
            f"{folder / CONFIG_FILE}: not a format draftsmith imports (architectures {public.get('architectures')}, "
            f"speculators_model_type {public.get('speculators_model_type')!r}); known: {known}"
        )
    name = fmt.layout
    try:
        imported = resolve(fmt.read)(folder, public, target)
    except CheckpointImportError:
        raise
    except ValueError as e:
        raise CheckpointImportError(f"{folder}: {e}") from None
    check_finite(imported.tensors, folder, CheckpointImportError)  # the readers check each file they read; this,
    # what any of them computed

    record = {"source": str(src), "format": name, "notes": imported.notes}
    if imported.num_speculative_tokens is not None:
        record["num_speculative_tokens"] = imported.num_speculative_tokens
    files = [CONFIG_FILE, WEIGHTS_FILE, IMPORT_FILE]
    with atomic_output_dir(out_dir, overwrite=overwrite, keep=(folder,)) as tmp:
        write_json_atomic(imported.config, tmp / CONFIG_FILE)
        save_safetensors_atomic(imported.tensors, tmp / WEIGHTS_FILE)
        write_json_atomic(record, tmp / IMPORT_FILE)
        if imported.step is not None:
            write_json_atomic({"step": imported.step}, tmp / TRAINER_STATE_FILE)
            files.append(TRAINER_STATE_FILE)
    return ImportResult(out_dir=out_dir, format=name, files=[out_dir / f for f in files], notes=imported.notes)


def add_import_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="folder (or Hugging Face repo id) of a published drafter: "
                   + "; ".join(f"{fmt.layout}: {fmt.help}" for fmt in importable_formats()))
    p.add_argument("--out", required=True, type=Path, help="checkpoint folder to write (must be empty or absent)")
    p.add_argument("--target", default=None,
                   help="the target's Hub id or local folder, when the drafter's config does not name it or names "
                        "a copy you do not have; its config.json fills in the layer count")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists and is not empty")


def run_import(args: argparse.Namespace) -> int:
    try:
        result = import_checkpoint(args.src, args.out, target=args.target, overwrite=args.overwrite)
    except (CheckpointImportError, CheckpointError, ExportError) as e:
        print(f"draftsmith import: error: {e}", file=sys.stderr)
        return 2
    for note in result.notes:
        print(f"draftsmith import: note: {note}", file=sys.stderr)
    print(f"wrote {result.out_dir} (draftsmith checkpoint, from {result.format}):")
    for path in result.files:
        print(f"  {path.name}")
    print(f"\nexport it again with: draftsmith export {result.out_dir} --format FORMAT --out DIR")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="draftsmith import", description=__doc__.splitlines()[0])
    add_import_args(parser)
    return run_import(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
