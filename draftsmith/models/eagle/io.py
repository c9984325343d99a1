"""Read an EAGLE-1 drafter: a draftsmith checkpoint, the EAGLE reference's layout (what `--format eagle` writes, and
the `yuhuili/EAGLE-*` drafters) or speculators' eagle layout, for the runtime (`load_drafter`) and `draftsmith
import`. Every layout is turned into draftsmith's config and tensor names here, so both read the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftsmith.models.checkpoint import (
    CONFIG_FILE,
    CheckpointImportError,
    ImportedCheckpoint,
    check_tensors,
    load_folder_tensors,
    meta_shapes,
    provenance_step,
    resolve_checkpoint,
    size_mismatch,
    weights_file,
)
from draftsmith.models.drafter_config import DrafterLoadError, load_for_inference, local_folder, read_drafter_config
from draftsmith.models.eagle.config import METHOD, EagleConfig
from draftsmith.models.eagle.export import config_from_native, tensors_from_native
from draftsmith.models.eagle.model import EagleDrafter
from draftsmith.models.eagle.spec import is_native_eagle, is_speculators_eagle
from draftsmith.models.eagle.speculators import config_from_speculators, from_speculators_name
from draftsmith.models.target_files import load_target_embedding, read_target_config


def read_public(raw: dict[str, Any], tensors: dict[str, torch.Tensor], target_config: dict[str, Any] | None = None
                ) -> tuple[EagleConfig, dict[str, torch.Tensor], dict[str, torch.Tensor], list[str]]:
    """(config, tensors in draftsmith names, tensors the file shares with the target, notes) of a reference or
    speculators EAGLE config and its tensors; ValueError for what draftsmith cannot run."""
    if is_speculators_eagle(raw):
        config, notes = config_from_speculators(raw, set(tensors), target_config)
        tensors = {from_speculators_name(name): t for name, t in tensors.items()}
    elif is_native_eagle(raw):
        config, notes = config_from_native(raw, any(n.removeprefix("model.") == "fc.bias" for n in tensors),
                                           target_config)
    else:
        raise ValueError(f"not an EAGLE-1 layout (architectures {raw.get('architectures')}, speculators_model_type "
                         f"{raw.get('speculators_model_type')!r})")
    ours, shared = tensors_from_native(tensors)
    return config, ours, shared, notes


def tensor_problems(config: EagleConfig, tensors: dict[str, torch.Tensor]) -> list[str]:
    """What keeps `tensors` from loading into the drafter `config` builds (checkpoint.check_tensors)."""
    return check_tensors(meta_shapes(lambda: EagleDrafter(config)), tensors)  # shapes only: no memory


def read_drafter_folder(path: str | Path) -> tuple[EagleConfig, dict[str, torch.Tensor], list[str]]:
    """(config, tensors in draftsmith names, notes) of a draftsmith EAGLE checkpoint or a published folder."""
    folder = Path(path)
    raw, config_path, _ = read_drafter_config(folder, "EAGLE")
    try:
        tensors = load_folder_tensors(folder)
    except CheckpointImportError as e:
        raise DrafterLoadError(str(e)) from None
    try:
        if raw.get("method") == METHOD:
            config, notes = EagleConfig.from_dict(raw), []
        else:
            config, tensors, _, notes = read_public(raw, tensors)
    except (TypeError, ValueError) as e:
        raise DrafterLoadError(f"{config_path}: {e}") from None
    problem = size_mismatch(meta_shapes(lambda: EagleDrafter(config)), tensors, raw, config_path,
                            weights_file(folder))
    if problem:  # before anything builds the drafter: absurd sizes would allocate them first
        raise DrafterLoadError(problem)
    return config, tensors, notes


def load_drafter(path: str | Path, device="cpu", dtype=torch.float32) -> EagleDrafter:
    """An eval-mode drafter (its target's norm and head still to be shared); a draftsmith output_dir means its
    latest checkpoint."""
    config, tensors, _ = read_drafter_folder(resolve_checkpoint(local_folder(path)))
    return load_for_inference(EagleDrafter(config), tensors, path, device, dtype, DrafterLoadError)


def import_folder(folder: Path, public: dict[str, Any], target: str | None) -> ImportedCheckpoint:
    """`draftsmith import` of a reference or speculators EAGLE folder (ExportFormat.read): the target, when found
    locally, fills in its layer count and context; an embedding or head the file ships is compared with the
    target's, which draftsmith reads out through."""
    prov = public.get("draftsmith") if isinstance(public.get("draftsmith"), dict) else {}
    verifier = ((public.get("speculators_config") or {}).get("verifier") or {}) if is_speculators_eagle(public) else {}
    target_name = target or prov.get("target") or verifier.get("name_or_path") or ""
    target_config = read_target_config(target_name) if target_name else None
    tensors = load_folder_tensors(folder)
    try:
        config, ours, shared, notes = read_public(public, tensors, target_config)
    except ValueError as e:
        raise CheckpointImportError(f"{folder / CONFIG_FILE}: {e}") from None
    if target:
        config.target_name_or_path = target
    elif not config.target_name_or_path:
        config.target_name_or_path = target_name
    if is_speculators_eagle(public):
        notes.append("read from speculators' eagle layout (speculators_model_type eagle)")
    if target_name and target_config is None:
        notes.append(f"target {target_name!r} not found locally (folder or Hugging Face cache): its layer count is "
                     "unknown; the runtime reads the running target's")
    problems = tensor_problems(config, ours)
    if problems:
        raise CheckpointImportError(f"{folder}: tensors do not match the config: " + "; ".join(problems))
    if "embed_tokens.weight" in shared:
        embedding, _ = load_target_embedding(target_name) if target_name else (None, "")
        same = embedding is not None and torch.equal(embedding.to(shared["embed_tokens.weight"].dtype),
                                                     shared["embed_tokens.weight"])
        if not same:
            notes.append("the drafter's embed_tokens.weight was dropped" + (" and differs from the target's"
                                                                           if embedding is not None else "")
                         + ": draftsmith drafts with the target's embedding, as vLLM does")
    if "lm_head.weight" in shared:
        notes.append("the drafter's lm_head.weight was dropped: draftsmith reads out through the target's head")
    return ImportedCheckpoint(config=config.to_dict(), tensors=ours, notes=notes, step=provenance_step(public))
