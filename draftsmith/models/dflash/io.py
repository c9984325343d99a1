"""Read a DFlash drafter: a draftsmith checkpoint or a `DFlashDraftModel` folder (ours, z-lab's, SpecForge's), for the
runtime (`load_drafter`) and `draftsmith import` (`import_folder`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftsmith.models.checkpoint import (
    CheckpointImportError,
    ImportedCheckpoint,
    check_tensors,
    meta_shapes,
    provenance_step,
    resolve_checkpoint,
    size_mismatch,
)
from draftsmith.models.dflash.config import METHOD, DflashConfigError, DflashDrafterConfig
from draftsmith.models.dflash.export import config_from_export
from draftsmith.models.dflash.model import MASK_EMBEDDING_FILE, DflashDrafter
from draftsmith.models.dflash.spec import is_dflash
from draftsmith.models.drafter_config import (
    DrafterLoadError,
    load_drafter_weights,
    load_for_inference,
    local_folder,
    read_drafter_config,
)


def read_drafter_folder(path: str | Path) -> tuple[DflashDrafterConfig, dict[str, torch.Tensor]]:
    """Config and tensors (draftsmith names) of a draftsmith DFlash checkpoint or a `--format dflash` export."""
    folder = Path(path)
    raw, config_path, weights_path = read_drafter_config(folder, "DFlash")
    native = is_dflash(raw)
    if raw.get("method") != METHOD and not native:
        raise DrafterLoadError(f"{config_path}: not a DFlash drafter (no \"method\": \"dflash\" and architectures "
                               f"{raw.get('architectures')} are not ['DFlashDraftModel'])")
    mask_file = folder / MASK_EMBEDDING_FILE
    try:
        config = (DflashDrafterConfig.from_dict(raw) if not native
                  else config_from_export(raw, learned_mask=mask_file.is_file()))
    except (DflashConfigError, KeyError, TypeError) as e:
        raise DrafterLoadError(f"{config_path}: {e}") from None
    tensors = load_drafter_weights(weights_path)
    if native and mask_file.is_file():
        tensors["mask_embedding"] = read_mask_embedding(mask_file, raw)
    problem = size_mismatch(meta_shapes(lambda: DflashDrafter(config)), tensors, raw, config_path, weights_path)
    if problem:  # before anything builds the drafter: absurd sizes would allocate them first
        raise DrafterLoadError(problem)
    return config, tensors


def read_mask_embedding(path: Path, config: dict) -> torch.Tensor:
    """vLLM's `mask_embedding.pt`: a tensor, or {"mask_token_id": id, "embedding": tensor}; returns (H,)."""
    import pickle

    try:  # torch's restricted loader: tensors, dicts and numbers only, no code
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:
        why = (f"{path}: not a torch file of tensors alone ({type(e).__name__}); draftsmith never unpickles "
               "objects from a drafter folder (they can run code): save the vector alone, torch.save({"
               "'mask_token_id': ID, 'embedding': tensor}), as vLLM writes it")
        raise DrafterLoadError(why) from None
    if isinstance(state, dict) and not isinstance(state.get("embedding"), torch.Tensor):
        raise DrafterLoadError(f"{path}: a dict without an 'embedding' tensor (keys {sorted(map(str, state))[:6]})")
    if not isinstance(state, (dict, torch.Tensor)):
        raise DrafterLoadError(f"{path}: holds a {type(state).__name__}, not the mask embedding tensor")
    if isinstance(state, dict):
        want = (config.get("dflash_config") or {}).get("mask_token_id")
        if state.get("mask_token_id", want) != want:
            raise DrafterLoadError(f"{path}: mask_token_id {state.get('mask_token_id')} differs from "
                                   f"dflash_config.mask_token_id {want}")
        state = state["embedding"]
    return state.reshape(-1)


def load_drafter(path: str | Path, device="cpu", dtype=torch.float32) -> DflashDrafter:
    """An eval-mode drafter; a draftsmith output_dir means its latest checkpoint."""
    config, tensors = read_drafter_folder(resolve_checkpoint(local_folder(path)))
    return load_for_inference(DflashDrafter(config), tensors, path, device, dtype, DrafterLoadError)


def import_folder(folder: Path, public: dict[str, Any], target: str | None) -> ImportedCheckpoint:
    """`draftsmith import` of a `DFlashDraftModel` folder (ExportFormat.read): every tensor must match the config."""
    try:
        config, tensors = read_drafter_folder(folder)
    except DrafterLoadError as e:
        raise CheckpointImportError(str(e)) from None
    if target:
        config.target_name_or_path = target
    problems = check_tensors(meta_shapes(lambda: DflashDrafter(config)), tensors)
    if problems:
        raise CheckpointImportError(f"{folder}: tensors do not match the config: " + "; ".join(problems))
    return ImportedCheckpoint(config=config.to_dict(), tensors=tensors, step=provenance_step(public))
