"""Read a Gemma 4 assistant: a published folder (`model_type: gemma4_assistant`, what Google ships and what
`export --format gemma4_mtp` writes) or a draftsmith checkpoint (`"method": "gemma4_mtp"`, an output_dir meaning its
newest), for the trainer's starting point, the runtime and `draftsmith import`.

Both hold the same tensors under the same names (transformers' `Gemma4AssistantForCausalLM` state dict, which
vLLM's `Gemma4MTP.load_weights` reads): `model.embed_tokens.weight` (the tied head), `model.layers.{i}.*` (q-only
attention, MLP, four norms, `layer_scalar`), `model.norm.weight`, `pre_projection.weight`, `post_projection.weight`,
and with ordered embeddings `masked_embedding.centroids.weight` and `masked_embedding.token_ordering` (int64).
A tied `lm_head.weight` is dropped on reading (it is the embedding) and never written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from draftsmith.models.checkpoint import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    CheckpointImportError,
    ImportedCheckpoint,
    check_finite,
    check_tensors,
    load_folder_tensors,
    module_shapes,
    provenance_step,
    read_json,
    resolve_checkpoint,
    size_mismatch,
    weights_file,
)
from draftsmith.models.gemma4_mtp.config import METHOD, MODEL_TYPES, Gemma4MtpConfig
from draftsmith.models.gemma4_mtp.model import Gemma4MtpDrafter
from draftsmith.models.target_files import offline_folder

INT_TENSORS = {"masked_embedding.token_ordering": torch.int64}


class Gemma4MtpLoadError(ValueError):
    """A folder that holds no Gemma 4 assistant draftsmith can read; the message names the file."""


def is_gemma4_assistant(config: Any) -> bool:
    """A published assistant's config.json, or a draftsmith checkpoint's of this method."""
    return isinstance(config, dict) and (config.get("model_type") in MODEL_TYPES or config.get("method") == METHOD)


def _folder(path: str | Path) -> Path:
    """A local folder, or a Hub id's snapshot (from the local cache, else downloaded: its JSON and safetensors)."""
    folder = offline_folder(path)
    if folder is None and str(path).count("/") == 1 and not Path(path).exists():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors"]))
        except Exception as e:  # noqa: BLE001 - offline, unknown id, gated: one line saying which
            raise Gemma4MtpLoadError(f"{path}: not a folder, and the Hub download failed "
                                     f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if folder is None:
        raise Gemma4MtpLoadError(f"{path}: no such folder (nor a Hub id ORG/NAME)")
    return folder


def read_folder(path: str | Path) -> tuple[Gemma4MtpConfig, dict[str, torch.Tensor]]:
    """(config, tensors in the published names) of a published assistant folder or a draftsmith checkpoint."""
    folder = _folder(path)
    top = folder / CONFIG_FILE
    try:
        raw = read_json(top) if top.is_file() else None
        if isinstance(raw, dict) and raw.get("model_type") in MODEL_TYPES:
            config = Gemma4MtpConfig.from_assistant(raw, source=str(path))
            tensors = load_folder_tensors(folder)
            config_file, weights = top, weights_file(folder)
        else:
            ckpt = resolve_checkpoint(folder)
            raw = read_json(ckpt / CONFIG_FILE)
            if not isinstance(raw, dict) or raw.get("method") != METHOD:
                got = raw.get("model_type") or raw.get("method") if isinstance(raw, dict) else None
                raise Gemma4MtpLoadError(f"{ckpt / CONFIG_FILE}: {got!r} is not a Gemma 4 assistant (model_type "
                                         f"{MODEL_TYPES[0]!r}) nor a draftsmith {METHOD!r} checkpoint")
            config = Gemma4MtpConfig.from_dict(raw)
            config_file, weights = ckpt / CONFIG_FILE, ckpt / WEIGHTS_FILE
            tensors = load_file(str(weights))
            check_finite(tensors, weights, Gemma4MtpLoadError)
    except (CheckpointError, CheckpointImportError) as e:
        raise Gemma4MtpLoadError(str(e)) from None
    except (TypeError, ValueError) as e:
        if isinstance(e, Gemma4MtpLoadError):
            raise
        raise Gemma4MtpLoadError(f"{folder / CONFIG_FILE}: {e}") from None
    if config.hf_config().tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # transformers' tied head: the embedding itself
    order = tensors.get("masked_embedding.token_ordering")
    if order is not None and not order.is_floating_point():
        tensors["masked_embedding.token_ordering"] = order.long()  # an index table, whatever integer type it came in
    with torch.device("meta"):  # shapes only: no memory
        expected = expected_shapes(Gemma4MtpDrafter(config))
    problem = size_mismatch(expected, tensors, raw, config_file, weights)
    if problem:  # before anything builds the drafter: absurd sizes would allocate them first
        raise Gemma4MtpLoadError(problem)
    order = tensors.get("masked_embedding.token_ordering")
    if order is not None and not order.is_floating_point() and order.numel() and (
            int(order.min()) < 0 or int(order.max()) >= config.vocab_size):
        raise Gemma4MtpLoadError(f"{weights}: masked_embedding.token_ordering holds ids in "
                                 f"{int(order.min())}..{int(order.max())}, outside the vocabulary "
                                 f"0..{config.vocab_size - 1}")
    return config, tensors


def expected_shapes(drafter: Gemma4MtpDrafter) -> dict[str, tuple[tuple[int, ...], str]]:
    """The tensor contract of a drafter (its state dict in the published names, the tied head left out)."""
    shapes = module_shapes(drafter, "from the assistant config")
    if drafter.tied:
        shapes.pop("lm_head.weight", None)
    return shapes


def check_drafter_tensors(drafter: Gemma4MtpDrafter, tensors: dict[str, torch.Tensor]) -> list[str]:
    return check_tensors(expected_shapes(drafter), tensors, dtypes=INT_TENSORS)


def check_config_tensors(config: Gemma4MtpConfig, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Refuse tensors that do not load into the drafter `config` builds, asked of one built on the meta device (no
    memory, whatever the config's sizes)."""
    with torch.device("meta"):
        problems = check_drafter_tensors(Gemma4MtpDrafter(config), tensors)
    if problems:
        raise Gemma4MtpLoadError(f"{where}: tensors do not match its assistant config: " + "; ".join(problems))


def drafter_from(config: Gemma4MtpConfig, tensors: dict[str, torch.Tensor], where: str) -> Gemma4MtpDrafter:
    check_config_tensors(config, tensors, where)
    drafter = Gemma4MtpDrafter(config)
    drafter.load_state_dict(tensors, strict=False)
    return drafter


def load_drafter(path: str | Path, device="cpu", dtype=torch.float32) -> Gemma4MtpDrafter:
    """An eval-mode drafter on `device`; floating-point weights in `dtype` (token_ordering stays int64)."""
    config, tensors = read_folder(path)
    return drafter_from(config, tensors, str(path)).to(device=device, dtype=dtype).eval()


def import_folder(folder: Path, public: dict[str, Any], target: str | None) -> ImportedCheckpoint:
    """`draftsmith import` of a published assistant folder (ExportFormat.read)."""
    try:
        config, tensors = read_folder(folder)
        check_config_tensors(config, tensors, str(folder))
    except Gemma4MtpLoadError as e:
        raise CheckpointImportError(str(e)) from None
    if target:
        config.target_name_or_path = target
    notes = [] if target else ["the target is not recorded in an assistant's config: pass --target to record it"]
    return ImportedCheckpoint(config=config.to_dict(), tensors=tensors, notes=notes, step=provenance_step(public))
