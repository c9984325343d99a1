"""Export a DFlash checkpoint as `--format dflash`, the layout vLLM (`method: dflash`) and SGLang (`DFLASH`) load.

The format (engines.md §1.6, z-lab's checkpoints): a Qwen3-shaped `config.json` with
`"architectures": ["DFlashDraftModel"]`, `block_size`, `num_target_layers` (the target's depth) and
`dflash_config: {"target_layer_ids": [...], "mask_token_id": id}`, ids in the output-of-layer convention (both
engines add 1 to capture them); one `model.safetensors` with `layers.{i}.*` (q_norm / k_norm included), `fc.weight`,
`hidden_norm.weight`, `norm.weight`, and no embedding or head (both are the target's). SGLang ignores unknown
tensors silently and both engines read only what they expect, so `check_dflash_export` checks the whole contract.

The top-level `eagle_aux_hidden_state_layer_ids` repeats the ids in capture form (id + 1), as the speculators
converter writes it for vLLM.

Mask token. A drafter trained with `dflash.mask_token_id` embeds mask slots with the target's row of that id: the
reference setup, and what every engine does. A drafter trained with a learned mask embedding ships it as
`mask_embedding.pt` ({"mask_token_id": id, "embedding": (H,)}), which vLLM substitutes wherever the draft input is
`mask_token_id`; an engine that does not read that file embeds the target's row instead and accepts far less.
"""

from __future__ import annotations

import shlex
from typing import Any

import torch

from draftsmith.models.checkpoint import ExportError, check_tensors
from draftsmith.models.dflash.config import METHOD, DflashConfigError, DflashDrafterConfig
from draftsmith.models.dflash.model import MASK_EMBEDDING_FILE
from draftsmith.models.drafter_config import is_int, legacy_rope
from draftsmith.models.export_base import (
    ExportSource,
    FormatExport,
    FormatFiles,
    key_problems,
    provenance,
    vllm_serve,
)

ARCHITECTURE = "DFlashDraftModel"  # vLLM: qwen3_dflash.DFlashQwen3ForCausalLM; SGLang: models/dflash.py
MODEL_TYPE = "qwen3"
AUX_IDS_KEY = "eagle_aux_hidden_state_layer_ids"
TAGS = ["speculative-decoding", "dflash", "draftsmith", "vllm", "sglang"]

_REQUIRED_INTS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "vocab_size", "num_hidden_layers", "block_size", "num_target_layers", "max_position_embeddings")


# ---- config ------------------------------------------------------------------------------------------------
def export_config(config: DflashDrafterConfig, step: int | None = None) -> dict[str, Any]:
    """The Qwen3-shaped `config.json` vLLM's and SGLang's DFlash loaders read."""
    rope = {"rope_type": "default", **config.rope_parameters}
    rope_theta, rope_scaling = legacy_rope(rope)
    rope["rope_theta"] = rope_theta
    n = config.num_hidden_layers
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "num_hidden_layers": n,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "layer_types": ["full_attention"] * n,  # bidirectional inside the block (vLLM, SGLang: non-causal)
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "dflash_config": {"target_layer_ids": list(config.target_layer_ids), "mask_token_id": config.mask_token_id},
        AUX_IDS_KEY: list(config.aux_layer_ids),
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "draftsmith": provenance(
            config, METHOD, step,
            learned_mask_embedding=config.learned_mask,
            layer_ids_note=(
                "dflash_config.target_layer_ids: output of target layer i (vLLM and SGLang capture i + 1); "
                f"{AUX_IDS_KEY}: the same layers as capture ids (residual stream entering layer i + 1)"
            ),
        ),
    }


def config_from_export(cfg: dict[str, Any], learned_mask: bool) -> DflashDrafterConfig:
    """Our config from a `--format dflash` config.json (ours or z-lab's)."""
    dflash = cfg.get("dflash_config") or {}
    rope = cfg.get("rope_parameters") or {
        **(cfg.get("rope_scaling") or {}),
        "rope_type": (cfg.get("rope_scaling") or {}).get("rope_type", "default"),
        "rope_theta": cfg.get("rope_theta", 1000000.0),  # vLLM's default for DFlash layers
    }
    prov = cfg.get("draftsmith") or {}
    heads = cfg["num_attention_heads"]
    ids = dflash.get("target_layer_ids")
    if ids is None:
        raise DflashConfigError("dflash_config.target_layer_ids is missing: the target layers are unknown")
    return DflashDrafterConfig(
        hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"], num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads", heads), head_dim=cfg.get("head_dim") or
        cfg["hidden_size"] // heads, vocab_size=cfg["vocab_size"], num_hidden_layers=cfg["num_hidden_layers"],
        block_size=dflash.get("block_size", cfg.get("block_size", 16)), target_layer_ids=list(ids),
        num_target_layers=cfg.get("num_target_layers") or max(ids) + 4,
        mask_token_id=dflash.get("mask_token_id"), learned_mask=learned_mask,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rope_parameters=rope, target_name_or_path=prov.get("target", ""),
        target_architectures=list(prov.get("target_architectures") or []),
        target_model_type=prov.get("target_model_type", ""), bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"), pad_token_id=cfg.get("pad_token_id"),
    )


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Export tensor name -> (shape, how the shape follows from the config)."""
    h, i, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    n_feat = len(config["dflash_config"]["target_layer_ids"])
    per_layer = {
        "input_layernorm.weight": ((h,), "(hidden_size,)"),
        "self_attn.q_proj.weight": ((q, h), "(heads x head_dim, hidden_size)"),
        "self_attn.k_proj.weight": ((kv, h), "(kv_heads x head_dim, hidden_size)"),
        "self_attn.v_proj.weight": ((kv, h), "(kv_heads x head_dim, hidden_size)"),
        "self_attn.o_proj.weight": ((h, q), "(hidden_size, heads x head_dim)"),
        "self_attn.q_norm.weight": ((hd,), "(head_dim,)"),
        "self_attn.k_norm.weight": ((hd,), "(head_dim,)"),
        "post_attention_layernorm.weight": ((h,), "(hidden_size,)"),
        "mlp.gate_proj.weight": ((i, h), "(intermediate_size, hidden_size)"),
        "mlp.up_proj.weight": ((i, h), "(intermediate_size, hidden_size)"),
        "mlp.down_proj.weight": ((h, i), "(hidden_size, intermediate_size)"),
    }
    shapes = {f"layers.{n}.{name}": spec for n in range(config["num_hidden_layers"]) for name, spec in per_layer.items()}
    shapes["fc.weight"] = ((h, n_feat * h), f"(hidden_size, {n_feat} target layers x hidden_size)")
    shapes["hidden_norm.weight"] = ((h,), "(hidden_size,)")
    shapes["norm.weight"] = ((h,), "(hidden_size,)")
    return shapes


# ---- validation --------------------------------------------------------------------------------------------
def check_block_config(config: dict[str, Any], architecture: str = ARCHITECTURE) -> tuple[list[str], list[str]]:
    """(problems, warnings) of the config keys a block drafter (DFlash, DSpark) shares with the engines."""
    problems: list[str] = []
    warnings: list[str] = []
    if config.get("architectures") != [architecture]:
        problems.append(f"config architectures: {config.get('architectures')!r}, expected [{architecture!r}]")
    if config.get("model_type") != MODEL_TYPE:
        problems.append(f"config model_type: {config.get('model_type')!r}, expected {MODEL_TYPE!r}")
    problems += key_problems(config, _REQUIRED_INTS)
    if is_int(config.get("block_size")) and config["block_size"] < 2:
        problems.append(f"config block_size: {config['block_size']}, expected >= 2 (the anchor and one mask)")
    if config.get("hidden_act") != "silu":
        problems.append(f"config hidden_act: {config.get('hidden_act')!r}; SGLang's DFlash supports only 'silu'")
    for key in ("rms_norm_eps", "rope_theta", "rope_parameters"):
        if key not in config:
            problems.append(f"config: missing {key}")

    dflash = config.get("dflash_config")
    if not isinstance(dflash, dict):
        problems.append("config: missing dflash_config {target_layer_ids, mask_token_id}")
        return problems, warnings
    ids, depth = dflash.get("target_layer_ids"), config.get("num_target_layers")
    if not isinstance(ids, list) or not ids or not all(is_int(i) for i in ids):
        problems.append(f"config dflash_config.target_layer_ids: {ids!r}, expected a non-empty list of layer ids")
        return problems, warnings
    if any(b <= a for a, b in zip(ids, ids[1:])):
        problems.append(f"config dflash_config.target_layer_ids: {ids} must be strictly increasing "
                        "(engines concatenate features in layer order)")
    if is_int(depth) and any(not 0 <= i < depth for i in ids):
        problems.append(f"config dflash_config.target_layer_ids: {ids} outside 0..{depth - 1} "
                        f"(output of layer i of the {depth}-layer target)")
    aux = config.get(AUX_IDS_KEY)
    if aux is not None and aux != [i + 1 for i in ids]:
        problems.append(f"config {AUX_IDS_KEY}: {aux!r}, expected {[i + 1 for i in ids]} "
                        "(capture form of dflash_config.target_layer_ids)")
    mask_id, vocab = dflash.get("mask_token_id"), config.get("vocab_size")
    if not is_int(mask_id) or (is_int(vocab) and not 0 <= mask_id < vocab):
        problems.append(f"config dflash_config.mask_token_id: {mask_id!r}, engines need a token id in the target "
                        "vocabulary to mark mask slots: train with dflash.mask_token_id set to an unused id")
    return problems, warnings


def check_dflash_export(
    config: dict[str, Any], tensors: dict[str, torch.Tensor], mask_embedding: torch.Tensor | None = None
) -> tuple[list[str], list[str]]:
    """(problems, warnings) of a `--format dflash` config + tensors (+ mask embedding). Problems make it unloadable
    or wrong in an engine; an empty list means vLLM and SGLang load it."""
    problems, warnings = check_block_config(config)
    sizes_ok = all(is_int(config.get(k)) and config[k] > 0 for k in _REQUIRED_INTS)
    ids = (config.get("dflash_config") or {}).get("target_layer_ids") if isinstance(config.get("dflash_config"),
                                                                                   dict) else None
    if not sizes_ok or not isinstance(ids, list):
        return problems + ["tensors not checked: their shapes follow from the config sizes above"], warnings
    problems += check_tensors(expected_shapes(config), tensors)
    if mask_embedding is not None:
        more_problems, more_warnings = check_mask_embedding(config, mask_embedding)
        problems += more_problems
        warnings += more_warnings
    return problems, warnings


def check_mask_embedding(config: dict[str, Any], mask_embedding: torch.Tensor) -> tuple[list[str], list[str]]:
    """(problems, warnings) of a learned mask embedding shipped as MASK_EMBEDDING_FILE."""
    problems = []
    if tuple(mask_embedding.shape) != (config["hidden_size"],):
        problems.append(f"{MASK_EMBEDDING_FILE}: shape {tuple(mask_embedding.shape)}, expected "
                        f"({config['hidden_size']},) = (hidden_size,)")
    return problems, [f"the mask embedding is learned and ships as {MASK_EMBEDDING_FILE}, which vLLM reads; an "
                      "engine that does not embeds the target's row of mask_token_id instead and accepts less"]


# ---- export ------------------------------------------------------------------------------------------------
def dflash_serve_commands(target: str, draft: str, block_size: int) -> dict[str, str]:
    """Commands that serve `target` with this drafter at its full block (k = block_size - 1)."""
    t, d = shlex.quote(target), shlex.quote(draft)
    return {
        "vLLM": vllm_serve(target, METHOD, draft, block_size - 1),
        "SGLang": (f"python -m sglang.launch_server --model {t} --speculative-algorithm DFLASH "
                   f"--speculative-draft-model-path {d} --speculative-num-draft-tokens {block_size}"),
    }


def serve_commands_from_config(config: dict[str, Any], draft: str) -> dict[str, str]:
    """The serve commands of an exported folder's config.json (push re-renders its card with them)."""
    return dflash_serve_commands((config.get("draftsmith") or {}).get("target") or "TARGET", draft,
                                 config["block_size"])


def dflash_files(source: ExportSource) -> FormatFiles:
    """The `--format dflash` layout of a checkpoint: the engines' config, the weights (draftsmith adopted the
    engines' names: the key map is the identity), a learned mask embedding as its own file, the card rows."""
    cfg = source.config
    config = export_config(cfg, step=source.step)
    tensors = source.tensors()
    mask_embedding = tensors.pop("mask_embedding", None)
    if cfg.learned_mask and mask_embedding is None:
        raise ExportError(f"{source.ckpt}: config says learned_mask but model.safetensors has no mask_embedding")
    extra, warnings = {}, []
    if mask_embedding is not None:
        problems, warnings = check_mask_embedding(config, mask_embedding)
        source.refuse(problems)
        mask_file = {"mask_token_id": cfg.mask_token_id, "embedding": mask_embedding.clone()}
        extra[MASK_EMBEDDING_FILE] = lambda path: torch.save(mask_file, path)
    return FormatFiles(
        config=config,
        tensors=tensors,
        summary={
            "architecture": ARCHITECTURE,
            "draft layers": cfg.num_hidden_layers,
            "block_size": f"{cfg.block_size} (drafts up to {cfg.block_size - 1} tokens per step)",
            "hidden_size": cfg.hidden_size,
            "mask": (f"learned embedding in {MASK_EMBEDDING_FILE} (read by vLLM), at token id {cfg.mask_token_id}"
                     if cfg.learned_mask else f"the target's embedding of token id {cfg.mask_token_id}"),
        },
        aux_layer_ids=[
            ("output of layer i (DFlash: vLLM and SGLang add 1)", "dflash_config.target_layer_ids",
             config["dflash_config"]["target_layer_ids"]),
            ("capture: residual entering layer k = HF `output_hidden_states[k]`", AUX_IDS_KEY, config[AUX_IDS_KEY]),
        ],
        serve_commands=dflash_serve_commands(source.target, source.draft, cfg.block_size),
        warnings=warnings,
        extra_files=extra,
    )


DFLASH_EXPORT = FormatExport(name="dflash", method=METHOD, config_class=DflashDrafterConfig, title="DFlash",
                             tags=TAGS, build=dflash_files, check=check_dflash_export)
export_dflash = DFLASH_EXPORT.write  # (checkpoint, out_dir, *, overwrite, dtype) -> ExportResult
