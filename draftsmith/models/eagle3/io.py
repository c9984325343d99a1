"""Load an EAGLE-3 drafter from a draftsmith checkpoint, a native (SGLang / vLLM) folder or a speculators folder.

Every public layout is turned into draftsmith's config and tensor names here, in one place, so the runtime
(`load_drafter`) and `draftsmith import` read the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftsmith.models.drafter_config import (
    DrafterLoadError,
    load_drafter_weights,
    load_for_inference,
    local_folder,
    read_drafter_config,
)
from draftsmith.models.checkpoint import (
    CONFIG_FILE,
    CheckpointImportError,
    ImportedCheckpoint,
    load_folder_tensors,
    meta_shapes,
    provenance_step,
    resolve_checkpoint,
    size_mismatch,
)
from draftsmith.models.eagle3.config import METHOD, Eagle3Config
from draftsmith.models.eagle3.export import (
    AUX_IDS_KEY,
    check_state_dict,
    eagle3_config_from_native,
    expected_native_shapes,
    tensors_from_native,
)
from draftsmith.models.eagle3.model import Eagle3Drafter
from draftsmith.models.eagle3.spec import NATIVE_ARCHITECTURES, is_native_eagle3, is_speculators_eagle3
from draftsmith.models.eagle3.speculators import (
    EMBED_KEY,
    SpeculatorsFormatError,
    eagle3_config_from_speculators,
    tensors_from_speculators,
)
from draftsmith.models.target_files import load_target_embedding, read_target_config

# The most draft tokens per step an imported speculators config may ask to serve with (its speculative_tokens): the
# engines verify k + 1 tokens a step, and published drafters use 3 to 8
MAX_IMPORTED_K = 32


def read_public_eagle3(
    cfg: dict[str, Any], tensors: dict[str, torch.Tensor], target_config: dict[str, Any] | None = None
) -> tuple[Eagle3Config, dict[str, torch.Tensor], list[str]]:
    """(config, tensors in draftsmith names, notes) of a native or speculators EAGLE-3 config + state dict."""
    if is_speculators_eagle3(cfg):
        try:
            config, notes = eagle3_config_from_speculators(cfg, target_config)
        except SpeculatorsFormatError as e:
            raise DrafterLoadError(f"speculators config: {e}") from None
        return config, tensors_from_speculators(tensors, config.draft_vocab_size, config.vocab_size), notes
    if is_native_eagle3(cfg):
        config, notes = eagle3_config_from_native(cfg, target_config)
        return config, tensors_from_native(tensors, config.draft_vocab_size, config.vocab_size), notes
    raise DrafterLoadError(f"not a native or speculators EAGLE-3 config (architectures {cfg.get('architectures')}, "
                           f"speculators_model_type {cfg.get('speculators_model_type')!r})")


def read_drafter_folder(path: str | Path) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """Config and tensors (draftsmith names) of a drafter folder in draftsmith's, the native or speculators layout."""
    cfg, config_path, weights_path = read_drafter_config(Path(path), "EAGLE-3")
    tensors = load_drafter_weights(weights_path)
    if cfg.get("method") == METHOD:
        config = Eagle3Config.from_dict(cfg)
    elif is_native_eagle3(cfg) or is_speculators_eagle3(cfg):
        try:
            config, tensors, _ = read_public_eagle3(cfg, tensors)
        except DrafterLoadError as e:
            raise DrafterLoadError(f"{config_path}: {e}") from None
    else:
        raise DrafterLoadError(f"{config_path}: not an EAGLE-3 drafter (no \"method\": \"eagle3\", architectures "
                               f"{cfg.get('architectures')} are not {sorted(NATIVE_ARCHITECTURES)} and no "
                               "\"speculators_model_type\": \"eagle3\")")
    problem = size_mismatch(meta_shapes(lambda: Eagle3Drafter(config)), tensors, cfg, config_path, weights_path)
    if problem:  # before anything builds the drafter: absurd sizes would allocate them first
        raise DrafterLoadError(problem)
    problems = checked_against_config(config, tensors)  # the rules import applies (the vocabulary maps too)
    if problems:
        raise DrafterLoadError(f"{weights_path}: tensors do not match {config_path}: " + "; ".join(problems))
    return config, tensors


def checked_against_config(config: Eagle3Config, tensors: dict[str, torch.Tensor]) -> list[str]:
    """What is wrong with draftsmith-named tensors for `config`: names, shapes, dtypes and the vocabulary maps
    (d2t, t2d), the one validation of import and of the runtime loader."""
    flat = {**config.to_dict(), AUX_IDS_KEY: config.aux_layer_ids}
    return check_state_dict(flat, expected_native_shapes(flat), tensors)


def proposal_length(speculators: dict[str, Any], where: Path) -> int | None:
    """speculators' speculative_tokens (the k its export serves with), checked: an integer in 1..MAX_IMPORTED_K."""
    methods = speculators.get("proposal_methods")
    if not (isinstance(methods, list) and methods and isinstance(methods[0], dict)):
        return None
    k = methods[0].get("speculative_tokens")
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_IMPORTED_K:
        raise CheckpointImportError(f"{where}: speculators_config.proposal_methods[0].speculative_tokens {k!r}: "
                                    f"expected an integer in 1..{MAX_IMPORTED_K}")
    return k


def load_drafter(path: str | Path, device="cpu", dtype=torch.float32) -> Eagle3Drafter:
    """An eval-mode drafter; a draftsmith output_dir means its latest checkpoint."""
    config, tensors = read_drafter_folder(resolve_checkpoint(local_folder(path)))
    return load_for_inference(Eagle3Drafter(config), tensors, path, device, dtype, DrafterLoadError)


def import_folder(folder: Path, public: dict[str, Any], target: str | None) -> ImportedCheckpoint:
    """`draftsmith import` of a native or speculators EAGLE-3 folder (ExportFormat.read): the target, when it can be
    found locally, fills in its layer count; the drafter's own embedding, which draftsmith does not use, is compared
    with the target's."""
    prov = public.get("draftsmith") if isinstance(public.get("draftsmith"), dict) else {}
    speculators = public.get("speculators_config") if isinstance(public.get("speculators_config"), dict) else {}
    verifier = speculators.get("verifier") if isinstance(speculators.get("verifier"), dict) else {}
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

    problems = checked_against_config(config, state)
    if problems:
        raise CheckpointImportError(f"{folder}: tensors do not match the config: " + "; ".join(problems))
    if EMBED_KEY in tensors and target_name:
        embedding, _ = load_target_embedding(target_name)
        if embedding is not None and not torch.equal(embedding.to(tensors[EMBED_KEY].dtype), tensors[EMBED_KEY]):
            notes.append(f"the drafter's {EMBED_KEY} differs from the target's; draftsmith drafts with the target's "
                         "embedding, as vLLM and SGLang do")
    return ImportedCheckpoint(config=config.to_dict(), tensors=state, notes=notes, step=provenance_step(public),
                              num_speculative_tokens=proposal_length(speculators, folder / CONFIG_FILE))
