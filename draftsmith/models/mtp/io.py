"""Load an MTP drafter from a draftsmith checkpoint or export, or from a checkpoint folder with native MTP weights
(a native export, or the target itself: vLLM's `mtp` method defaults `model` to the target)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from draftsmith.models.checkpoint import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    check_finite,
    read_json,
    resolve_checkpoint,
)
from draftsmith.models.mtp.config import METHOD, MtpDrafterConfig
from draftsmith.models.mtp.model import MtpDrafter
from draftsmith.models.mtp.native import NativeMtpError, find_native_mtp, stack_experts
from draftsmith.models.target_files import offline_folder


class MtpLoadError(ValueError):
    """A folder that holds no MTP drafter draftsmith can read."""


def read_mtp_folder(path: str | Path) -> tuple[MtpDrafterConfig, dict[str, torch.Tensor]]:
    """Config and tensors (draftsmith names, experts possibly split) of a draftsmith or native MTP folder."""
    folder = offline_folder(path)
    if folder is None:
        raise MtpLoadError(f"{path}: no such folder (and not a Hub id in the local cache)")
    config_path = folder / CONFIG_FILE
    raw = _read_config(config_path) if config_path.is_file() else None
    if raw is None or raw.get("method") == METHOD:
        ckpt = resolve_checkpoint(folder)
        raw = _read_config(ckpt / CONFIG_FILE)
        if raw.get("method") != METHOD:
            raise MtpLoadError(f"{ckpt / CONFIG_FILE}: method {raw.get('method')!r}, not an MTP drafter")
        try:
            config = MtpDrafterConfig.from_dict(raw)
        except (TypeError, ValueError) as e:
            raise MtpLoadError(f"{ckpt / CONFIG_FILE}: {e}") from None
        tensors = load_file(str(ckpt / WEIGHTS_FILE))
        check_finite(tensors, ckpt / WEIGHTS_FILE, MtpLoadError)
        return config, tensors

    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise MtpLoadError(f"{config_path}: not a draftsmith MTP config and not a transformers config "
                           f"({str(e).splitlines()[0]})") from None
    try:
        native = find_native_mtp(folder, hf)
    except NativeMtpError as e:
        raise MtpLoadError(str(e)) from None
    if native is None:
        raise MtpLoadError(f"{folder}: no MTP weights (neither \"method\": \"mtp\" in config.json nor native "
                           f"model.layers.{hf.num_hidden_layers}.* / mtp.* tensors)")
    config = MtpDrafterConfig.from_target(hf, num_modules=native.num_modules, recursive=True,
                                          num_depths=native.num_modules, native_layout=native.layout,
                                          target_name_or_path=str(path))
    probe = MtpDrafter(config)  # only for the expected names and shapes (small: one block per module)
    return config, native.drafter_state_dict(native.num_modules, probe)


def _read_config(path: Path) -> dict:
    """A config.json as a dict; a broken or non-object file is an MtpLoadError naming it (and the line)."""
    try:
        raw = read_json(path)
    except CheckpointError as e:
        raise MtpLoadError(str(e)) from None
    if not isinstance(raw, dict):
        raise MtpLoadError(f"{path}: expected a JSON object")
    return raw


def load_mtp_drafter(path: str | Path, device="cpu", dtype=torch.float32, layer_cls=None) -> MtpDrafter:
    """An eval-mode drafter on `device` in `dtype`; a draftsmith output_dir means its latest checkpoint."""
    config, tensors = read_mtp_folder(path)
    drafter = MtpDrafter(config, layer_cls=layer_cls)
    expected = {k: v.shape for k, v in drafter.state_dict().items()}
    tensors = stack_experts(tensors, expected)
    missing, unexpected = drafter.load_state_dict(tensors, strict=False)
    missing = [m for m in missing if not m.startswith("rotary_emb.")]
    if missing or unexpected:
        raise MtpLoadError(f"{path}: MTP tensors do not match its config (missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]})")
    drafter.to(device=device, dtype=dtype)
    drafter.reset_rotary(device)
    return drafter.eval()
