"""Draft vocabulary: frequency under the loss mask, d2t offsets, t2d mask, cache."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from draftsmith.data import (
    DataError,
    TokenizedSample,
    build_draft_vocab,
    draft_vocab_cache_key,
    load_or_build_draft_vocab,
    target_ids_of_draft,
)
from draftsmith.data import vocab as vocab_mod


def S(ids, mask):
    return TokenizedSample(input_ids=list(ids), loss_mask=list(mask))


def test_literal_counts_give_exact_d2t_t2d():
    # masked counts: 5 -> 2, then 1, 2, 7 -> 1 each (tie: lower ids win); the unmasked 7s must not count
    samples = [S([7, 7, 7, 5, 2], [0, 0, 0, 1, 1]), S([5, 1, 7, 3], [1, 1, 1, 0])]
    d2t, t2d = build_draft_vocab(samples, target_vocab_size=8, draft_vocab_size=3)
    assert d2t.dtype == torch.int64 and d2t.tolist() == [1, 1, 3]  # used = [1, 2, 5]
    assert t2d.dtype == torch.bool
    assert t2d.tolist() == [False, True, True, False, False, True, False, False]


def test_pads_with_lowest_unused_ids():
    d2t, t2d = build_draft_vocab([S([4, 4, 9], [1, 1, 0])], target_vocab_size=10, draft_vocab_size=3)
    assert target_ids_of_draft(d2t).tolist() == [0, 1, 4]
    assert d2t.tolist() == [0, 0, 2]
    assert t2d.nonzero().flatten().tolist() == [0, 1, 4]


def test_round_trip_on_random_samples():
    g = torch.Generator().manual_seed(0)
    samples = [
        S(torch.randint(0, 50, (n,), generator=g).tolist(), torch.randint(0, 2, (n,), generator=g).tolist())
        for n in (5, 17, 30)
    ]
    d2t, t2d = build_draft_vocab(samples, target_vocab_size=64, draft_vocab_size=20)
    target_ids = target_ids_of_draft(d2t)
    assert (target_ids[1:] > target_ids[:-1]).all()  # ascending and distinct
    assert t2d[target_ids].all() and int(t2d.sum()) == 20
    # the most frequent masked id is always in the draft vocab
    masked = torch.tensor([t for s in samples for t, m in zip(s.input_ids, s.loss_mask) if m])
    assert t2d[torch.bincount(masked).argmax()]


def test_bad_sizes_and_ids():
    with pytest.raises(DataError, match="set draft_vocab_size <= 8"):
        build_draft_vocab([], target_vocab_size=8, draft_vocab_size=9)
    with pytest.raises(DataError, match="token id 8 is outside the target vocab of 8"):
        build_draft_vocab([S([1, 8], [1, 1])], target_vocab_size=8, draft_vocab_size=2)
    d2t, t2d = build_draft_vocab([], target_vocab_size=4, draft_vocab_size=4)  # full vocab: identity
    assert d2t.tolist() == [0, 0, 0, 0] and t2d.all()


def tokenizer(vocab=None, name="tiny"):
    vocab = vocab or {"a": 0, "b": 1, "c": 2}
    return SimpleNamespace(name_or_path=name, get_vocab=lambda: dict(vocab))


def test_cache_reuse_and_key_changes(tmp_path, monkeypatch):
    samples = [S([1, 2, 2, 3], [0, 1, 1, 1])]
    d2t, t2d, path = load_or_build_draft_vocab(tmp_path, tokenizer(), samples, 8, 3)
    assert path.parent == tmp_path / "draft_vocab" and path.suffix == ".safetensors"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind
    with safe_open(str(path), "pt") as f:
        assert f.metadata()["format"] == "pt"
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool

    def no_rebuild(*a, **k):
        raise AssertionError("cache was not reused")

    monkeypatch.setattr(vocab_mod, "build_draft_vocab", no_rebuild)
    d2t2, t2d2, path2 = load_or_build_draft_vocab(tmp_path, tokenizer(), iter(samples), 8, 3)
    assert path2 == path and torch.equal(d2t2, d2t) and torch.equal(t2d2, t2d)

    key = path.stem
    fp = vocab_mod.tokenizer_vocab_fingerprint(tokenizer())
    assert draft_vocab_cache_key("tiny", fp, 8, 3, samples) == key
    assert draft_vocab_cache_key("tiny", fp, 8, 4, samples) != key  # draft size
    assert draft_vocab_cache_key("tiny", fp, 9, 3, samples) != key  # target size
    assert draft_vocab_cache_key("tiny", fp, 8, 3, [S([1, 2, 2, 3], [1, 1, 1, 1])]) != key  # mask
    assert draft_vocab_cache_key("tiny", fp, 8, 3, [S([1, 2, 2, 4], [0, 1, 1, 1])]) != key  # ids
    assert draft_vocab_cache_key("tiny", fp, 8, 3, samples + samples) != key  # more data
    other = vocab_mod.tokenizer_vocab_fingerprint(tokenizer({"a": 0, "b": 2, "c": 1}))
    assert other != fp and draft_vocab_cache_key("tiny", other, 8, 3, samples) != key


def test_damaged_cache_file_is_rebuilt(tmp_path):
    samples = [S([1, 2], [1, 1])]
    _, _, path = load_or_build_draft_vocab(tmp_path, tokenizer(), samples, 8, 2)
    path.write_bytes(b"not safetensors")
    d2t, _, _ = load_or_build_draft_vocab(tmp_path, tokenizer(), samples, 8, 2)
    assert target_ids_of_draft(d2t).tolist() == [1, 2]
