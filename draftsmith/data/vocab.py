"""Draft vocabulary: the target ids the drafter can propose, chosen by loss-masked frequency.

Layout (DESIGN.md section 3, the EAGLE-3 format SGLang and vLLM load)::

    used  = sorted(top draft_vocab_size target ids by count under loss_mask)
    d2t[i] = used[i] - i          # int64 offset: target_id = i + d2t[i]
    t2d[t] = t in used            # bool over the target vocab
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors.torch import load_file, save_file

from .conversations import DataError
from .tokenize import TokenizedSample

_COUNT_CHUNK = 1024  # samples per bincount: one pass over the vocab per chunk, not per sample


def count_target_tokens(samples: Iterable[TokenizedSample], target_vocab_size: int) -> torch.Tensor:
    """Counts of each target id under the loss mask, shape (target_vocab_size,), int64."""
    counts = torch.zeros(target_vocab_size, dtype=torch.int64)
    chunk: list[torch.Tensor] = []

    def flush() -> None:
        if not chunk:
            return
        ids = torch.cat(chunk)  # (N,) masked target ids of up to _COUNT_CHUNK samples
        chunk.clear()
        if ids.numel() and (int(ids.max()) >= target_vocab_size or int(ids.min()) < 0):
            bad = int(ids.max()) if int(ids.max()) >= target_vocab_size else int(ids.min())
            raise DataError(
                f"token id {bad} is outside the target vocab of {target_vocab_size}; "
                "the samples were tokenized with another tokenizer than the target's"
            )
        counts.add_(torch.bincount(ids, minlength=target_vocab_size))

    for s in samples:
        ids = torch.tensor(s.input_ids, dtype=torch.int64)
        chunk.append(ids[torch.tensor(s.loss_mask, dtype=torch.bool)])
        if len(chunk) >= _COUNT_CHUNK:
            flush()
    flush()
    return counts


def build_draft_vocab(
    samples: Iterable[TokenizedSample], target_vocab_size: int, draft_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (d2t int64 (draft_vocab_size,), t2d bool (target_vocab_size,))."""
    if draft_vocab_size > target_vocab_size:
        raise DataError(
            f"draft_vocab_size {draft_vocab_size} > target vocab size {target_vocab_size}: "
            f"set draft_vocab_size <= {target_vocab_size}"
        )
    if draft_vocab_size < 1:
        raise DataError(f"draft_vocab_size must be >= 1, got {draft_vocab_size}")
    counts = count_target_tokens(samples, target_vocab_size)
    # A stable sort by descending count breaks ties by lower id, and puts the never-seen ids
    # after every seen one in id order, which is exactly the "pad with the lowest unused ids" rule.
    order = torch.sort(-counts, stable=True).indices  # (target_vocab_size,)
    used = order[:draft_vocab_size].sort().values  # (draft_vocab_size,) ascending target ids
    d2t = used - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def target_ids_of_draft(d2t: torch.Tensor) -> torch.Tensor:
    """Target id of every draft id: arange + d2t."""
    return torch.arange(d2t.numel(), dtype=torch.int64, device=d2t.device) + d2t


def tokenizer_vocab_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's (token, id) pairs: same vocabulary, same fingerprint, wherever it lives."""
    h = hashlib.sha256()
    for token, idx in sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0])):
        h.update(f"{idx}\t{token}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def draft_vocab_cache_key(
    tokenizer_name_or_path: str,
    tokenizer_vocab_fingerprint: str,
    target_vocab_size: int,
    draft_vocab_size: int,
    samples: Iterable[TokenizedSample],
) -> str:
    """sha256 over tokenizer identity, both vocab sizes and every sample's ids and mask."""
    h = hashlib.sha256()
    h.update(f"draft-vocab-v1\n{tokenizer_name_or_path}\n{tokenizer_vocab_fingerprint}\n".encode())
    h.update(f"{target_vocab_size}\n{draft_vocab_size}\n".encode())
    for s in samples:
        h.update(len(s.input_ids).to_bytes(8, "little"))
        h.update(torch.tensor(s.input_ids, dtype=torch.int64).numpy().tobytes())
        h.update(bytes(s.loss_mask))
    return h.hexdigest()


def _save_atomic(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_or_build_draft_vocab(
    cache_dir: str | os.PathLike,
    tokenizer: Any,
    samples: Iterable[TokenizedSample],
    target_vocab_size: int,
    draft_vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor, Path]:
    """Reuse `<cache_dir>/draft_vocab/<key>.safetensors` when present, else build and save it."""
    samples = list(samples)  # iterated twice: for the key and for the counts
    key = draft_vocab_cache_key(
        str(getattr(tokenizer, "name_or_path", "")),
        tokenizer_vocab_fingerprint(tokenizer),
        target_vocab_size,
        draft_vocab_size,
        samples,
    )
    path = Path(cache_dir) / "draft_vocab" / f"{key}.safetensors"
    if path.exists():
        try:
            t = load_file(str(path))
            d2t, t2d = t["d2t"], t["t2d"]
            if d2t.shape == (draft_vocab_size,) and t2d.shape == (target_vocab_size,) and d2t.dtype == torch.int64:
                return d2t, t2d, path
        except Exception:  # a damaged cache file is rebuilt, never trusted
            pass
    d2t, t2d = build_draft_vocab(samples, target_vocab_size, draft_vocab_size)
    meta = {"format": "pt", "target_vocab_size": str(target_vocab_size), "draft_vocab_size": str(draft_vocab_size)}
    _save_atomic(path, {"d2t": d2t, "t2d": t2d}, meta)
    return d2t, t2d, path
