"""Acceptance and speed of speculative configs over a prompt set, side by side with plain greedy decoding.

Every config runs over the same prompts as one plain greedy baseline in the same process, so speedups are
ratios measured together; each output is compared with the baseline's token for token (`lossless_mismatches`),
which must be 0 in float32: greedy speculative decoding may not change a single token.
"""

from __future__ import annotations

import json
import math
import platform
import shlex
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from draftsmith import device as dev
from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.metrics import SpecDecodingMetrics
from draftsmith.inference.spec_config import SpecConfig, build_proposer

WARMUP_TOKENS = 8  # each generator first runs one short untimed generation: start-up costs stay out of tok/s


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


def _first_user_turns(path: Path, limit: int | None) -> list[str]:
    """MT-bench `question.jsonl` (`turns[0]`) or conversation JSONL (first user message)."""
    with open(path, encoding="utf-8") as f:
        first = next((line for line in f if line.strip()), None)
    if first is None:
        raise EvalError(f"{path}: no prompts (empty file)")
    try:
        is_mt_bench = "turns" in json.loads(first)
    except (json.JSONDecodeError, TypeError):
        raise EvalError(f"{path}:1: expected one JSON object per line (MT-bench or conversation JSONL)") from None
    if not is_mt_bench:
        from draftsmith.data.conversations import load_conversations

        conversations, _ = load_conversations(str(path), format="jsonl", max_samples=limit)
        return [next(m["content"] for m in conv if m["role"] == "user") for conv in conversations]

    texts: list[str] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(texts) >= limit:
                break
            if not line.strip():
                continue
            try:
                turns = json.loads(line)["turns"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise EvalError(f"{path}:{lineno}: expected a JSON object with a 'turns' list") from None
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
                raise EvalError(f"{path}:{lineno}: 'turns' must be a non-empty list of strings")
            texts.append(turns[0])
    return texts


def load_prompts(path: str | Path, tokenizer, limit: int | None = None) -> list[list[int]]:
    """The first user turn of each record, rendered for generation; at most `limit` prompts."""
    path = Path(path)
    if not path.is_file():
        raise EvalError(f"{path}: prompt file not found")
    if limit is not None and limit < 1:
        raise EvalError(f"number of prompts must be >= 1, got {limit}")
    return [render_prompt(tokenizer, text) for text in _first_user_turns(path, limit)]


def _run(generator: SpeculativeGenerator, prompts, max_new_tokens, eos, desc, progress):
    generator.generate(torch.tensor([prompts[0]]), WARMUP_TOKENS, eos)
    outputs, metrics, seconds, steps = [], SpecDecodingMetrics(generator.k), 0.0, 0
    for ids in tqdm(prompts, desc=desc, disable=not progress, leave=False):
        result = generator.generate(torch.tensor([ids]), max_new_tokens, eos)
        outputs.append(result.token_ids)
        metrics = metrics.merge(result.metrics)
        seconds += result.seconds
        steps += result.num_target_steps
    tokens = sum(len(o) for o in outputs)
    return outputs, metrics, {"tokens": tokens, "seconds": seconds, "num_target_steps": steps,
                              "tokens_per_second": tokens / seconds if seconds else math.nan}


def run_eval(target, tokenizer, prompts: list[list[int]], spec_configs: list[SpecConfig], max_new_tokens: int,
             progress: bool = True) -> dict[str, Any]:
    """Plain greedy once, then every config over the same prompts; returns a JSON-ready dict."""
    if not prompts:
        raise EvalError("no prompts to evaluate")
    eos = eos_token_ids(target, tokenizer)
    plain = SpeculativeGenerator(target, None, 0)
    baseline_outputs, _, baseline = _run(plain, prompts, max_new_tokens, eos, "plain greedy", progress)

    results = []
    for spec in spec_configs:
        generator = SpeculativeGenerator(target, build_proposer(spec, target), spec.num_speculative_tokens)
        desc = f"{spec.method} k={spec.num_speculative_tokens}"
        outputs, metrics, timing = _run(generator, prompts, max_new_tokens, eos, desc, progress)
        mismatched = [i for i, (a, b) in enumerate(zip(outputs, baseline_outputs)) if a != b]
        results.append({
            "spec_config": spec.to_dict(),
            "method": spec.method,
            "num_speculative_tokens": spec.num_speculative_tokens,
            "metrics": metrics.to_dict(),
            **timing,
            "speedup": timing["tokens_per_second"] / baseline["tokens_per_second"],
            "lossless_mismatches": len(mismatched),
            "mismatched_prompts": mismatched,
        })
    return {
        "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "temperature": 0.0,
        "baseline": baseline,
        "results": results,
    }


def format_table(result: dict[str, Any]) -> str:
    """One row per config (plus the plain baseline): method, k, tau, per-position acceptance, tok/s, speedup."""
    header = ["method", "k", "mean acc. len", "per-position acceptance", "tok/s", "speedup", "lossless"]
    base = result["baseline"]
    rows = [["plain", "-", "-", "-", f"{base['tokens_per_second']:.1f}", "1.00x", "-"]]
    for r in result["results"]:
        m = r["metrics"]
        tau = m["mean_acceptance_length"]
        per_pos = " ".join("-" if p is None else f"{p:.2f}" for p in m["per_position_acceptance"])
        lossless = "yes" if r["lossless_mismatches"] == 0 else f"NO ({r['lossless_mismatches']} differ)"
        rows.append([r["method"], str(r["num_speculative_tokens"]), "-" if tau is None else f"{tau:.2f}",
                     per_pos, f"{r['tokens_per_second']:.1f}", f"{r['speedup']:.2f}x", lossless])
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
        "versions": {name: _version(name) for name in ("torch", "transformers", "draftsmith")},
    }


def write_eval_json(result: dict[str, Any], path: str | Path, target, argv: list[str] | None = None) -> Path:
    """Write `result` plus `run_info` atomically (temporary file, then rename) and return the path."""
    from draftsmith.models.checkpoint import write_json_atomic

    path = Path(path)
    write_json_atomic({**run_info(target, argv), **result}, path)
    return path
