"""Export an EAGLE-3 checkpoint in the native format that SGLang and vLLM (`method: eagle3`) load unchanged.

The format (engines.md §0, §1.3, §3): a Llama-shaped `config.json` with `"architectures": ["LlamaForCausalLMEagle3"]`
and one `model.safetensors`. Both engines silently ignore tensors they do not expect and silently fall back to
default aux layers when the ids are missing, so `validate_native_eagle3` checks the whole contract before anything
is written.

Aux layer ids. draftsmith keeps capture ids (id k = the residual stream entering target layer k = Hugging Face
`output_hidden_states[k]`), which is what vLLM reads from the top-level key. SGLang reads
`eagle_config.eagle_aux_hidden_state_layer_ids` as "output of layer i" and captures i + 1:

    capture id (vLLM)        0      1      2     ...   k
                          embeds  out(0) out(1)  ...  out(k-1)
    output-of-layer (SGLang)  -      0      1     ...   k-1
"""

from __future__ import annotations

import shlex
from typing import Any

import torch

from draftsmith.models.checkpoint import CONFIG_FILE, ExportError, FormatNotApplicable, check_tensors
from draftsmith.models.drafter_config import DrafterLoadError, is_int, layer_bias_shapes, one_layer_llama_json
from draftsmith.models.eagle3.config import FORWARD_FLAGS, METHOD, Eagle3Config
from draftsmith.models.export_base import (
    ExportSource,
    FormatExport,
    FormatFiles,
    one_layer_llama_problems,
    provenance,
    vllm_serve,
)
from draftsmith.models.spec import capture_from_output, output_from_capture

ARCHITECTURE = "LlamaForCausalLMEagle3"  # in both vLLM's and SGLang's registries (engines.md §1.1, §3)
AUX_IDS_KEY = "eagle_aux_hidden_state_layer_ids"
ENGINE_AUX_LAYERS = 3  # vLLM's and SGLang's Llama EAGLE-3 build fc for exactly three aux layers
NUM_SPECULATIVE_TOKENS = 3  # what the printed serve commands ask for; SGLang's draft tokens count the root: k + 1
TAGS = ["speculative-decoding", "eagle3", "draftsmith", "vllm", "sglang"]

# {draftsmith name: native name}. draftsmith adopted the native names, so the map is the identity; it is still
# spelled out because it is the contract (a tensor outside it is refused, a missing one is reported).
_WEIGHT_NAMES = (
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
)
_VOCAB_NAMES = ("d2t", "t2d")
VOCAB_MAP_DTYPES = {"d2t": torch.int64, "t2d": torch.bool}
MAX_AUX_LAYERS = 16  # fc_norm.{i} names are listed up to this many aux layers
_FLAG_NORM_NAMES = ("input_norm.weight", *(f"fc_norm.{i}.weight" for i in range(MAX_AUX_LAYERS)))  # with the flags
_ATTENTION_BIAS_NAMES = tuple(f"midlayer.self_attn.{p}_proj.bias" for p in "qkvo")  # when attention_bias
_MLP_BIAS_NAMES = tuple(f"midlayer.mlp.{p}_proj.bias" for p in ("gate", "up", "down"))  # when mlp_bias
NATIVE_KEY_MAP: dict[str, str] = {
    name: name for name in _WEIGHT_NAMES + _VOCAB_NAMES + _ATTENTION_BIAS_NAMES + _MLP_BIAS_NAMES + _FLAG_NORM_NAMES
}

_REQUIRED_INTS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "draft_vocab_size",
    "target_hidden_size",
    "max_position_embeddings",
)


# ---- reading the layout back ---------------------------------------------------------------------------------
def eagle3_config_from_native(
    cfg: dict[str, Any], target_config: dict[str, Any] | None = None
) -> tuple[Eagle3Config, list[str]]:
    """(draftsmith config, notes on what had to be assumed) of a Llama-shaped native EAGLE-3 config.

    Aux ids, in order of trust: the top-level capture ids (vLLM), SGLang's nested output-of-layer ids + 1, then
    the engines' shared default (2, L//2, L-3) when the target's layer count L is known.
    """
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in cfg]
    if missing:
        raise DrafterLoadError(f"native EAGLE-3 config: missing {', '.join(missing)}")
    notes: list[str] = []
    prov = cfg.get("draftsmith") if isinstance(cfg.get("draftsmith"), dict) else {}
    target_config = target_config or {}
    num_layers = prov.get("num_target_layers") or cfg.get("num_target_layers") or target_config.get("num_hidden_layers")
    ids = cfg.get(AUX_IDS_KEY)
    nested = (cfg.get("eagle_config") or {}).get(AUX_IDS_KEY) if isinstance(cfg.get("eagle_config"), dict) else None
    if not ids and nested:
        ids = capture_from_output(list(nested))
        notes.append(f"only SGLang's eagle_config.{AUX_IDS_KEY} {nested} given: read as output-of-layer ids, "
                     f"capture ids {ids}")
    if not ids:
        if not num_layers:
            raise DrafterLoadError(
                f"native EAGLE-3 config has no {AUX_IDS_KEY} and the target's layer count is unknown: give the "
                "target (a local folder or a cached Hub id) so the engines' default aux layers can be used"
            )
        ids = [2, num_layers // 2, num_layers - 3]
        notes.append(f"no aux layer ids in the config: assumed vLLM's and SGLang's default {ids}")
    if not num_layers:
        num_layers = max(ids) + 3
        notes.append(f"the target's layer count is unknown: assumed {num_layers} (last aux id + 3)")
    max_pos = cfg.get("max_position_embeddings", 4096)
    target_max = target_config.get("max_position_embeddings")
    if isinstance(target_max, int) and target_max > max_pos:  # yuhuili's configs ship 2048 for 128k targets
        notes.append(f"max_position_embeddings raised from {max_pos} to the target's {target_max}")
        max_pos = target_max
    rope = cfg.get("rope_parameters") or {
        **(cfg.get("rope_scaling") or {}),
        "rope_type": (cfg.get("rope_scaling") or {}).get("rope_type", "default"),
        "rope_theta": cfg.get("rope_theta", 10000.0),
    }
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    return Eagle3Config(
        hidden_size=hidden, intermediate_size=cfg["intermediate_size"], num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads, head_dim=cfg.get("head_dim") or hidden // heads,
        vocab_size=cfg["vocab_size"], draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
        target_hidden_size=cfg.get("target_hidden_size") or hidden,
        num_target_layers=num_layers, aux_layer_ids=list(ids),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), hidden_act=cfg.get("hidden_act", "silu"),
        max_position_embeddings=max_pos, rope_parameters=dict(rope),
        attention_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
        target_name_or_path=prov.get("target") or prov.get("target_name_or_path") or "",
        target_architectures=list(prov.get("target_architectures") or target_config.get("architectures") or []),
        target_model_type=prov.get("target_model_type") or target_config.get("model_type", ""),
        bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"),
        pad_token_id=cfg.get("pad_token_id"),
        **forward_flags_of(cfg),
    ), notes


def forward_flags_of(cfg: dict[str, Any]) -> dict[str, bool]:
    """The forward-pass flags of a native (or flattened speculators) config, read as vLLM's llama_eagle3.py does:
    `norm_before_fc` from eagle_config first, then the top level; a missing flag is false."""
    eagle = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    flags = {flag: bool(cfg.get(flag, False)) for flag in FORWARD_FLAGS}
    flags["norm_before_fc"] = bool(eagle.get("norm_before_fc", cfg.get("norm_before_fc", False)))
    return flags


def tensors_from_native(
    tensors: dict[str, torch.Tensor], draft_vocab_size: int, vocab_size: int
) -> dict[str, torch.Tensor]:
    """draftsmith names of a native state dict (`midlayer.*`, or vLLM's `model.layers.0.*`); the embedding is
    dropped (draftsmith uses the target's) and a full-vocab drafter without maps gets the identity d2t / t2d."""
    renamed = {}
    for name, t in tensors.items():
        name = name.removeprefix("model.")
        name = "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name
        if name != "embed_tokens.weight":
            renamed[name] = t
    if "d2t" not in renamed and "t2d" not in renamed and draft_vocab_size == vocab_size:
        renamed["d2t"] = torch.zeros(draft_vocab_size, dtype=torch.long)  # draft id i = target id i
        renamed["t2d"] = torch.ones(vocab_size, dtype=torch.bool)
    return renamed



# ---- config ------------------------------------------------------------------------------------------------
def native_config(config: Eagle3Config, step: int | None = None) -> dict[str, Any]:
    """The Llama-shaped `config.json` both engines read, with aux ids in each engine's convention."""
    capture_ids = list(config.aux_layer_ids)
    return {
        "architectures": [ARCHITECTURE],
        **one_layer_llama_json(config),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        # the forward-pass flags, as vLLM's llama_eagle3.py reads them
        **config.variants(),
        AUX_IDS_KEY: capture_ids,
        "eagle_config": {AUX_IDS_KEY: output_from_capture(capture_ids), "use_aux_hidden_state": True},
        "draftsmith": provenance(
            config, METHOD, step,
            num_target_layers=config.num_target_layers,
            target_max_position_embeddings=config.max_position_embeddings,
            aux_layer_ids_capture=capture_ids,
            aux_layer_ids_note=(
                f"top-level {AUX_IDS_KEY} (vLLM): id k = residual stream entering target layer k = HF "
                f"output_hidden_states[k]; eagle_config.{AUX_IDS_KEY} (SGLang): output of layer i = capture id i+1"
            ),
        ),
    }


def expected_native_shapes(config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Native tensor name -> (shape, how the shape follows from the config)."""
    h, i = config["hidden_size"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    n_aux, h_t = len(config[AUX_IDS_KEY]), config["target_hidden_size"]
    shapes = {
        "fc.weight": ((h, n_aux * h_t), f"(hidden_size, {n_aux} aux layers x target_hidden_size)"),
        "midlayer.input_layernorm.weight": ((h,), "(hidden_size,)"),
        "midlayer.hidden_norm.weight": ((h,), "(hidden_size,)"),
        "midlayer.self_attn.q_proj.weight": ((q, 2 * h), "(heads x head_dim, 2 x hidden_size)"),
        "midlayer.self_attn.k_proj.weight": ((kv, 2 * h), "(kv_heads x head_dim, 2 x hidden_size)"),
        "midlayer.self_attn.v_proj.weight": ((kv, 2 * h), "(kv_heads x head_dim, 2 x hidden_size)"),
        "midlayer.self_attn.o_proj.weight": ((h, q), "(hidden_size, heads x head_dim)"),
        "midlayer.post_attention_layernorm.weight": ((h,), "(hidden_size,)"),
        "midlayer.mlp.gate_proj.weight": ((i, h), "(intermediate_size, hidden_size)"),
        "midlayer.mlp.up_proj.weight": ((i, h), "(intermediate_size, hidden_size)"),
        "midlayer.mlp.down_proj.weight": ((h, i), "(hidden_size, intermediate_size)"),
        "norm.weight": ((h,), "(hidden_size,)"),
        "lm_head.weight": ((config["draft_vocab_size"], h), "(draft_vocab_size, hidden_size)"),
        "d2t": ((config["draft_vocab_size"],), "(draft_vocab_size,)"),
        "t2d": ((config["vocab_size"],), "(vocab_size,)"),
    }
    if config.get("norm_before_fc"):
        shapes["input_norm.weight"] = ((n_aux * h_t,), f"({n_aux} aux layers x target_hidden_size,) (norm_before_fc)")
    if config.get("fc_norm"):
        for j in range(n_aux):
            shapes[f"fc_norm.{j}.weight"] = ((h_t,), "(target_hidden_size,) (fc_norm)")
    shapes.update(layer_bias_shapes(config, _ATTENTION_BIAS_NAMES, _MLP_BIAS_NAMES, q, kv, h, i))
    return shapes


# ---- validation --------------------------------------------------------------------------------------------
def _check_config(config: dict[str, Any]) -> tuple[list[str], list[str]]:
    problems: list[str] = []
    warnings: list[str] = []
    if config.get("architectures") != [ARCHITECTURE]:
        problems.append(f"config architectures: {config.get('architectures')!r}, expected [{ARCHITECTURE!r}]")
    problems += one_layer_llama_problems(config, _REQUIRED_INTS,
                                         ("rms_norm_eps", "hidden_act", "rope_theta", "rope_parameters"))
    rope = config.get("rope_parameters")
    rope_ok = isinstance(rope, dict) and rope.get("rope_theta") == config.get("rope_theta")
    if "rope_parameters" in config and not rope_ok:
        problems.append("config rope_parameters: must be a dict whose rope_theta equals the top-level rope_theta")
    if config.get("tie_word_embeddings") is not False:
        problems.append("config tie_word_embeddings: must be false (SGLang would use the embedding as lm_head)")
    vocab, draft_vocab = config.get("vocab_size"), config.get("draft_vocab_size")
    if is_int(vocab) and is_int(draft_vocab) and draft_vocab > vocab:
        problems.append(f"config draft_vocab_size {draft_vocab} > vocab_size {vocab}")
    if config.get("attention_bias") or config.get("mlp_bias"):
        warnings.append("the draft layer has biases; SGLang's LlamaForCausalLMEagle3 has none and drops them silently")
    for flag in FORWARD_FLAGS:
        if not isinstance(config.get(flag), bool):
            problems.append(f"config {flag}: {config.get(flag)!r}, expected true or false (vLLM reads a missing "
                            "key as false)")

    provenance = config.get("draftsmith") or {}
    target_max_pos = provenance.get("target_max_position_embeddings")
    max_pos = config.get("max_position_embeddings")
    if is_int(target_max_pos) and is_int(max_pos) and max_pos < target_max_pos:
        problems.append(f"config max_position_embeddings {max_pos} < the target's {target_max_pos}")

    ids = config.get(AUX_IDS_KEY)
    if not isinstance(ids, list) or not ids or not all(is_int(i) for i in ids):
        problems.append(f"config {AUX_IDS_KEY}: {ids!r}, expected a non-empty list of capture ids (vLLM convention)")
        return problems, warnings
    if any(b <= a for a, b in zip(ids, ids[1:])):
        problems.append(f"config {AUX_IDS_KEY}: {ids} must be strictly increasing (engines concatenate in layer order)")
    num_layers = provenance.get("num_target_layers")
    if is_int(num_layers) and any(i > num_layers for i in ids):
        problems.append(f"config {AUX_IDS_KEY}: {ids} exceed the target's {num_layers} layers")
    elif is_int(num_layers) and ids[-1] == num_layers:
        warnings.append(f"aux id {num_layers} is the last layer's output; older vLLM only captures ids < {num_layers}")
    if len(ids) != ENGINE_AUX_LAYERS:
        warnings.append(f"{len(ids)} aux layers; vLLM's and SGLang's Llama EAGLE-3 expect {ENGINE_AUX_LAYERS}")

    eagle = config.get("eagle_config")
    if not isinstance(eagle, dict):
        problems.append(f"config: missing eagle_config.{AUX_IDS_KEY} (SGLang reads only the nested key)")
        return problems, warnings
    if eagle.get("use_aux_hidden_state") is not True:
        problems.append("config eagle_config.use_aux_hidden_state: must be true (false makes the engines skip fc)")
    try:
        want = output_from_capture(ids)
    except ValueError as e:
        problems.append(f"config {AUX_IDS_KEY}: {e}")
        return problems, warnings
    got = eagle.get(AUX_IDS_KEY)
    if got != want:
        problems.append(
            f"config eagle_config.{AUX_IDS_KEY}: {got!r}, expected {want} (output-of-layer form of capture ids {ids})"
        )
    elif want[0] != 1:
        warnings.append(
            f"SGLang ids {want} do not start at 1; SGLang adds its +1 only when the first id is 1 and may read them "
            f"as capture ids (one layer early). Check acceptance under SGLang, or train with first aux id 2"
        )
    return problems, warnings


def check_vocab_maps(config: dict[str, Any], d2t: torch.Tensor, t2d: torch.Tensor) -> list[str]:
    """d2t and t2d must describe the same sorted set of target ids (DESIGN.md §3, draft vocabulary)."""
    if int(t2d.sum()) != config["draft_vocab_size"]:
        return [f"t2d: {int(t2d.sum())} True entries, but draft_vocab_size is {config['draft_vocab_size']}"]
    used = torch.arange(d2t.numel()) + d2t  # (V_d,) target id of each draft id
    if used.numel() > 1 and not bool((used[1:] > used[:-1]).all()):
        return ["d2t: target ids arange + d2t are not strictly increasing"]
    if int(used.min()) < 0 or int(used.max()) >= config["vocab_size"]:
        return [f"d2t: target ids arange + d2t fall outside 0..{config['vocab_size'] - 1}"]
    marked = t2d.nonzero().flatten()  # (V_d,) target ids in the draft vocab, ascending
    if not torch.equal(marked, used):
        i = int((marked != used).nonzero()[0])
        return [f"d2t and t2d disagree: draft id {i} maps to target id {int(used[i])}, t2d says {int(marked[i])}"]
    return []


_check_vocab_maps = check_vocab_maps  # the name earlier callers used


def check_state_dict(
    config: dict[str, Any],
    expected: dict[str, tuple[tuple[int, ...], str]],
    tensors: dict[str, torch.Tensor],
) -> list[str]:
    """Names, shapes and dtypes of `tensors` against one consumer's contract `expected` (name -> (shape, why)).

    Shared by every EAGLE-3 layout: only the names differ between them, not the shapes or the vocabulary maps.
    """
    problems = check_tensors(expected, tensors, VOCAB_MAP_DTYPES)
    maps_ok = not any(p.startswith(("d2t:", "t2d:")) for p in problems)
    if "d2t" in tensors and "t2d" in tensors and "d2t" in expected and maps_ok:
        problems += check_vocab_maps(config, tensors["d2t"], tensors["t2d"])
    return problems


def check_native_eagle3(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """(problems, warnings) for a native EAGLE-3 config + state dict. Problems make an export unloadable or wrong."""
    problems, warnings = _check_config(config)
    sizes_ok = all(is_int(config.get(k)) and config[k] > 0 for k in _REQUIRED_INTS)
    if not sizes_ok or not isinstance(config.get(AUX_IDS_KEY), list):
        return problems + ["tensors not checked: their shapes follow from the config sizes above"], warnings
    return problems + check_state_dict(config, expected_native_shapes(config), tensors), warnings


def validate_native_eagle3(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> list[str]:
    """Problems with a native EAGLE-3 export (empty = loadable by SGLang and vLLM); see `check_native_eagle3`."""
    return check_native_eagle3(config, tensors)[0]


# ---- export ------------------------------------------------------------------------------------------------
def eagle3_serve_commands(
    target: str, draft: str, num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS
) -> dict[str, str]:
    """Commands that serve `target` with this drafter; SGLang's draft-token count includes the root (k + 1)."""
    t, d, k = shlex.quote(target), shlex.quote(draft), num_speculative_tokens
    return {
        "vLLM": vllm_serve(target, METHOD, draft, k),
        "SGLang": (
            f"python -m sglang.launch_server --model {t} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {d} --speculative-num-steps {k} --speculative-eagle-topk 1 "
            f"--speculative-num-draft-tokens {k + 1}"
        ),
    }


def serve_commands_from_config(config: dict[str, Any], draft: str) -> dict[str, str]:
    """The serve commands of an exported native folder's config.json (push re-renders its card with them)."""
    return eagle3_serve_commands((config.get("draftsmith") or {}).get("target") or "TARGET", draft)


def native_files(source: ExportSource) -> FormatFiles:
    """The native layout of an EAGLE-3 checkpoint: its config, the weights under NATIVE_KEY_MAP, the card rows."""
    cfg = source.config
    on = [flag for flag, value in cfg.variants().items() if value]
    if on:
        raise FormatNotApplicable(
            f"{source.ckpt}: this drafter was trained with {', '.join(f'eagle3.{f}=true' for f in on)}, which "
            f"SGLang's {ARCHITECTURE} does not implement (it would serve wrong drafts): export --format speculators "
            "for vLLM, or train with those keys false for SGLang")
    try:
        config = native_config(cfg, step=source.step)
    except ValueError as e:  # aux ids with no SGLang form
        raise ExportError(f"{source.ckpt / CONFIG_FILE}: {e}") from None
    return FormatFiles(
        config=config,
        tensors=source.tensors(NATIVE_KEY_MAP),
        summary={
            "architecture": ARCHITECTURE,
            "draft layers": 1,
            "hidden_size": cfg.hidden_size,
            "target_hidden_size": cfg.target_hidden_size,
            "draft_vocab_size": f"{cfg.draft_vocab_size} of {cfg.vocab_size}",
        },
        aux_layer_ids=[
            ("capture: residual entering layer k = HF `output_hidden_states[k]` (vLLM)", AUX_IDS_KEY,
             config[AUX_IDS_KEY]),
            ("output of layer i (SGLang)", f"eagle_config.{AUX_IDS_KEY}", config["eagle_config"][AUX_IDS_KEY]),
        ],
        serve_commands=eagle3_serve_commands(source.target, source.draft),
    )


NATIVE_EXPORT = FormatExport(name="native EAGLE-3", method=METHOD, config_class=Eagle3Config, title="EAGLE-3",
                             tags=TAGS, build=native_files, check=check_native_eagle3)
export_native_eagle3 = NATIVE_EXPORT.write  # (checkpoint, out_dir, *, overwrite, dtype) -> ExportResult
