"""The vllm-project/speculators layout of an EAGLE-3 drafter: what `vllm serve DIR` and the `speculators` package load.

Checked against speculators 0.9.0 (`speculators/config.py`, `models/eagle3/{config,core,model_definitions}.py`)
and vLLM's reader (`transformers_utils/configs/speculators/{base,algos}.py`, engines.md §1.7):

- `config.json`: `speculators_model_type: "eagle3"`, a Llama-shaped `transformer_layer_config` (vLLM builds the
  draft model from it alone, so it carries every layer size, RoPE and `max_position_embeddings`), the Eagle3 flags
  at the top level, and `speculators_config` = {algorithm, proposal_methods, default_proposal_method, verifier}.
  vLLM serves `speculators_config.verifier.name_or_path` as the target and drafts
  `proposal_methods[0].speculative_tokens` tokens.
- tensors: draftsmith's names with `midlayer.` spelled `layers.0.`, plus `embed_tokens.weight`, a copy of the
  target's embedding. vLLM would share the target's, but the speculators package needs it in the file: its
  `from_pretrained` lists the key as optional and means to fill it from the verifier, yet (0.9.0, transformers 5.19
  and 5.24) a missing embedding is left uninitialised. So the export refuses when the target's is not at hand.

Where the consumers disagree, draftsmith writes the value that makes them agree:

- the forward-pass flags (`norm_before_fc`, `fc_norm`, `norm_before_residual`, `norm_output`): always written, as
  the drafter was trained. `norm_before_residual` matters most: speculators reads a missing key as false, vLLM's
  speculators path as true.
- aux ids: both read `eagle_aux_hidden_state_layer_ids` as capture ids (id k = HF `output_hidden_states[k]`), the
  same as draftsmith; when the key is missing both fall back to `(2, L//2, L-3)`. Always written.
- `target_hidden_size`: vLLM sizes `fc` from it; the speculators package ignores it and assumes the target's width
  equals the draft's. Written; a difference is reported as a warning.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import torch

from draftsmith.models.checkpoint import IMPORT_FILE, CheckpointError, ExportError, read_optional_json
from draftsmith.models.drafter_config import is_int, one_layer_llama_json
from draftsmith.models.eagle3.config import FORWARD_FLAGS, METHOD, Eagle3Config
from draftsmith.models.eagle3.export import (
    AUX_IDS_KEY,
    NATIVE_KEY_MAP,
    NUM_SPECULATIVE_TOKENS,
    check_state_dict,
    eagle3_config_from_native,
    eagle3_serve_commands,
    expected_native_shapes,
)
from draftsmith.models.export_base import (
    ExportSource,
    FormatExport,
    FormatFiles,
    one_layer_llama_problems,
    provenance,
)
from draftsmith.models.model_card import looks_like_hub_id
from draftsmith.models.target_files import load_target_embedding, read_target_config

SPECULATORS_MODEL_TYPE = "eagle3"
SPECULATORS_VERSION = "0.9.0"  # the speculators release this layout was checked against
ARCHITECTURE = "Eagle3DraftModel"  # what the speculators package's save_pretrained writes; vLLM replaces it
EMBED_KEY = "embed_tokens.weight"
TAGS = ["speculative-decoding", "eagle3", "draftsmith", "vllm", "speculators"]


class SpeculatorsFormatError(ValueError):
    """A speculators-format config that draftsmith cannot read or whose drafter draftsmith does not implement."""


def to_speculators_name(name: str) -> str:
    """draftsmith tensor name -> speculators tensor name (`midlayer.` is the first of `layers`)."""
    name = NATIVE_KEY_MAP.get(name, name)
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def from_speculators_name(name: str) -> str:
    return "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name


# The contract as a table {draftsmith name: speculators name}; a tensor outside it is refused.
SPECULATORS_KEY_MAP: dict[str, str] = {ours: to_speculators_name(ours) for ours in NATIVE_KEY_MAP}


# ---- config ------------------------------------------------------------------------------------------------
HF_CACHE_REPO = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/")  # a Hugging Face cache snapshot


def verifier_name(target: str, given: str | None = None) -> tuple[str, str | None]:
    """(what `speculators_config.verifier.name_or_path` records, a warning or None).

    A pushed checkpoint is served elsewhere, so the verifier should be the Hub id the target came from: `given`
    (`export --verifier`), else the recipe's target when it is a Hub id, else the id of a Hugging Face cache
    snapshot the local path points into. Only a plain local folder is left as it is, with a warning."""
    if given:
        return given, None
    if looks_like_hub_id(target):
        return target, None
    cached = HF_CACHE_REPO.search(str(Path(target).resolve()) + "/") if target else None
    if cached:
        return f"{cached['org']}/{cached['name']}", None
    return target, (f"speculators_config.verifier.name_or_path is the local path {target!r}: a pushed checkpoint "
                    "would name a folder on this machine; pass --verifier ORG/NAME (the target's Hub id)")


def speculators_config(
    config: Eagle3Config,
    *,
    num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS,
    verifier_architectures: list[str] | None = None,
    target_max_position_embeddings: int | None = None,
    step: int | None = None,
    verifier: str | None = None,
) -> dict[str, Any]:
    """The speculators-format `config.json` of a draftsmith EAGLE-3 config; `verifier` (default: the target as the
    checkpoint names it) is what vLLM will serve as the target."""
    return {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": SPECULATORS_MODEL_TYPE,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": one_layer_llama_json(config),  # vLLM merges it into its model config
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        AUX_IDS_KEY: list(config.aux_layer_ids),  # capture ids, as vLLM and speculators read them
        **config.variants(),
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": SPECULATORS_MODEL_TYPE,
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
                 "verifier_accept_k": 1, "accept_tolerance": 0.0},
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier or config.target_name_or_path,
                "architectures": list(verifier_architectures or config.target_architectures),
            },
        },
        "draftsmith": provenance(
            config, METHOD, step,
            num_target_layers=config.num_target_layers,
            target_max_position_embeddings=target_max_position_embeddings or config.max_position_embeddings,
            aux_layer_ids_note=(
                f"{AUX_IDS_KEY}: id k = residual stream entering target layer k = HF output_hidden_states[k] "
                "(the convention of vLLM, speculators and draftsmith)"
            ),
        ),
    }


def flat_view(config: dict[str, Any]) -> dict[str, Any]:
    """transformer_layer_config merged under the top level, as vLLM reads a speculators config."""
    layer = config.get("transformer_layer_config")
    return {**(layer if isinstance(layer, dict) else {}), **{k: v for k, v in config.items()
                                                              if k != "transformer_layer_config"}}


def expected_speculators_shapes(config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Speculators tensor name -> (shape, why), from the flattened config (see `flat_view`)."""
    flat = flat_view(config)
    native = expected_native_shapes({**flat, "target_hidden_size": flat.get("target_hidden_size") or
                                     flat["hidden_size"]})
    shapes = {to_speculators_name(name): shape for name, shape in native.items()}
    shapes[EMBED_KEY] = ((flat["vocab_size"], flat["hidden_size"]), "(vocab_size, hidden_size), the target's")
    return shapes


# ---- validation --------------------------------------------------------------------------------------------
_LAYER_INTS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "vocab_size", "max_position_embeddings")


def _check_speculators_block(spec: Any) -> list[str]:
    if not isinstance(spec, dict):
        return ["config: missing speculators_config (vLLM finds the target and the method there)"]
    problems = []
    if spec.get("algorithm") != SPECULATORS_MODEL_TYPE:
        problems.append(f"config speculators_config.algorithm: {spec.get('algorithm')!r}, expected 'eagle3'")
    methods = spec.get("proposal_methods")
    if not isinstance(methods, list) or not methods or not all(isinstance(m, dict) for m in methods):
        problems.append("config speculators_config.proposal_methods: expected a non-empty list of objects")
    else:
        k = methods[0].get("speculative_tokens")
        if not is_int(k) or k < 1:
            problems.append(f"config speculators_config.proposal_methods[0].speculative_tokens: {k!r}, expected a "
                            "positive integer (vLLM's num_speculative_tokens)")
        types = [m.get("proposal_type") for m in methods]
        if spec.get("default_proposal_method") not in types:
            problems.append(f"config speculators_config.default_proposal_method: "
                            f"{spec.get('default_proposal_method')!r} is not one of the proposal types {types}")
    verifier = spec.get("verifier")
    if not isinstance(verifier, dict) or not isinstance(verifier.get("name_or_path"), str) \
            or not verifier["name_or_path"]:
        problems.append("config speculators_config.verifier.name_or_path: missing; vLLM serves this model as the "
                        "target (set model.target in the recipe)")
    elif not isinstance(verifier.get("architectures"), list):
        problems.append("config speculators_config.verifier.architectures: expected a list of class names")
    return problems


def check_speculators(
    config: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> tuple[list[str], list[str]]:
    """(problems, warnings) for a speculators-format EAGLE-3 config + state dict, as vLLM and speculators read it."""
    problems: list[str] = []
    warnings: list[str] = []
    if config.get("speculators_model_type") != SPECULATORS_MODEL_TYPE:
        problems.append(f"config speculators_model_type: {config.get('speculators_model_type')!r}, expected 'eagle3'")
    problems += _check_speculators_block(config.get("speculators_config"))
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        return problems + ["config transformer_layer_config: missing or not an object (vLLM requires a dict)"], []
    problems += one_layer_llama_problems(layer, _LAYER_INTS, ("rms_norm_eps", "hidden_act", "rope_parameters"),
                                         "transformer_layer_config")
    if layer.get("tie_word_embeddings") is not False:
        problems.append("config transformer_layer_config.tie_word_embeddings: must be false (lm_head is the draft's)")
    for flag in FORWARD_FLAGS:
        if not isinstance(config.get(flag), bool):
            why = " (speculators reads a missing key as false, vLLM as true)" if flag == "norm_before_residual" else ""
            problems.append(f"config {flag}: {config.get(flag)!r}, expected true or false{why}")
    draft_vocab, vocab = config.get("draft_vocab_size"), layer.get("vocab_size")
    if not is_int(draft_vocab) or draft_vocab <= 0:
        problems.append(f"config draft_vocab_size: {draft_vocab!r}, expected a positive integer")
    elif is_int(vocab) and draft_vocab > vocab:
        problems.append(f"config draft_vocab_size {draft_vocab} > transformer_layer_config.vocab_size {vocab}")
    hidden, target_hidden = layer.get("hidden_size"), config.get("target_hidden_size")
    if target_hidden is not None and (not is_int(target_hidden) or target_hidden <= 0):
        problems.append(f"config target_hidden_size: {target_hidden!r}, expected a positive integer or null")
    elif target_hidden not in (None, hidden):
        warnings.append(f"target_hidden_size {target_hidden} != hidden_size {hidden}: vLLM reads it, but the "
                        "speculators package sizes fc from hidden_size and cannot load this drafter")

    provenance = config.get("draftsmith") or {}
    target_max, max_pos = provenance.get("target_max_position_embeddings"), layer.get("max_position_embeddings")
    if is_int(target_max) and is_int(max_pos) and max_pos < target_max:
        problems.append(f"config transformer_layer_config.max_position_embeddings {max_pos} < the target's "
                        f"{target_max}")
    ids = config.get(AUX_IDS_KEY)
    if not isinstance(ids, list) or not ids or not all(is_int(i) and i >= 0 for i in ids):
        problems.append(f"config {AUX_IDS_KEY}: {ids!r}, expected capture ids (missing makes vLLM fall back to its "
                        "default layers silently)")
    else:
        if any(b <= a for a, b in zip(ids, ids[1:])):
            problems.append(f"config {AUX_IDS_KEY}: {ids} must be strictly increasing")
        num_layers = provenance.get("num_target_layers")
        if is_int(num_layers) and max(ids) > num_layers:
            problems.append(f"config {AUX_IDS_KEY}: {ids} exceed the target's {num_layers} layers")
    if config.get("attention_bias") or layer.get("attention_bias") or layer.get("mlp_bias"):
        warnings.append("the draft layer has biases; check that your vLLM build loads them")

    sizes_ok = all(is_int(layer.get(k)) and layer[k] > 0 for k in _LAYER_INTS) and is_int(draft_vocab) \
        and isinstance(ids, list) and (target_hidden is None or is_int(target_hidden))
    if not sizes_ok:
        return problems + ["tensors not checked: their shapes follow from the config sizes above"], warnings
    problems += check_state_dict(flat_view(config), expected_speculators_shapes(config), tensors)
    return problems, warnings


def validate_speculators(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> list[str]:
    """Problems with a speculators-format export (empty = loadable by vLLM and the speculators package)."""
    return check_speculators(config, tensors)[0]


# ---- reading the format back -------------------------------------------------------------------------------
def eagle3_config_from_speculators(
    config: dict[str, Any], target_config: dict[str, Any] | None = None
) -> tuple[Eagle3Config, list[str]]:
    """(draftsmith config, notes on what had to be assumed) of a speculators-format EAGLE-3 config.

    Flattened the way vLLM reads it (`flat_view`), the config is a native one, with the target named by the
    verifier; `target_config` (the target's config.json, when found) supplies what a third-party config may lack.
    """
    if config.get("speculators_model_type") != SPECULATORS_MODEL_TYPE:
        raise SpeculatorsFormatError(f"speculators_model_type {config.get('speculators_model_type')!r} is not "
                                     "'eagle3'; draftsmith reads only EAGLE-3 speculators checkpoints")
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise SpeculatorsFormatError("transformer_layer_config: missing or not an object")
    if "norm_before_residual" not in config:
        raise SpeculatorsFormatError(
            "norm_before_residual is missing: speculators reads that as false and vLLM as true, so the drafter's "
            "residual is ambiguous; add \"norm_before_residual\": false (or true) to config.json"
        )
    if layer.get("model_type", "llama") != "llama":
        raise SpeculatorsFormatError(f"transformer_layer_config.model_type {layer.get('model_type')!r}: draftsmith's "
                                     "draft layer is Llama-shaped (no q/k norms)")
    spec = config.get("speculators_config") if isinstance(config.get("speculators_config"), dict) else {}
    verifier = spec.get("verifier") if isinstance(spec.get("verifier"), dict) else {}
    prov = config.get("draftsmith") if isinstance(config.get("draftsmith"), dict) else {}
    flat = flat_view(config)
    flat["draftsmith"] = {
        "target": verifier.get("name_or_path") or "",
        "target_architectures": verifier.get("architectures") or [],
        **{k: v for k, v in prov.items() if v not in (None, "", [])},
    }
    config, notes = eagle3_config_from_native(flat, target_config)
    window = layer.get("sliding_window")
    if "sliding_attention" in (layer.get("layer_types") or []) and is_int(window):
        notes.append(f"the draft layer was trained with a {window}-token sliding window; draftsmith attends to the "
                     f"whole context, which is the same for contexts up to {window} tokens")
    return config, notes


def tensors_from_speculators(
    tensors: dict[str, torch.Tensor], draft_vocab_size: int, vocab_size: int
) -> dict[str, torch.Tensor]:
    """draftsmith names; the embedding is dropped (the target's is used) and, for a full-vocab draft, the identity
    d2t / t2d the speculators package does not save are filled in."""
    out = {from_speculators_name(n): t for n, t in tensors.items() if n != EMBED_KEY}
    if "d2t" not in out and "t2d" not in out and draft_vocab_size == vocab_size:
        out["d2t"] = torch.zeros(draft_vocab_size, dtype=torch.long)  # draft id i = target id i
        out["t2d"] = torch.ones(vocab_size, dtype=torch.bool)
    return out


# ---- export ------------------------------------------------------------------------------------------------
def speculators_serve_commands(
    target: str, draft: str, num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS, sglang: bool = True
) -> dict[str, str]:
    """vLLM reads the target and k from config.json; SGLang reads only the native layout, so its line converts first
    (and is left out for drafters SGLang cannot run: `sglang=False`)."""
    d = shlex.quote(draft)
    native_dir = f"{draft.rstrip('/')}-sglang"
    native = eagle3_serve_commands(target, native_dir, num_speculative_tokens)
    commands = {
        "vLLM": f"vllm serve {d}",
        "vLLM, naming the target": eagle3_serve_commands(target, draft, num_speculative_tokens)["vLLM"],
    }
    if sglang:
        commands["SGLang (native layout only: convert, then serve)"] = (
            f"draftsmith import {d} --out {shlex.quote(native_dir + '-checkpoint')} && "
            f"draftsmith export {shlex.quote(native_dir + '-checkpoint')} --format sglang --out "
            f"{shlex.quote(native_dir)} && " + native["SGLang"]
        )
    return commands


def serve_commands_from_config(config: dict[str, Any], draft: str) -> dict[str, str]:
    """The serve commands of an exported speculators folder's config.json (push re-renders its card with them)."""
    spec = config["speculators_config"]
    return speculators_serve_commands(spec["verifier"]["name_or_path"], draft,
                                      spec["proposal_methods"][0]["speculative_tokens"])


def _num_speculative_tokens(eval_result: Any, ckpt: Path) -> int:
    """k for `proposal_methods[0].speculative_tokens`: the one `draftsmith eval` measured, else the one an imported
    drafter shipped with (import.json), else the default of the printed serve commands."""
    candidates = [eval_result]
    try:
        candidates.append(read_optional_json(ckpt / IMPORT_FILE))
    except CheckpointError:
        pass
    for source in candidates:
        k = source.get("num_speculative_tokens") if isinstance(source, dict) else None
        if is_int(k) and k > 0:
            return k
    return NUM_SPECULATIVE_TOKENS


def speculators_files(source: ExportSource) -> FormatFiles:
    """The speculators layout of an EAGLE-3 checkpoint: its config (the verifier and k recorded), the weights under
    SPECULATORS_KEY_MAP plus a copy of the target's embedding, the card rows (the card names the verifier)."""
    cfg, ckpt, warnings = source.config, source.ckpt, []
    target_config = read_target_config(cfg.target_name_or_path) or {}
    architectures = list(cfg.target_architectures or target_config.get("architectures") or [])
    if not architectures:
        warnings.append("the target's architectures are unknown; speculators_config.verifier.architectures is empty")
    target_max = target_config.get("max_position_embeddings")
    num_tokens = _num_speculative_tokens(source.card.eval_result, ckpt)
    verifier, why = verifier_name(cfg.target_name_or_path, source.options.get("verifier"))
    if why:
        warnings.append(why)
    config = speculators_config(cfg, num_speculative_tokens=num_tokens, verifier_architectures=architectures,
                                target_max_position_embeddings=target_max if is_int(target_max) else None,
                                step=source.step, verifier=verifier)

    tensors = source.tensors(SPECULATORS_KEY_MAP)
    embedding, why_not = load_target_embedding(cfg.target_name_or_path)
    if embedding is None:
        raise ExportError(
            f"{ckpt}: cannot write {EMBED_KEY}, which the speculators package needs in the file: {why_not}. Put the "
            f"target's config and safetensors in that folder or the Hugging Face cache (hf download "
            f"{cfg.target_name_or_path or 'TARGET'} --include '*.json' '*.safetensors'), or use --format sglang"
        )
    weights_dtype = tensors["lm_head.weight"].dtype if "lm_head.weight" in tensors else embedding.dtype
    tensors[EMBED_KEY] = embedding.to(weights_dtype)  # (V, H) one float dtype per file

    layer, spec = config["transformer_layer_config"], config["speculators_config"]
    return FormatFiles(
        config=config,
        tensors=tensors,
        summary={
            "format": f"speculators {config['speculators_version']} (speculators_model_type eagle3)",
            "draft layers": layer["num_hidden_layers"],
            "hidden_size": layer["hidden_size"],
            "target_hidden_size": config["target_hidden_size"],
            "draft_vocab_size": f"{config['draft_vocab_size']} of {layer['vocab_size']}",
            "speculative tokens (vLLM default)": spec["proposal_methods"][0]["speculative_tokens"],
        },
        aux_layer_ids=[
            ("capture: residual entering layer k = HF `output_hidden_states[k]` (vLLM, speculators)", AUX_IDS_KEY,
             config[AUX_IDS_KEY]),
        ],
        serve_commands=speculators_serve_commands(verifier, source.draft, num_tokens,
                                                  sglang=not any(cfg.variants().values())),
        warnings=warnings,
        card_target=spec["verifier"]["name_or_path"] or "TARGET",
    )


SPECULATORS_EXPORT = FormatExport(name="speculators EAGLE-3", method=METHOD, config_class=Eagle3Config,
                                  title="EAGLE-3", tags=TAGS, build=speculators_files, check=check_speculators,
                                  options=("verifier",))
export_speculators = SPECULATORS_EXPORT.write  # (checkpoint, out_dir, *, overwrite, dtype, verifier)
