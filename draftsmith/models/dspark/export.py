"""Export a DSpark checkpoint as `--format dspark`: the `Qwen3DSparkModel` layout vLLM (`method: dspark`,
qwen3_dspark.py) and SGLang (`--speculative-algorithm DSPARK`, models/dspark.py) both load.

DFlash's Qwen3-shaped config (models/dflash/export.py) with architecture `Qwen3DSparkModel` and, at the top level
where both engines read them (vLLM reads `markov_rank` nowhere else; SGLang's heads read the top-level attributes,
0.5.23's config parser `dflash_config` first): `markov_rank`, `markov_head_type`, `enable_confidence_head`,
`confidence_head_with_markov`, `mask_token_id`, `target_layer_ids` (output-of-layer ids, both engines capture
i + 1) and `sample_from_anchor: true`, the slot convention (config.py): vLLM reads it at the top level only (inside
`dflash_config` its DFlash parent refuses it), SGLang 0.5.19 to 0.5.23 at the top level too (missing = true;
0.5.16 to 0.5.18 assume it). `dflash_config` repeats the layer ids and the mask token for readers that look there
first. Tensors: DFlash's, plus `markov_head.markov_w1.weight` (V, r), `markov_head.markov_w2.weight` (V, r),
`markov_head.gate_proj.*` (gated head) and `confidence_head.proj.*`; no embedding or head (both engines share the
target's). vLLM 0.32 builds only the vanilla Markov head. SGLang (0.5.17 to 0.5.23) builds its confidence head
whatever `enable_confidence_head` says unless SGLANG_RAGGED_VERIFY_MODE is `static` (its default), and then refuses
a checkpoint without `confidence_head.proj.*`: a drafter trained without the head serves in the default mode only.

A pruned draft vocabulary (model.draft_vocab_size) exports as vLLM 0.32's reduced-vocabulary DSpark reads it
(qwen3_dspark.py): top-level `draft_vocab_size` (< vocab_size), the drafter's own `lm_head.weight`
(draft_vocab_size, H), `d2t` (int64 offsets: draft id i -> target id i + d2t[i], vLLM's draft_id_to_target_id; no
t2d, which vLLM skips) and `markov_head.markov_w2.weight` (draft_vocab_size, r); markov_w1 stays (vocab_size, r).
SGLang's DSpark always reads out with the target's whole head and has no d2t, so such an export is vLLM's only: the
export warns, and its card and serve commands name vLLM alone. A whole-vocabulary export is unchanged: no
draft_vocab_size, lm_head or d2t.
"""

from __future__ import annotations

import shlex
from typing import Any

import torch

from draftsmith.models.checkpoint import check_tensors
from draftsmith.models.dflash.export import AUX_IDS_KEY, check_block_config, expected_shapes, export_config
from draftsmith.models.drafter_config import is_int
from draftsmith.models.dspark.config import METHOD, SLOT_CONVENTION, DsparkDrafterConfig
from draftsmith.models.dspark.io import VOCAB_MAP_DTYPES, check_draft_vocab
from draftsmith.models.export_base import ExportSource, FormatExport, FormatFiles, vllm_serve

ARCHITECTURE = "Qwen3DSparkModel"  # vLLM: qwen3_dspark.Qwen3DSparkForCausalLM; SGLang: models/dspark.py EntryClass
TAGS = ["speculative-decoding", "dspark", "draftsmith", "vllm", "sglang"]
VLLM_MARKOV_HEADS = ("vanilla",)  # Qwen3DSparkModel in vLLM 0.32.0 builds no gate
SGLANG_PRUNED = ("draft_vocab_size {size} < vocab_size {vocab}: a pruned draft vocabulary serves in vLLM only "
                 "(SGLang's DSpark reads out with the target's whole head and has no d2t); no SGLang command is "
                 "offered")


def pruned_size(config: dict[str, Any]) -> int | None:
    """An export config's draft_vocab_size when it prunes the vocabulary, else None."""
    size, vocab = config.get("draft_vocab_size"), config.get("vocab_size")
    return size if is_int(size) and is_int(vocab) and size < vocab else None


def dspark_export_config(config: DsparkDrafterConfig, step: int | None = None) -> dict[str, Any]:
    """The `config.json` both engines read (module docstring)."""
    out = export_config(config, step=step)
    out["architectures"] = [ARCHITECTURE]
    out.update({
        "target_layer_ids": list(config.target_layer_ids),
        "mask_token_id": config.mask_token_id,
        "markov_rank": config.markov_rank,
        "markov_head_type": config.markov_head,
        "enable_confidence_head": config.confidence_head,
        "confidence_head_with_markov": config.confidence_head,
        "sample_from_anchor": True,
    })
    if config.pruned:  # vLLM's reduced-vocabulary DSpark; a whole-vocabulary config has no such key
        out["draft_vocab_size"] = config.draft_vocab_size
    out["draftsmith"].update({
        "method": METHOD,
        "slot_convention": SLOT_CONVENTION,
        "slot_convention_note": "block [anchor, mask x (B-1)] at positions a..a+B-1; slot k predicts the token at "
                                "a+k+1 (DeepSpec's, vLLM's and SGLang's sample_from_anchor)",
    })
    del out["draftsmith"]["learned_mask_embedding"]
    return out


def expected_dspark_shapes(config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Export tensor name -> (shape, how it follows from the config): DFlash's plus the two heads."""
    shapes = expected_shapes(config)
    h, v, r = config["hidden_size"], config["vocab_size"], config["markov_rank"]
    shapes["markov_head.markov_w1.weight"] = ((v, r), "(vocab_size, markov_rank)")
    shapes["markov_head.markov_w2.weight"] = ((v, r), "(vocab_size, markov_rank)")
    draft = pruned_size(config)
    if draft is not None:  # the drafter's own head and map over the draft ids (vLLM's reduced vocabulary)
        shapes["markov_head.markov_w2.weight"] = ((draft, r), "(draft_vocab_size, markov_rank)")
        shapes["lm_head.weight"] = ((draft, h), "(draft_vocab_size, hidden_size)")
        shapes["d2t"] = ((draft,), "(draft_vocab_size,)")
    if config.get("markov_head_type") == "gated":
        shapes["markov_head.gate_proj.weight"] = ((r, h + r), "(markov_rank, hidden_size + markov_rank)")
        shapes["markov_head.gate_proj.bias"] = ((r,), "(markov_rank,)")
    if config.get("enable_confidence_head"):
        shapes["confidence_head.proj.weight"] = ((1, h + r), "(1, hidden_size + markov_rank)")
        shapes["confidence_head.proj.bias"] = ((1,), "(1,)")
    return shapes


def check_dspark_export(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """(problems, warnings) of a `--format dspark` config + tensors; no problem means vLLM and SGLang load it."""
    problems, warnings = check_block_config(config, ARCHITECTURE)
    rank, head = config.get("markov_rank"), config.get("markov_head_type")
    if not is_int(rank) or rank < 1:
        problems.append(f"config markov_rank: {rank!r}, expected a positive integer at the top level (vLLM reads it "
                        "nowhere else)")
    if head not in ("vanilla", "gated"):
        problems.append(f"config markov_head_type: {head!r}, expected 'vanilla' or 'gated'")
    elif head not in VLLM_MARKOV_HEADS:
        warnings.append(f"markov_head_type {head!r}: SGLang serves it, vLLM 0.32 builds only the vanilla head")
    if config.get("sample_from_anchor") is not True:
        problems.append("config sample_from_anchor: must be true at the top level (draftsmith's slots predict the "
                        "token after their own position; vLLM reads a missing key as true, its speculators path as "
                        "false)")
    if "sample_from_anchor" in (config.get("dflash_config") or {}):
        problems.append("config dflash_config.sample_from_anchor: vLLM's DFlash reader refuses it there; keep it at "
                        "the top level only")
    if "speculators_model_type" in config:
        problems.append("config speculators_model_type: marks a speculators-format config (SGLang refuses any DSpark "
                        "config that has it at commit 01f4762; releases 0.5.19 to 0.5.23 read sample_from_anchor)")
    if not config.get("enable_confidence_head"):
        warnings.append("no confidence head: SGLang builds one whatever enable_confidence_head says unless "
                        "SGLANG_RAGGED_VERIFY_MODE is static (its default), and then refuses this checkpoint "
                        "(missing confidence_head.proj.*): serve it in SGLang's default mode")
    draft, vocab = config.get("draft_vocab_size"), config.get("vocab_size")
    if draft is not None and (not is_int(draft) or draft < 1 or (is_int(vocab) and draft > vocab)):
        problems.append(f"config draft_vocab_size: {draft!r}, expected an integer in 1..vocab_size {vocab}")
    elif pruned_size(config) is not None:
        warnings.append(SGLANG_PRUNED.format(size=draft, vocab=vocab))
    if config.get("enable_confidence_head") and config.get("confidence_head_with_markov") is not True:
        problems.append("config confidence_head_with_markov: must be true (the head reads [h; markov_w1[x]]); vLLM "
                        "reads a missing key as false and would size the head without the Markov input")
    dflash = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    for key in ("target_layer_ids", "mask_token_id"):
        if config.get(key) != dflash.get(key):
            problems.append(f"config {key}: {config.get(key)!r} at the top level, {dflash.get(key)!r} in "
                            "dflash_config: engines read one or the other, so they must agree")
    sizes_ok = all(is_int(config.get(k)) and config[k] > 0 for k in
                   ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "vocab_size", "num_hidden_layers")) and is_int(rank) and isinstance(dflash.get("target_layer_ids"),
                                                                                         list)
    if not sizes_ok:
        return problems + ["tensors not checked: their shapes follow from the config sizes above"], warnings
    problems += check_tensors(expected_dspark_shapes(config), tensors, VOCAB_MAP_DTYPES)
    draft = pruned_size(config)
    if draft is not None and "d2t" in tensors and tensors["d2t"].dtype == torch.int64:
        problems += check_draft_vocab(tensors["d2t"], draft, config["vocab_size"])
    return problems, warnings


def dspark_serve_commands(target: str, draft: str, block_size: int, pruned: bool = False) -> dict[str, str]:
    """Commands that serve `target` with this drafter at its full block (k = block_size drafts); a pruned draft
    vocabulary serves in vLLM only."""
    commands = {"vLLM": vllm_serve(target, METHOD, draft, block_size)}
    if not pruned:
        commands["SGLang"] = (f"python -m sglang.launch_server --model {shlex.quote(target)} --speculative-algorithm "
                              f"DSPARK --speculative-draft-model-path {shlex.quote(draft)} "
                              f"--speculative-num-draft-tokens {block_size + 1}")
    return commands


def serve_commands_from_config(config: dict[str, Any], draft: str) -> dict[str, str]:
    """The serve commands of an exported folder's config.json (push re-renders its card with them)."""
    return dspark_serve_commands((config.get("draftsmith") or {}).get("target") or "TARGET", draft,
                                 config["block_size"], pruned=pruned_size(config) is not None)


def dspark_files(source: ExportSource) -> FormatFiles:
    """The `--format dspark` layout of a checkpoint: the engines' config, the weights under their own names (a
    pruned vocabulary's t2d left out: training-only, vLLM skips it), the card rows."""
    cfg = source.config
    config = dspark_export_config(cfg, step=source.step)
    return FormatFiles(
        config=config,
        tensors=source.tensors(drop=("t2d",)),
        summary={
            "architecture": ARCHITECTURE,
            "draft layers": cfg.num_hidden_layers,
            "block_size": f"{cfg.block_size} (drafts up to {cfg.block_size} tokens per step: every slot predicts)",
            "slot convention": "sample_from_anchor: slot k predicts the token after anchor + k",
            "Markov head": f"{cfg.markov_head}, rank {cfg.markov_rank}",
            "confidence head": "yes (draftsmith's confidence_threshold; vLLM's enable_adaptive_verification)"
                               if cfg.confidence_head else "no",
            "mask": f"the target's embedding of token id {cfg.mask_token_id}",
            **({"draft vocabulary": f"{cfg.draft_vocab_size} of {cfg.vocab_size} tokens (its own lm_head and d2t: "
                                    "vLLM serves it, SGLang does not)"} if cfg.pruned else {}),
        },
        aux_layer_ids=[
            ("output of layer i (vLLM and SGLang add 1)", "target_layer_ids", config["target_layer_ids"]),
            ("capture: residual entering layer k = HF `output_hidden_states[k]`", AUX_IDS_KEY, config[AUX_IDS_KEY]),
        ],
        serve_commands=dspark_serve_commands(source.target, source.draft, cfg.block_size, pruned=cfg.pruned),
        tags=[t for t in TAGS if t != "sglang"] if cfg.pruned else None,
    )


DSPARK_EXPORT = FormatExport(name="dspark", method=METHOD, config_class=DsparkDrafterConfig, title="DSpark",
                             tags=TAGS, build=dspark_files, check=check_dspark_export)
export_dspark = DSPARK_EXPORT.write  # (checkpoint, out_dir, *, overwrite, dtype) -> ExportResult
