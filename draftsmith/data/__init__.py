"""Conversations in, token ids + assistant-only loss masks out; the draft vocabulary.

`prepare_dataset(cfg.data, tokenizer)` is the one call the pipeline makes; the pieces
(`load_conversations`, `tokenize_conversations`, `build_draft_vocab`) are public for tests
and tools.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .conversations import DataError, LoadReport, Message, load_conversations
from .tokenize import (
    TokenizedSample,
    TokenizeReport,
    mask_from_offsets,
    render_with_segments,
    tokenize_conversation,
    tokenize_conversations,
)
from .vocab import (
    build_draft_vocab,
    count_target_tokens,
    draft_vocab_cache_key,
    load_or_build_draft_vocab,
    target_ids_of_draft,
    tokenizer_vocab_fingerprint,
)

__all__ = [
    "DataError",
    "LoadReport",
    "Message",
    "PreparedData",
    "TokenizeReport",
    "TokenizedSample",
    "build_draft_vocab",
    "count_target_tokens",
    "draft_vocab_cache_key",
    "load_conversations",
    "load_or_build_draft_vocab",
    "mask_from_offsets",
    "prepare_dataset",
    "render_with_segments",
    "target_ids_of_draft",
    "tokenize_conversation",
    "tokenize_conversations",
    "tokenizer_vocab_fingerprint",
]


@dataclass
class PreparedData:
    train: list[TokenizedSample]
    eval: list[TokenizedSample]  # the last `eval_samples` kept samples, in source order
    load_report: LoadReport
    tokenize_report: TokenizeReport


DERIVED_EVAL_EVERY = 20  # data.eval_samples null: 5% of the usable samples are held out ...
DERIVED_EVAL_MAX = 256  # ... but no more than this many


def prepare_dataset(data_cfg: Any, tokenizer: Any, *, log: Callable[[str], None] = print) -> PreparedData:
    """Load, tokenize and split per a `DataConfig` (read by attribute only); logs one line per stage."""
    convs, load_report = load_conversations(
        data_cfg.path,
        format=data_cfg.format,
        split=data_cfg.split,
        on_malformed=data_cfg.on_malformed,
        start_index=data_cfg.start_index,
        max_samples=data_cfg.max_samples,
        subset=getattr(data_cfg, "subset", None),
    )
    log(load_report.summary())
    samples, tokenize_report = tokenize_conversations(tokenizer, convs, data_cfg.max_length, data_cfg.on_long)
    log(tokenize_report.summary())
    n_eval = data_cfg.eval_samples
    if n_eval is None:  # follows the data
        n_eval = min(DERIVED_EVAL_MAX, len(samples) // DERIVED_EVAL_EVERY)
        log(f"held out {n_eval} samples for evaluation (data.eval_samples null: 1 in {DERIVED_EVAL_EVERY}, at most "
            f"{DERIVED_EVAL_MAX})")
    if n_eval < 0:
        raise DataError(f"data.eval_samples must be >= 0, got {n_eval}")
    if len(samples) <= n_eval:
        raise DataError(
            f"{data_cfg.path}: {len(samples)} usable samples leave none for training after data.eval_samples="
            f"{n_eval}; lower data.eval_samples, raise data.max_samples or data.max_length, or use data.on_long=truncate"
        )
    split_at = len(samples) - n_eval
    return PreparedData(samples[:split_at], samples[split_at:], load_report, tokenize_report)
