"""Read a DSpark drafter: a draftsmith checkpoint, or a published folder of DeepSpec (`Qwen3DSparkModel`, what
`--format dspark` writes too), SpecForge (`DSparkDraftModel`, its DSpark keys nested in `dflash_config`) or
`speculators` (`speculators_model_type: dspark`), for the runtime (`load_drafter`) and `draftsmith import`.

What draftsmith runs, it must be able to read without guessing: the slot convention has to be "sample from
anchor" (config.py) and the Markov head vanilla or gated. A folder that is otherwise (speculators' older fill-in
slots, the RNN head) is refused with one line saying what it is, rather than run one position off.

A pruned draft vocabulary (`draft_vocab_size` < `vocab_size`, vLLM's reduced-vocabulary DSpark) is read as vLLM
reads it: the folder's own `lm_head.weight` (draft_vocab_size, H) and `d2t` (draft id i -> target id i + d2t[i]),
which must map into the target's vocabulary, one target id per draft id; a `t2d` there is ignored (vLLM skips it)
and rebuilt from d2t. Without a pruned vocabulary the embedding, head and maps a folder may carry are the target's
and are dropped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftsmith.models.checkpoint import (
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
from draftsmith.models.drafter_config import (
    DrafterLoadError,
    load_for_inference,
    local_folder,
    read_drafter_config,
)
from draftsmith.models.dspark.config import MARKOV_HEADS, METHOD, DsparkDrafterConfig
from draftsmith.models.dspark.model import DsparkDrafter
from draftsmith.models.dspark.section import DsparkConfigError
from draftsmith.models.dspark.spec import is_dspark
from draftsmith.models.spec import output_from_capture

SHARED_WITH_TARGET = ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d")  # draftsmith uses the target's
DRAFT_VOCAB = ("lm_head.weight", "d2t", "t2d")  # a pruned vocabulary's own (t2d rebuilt from d2t)
VOCAB_MAP_DTYPES = {"d2t": torch.int64, "t2d": torch.bool}


def check_draft_vocab(d2t: torch.Tensor, draft_vocab_size: int, vocab_size: int) -> list[str]:
    """Problems of a d2t (int64 offsets: draft id i -> target id i + d2t[i]) for a draft vocabulary of
    `draft_vocab_size` ids inside a target vocabulary of `vocab_size`: one line each."""
    if tuple(d2t.shape) != (draft_vocab_size,):
        return [f"d2t: shape {tuple(d2t.shape)}, expected ({draft_vocab_size},) = (draft_vocab_size,)"]
    if d2t.is_floating_point() or d2t.dtype == torch.bool:
        return [f"d2t: dtype {d2t.dtype}, expected integer offsets (int64: draft id i -> target id i + d2t[i])"]
    ids = torch.arange(draft_vocab_size, dtype=torch.int64) + d2t.long().cpu()
    if bool((ids < 0).any()) or bool((ids >= vocab_size).any()):
        bad = int(((ids < 0) | (ids >= vocab_size)).nonzero()[0])
        return [f"d2t maps draft id {bad} to target id {int(ids[bad])}, outside the target vocabulary "
                f"0..{vocab_size - 1} (target id = draft id + d2t[draft id])"]
    if ids.unique().numel() != draft_vocab_size:
        return ["d2t maps two draft ids to the same target id: each draft id must name its own target token"]
    return []


def vocab_maps(d2t: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    """d2t as int64 and the t2d mask (bool over the target vocabulary) it implies."""
    d2t = d2t.to(torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.arange(d2t.numel(), dtype=torch.int64) + d2t] = True
    return {"d2t": d2t, "t2d": t2d}


def _lookup(config: dict[str, Any], key: str, *sections: str) -> Any:
    """`key` at the top level, else in the first of `sections` (nested dicts) that has it."""
    if config.get(key) is not None:
        return config[key]
    for section in sections:
        nested = config.get(section)
        if isinstance(nested, dict) and nested.get(key) is not None:
            return nested[key]
    return None


def config_from_public(raw: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[DsparkDrafterConfig, list[str]]:
    """(our config, notes) of a published DSpark config.json; a DrafterLoadError for what draftsmith cannot run."""
    notes: list[str] = []
    speculators = raw.get("speculators_model_type") == METHOD
    cfg = {**(raw.get("transformer_layer_config") or {}), **raw} if speculators else raw
    anchor = raw.get("sample_from_anchor", not speculators)  # vLLM's defaults: true, false on its speculators path
    if anchor is not True:
        raise DrafterLoadError(
            "sample_from_anchor is false: this drafter was trained with the fill-in slots (slot j predicts the "
            "token at anchor + j, slot 0 unused), one position off the convention draftsmith trains and runs "
            "(slot k predicts the token after anchor + k); retrain it with speculators' sample_from_anchor true")
    vocab = cfg["vocab_size"]
    draft_vocab = cfg.get("draft_vocab_size") or vocab
    if not isinstance(draft_vocab, int) or isinstance(draft_vocab, bool) or not 0 < draft_vocab <= vocab:
        raise DrafterLoadError(f"draft_vocab_size {draft_vocab!r}: expected an integer in 1..vocab_size {vocab}")
    if draft_vocab < vocab:  # a pruned draft vocabulary: its own head and d2t, as vLLM loads them
        have = {name.removeprefix("model.") for name in tensors}
        missing = [name for name in ("lm_head.weight", "d2t") if name not in have]
        if missing:
            raise DrafterLoadError(f"draft_vocab_size {draft_vocab} < vocab_size {vocab}: a pruned draft vocabulary "
                                   f"needs its own {' and '.join(missing)} (vLLM refuses it too): this folder has "
                                   "none")
    ids = _lookup(cfg, "target_layer_ids", "dflash_config") or cfg.get("dspark_target_layer_ids")
    if ids is None and cfg.get("aux_hidden_state_layer_ids") is not None:  # speculators: capture ids
        ids = output_from_capture(cfg["aux_hidden_state_layer_ids"])
    if ids is None:
        raise DrafterLoadError("no target_layer_ids (top level, dflash_config or speculators' "
                               "aux_hidden_state_layer_ids): the target layers the drafter reads are unknown")
    mask_id = _lookup(cfg, "mask_token_id", "dflash_config")
    mask_id = mask_id if mask_id is not None else cfg.get("dspark_noise_token_id")
    if mask_id is None:
        raise DrafterLoadError("no mask_token_id: the token that fills the mask slots is unknown")
    rank = _lookup(cfg, "markov_rank", "dspark_config", "dflash_config")
    head = _lookup(cfg, "markov_head_type", "dspark_config", "dflash_config") or "vanilla"
    if not rank:
        raise DrafterLoadError("no markov_rank: a DSpark drafter has a Markov head (markov_rank 0 is DFlash)")
    if head not in MARKOV_HEADS:
        raise DrafterLoadError(f"markov_head_type {head!r}: draftsmith runs the {' and '.join(MARKOV_HEADS)} heads")
    confidence = any(name.startswith("confidence_head.") for name in tensors)
    if confidence and _lookup(cfg, "confidence_head_with_markov", "dflash_config") is False:
        notes.append("its confidence head reads h alone (confidence_head_with_markov false); draftsmith's reads "
                     "[h; markov_w1[x]], so the head was left out (the drafts do not depend on it)")
        confidence = False
    block = _lookup(cfg, "block_size", "dflash_config") or cfg.get("dspark_block_size") or 7
    heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {**(cfg.get("rope_scaling") or {}), "rope_type": "default",
                                          "rope_theta": cfg.get("rope_theta", 1000000.0)}
    prov = raw.get("draftsmith") if isinstance(raw.get("draftsmith"), dict) else {}
    verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}) if speculators else {}
    try:
        config = DsparkDrafterConfig(
            hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"], num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, vocab_size=vocab,
            num_hidden_layers=cfg["num_hidden_layers"], block_size=block, target_layer_ids=list(ids),
            num_target_layers=cfg.get("num_target_layers") or max(ids) + 4, mask_token_id=mask_id,
            learned_mask=False, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096), rope_parameters=dict(rope),
            target_name_or_path=prov.get("target") or verifier.get("name_or_path") or "",
            target_architectures=list(prov.get("target_architectures") or verifier.get("architectures") or []),
            target_model_type=prov.get("target_model_type", ""), bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"), pad_token_id=cfg.get("pad_token_id"),
            markov_rank=rank, markov_head=head, confidence_head=confidence,
            draft_vocab_size=draft_vocab if draft_vocab < vocab else None,
        )
    except (DsparkConfigError, TypeError) as e:
        raise DrafterLoadError(str(e)) from None
    if not cfg.get("num_target_layers"):
        notes.append(f"num_target_layers missing: assumed {config.num_target_layers} (last target layer id + 4)")
    return config, notes


def public_tensors(tensors: dict[str, torch.Tensor], config: DsparkDrafterConfig) -> dict[str, torch.Tensor]:
    """draftsmith's names: the embedding, head and vocabulary maps shared with the target dropped (a pruned
    vocabulary keeps its head and d2t, and t2d is rebuilt from d2t), a `model.` prefix removed, SpecForge's legacy
    `logit_head.` read as `markov_head.`, a confidence head left out when the config leaves it out."""
    out = {}
    for name, t in tensors.items():
        name = name.removeprefix("model.")
        name = "markov_head." + name[len("logit_head."):] if name.startswith("logit_head.") else name
        if config.pruned and name in DRAFT_VOCAB:
            if name != "t2d":
                out[name] = t
            continue
        if name in SHARED_WITH_TARGET or (name.startswith("confidence_head.") and not config.confidence_head):
            continue
        out[name] = t
    if config.pruned:
        problems = check_draft_vocab(out["d2t"], config.draft_vocab_size, config.vocab_size)
        if problems:
            raise DrafterLoadError(problems[0])
        out.update(vocab_maps(out["d2t"], config.vocab_size))
    return out


def read_drafter_folder(path: str | Path) -> tuple[DsparkDrafterConfig, dict[str, torch.Tensor], list[str]]:
    """(config, tensors in draftsmith names, notes) of a draftsmith DSpark checkpoint or a published folder."""
    folder = Path(path)
    raw, config_path, _ = read_drafter_config(folder, "DSpark")
    tensors = load_folder_tensors(folder)
    if raw.get("method") == METHOD:
        try:
            config = DsparkDrafterConfig.from_dict(raw)
        except (DsparkConfigError, TypeError) as e:
            raise DrafterLoadError(f"{config_path}: {e}") from None
        if config.pruned and "d2t" in tensors:
            problems = check_draft_vocab(tensors["d2t"], config.draft_vocab_size, config.vocab_size)
            if problems:
                raise DrafterLoadError(f"{folder}: {problems[0]}")
        notes: list[str] = []
    elif not is_dspark(raw):
        raise DrafterLoadError(f"{config_path}: not a DSpark drafter (no \"method\": \"dspark\", architectures "
                               f"{raw.get('architectures')}, speculators_model_type "
                               f"{raw.get('speculators_model_type')!r})")
    else:
        try:
            config, notes = config_from_public(raw, tensors)
        except (DrafterLoadError, KeyError) as e:
            raise DrafterLoadError(f"{config_path}: {e}") from None
        try:
            tensors = public_tensors(tensors, config)
        except DrafterLoadError as e:
            raise DrafterLoadError(f"{folder}: {e}") from None
    problem = size_mismatch(meta_shapes(lambda: DsparkDrafter(config)), tensors, raw, config_path,
                            weights_file(folder))
    if problem:  # before anything builds the drafter: absurd sizes would allocate them first
        raise DrafterLoadError(problem)
    return config, tensors, notes


def load_drafter(path: str | Path, device="cpu", dtype=torch.float32) -> DsparkDrafter:
    """An eval-mode drafter; a draftsmith output_dir means its latest checkpoint."""
    config, tensors, _ = read_drafter_folder(resolve_checkpoint(local_folder(path)))
    return load_for_inference(DsparkDrafter(config), tensors, path, device, dtype, DrafterLoadError)


def import_folder(folder: Path, public: dict[str, Any], target: str | None) -> ImportedCheckpoint:
    """`draftsmith import` of a published DSpark folder (ExportFormat.read): every tensor must match the config."""
    try:
        config, tensors, notes = read_drafter_folder(folder)
    except (DrafterLoadError, CheckpointImportError) as e:
        raise CheckpointImportError(str(e)) from None
    if target:
        config.target_name_or_path = target
    problems = check_tensors(meta_shapes(lambda: DsparkDrafter(config)), tensors, VOCAB_MAP_DTYPES)
    if problems:
        raise CheckpointImportError(f"{folder}: tensors do not match the config: " + "; ".join(problems))
    return ImportedCheckpoint(config=config.to_dict(), tensors=tensors, notes=notes, step=provenance_step(public))
