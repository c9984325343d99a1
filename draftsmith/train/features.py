"""Where the target's features come from: a `FeatureSource`, handed to the method's loss (`method.loss(drafter,
batch, features)`, which calls `features(input_ids, attention_mask, aux_layer_ids, position_ids=...)` where it
would run the target). Three sources, one interface:

    online   the target runs on every micro-batch (`TargetModel.capture`)
    store    data.hidden_states_path, or a complete data.hidden_states_cache: the stored states of the samples the
             loop selects (data/store.py StoredCapture); the target's layers are not even loaded
    cache    data.hidden_states_cache, not complete yet: the first epoch captures online and also writes what it
             captured (CachingCapture); at its end the cache is completed and later epochs read it as a store

Every source is read through the finiteness check (health.py FeatureCheck), so the loop learns which rows came out
finite without a second target forward and without a sync.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from draftsmith.train.health import FeatureCheck


class FeatureSource:
    """The target's states for a batch, `features(input_ids, attention_mask=None, aux_layer_ids=None,
    position_ids=None) -> CapturedStates`, from `capture` (the target's own, a store's or the cache's). A store or
    cache reads the samples the loop names first (`select`, `select_eval`): store sample ids are the training
    samples' indices, then the held-out samples' (len(train) + j)."""

    def __init__(self, capture: Callable, train_count: int, stored=None,
                 complete_cache: Callable[[], object] | None = None):
        self.check = FeatureCheck(capture)
        self.stored = stored  # StoredCapture or CachingCapture (selects samples), None online
        self.train_count = train_count
        self.target_runs = stored is None or complete_cache is not None  # False: the target's layers never run
        self._complete_cache = complete_cache  # the first epoch's end: completes the cache, returns the store

    def __call__(self, input_ids, attention_mask=None, aux_layer_ids=None, position_ids=None):
        return self.check(input_ids, attention_mask, aux_layer_ids, position_ids=position_ids)

    def select(self, sample_ids: list[int], samples) -> None:
        """The next call reads these training samples (a store or cache; online capture needs nothing)."""
        if self.stored is not None:
            self.stored.select(sample_ids, [s.input_ids for s in samples])

    def select_eval(self, start: int, samples) -> None:
        """The next call reads held-out samples start .. start + len(samples) - 1."""
        first = self.train_count + start
        self.select(list(range(first, first + len(samples))), samples)

    def take(self) -> torch.Tensor | None:
        """(B,) bool on the device: which rows of the last call were finite (None before any call)."""
        return self.check.take()

    def end_epoch(self) -> None:
        """After an epoch: the first epoch of a cache completes it, and from now on it is read as a store."""
        if self._complete_cache is not None:
            self.stored = self._complete_cache()
            self.check.replace(self.stored)
            self._complete_cache = None


def recipe_store_header(recipe, tokenizer, target, method, data, dtype: str) -> dict:
    """What a hidden-state store for this recipe records (data/store.py): its samples are the training samples,
    then the held-out ones, with the method's aux layers. `collect` writes it, training checks it."""
    from draftsmith.data.store import store_header

    return store_header(recipe.model.target, tokenizer, method.aux_layer_ids, target.config.hidden_size,
                        [*data.train, *data.eval], len(data.train), dtype)


def store_folder(recipe) -> str | None:
    """The store training reads from its first step: data.hidden_states_path, or data.hidden_states_cache once
    complete (an index written); None when the target's layers must run."""
    from draftsmith.data.store import INDEX

    cache = recipe.data.hidden_states_cache
    complete = cache if cache and (Path(cache).expanduser() / INDEX).is_file() else None
    return recipe.data.hidden_states_path or complete


def open_store(folder, recipe, tokenizer, target, method, data, log):
    """The store in `folder`, checked against this recipe; the capture that reads it."""
    from accelerate import PartialState

    from draftsmith.data.store import HiddenStateStore, StoredCapture, human_bytes

    store = HiddenStateStore(Path(folder).expanduser())
    store.check_matches(recipe_store_header(recipe, tokenizer, target, method, data, store.index.get("dtype")))
    if recipe.data.verify_store:  # every shard's checksum before the first step, each process its share
        store.verify(PartialState().process_index, PartialState().num_processes)
    log(f"hidden states: read from {store.folder} ({store.index['num_samples']} samples, "
        f"{human_bytes(store.index['bytes'])}, {store.index['dtype']}); the target's layers are not run")
    return StoredCapture(store, target.device, target.dtype, method.aux_layer_ids)


def _start_cache(recipe, tokenizer, target, method, data, rank: int, log):
    """data.hidden_states_cache, not complete yet: the capture that also writes the first epoch's states."""
    from draftsmith.data.store import CachingCapture

    header = recipe_store_header(recipe, tokenizer, target, method, data, recipe.collect.dtype)
    folder = Path(recipe.data.hidden_states_cache).expanduser()
    cache = CachingCapture(target.capture, folder, header, [*data.train, *data.eval], rank, recipe.collect.dtype,
                           recipe.collect.max_shard_bytes)
    log(f"hidden states: the first epoch also writes them to {folder}"
        + (f" (resuming: {len(cache.writer.done)} samples there)" if cache.writer.done else "")
        + "; later epochs read them")
    return cache


def open_features(recipe, tokenizer, target, method, data, accelerator, log) -> FeatureSource:
    """The run's feature source: the store of `store_folder(recipe)`, the first epoch's cache, or online capture."""
    folder = store_folder(recipe)
    if folder:
        stored = open_store(folder, recipe, tokenizer, target, method, data, log)
        return FeatureSource(stored, len(data.train), stored)
    if not recipe.data.hidden_states_cache:
        return FeatureSource(target.capture, len(data.train))
    caching = _start_cache(recipe, tokenizer, target, method, data, accelerator.process_index, log)

    def complete_cache():
        caching.finish(accelerator.device, method.aux_layer_ids, accelerator.num_processes,
                       recipe.collect.batch_tokens, accelerator.wait_for_everyone)
        return open_store(recipe.data.hidden_states_cache, recipe, tokenizer, target, method, data, log)

    return FeatureSource(caching, len(data.train), caching, complete_cache)
