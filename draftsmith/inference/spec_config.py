"""The speculative config: the same dict vLLM's `--speculative-config` takes, parsed strictly.

One JSON string works unchanged for `vllm serve`, for vllm-ascend and for `draftsmith generate`, so a drafter
is evaluated here with exactly the settings it will be served with. Keys vLLM knows that cannot change the
output of this runtime (parallelism, memory, kernels) are accepted and ignored; anything else unknown is an
error with a did-you-mean, because a misspelled key silently falling back to a default wastes a benchmark.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith import device as dev
from draftsmith.inference.hybrid import SuffixHybridProposer
from draftsmith.inference.ngram import NgramProposer
from draftsmith.inference.suffix import SUFFIX_DEFAULTS, SuffixProposer
from draftsmith.models import registry
from draftsmith.models.spec import resolve
from draftsmith.runtime.tree import TreeError, parse_token_tree

# The runtime's own proposers, which need no drafter; every drafter method comes from models/registry.py. Each
# class has `from_config(spec, target) -> Proposer`: adding a method is a spec or a row here, never a branch in the
# runtime.
MODEL_FREE_PROPOSERS = {
    "ngram": NgramProposer,
    "suffix": SuffixProposer,
}
# vLLM methods draftsmith will run, not yet, and why: refused rather than run with another method's code.
RESERVED_METHODS: dict[str, str] = {}


def available_methods() -> tuple[str, ...]:
    return (*registry.methods(), *MODEL_FREE_PROPOSERS)


def scored_methods() -> tuple[str, ...]:
    """Methods whose proposers draft from per-token scores: they can draft trees and sample their drafts."""
    return tuple(spec.method for spec in registry.SPECS if spec.scored_drafts)


# vLLM keys that do not change which tokens come out of this runtime.
IGNORED_KEYS = frozenset({
    "max_model_len", "enforce_eager", "revision", "quantization", "attention_backend", "kv_cache_dtype",
    "moe_backend",
})
# vLLM keys that would change the output and that draftsmith does not implement yet.
UNSUPPORTED_KEYS = frozenset({
    "rejection_sample_method", "enable_adaptive_verification", "dspark_draft_topk",
    "parallel_drafting", "num_speculative_tokens_per_batch_size", "synthetic_acceptance_rates",
    "synthetic_acceptance_length", "n_predict",
})
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's value for both bounds when neither is given
# Keys people write for vLLM's static tree that vLLM does not read.
TREE_KEY_ALIASES = ("spec_token_tree", "token_tree", "tree")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")  # vLLM's draft_sample_method values; greedy is its default
DYNAMIC_TREE_KEYS = ("depth", "top_k")
HYBRID_KEYS = ("min_score",)
NPU_MAX_TOKENS_PER_ROUND = 16  # vllm-ascend: npu_fused_infer_attention_score verifies at most 16 tokens


class SpecConfigError(ValueError):
    """A speculative config that cannot be run; the message names the key and the fix."""


@dataclass
class SpecConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None  # drafter checkpoint (eagle3, dflash, mtp)
    prompt_lookup_max: int | None = None  # ngram: longest suffix n-gram tried
    prompt_lookup_min: int | None = None  # ngram: shortest suffix n-gram tried
    suffix_decoding_max_tree_depth: int | None = None  # suffix: trie depth, caps match + draft length
    suffix_decoding_max_cached_requests: int | None = None  # suffix: outputs kept in the global trie (0: none)
    suffix_decoding_max_spec_factor: float | None = None  # suffix: draft length <= factor * match length
    suffix_decoding_min_token_prob: float | None = None  # suffix: stop below this running probability
    draft_sample_method: str | None = None  # "greedy" (drafts count as one-hot) or "probabilistic"; None = greedy
    speculative_token_tree: str | None = None  # vLLM's static tree, paths of child ranks: "[(0,), (1,), (0, 0)]"
    dynamic_tree: dict[str, int] | None = None  # EAGLE-2 tree {"depth": d, "top_k": k}; nodes kept = k_spec
    suffix_hybrid: dict[str, float] | None = None  # {"min_score": s}: suffix drafts where they score >= s
    # vLLM's and vllm-ascend's deployment keys, checked and kept so that `draftsmith eval` recommends them back: the
    # drafter's tensor-parallel size (vLLM: 1 or the target's; draftsmith's runtime is one device, so 1) and
    # disable_padded_drafter_batch (how vLLM batches drafter inputs; no token changes)
    draft_tensor_parallel_size: int | None = None
    disable_padded_drafter_batch: bool | None = None
    # the method's own keys (its spec's runtime_keys, e.g. DSpark's confidence_threshold), checked
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        flat = {k: v for k, v in dataclasses.asdict(self).items() if v is not None and k != "options"}
        return {**flat, **self.options}


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecConfigError(f"speculative config: {key} must be an integer > 0, got {value!r}")
    return value


def _deployment_options(raw: Mapping[str, Any]) -> dict[str, Any]:
    """draft_tensor_parallel_size and disable_padded_drafter_batch, when given (null: not given, vLLM's default)."""
    opts: dict[str, Any] = {}
    if raw.get("draft_tensor_parallel_size") is not None:
        size = _positive_int("draft_tensor_parallel_size", raw["draft_tensor_parallel_size"])
        if size != 1:
            raise SpecConfigError(f"speculative config: draft_tensor_parallel_size {size}: draftsmith's runtime runs "
                                  "the drafter on one device (vLLM and vllm-ascend take 1 or the target's "
                                  "tensor-parallel size); set it to 1 to measure here, or drop it")
        opts["draft_tensor_parallel_size"] = size
    if raw.get("disable_padded_drafter_batch") is not None:
        flag = raw["disable_padded_drafter_batch"]
        if not isinstance(flag, bool):
            raise SpecConfigError(f"speculative config: disable_padded_drafter_batch must be true or false, "
                                  f"got {flag!r}")
        opts["disable_padded_drafter_batch"] = flag
    return opts


def _check_method(method: Any) -> str:
    """The method's canonical name: a registry method (or an engine's other name for it, such as vLLM's
    deepseek_mtp for mtp) or a model-free proposer."""
    available = available_methods()
    if method is None:
        raise SpecConfigError(f"speculative config: 'method' is required (one of {', '.join(available)})")
    if method in RESERVED_METHODS:
        raise SpecConfigError(
            f"speculative config: method {method!r} is not available yet in draftsmith's runtime: "
            f"{RESERVED_METHODS[method]} (available: {', '.join(available)})"
        )
    if method in MODEL_FREE_PROPOSERS:
        return method
    spec = registry.find(str(method))
    if spec is None:
        close = difflib.get_close_matches(str(method), available + tuple(RESERVED_METHODS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise SpecConfigError(f"speculative config: unknown method {method!r}{hint}; available: {', '.join(available)}")
    return spec.method


def _prompt_lookup_bounds(raw: Mapping[str, Any]) -> tuple[int, int]:
    """vLLM's rules (vllm/config/speculative.py): neither given -> both 5; one given -> the other equals it."""
    low, high = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
    if low is None and high is None:
        return DEFAULT_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP
    low = _positive_int("prompt_lookup_min", low if low is not None else high)
    high = _positive_int("prompt_lookup_max", high if high is not None else low)
    if low > high:
        raise SpecConfigError(
            f"speculative config: prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})"
        )
    return low, high


def _suffix_options(raw: Mapping[str, Any]) -> dict[str, Any]:
    """suffix_decoding_* with vLLM's defaults and its range checks: depth >= 1, requests >= 0, factor >= 0,
    probability in [0, 1]."""
    opts = {key: raw.get(key, default) for key, default in SUFFIX_DEFAULTS.items()}
    opts["suffix_decoding_max_tree_depth"] = _positive_int(
        "suffix_decoding_max_tree_depth", opts["suffix_decoding_max_tree_depth"])
    requests = opts["suffix_decoding_max_cached_requests"]
    if isinstance(requests, bool) or not isinstance(requests, int) or requests < 0:
        raise SpecConfigError(f"speculative config: suffix_decoding_max_cached_requests must be an integer >= 0, "
                              f"got {requests!r}")
    for key, high in (("suffix_decoding_max_spec_factor", math.inf), ("suffix_decoding_min_token_prob", 1.0)):
        value = opts[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= high:
            bound = ">= 0" if high == math.inf else f"in [0, {high:g}]"
            raise SpecConfigError(f"speculative config: {key} must be a number {bound}, got {value!r}")
        opts[key] = float(value)
    return opts


def _check_object(name: str, value: Any, known: tuple[str, ...], example: str) -> None:
    """A nested object of the config (dynamic_tree, suffix_hybrid): a mapping with known keys only."""
    if not isinstance(value, Mapping):
        raise SpecConfigError(f"speculative config: {name} must be an object like {example}, got {value!r}")
    for key in value:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise SpecConfigError(f"speculative config: unknown key {name}.{key}{hint}; known: {', '.join(known)}")


def _tree_options(raw: Mapping[str, Any], method: str) -> dict[str, Any]:
    """draft_sample_method, speculative_token_tree and dynamic_tree, checked against the method and each other.

    With a tree, num_speculative_tokens counts the tree's nodes (the tokens verified per step), as in vLLM:
    a static tree fills it in when it is missing and must match it otherwise; a dynamic tree keeps that many of
    its best nodes, so it must be at most the nodes the expansion generates (top_k + (depth-1) * top_k^2).
    """
    opts: dict[str, Any] = {}
    sample = raw.get("draft_sample_method")
    if sample is not None:
        if sample not in DRAFT_SAMPLE_METHODS:
            raise SpecConfigError(f"speculative config: draft_sample_method must be one of "
                                  f"{', '.join(DRAFT_SAMPLE_METHODS)}, got {sample!r}")
        if sample == "probabilistic" and method not in scored_methods():
            raise SpecConfigError(f"speculative config: draft_sample_method 'probabilistic' needs a drafter with "
                                  f"draft distributions ({', '.join(scored_methods())}); {method!r} drafts are "
                                  "one-hot")
        opts["draft_sample_method"] = sample
    static, dynamic = raw.get("speculative_token_tree"), raw.get("dynamic_tree")
    if static is None and dynamic is None:
        return opts
    if method not in scored_methods():
        raise SpecConfigError(f"speculative config: draft trees need a drafter with per-token scores "
                              f"({', '.join(scored_methods())}), not {method!r}; drop the tree key")
    if static is not None and dynamic is not None:
        raise SpecConfigError("speculative config: give speculative_token_tree (static) or dynamic_tree, not both")
    if sample == "probabilistic":
        raise SpecConfigError("speculative config: draft trees draft top-k children (one-hot); "
                              "use draft_sample_method 'greedy' or drop it")
    k = raw.get("num_speculative_tokens")
    if static is not None:
        try:
            paths = parse_token_tree(static)
        except TreeError as e:
            raise SpecConfigError(f"speculative config: {e}") from None
        if k is not None and k != len(paths):
            raise SpecConfigError(f"speculative config: num_speculative_tokens ({k}) must equal the number of "
                                  f"nodes of speculative_token_tree ({len(paths)}), as in vLLM")
        opts["speculative_token_tree"] = str(paths)
        opts["num_speculative_tokens"] = len(paths)
        return opts
    _check_object("dynamic_tree", dynamic, DYNAMIC_TREE_KEYS, '{"depth": 6, "top_k": 10}')
    missing = [key for key in DYNAMIC_TREE_KEYS if key not in dynamic]
    if missing:
        raise SpecConfigError(f"speculative config: dynamic_tree needs {', '.join(missing)}")
    depth = _positive_int("dynamic_tree.depth", dynamic["depth"])
    top_k = _positive_int("dynamic_tree.top_k", dynamic["top_k"])
    if k is None:
        raise SpecConfigError("speculative config: a dynamic_tree needs 'num_speculative_tokens', the number of "
                              "tree nodes verified per step (EAGLE's total_token - 1)")
    generated = top_k + (depth - 1) * top_k * top_k
    if isinstance(k, int) and not isinstance(k, bool) and k > generated:
        raise SpecConfigError(f"speculative config: num_speculative_tokens ({k}) exceeds the {generated} nodes a "
                              f"dynamic_tree of depth {depth} and top_k {top_k} generates; lower it or grow the tree")
    opts["dynamic_tree"] = {"depth": depth, "top_k": top_k}
    return opts


def _hybrid_options(raw: Mapping[str, Any], method: str, tree: Mapping[str, Any]) -> dict[str, Any]:
    """suffix_hybrid (draftsmith's, not vLLM's): a drafter's greedy chain, replaced per step and row by the suffix
    draft when that draft's score (its expected accepted length by the suffix counts) reaches `min_score`. The
    suffix_decoding_* keys then set its suffix half."""
    hybrid = raw.get("suffix_hybrid")
    if hybrid is None:
        return {}
    if method not in scored_methods():
        raise SpecConfigError(f"speculative config: suffix_hybrid pairs suffix decoding with a drafter "
                              f"({', '.join(scored_methods())}), not {method!r}")
    if tree or raw.get("draft_sample_method") == "probabilistic":
        raise SpecConfigError("speculative config: suffix_hybrid drafts greedy chains; drop the tree or "
                              "draft_sample_method 'probabilistic'")
    _check_object("suffix_hybrid", hybrid, HYBRID_KEYS, '{"min_score": 2.0}')
    score = hybrid.get("min_score")
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not score > 0:
        raise SpecConfigError(f"speculative config: suffix_hybrid.min_score must be a number > 0, got {score!r}")
    given = {key: value for key, value in _suffix_options(raw).items() if key in raw}  # defaults stay implicit
    return {"suffix_hybrid": {"min_score": float(score)}, **given}


def parse_spec_config(text_or_dict: str | Mapping[str, Any], device_type: str | None = None) -> SpecConfig:
    """Parse a vLLM speculative config given as a JSON string or a dict.

    `device_type` is where the config will run ("cuda", "npu", "cpu"; default: the accelerator found here); on an
    NPU, vllm-ascend's limit of num_speculative_tokens + 1 <= 16 verified tokens per round is enforced.
    """
    raw: Any = text_or_dict
    if isinstance(text_or_dict, str):
        try:
            raw = json.loads(text_or_dict)
        except json.JSONDecodeError as e:
            raise SpecConfigError(f"speculative config: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(raw, Mapping):
        raise SpecConfigError(f"speculative config: expected a JSON object, got {type(raw).__name__}")

    fields = {f.name for f in dataclasses.fields(SpecConfig)} - {"options"}
    method_keys = {key: spec for spec in registry.SPECS for key in spec.runtime_keys}
    for key in raw:
        if key in fields or key in IGNORED_KEYS or key in method_keys:
            continue
        if key in TREE_KEY_ALIASES:
            raise SpecConfigError(f"speculative config: key {key!r} is not supported; vLLM's key for a static tree "
                                  "is 'speculative_token_tree' (draftsmith's dynamic EAGLE-2 tree: 'dynamic_tree')")
        if key in UNSUPPORTED_KEYS:
            raise SpecConfigError(f"speculative config: key {key!r} is not supported by draftsmith's runtime yet")
        close = difflib.get_close_matches(str(key), sorted(fields | IGNORED_KEYS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise SpecConfigError(f"speculative config: unknown key {key!r}{hint}")

    method = _check_method(raw.get("method"))
    options = {}
    for key, owner in method_keys.items():
        if key not in raw:
            continue
        if owner.method != method:
            raise SpecConfigError(f"speculative config: {key} is {owner.title}'s key, not {method!r}'s")
        try:
            options[key] = owner.runtime_keys[key](raw[key])
        except ValueError as e:
            raise SpecConfigError(f"speculative config: {e}") from None
    # suffix_decoding_* are accepted for every method, as vLLM does, but only mean something for suffix.
    suffix = _suffix_options(raw) if method == "suffix" else {}
    if raw.get("num_speculative_tokens") is None and suffix:  # vLLM: suffix drafts up to the tree depth
        raw = {**raw, "num_speculative_tokens": suffix["suffix_decoding_max_tree_depth"]}
    tree = _tree_options(raw, method)
    if "num_speculative_tokens" in tree:  # a static tree sets the node count
        raw = {**raw, "num_speculative_tokens": tree.pop("num_speculative_tokens")}
    hybrid = _hybrid_options(raw, method, tree)
    if raw.get("num_speculative_tokens") is None:
        raise SpecConfigError("speculative config: 'num_speculative_tokens' is required (an integer > 0)")
    k = _positive_int("num_speculative_tokens", raw["num_speculative_tokens"])
    model = raw.get("model")
    if model is not None and not isinstance(model, str):
        raise SpecConfigError(f"speculative config: model must be a path string, got {model!r}")
    spec = registry.find(method)
    if spec is not None and spec.model_required and not model:
        raise SpecConfigError(f"speculative config: method {method!r} needs 'model', the drafter checkpoint path")
    # prompt_lookup_* are accepted for every method, as vLLM does, but only mean something for ngram.
    low, high = _prompt_lookup_bounds(raw) if method == "ngram" else (None, None)

    kind = device_type if device_type is not None else dev.accelerator_type()
    if kind == "npu" and k + 1 > NPU_MAX_TOKENS_PER_ROUND:
        raise SpecConfigError(
            f"speculative config: num_speculative_tokens={k} is too large on an Ascend NPU: vllm-ascend verifies at "
            f"most {NPU_MAX_TOKENS_PER_ROUND} tokens per round (k + 1 <= {NPU_MAX_TOKENS_PER_ROUND}); "
            f"use num_speculative_tokens <= {NPU_MAX_TOKENS_PER_ROUND - 1}"
        )
    return SpecConfig(method=method, num_speculative_tokens=k, model=model, prompt_lookup_max=high,
                      prompt_lookup_min=low, **suffix, **tree, **hybrid, **_deployment_options(raw), options=options)


def _served_drafter(spec: SpecConfig):
    """The registry spec an engine method serves under its own name, chosen by the model's config.json (vLLM's
    `mtp` with a Gemma 4 assistant: `registry.served_as`); None when the model is no such drafter. The parsed config
    keeps the engine's method, so `draftsmith eval` recommends what vLLM takes."""
    if not spec.model:
        return None
    path = Path(spec.model) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, json.JSONDecodeError):
        return None  # the method's own loader reports a broken folder
    return registry.served_as(spec.method, config) if isinstance(config, dict) else None


def build_proposer(spec: SpecConfig, target):
    """The proposer for `spec.method` (its registry spec's `proposer`, or a model-free one), built with
    `from_config(spec, target)`; with `suffix_hybrid`, wrapped with a suffix proposer."""
    drafter = _served_drafter(spec) or registry.find(spec.method)
    if drafter is not None:
        try:
            cls = resolve(drafter.proposer)
        except (ImportError, AttributeError) as e:
            raise SpecConfigError(f"speculative config: method {spec.method!r}: cannot load {drafter.proposer} "
                                  f"({e})") from None
    elif spec.method in MODEL_FREE_PROPOSERS:
        cls = MODEL_FREE_PROPOSERS[spec.method]
    else:
        raise SpecConfigError(f"speculative config: no proposer for method {spec.method!r}")
    proposer = cls.from_config(spec, target)
    if spec.suffix_hybrid is not None:
        proposer = SuffixHybridProposer(proposer, SuffixProposer.from_config(spec), spec.suffix_hybrid["min_score"])
    return proposer
