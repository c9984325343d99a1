"""`draftsmith import SRC --out CHECKPOINT [--target T] [--overwrite]`: a published drafter as a draftsmith checkpoint.

So a drafter trained elsewhere can be fine-tuned (a recipe's `model.init_from: CHECKPOINT`), evaluated or
re-exported. SRC is a folder, or a Hugging Face repo id (downloaded). Formats are a table, format name ->
`ImportFormat(detect, read)`; the first whose `detect(config)` is true reads the folder. Adding a drafter's formats
means adding rows here.

The checkpoint written is what the trainer writes (config.json, model.safetensors, trainer_state.json when the
source recorded its step) plus `import.json`: where it came from, what had to be assumed, and the source's
proposal length, which a later speculators export keeps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from draftsmith.models.checkpoint import (
    CONFIG_FILE,
    TRAINER_STATE_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    ExportError,
    atomic_output_dir,
    check_output_dir,
    save_safetensors_atomic,
    write_json_atomic,
)

IMPORT_FILE = "import.json"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointImportError(ValueError):
    """A source folder that cannot be imported; the message names the file and the reason."""


@dataclass
class ImportedCheckpoint:
    """What a format reader hands back: a draftsmith config (with "method") and tensors in draftsmith's names."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    notes: list[str] = field(default_factory=list)  # what had to be assumed; shown to the user, kept in import.json
    step: int | None = None
    num_speculative_tokens: int | None = None  # the source's proposal length, if it recorded one


@dataclass(frozen=True)
class ImportFormat:
    detect: Callable[[dict[str, Any]], bool]
    # (source folder, its config.json, --target or None) -> ImportedCheckpoint; raise ValueError to refuse
    read: Callable[[Path, dict[str, Any], str | None], ImportedCheckpoint]
    help: str = ""


@dataclass
class ImportResult:
    out_dir: Path
    format: str
    files: list[Path]
    notes: list[str]


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


def load_folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of `model.safetensors`, or of the shards a `model.safetensors.index.json` names."""
    try:
        if (folder / INDEX_FILE).is_file():
            index = json.loads((folder / INDEX_FILE).read_text(encoding="utf-8"))
            tensors: dict[str, torch.Tensor] = {}
            for shard in sorted(set(index["weight_map"].values())):
                tensors.update(load_file(str(folder / shard), device="cpu"))
            return tensors
        if (folder / WEIGHTS_FILE).is_file():
            return load_file(str(folder / WEIGHTS_FILE), device="cpu")
    except (SafetensorError, OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointImportError(f"{folder}: cannot load its safetensors weights: {e}") from None
    raise CheckpointImportError(f"{folder}: no {WEIGHTS_FILE} or {INDEX_FILE}")


# ---- EAGLE-3 (native and speculators layouts) --------------------------------------------------------------
def _read_eagle3(folder: Path, public: dict[str, Any], target: str | None) -> ImportedCheckpoint:
    from draftsmith.models.eagle3.export import AUX_IDS_KEY, check_state_dict, expected_native_shapes
    from draftsmith.models.eagle3.io import DrafterLoadError, read_public_eagle3
    from draftsmith.models.eagle3.speculators import EMBED_KEY, load_target_embedding, read_target_config

    prov = public.get("draftsmith") if isinstance(public.get("draftsmith"), dict) else {}
    verifier = ((public.get("speculators_config") or {}).get("verifier") or {}) \
        if isinstance(public.get("speculators_config"), dict) else {}
    target_name = target or prov.get("target") or verifier.get("name_or_path") or ""
    target_config = read_target_config(target_name) if target_name else None
    tensors = load_folder_tensors(folder)
    try:
        config, state, notes = read_public_eagle3(public, tensors, target_config)
    except DrafterLoadError as e:
        raise CheckpointImportError(f"{folder / CONFIG_FILE}: {e}") from None
    if target:
        config.target_name_or_path = target
    if target_name and target_config is None:
        notes.append(f"target {target_name!r} not found locally (folder or Hugging Face cache); its layer count and "
                     "architectures were taken from the drafter's config")

    flat = {**config.to_dict(), AUX_IDS_KEY: config.aux_layer_ids}
    problems = check_state_dict(flat, expected_native_shapes(flat), state)
    if problems:
        raise CheckpointImportError(f"{folder}: tensors do not match the config: " + "; ".join(problems))
    if EMBED_KEY in tensors and target_name:
        embedding, _ = load_target_embedding(target_name)
        if embedding is not None and not torch.equal(embedding.to(tensors[EMBED_KEY].dtype), tensors[EMBED_KEY]):
            notes.append(f"the drafter's {EMBED_KEY} differs from the target's; draftsmith drafts with the target's "
                         "embedding, as vLLM and SGLang do")
    methods = (public.get("speculators_config") or {}).get("proposal_methods") \
        if isinstance(public.get("speculators_config"), dict) else None
    k = methods[0].get("speculative_tokens") if isinstance(methods, list) and methods and \
        isinstance(methods[0], dict) else None
    step = prov.get("step")
    return ImportedCheckpoint(
        config=config.to_dict(), tensors=state, notes=notes,
        step=step if isinstance(step, int) else None,
        num_speculative_tokens=k if isinstance(k, int) and k > 0 else None,
    )


def _is_speculators_eagle3(config: dict[str, Any]) -> bool:
    from draftsmith.models.eagle3.io import is_speculators_eagle3

    return is_speculators_eagle3(config)


def _is_native_eagle3(config: dict[str, Any]) -> bool:
    from draftsmith.models.eagle3.io import is_native_eagle3

    return is_native_eagle3(config)


# ---- DFlash (the `DFlashDraftModel` layout vLLM and SGLang load) ----------------------------------------------
def _read_dflash(folder: Path, public: dict[str, Any], target: str | None) -> ImportedCheckpoint:
    from draftsmith.models.dflash.model import DflashDrafter, DrafterLoadError, read_drafter_folder

    try:
        config, tensors = read_drafter_folder(folder)
    except DrafterLoadError as e:
        raise CheckpointImportError(str(e)) from None
    if target:
        config.target_name_or_path = target
    expected = {k: v.shape for k, v in DflashDrafter(config).state_dict().items() if not k.startswith("rotary_emb.")}
    problems = [f"missing {k}" for k in sorted(set(expected) - set(tensors))]
    problems += [f"unexpected {k}" for k in sorted(set(tensors) - set(expected))]
    problems += [f"{k}: shape {tuple(t.shape)}, expected {tuple(expected[k])}"
                 for k, t in sorted(tensors.items()) if k in expected and t.shape != expected[k]]
    if problems:
        raise CheckpointImportError(f"{folder}: tensors do not match the config: " + "; ".join(problems))
    prov = public.get("draftsmith") if isinstance(public.get("draftsmith"), dict) else {}
    step = prov.get("step")
    return ImportedCheckpoint(config=config.to_dict(), tensors=tensors, notes=[],
                              step=step if isinstance(step, int) else None)


def _is_dflash(config: dict[str, Any]) -> bool:
    return "DFlashDraftModel" in (config.get("architectures") or [])


IMPORTERS: dict[str, ImportFormat] = {
    "dflash": ImportFormat(_is_dflash, _read_dflash, "DFlash (DFlashDraftModel, `layers.*`, dflash_config): vLLM, SGLang"),
    "speculators-eagle3": ImportFormat(_is_speculators_eagle3, _read_eagle3,
                                       "vllm-project/speculators EAGLE-3 (`layers.0.*`, speculators_config)"),
    "native-eagle3": ImportFormat(_is_native_eagle3, _read_eagle3,
                                  "native EAGLE-3 (LlamaForCausalLMEagle3, `midlayer.*`): SGLang, SpecForge, EAGLE"),
}


def detect_format(config: dict[str, Any]) -> str | None:
    return next((name for name, fmt in IMPORTERS.items() if fmt.detect(config)), None)


# ---- the command -------------------------------------------------------------------------------------------
def _local_source(src: str) -> Path:
    """SRC as a folder; a Hub repo id that is not a local path is downloaded (config, weights, json files)."""
    path = Path(src)
    if path.exists():
        if not path.is_dir():
            raise CheckpointImportError(f"{src}: is a file; give the folder holding config.json and the weights")
        return path
    from draftsmith.models.drafter_config import DrafterLoadError, local_folder
    from draftsmith.models.model_card import looks_like_hub_id

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
    name = detect_format(public)
    if name is None:
        raise CheckpointImportError(
            f"{folder / CONFIG_FILE}: not a format draftsmith imports (architectures {public.get('architectures')}, "
            f"speculators_model_type {public.get('speculators_model_type')!r}); known: {', '.join(IMPORTERS)}"
        )
    try:
        imported = IMPORTERS[name].read(folder, public, target)
    except CheckpointImportError:
        raise
    except ValueError as e:
        raise CheckpointImportError(f"{folder}: {e}") from None

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
                   + "; ".join(f"{k}: {v.help}" for k, v in IMPORTERS.items()))
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
