"""Acceptance and speed of speculative configs over prompt sets, side by side with plain decoding.

Every config runs over the same prompts as one plain baseline in the same process, so speedups are ratios
measured together; at temperature 0 each output is compared with the baseline's token for token
(`lossless_mismatches`), which must be 0 in float32: greedy speculative decoding may not change a single token.

`run_eval` measures one prompt set; `run_sweep` runs every config on several datasets, and
`expand_spec_configs` turns configs without `num_speculative_tokens` into one config per proposal length, so
`draftsmith eval` compares methods and lengths in one process (report.py turns the result into a table, plots and
a recommendation).
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import shlex
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from draftsmith import device as dev
from draftsmith.data.conversations import iter_prompts
from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.spec_config import SpecConfig, SpecConfigError, build_proposer, parse_spec_config
from draftsmith.models.checkpoint import (
    CONFIG_FILE,
    EVAL_FILE,
    CheckpointError,
    draftsmith_version,
    read_json,
    resolve_checkpoint,
    write_json_atomic,
)
from draftsmith.models.target import context_length_of, prompt_overflow
from draftsmith.runtime.metrics import SpecDecodingMetrics

WARMUP_TOKENS = 8  # each generator first runs one short untimed generation: start-up costs stay out of tok/s
TRUNCATE_PROMPTS_FLAG = "--truncate-prompts"


class EvalError(ValueError):
    """A prompt file or setting the evaluation cannot use."""


def render_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of one user turn, through the chat template (with the assistant header) when there is one."""
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]  # the template writes BOS itself
    return tokenizer(text)["input_ids"]


def eos_token_ids(target, tokenizer) -> set[int]:
    """Every id that ends a reply: the generation config's (often several) and the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(target.model, "generation_config", None), target.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return ids


SKIP_MALFORMED_FLAG = "--skip-malformed"


def _first_user_turns(path: Path, limit: int | None, skip_malformed: bool = False) -> list[tuple[str, str]]:
    """The first user turn of each record (data/conversations.py: `iter_prompts` reads MT-bench `turns`, HumanEval
    `prompt`, `question`, `instruction` and conversation records); a record that is no prompt stops the run with its
    line, or is skipped and counted with `skip_malformed`. Each as ("path:line", text)."""
    texts: list[tuple[str, str]] = []
    skipped: Counter = Counter()
    with contextlib.closing(iter_prompts(path)) as records:
        for where, text, reason in records:
            if limit is not None and len(texts) >= limit:
                break
            if text is None:
                if not skip_malformed:
                    raise EvalError(f"{where}: {reason} (pass {SKIP_MALFORMED_FLAG} to skip such records)")
                skipped[reason] += 1
                continue
            texts.append((where, text))
    if not texts:
        why = "; ".join(f"skipped {n}: {r}" for r, n in skipped.most_common()) or "empty file"
        raise EvalError(f"{path}: no prompts ({why})")
    if skipped:
        print(f"{path}: skipped {sum(skipped.values())} records that are no prompt "
              f"({', '.join(f'{n} {r}' for r, n in skipped.most_common())})", file=sys.stderr)
    return texts


@dataclass
class PromptRecord:
    where: str  # what names it in a message: "path:line", or "--prompt #2"
    text: str  # the user turn as written
    ids: list[int]  # rendered for generation (chat template and assistant header)


def read_prompts(path: str | Path, tokenizer, limit: int | None = None, skip_malformed: bool = False
                 ) -> list[PromptRecord]:
    """The first user turn of each record with its place in the file, rendered for generation; at most `limit`."""
    path = Path(path)
    if not path.is_file():
        raise EvalError(f"{path}: prompt file not found")
    if limit is not None and limit < 1:
        raise EvalError(f"number of prompts must be >= 1, got {limit}")
    return [PromptRecord(where, text, render_prompt(tokenizer, text))
            for where, text in _first_user_turns(path, limit, skip_malformed)]


def load_prompts(path: str | Path, tokenizer, limit: int | None = None, skip_malformed: bool = False
                 ) -> list[list[int]]:
    """The first user turn of each record, rendered for generation; at most `limit` prompts."""
    return [record.ids for record in read_prompts(path, tokenizer, limit, skip_malformed)]


def _first_words(text: str, length: int = 40) -> str:
    words = " ".join(text.split())
    return words if len(words) <= length else words[: length - 3].rstrip() + "..."


def fit_prompts(records: Sequence[PromptRecord], max_new_tokens: int, target_config, truncate: bool = False,
                label: str = "") -> list[list[int]]:
    """The ids of every prompt that fits the target's context with `max_new_tokens` (`target.prompt_overflow`,
    the rule generate, eval and regenerate share); the first that does not is refused in one line naming it, or,
    with `truncate`, every such prompt keeps its last (context - max_new_tokens) tokens, as vLLM's
    truncate_prompt_tokens keeps the end: the question's last words and the assistant header, which the answer
    continues. `label` names the prompt set ("--dataset NAME") in messages."""
    context = context_length_of(target_config)
    if context is not None and max_new_tokens >= context:
        raise EvalError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the target's context of "
                        f"{context} tokens: use --max-new-tokens <= {context - 1}")
    fitted, cut = [], 0
    for record in records:
        overflow = prompt_overflow(len(record.ids), max_new_tokens, target_config)
        if overflow is None:
            fitted.append(record.ids)
            continue
        keep = context - max_new_tokens
        if not truncate:
            where = f"{label}, {record.where}" if label else record.where
            raise EvalError(f"{where} ({_first_words(record.text)!r}): {overflow}: shorten it, lower "
                            f"--max-new-tokens, or pass {TRUNCATE_PROMPTS_FLAG} to keep its last {keep} tokens")
        fitted.append(record.ids[-keep:])
        cut += 1
    if cut:
        print(f"{label or 'prompts'}: cut {cut} prompt(s) to their last {context - max_new_tokens} tokens, which fit "
              f"the target's context of {context} with --max-new-tokens {max_new_tokens} ({TRUNCATE_PROMPTS_FLAG})",
              file=sys.stderr)
    return fitted


def name_datasets(entries: Sequence[str]) -> dict[str, Path]:
    """`--dataset` values, `PATH` or `NAME=PATH`, as {name: path}; every file must exist.

    A name defaults to the file's stem; stems that clash become "folder/stem" (mt_bench/question).
    """
    named: list[tuple[str | None, Path]] = []
    for entry in entries:
        name, sep, rest = entry.partition("=")
        if sep and name and "/" not in name and not Path(entry).is_file():
            named.append((name, Path(rest)))
        else:
            named.append((None, Path(entry)))
    for _, path in named:
        if not path.is_file():
            raise EvalError(f"--dataset {path}: file not found")
    stems = [p.stem for n, p in named if n is None]
    datasets: dict[str, Path] = {}
    for name, path in named:
        if name is None:
            name = path.stem if stems.count(path.stem) == 1 else f"{path.parent.name}/{path.stem}"
        if name in datasets:
            raise EvalError(f"--dataset {path}: the name {name!r} is taken; name it with NAME=PATH")
        datasets[name] = path
    return datasets


def expand_spec_configs(
    configs: Sequence[str | Mapping[str, Any]],
    num_speculative_tokens: Sequence[int] | None = None,
    device_type: str | None = None,
) -> list[SpecConfig]:
    """Parse every config up front (a bad key fails before a model is loaded) and expand the sweep.

    A config without `num_speculative_tokens` becomes one config per length in `num_speculative_tokens` when that
    list is given; one with it runs as given, and so does one with a static `speculative_token_tree` (whose node
    count is its k). Without a list, vLLM's rules apply (required, except suffix, which defaults to its tree depth,
    and a static tree). Duplicates are dropped, the order is kept.
    """
    if num_speculative_tokens is not None and (
        not num_speculative_tokens
        or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in num_speculative_tokens)
    ):
        raise SpecConfigError(f"--num-speculative-tokens: need integers >= 1, got {list(num_speculative_tokens)}")
    specs: list[SpecConfig] = []
    for i, given in enumerate(configs, 1):
        raw: Any = given
        if isinstance(given, str):
            try:
                raw = json.loads(given)
            except json.JSONDecodeError:
                pass  # parse_spec_config names the JSON error
        swept = (isinstance(raw, Mapping) and raw.get("num_speculative_tokens") is None
                 and raw.get("speculative_token_tree") is None and num_speculative_tokens)
        for k in num_speculative_tokens if swept else [None]:
            try:
                spec = parse_spec_config(raw if k is None else {**raw, "num_speculative_tokens": k}, device_type)
            except SpecConfigError as e:
                hint = (" (or list lengths to sweep with --num-speculative-tokens)"
                        if "'num_speculative_tokens' is required" in str(e) else "")
                where = f" [--speculative-config #{i}]" if len(configs) > 1 else ""
                raise SpecConfigError(f"{e}{hint}{where}") from None
            if spec not in specs:
                specs.append(spec)
    return specs


def series_labels(spec_configs: Sequence[SpecConfig]) -> dict[str, str]:
    """A legend label per series (a config minus its length, keyed by `series_key`): the method name, plus the
    settings that tell apart several series of one method, e.g. "ngram prompt_lookup_max=2"."""
    series: dict[str, dict[str, Any]] = {}
    for spec in spec_configs:
        settings = {k: v for k, v in spec.to_dict().items() if k != "num_speculative_tokens"}
        series.setdefault(series_key(spec.to_dict()), settings)
    labels = {}
    for key, settings in series.items():
        siblings = [s for s in series.values() if s["method"] == settings["method"]]
        differing = [k for k in settings if k != "method" and len({json.dumps(s.get(k)) for s in siblings}) > 1]
        shown = [f"{k}={Path(v).name if k == 'model' else v}" for k, v in settings.items() if k in differing]
        labels[key] = " ".join([settings["method"], *shown])
    return labels


def series_key(spec_dict: Mapping[str, Any]) -> str:
    """Identity of a config's series: every setting but `num_speculative_tokens`, as canonical JSON."""
    return json.dumps({k: v for k, v in spec_dict.items() if k != "num_speculative_tokens"}, sort_keys=True)


def _generator(target, spec: SpecConfig | None) -> SpeculativeGenerator:
    if spec is None:
        return SpeculativeGenerator(target, None, 0)
    return SpeculativeGenerator(target, build_proposer(spec, target), spec.num_speculative_tokens)


def _generate(generator: SpeculativeGenerator, batch: list[list[int]], max_new_tokens: int, eos, sampling):
    """One request alone (the graphed single-request path), or a batch served together."""
    if len(batch) == 1:
        return [generator.generate(torch.tensor([batch[0]]), max_new_tokens, eos, sampling=sampling)]
    return generator.generate_batch(batch, max_new_tokens, eos, sampling=sampling)


def _measure(target, spec: SpecConfig | None, prompts, max_new_tokens, eos, desc, progress, sampling,
             batch_size: int = 1):
    """Outputs, merged metrics and timing of one config (None: plain decoding) over `prompts`, served
    `batch_size` at a time (rows of different lengths finishing at different steps).

    The untimed warm-up runs on a throwaway generator, and the timed run on a fresh one, so what a proposer
    learns across requests (suffix's global trie) comes from the measured prompts alone, in order. The warm-up is
    long enough to draft as wide as the timed run (`draft_width`), so it records the same graphs. A batch's wall
    time is counted once: tokens/s is the throughput at that concurrency.
    """
    warmup = _generator(target, spec)
    _generate(warmup, prompts[:batch_size], min(max_new_tokens, max(WARMUP_TOKENS, warmup.k)), eos, sampling)
    generator = _generator(target, spec)
    outputs, seconds, steps = [], 0.0, 0
    metrics = SpecDecodingMetrics(generator.draft_width(max_new_tokens))
    batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    for batch in tqdm(batches, desc=desc, disable=not progress, leave=False):
        results = _generate(generator, batch, max_new_tokens, eos, sampling)
        for result in results:
            outputs.append(result.token_ids)
            metrics = metrics.merge(result.metrics)
            steps += result.num_target_steps
        seconds += results[0].seconds  # the whole batch's wall time, the same in every row
    tokens = sum(len(o) for o in outputs)
    return outputs, metrics, {"tokens": tokens, "seconds": seconds, "num_target_steps": steps,
                              "tokens_per_second": tokens / seconds if seconds else math.nan}


def run_eval(target, tokenizer, prompts: list[list[int]], spec_configs: list[SpecConfig], max_new_tokens: int,
             progress: bool = True, sampling=None, desc: str = "",
             on_result: Callable[[dict, dict], None] | None = None, batch_size: int = 1) -> dict[str, Any]:
    """Plain decoding once, then every config over the same prompts; returns a JSON-ready dict.

    `sampling` (a `SamplingParams`; None = greedy) applies to the baseline and every config alike. Outputs are
    compared with the baseline's only at temperature 0, where they must be equal. `on_result(baseline, row)` is
    called after each config, so a caller can save what a long sweep has measured so far. With `batch_size` > 1
    the baseline and every config serve the prompts that many at a time, so speedups compare equal concurrency.
    """
    if not prompts:
        raise EvalError("no prompts to evaluate")
    if batch_size < 1:
        raise EvalError(f"batch size must be >= 1, got {batch_size}")
    temperature = float(getattr(sampling, "temperature", 0.0))
    eos = eos_token_ids(target, tokenizer)
    prefix = f"{desc} " if desc else ""
    baseline_outputs, _, baseline = _measure(target, None, prompts, max_new_tokens, eos, f"{prefix}plain",
                                             progress, sampling, batch_size)
    results = []
    labels = series_labels(spec_configs)
    for spec in spec_configs:
        label = f"{prefix}{spec.method} k={spec.num_speculative_tokens}"
        outputs, metrics, timing = _measure(target, spec, prompts, max_new_tokens, eos, label, progress, sampling,
                                            batch_size)
        row = {
            "spec_config": spec.to_dict(),
            "method": spec.method,
            "label": labels[series_key(spec.to_dict())],
            "num_speculative_tokens": spec.num_speculative_tokens,
            "metrics": metrics.to_dict(),
            **timing,
            "speedup": timing["tokens_per_second"] / baseline["tokens_per_second"],
        }
        if temperature == 0.0:
            mismatched = [i for i, (a, b) in enumerate(zip(outputs, baseline_outputs)) if a != b]
            row.update(lossless_mismatches=len(mismatched), mismatched_prompts=mismatched)
        results.append(row)
        if on_result is not None:
            on_result(baseline, row)
    result = {
        "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "batch_size": batch_size,
        "temperature": temperature,
        "baseline": baseline,
        "results": results,
    }
    if sampling is not None and hasattr(sampling, "to_dict"):
        result["sampling"] = sampling.to_dict()
    return result


def run_sweep(target, tokenizer, datasets: Mapping[str, list[list[int]]], spec_configs: list[SpecConfig],
              max_new_tokens: int, progress: bool = True, sampling=None,
              dataset_paths: Mapping[str, str] | None = None,
              on_progress: Callable[[dict], None] | None = None, batch_size: int = 1) -> dict[str, Any]:
    """`run_eval` on every dataset; one JSON-ready dict with a flat `results` list (each row names its dataset).

    Shape: {max_new_tokens, temperature, datasets: {name: {path, num_prompts, baseline}}, results: [row, ...],
    complete}, a row as in `run_eval` plus "dataset". `on_progress(sweep)` sees the sweep after every config,
    with complete=False until the last one.
    """
    if not datasets:
        raise EvalError("no dataset to evaluate")
    if not spec_configs:
        raise EvalError("no speculative config to evaluate")
    sweep: dict[str, Any] = {"max_new_tokens": max_new_tokens, "batch_size": batch_size,
                             "temperature": float(getattr(sampling, "temperature", 0.0)), "datasets": {},
                             "results": [], "complete": False}
    if sampling is not None and hasattr(sampling, "to_dict"):
        sweep["sampling"] = sampling.to_dict()
    for name, prompts in datasets.items():
        def record(baseline, row, name=name, prompts=prompts):
            sweep["datasets"][name] = {"path": (dataset_paths or {}).get(name), "num_prompts": len(prompts),
                                       "baseline": baseline}
            sweep["results"].append({"dataset": name, **row})
            if on_progress is not None:
                on_progress(sweep)

        run_eval(target, tokenizer, prompts, spec_configs, max_new_tokens, progress, sampling, desc=name,
                 on_result=record, batch_size=batch_size)
    sweep["complete"] = True
    return sweep


def format_table(result: dict[str, Any], mark: dict[str, Any] | None = None) -> str:
    """One row per config (plus the plain baseline): method, k, tau, per-position acceptance, tok/s, speedup.

    `result` is a `run_eval` result, or one dataset's slice of a sweep; the row with `mark`'s config gets a "*".
    """
    header = ["method", "k", "mean acc. len", "per-position acceptance", "tok/s", "speedup", "lossless"]
    base = result["baseline"]
    rows = [["plain", "-", "-", "-", f"{base['tokens_per_second']:.1f}", "1.00x", "-"]]
    for r in result["results"]:
        m = r["metrics"]
        tau = m["mean_acceptance_length"]
        positions = m["per_position_acceptance"]
        tree = r["spec_config"].get("dynamic_tree")
        if tree:  # a tree of k nodes is only `depth` deep: deeper positions are never drafted
            positions = positions[: tree["depth"]]
        per_pos = " ".join("-" if p is None else f"{p:.2f}" for p in positions)
        if "lossless_mismatches" not in r:
            lossless = "n/a"  # sampled outputs differ run to run; the distribution tests cover losslessness
        else:
            lossless = "yes" if r["lossless_mismatches"] == 0 else f"NO ({r['lossless_mismatches']} differ)"
        star = "*" if mark is not None and r["spec_config"] == mark["spec_config"] else ""
        rows.append([r.get("label", r["method"]) + star, str(r["num_speculative_tokens"]),
                     "-" if tau is None else f"{tau:.2f}", per_pos, f"{r['tokens_per_second']:.1f}",
                     f"{r['speedup']:.2f}x", lossless])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


def run_info(target, argv: list[str] | None = None) -> dict[str, Any]:
    """Where and how a result was measured: command, hardware, versions, dtype."""
    return {
        "command": shlex.join(argv if argv is not None else sys.argv),  # quoted: pastes back into a shell
        "hardware": dev.device_name(target.device),
        "device": str(target.device),
        "dtype": str(target.dtype).removeprefix("torch."),
        "target": str(getattr(target, "name_or_path", "")),
        "python": platform.python_version(),
        "versions": {**{name: _version(name) for name in ("torch", "transformers")},
                     "draftsmith": draftsmith_version()},  # also from a source tree that is not installed
    }


def write_eval_json(result: dict[str, Any], path: str | Path, target, argv: list[str] | None = None) -> Path:
    """Write `result` plus `run_info` atomically (temporary file, then rename) and return the path."""
    path = Path(path)
    write_json_atomic({**run_info(target, argv), **result}, path)
    return path


def training_checkpoint(model: str | None) -> Path | None:
    """The draftsmith training checkpoint that a config's `model` names (a checkpoint folder, or an output_dir
    meaning its newest checkpoint, as the proposers resolve it), or None for anything else: a Hub id (whose cache is
    not ours to write), an exported or published drafter (its config.json has "architectures", not "method")."""
    if not model or not Path(model).is_dir():
        return None
    try:
        ckpt = resolve_checkpoint(model)
        config = read_json(ckpt / CONFIG_FILE)
    except CheckpointError:
        return None
    return ckpt if isinstance(config, dict) and "method" in config and "architectures" not in config else None


def drafter_eval_results(sweep: Mapping[str, Any]) -> dict[Path, dict[str, Any]]:
    """{checkpoint folder: its slice of a `run_sweep` result} for every config whose drafter is a training
    checkpoint: what `draftsmith eval` leaves there as eval.json, for the model card's acceptance table
    (models/model_card.acceptance_table, read by every exporter through checkpoint.read_card_inputs).

    A slice keeps the sweep's settings and datasets, only this drafter's rows (other methods would read as its own
    in the card) and no recommendations (they may name other configs); its top-level `num_speculative_tokens` is
    the k of its fastest row, which the speculators export writes as vLLM's default proposal length.
    """
    rows_by_ckpt: dict[Path, list[dict[str, Any]]] = {}
    for row in sweep["results"]:
        ckpt = training_checkpoint(row["spec_config"].get("model"))
        if ckpt is not None:
            rows_by_ckpt.setdefault(ckpt.resolve(), []).append(row)  # one folder however the configs spell it
    settings = {k: v for k, v in sweep.items() if k not in ("results", "recommendations")}
    return {
        ckpt: {**settings, "num_speculative_tokens": max(rows, key=lambda r: r["speedup"])["num_speculative_tokens"],
               "results": rows}
        for ckpt, rows in rows_by_ckpt.items()
    }
