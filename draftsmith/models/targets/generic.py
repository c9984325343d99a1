"""Any other causal LM: its own forward over transformers' cache, slower than a family adapter but exact.

Each step runs the model's forward on the new tokens with a `DynamicCache` built without the config, so every layer
keeps all its keys and values (a sliding-window layer too: transformers' masks apply the window by position);
rolling back crops the cache. Aux features are the inputs of the requested decoder layers, recorded by hooks.
What this path cannot express it refuses in one line naming the family: a batch (rows that accept different
numbers of drafts leave holes no mask can give the stock forward) and a draft tree (a mask over the tree).
"""

from __future__ import annotations

import inspect
import sys

import torch
from torch import Tensor, nn

from draftsmith.models.targets.base import TargetError, layer_recorder


_noted: set[str] = set()  # families whose path was already named


class TransformersCache:
    """The runtime's cache interface (`length`, `max_length`, `rollback`) over a transformers `DynamicCache`."""

    def __init__(self, max_length: int):
        from transformers import DynamicCache

        self.cache = DynamicCache()  # no config: full layers only, which can always be cropped
        self.length = 0
        self.max_length = max_length

    def rollback(self, length: int) -> None:
        """Forget every position >= `length`."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a cache of length {self.length} to {length}")
        if length < self.length:
            self.cache.crop(length - self.length)  # a negative count: that many tokens removed, in every 5.x
        self.length = length


class TransformersForward:
    def __init__(self, model: nn.Module, layers: nn.ModuleList):
        self.model = model
        self.layers = layers
        self.model_type = getattr(model.config, "model_type", type(model).__name__)
        params = inspect.signature(model.forward).parameters
        self.cache_argument = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.x
        self.takes_logits_to_keep = "logits_to_keep" in params

    def note_once(self) -> None:
        """Say once per family, on stderr, which path serves it."""
        if self.model_type not in _noted:
            _noted.add(self.model_type)
            print(f"draftsmith: no runtime adapter for '{self.model_type}' targets: serving them through "
                  "transformers' own forward and cache (exact, slower; one request at a time, chains only)",
                  file=sys.stderr)

    def refusal(self, what: str, fix: str) -> TargetError:
        return TargetError(f"draftsmith serves '{self.model_type}' targets through transformers' own forward, which "
                           f"cannot take {what}: {fix}")

    def new_cache(self, batch_size: int, max_length: int) -> TransformersCache:
        if batch_size != 1:
            raise self.refusal(f"a batch ({batch_size} requests: rows accepting different numbers of drafts leave "
                               "holes in the cache)", "serve the prompts one at a time")
        return TransformersCache(max_length)

    def step(self, input_ids: Tensor, cache: TransformersCache, aux_ids: tuple[int, ...], logits_to_keep: int | None,
             attention_mask: Tensor | None, position_ids: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """(logits (1, T_kept, V) float32, aux (1, T, n_aux*H) or None) of `input_ids` after the cached context."""
        if attention_mask is not None or position_ids is not None:
            raise self.refusal("a draft tree", "use a chain (no speculative_token_tree or dynamic_tree)")
        if not isinstance(cache, TransformersCache):
            raise ValueError("this target's steps take the cache its new_cache made")
        recorded: dict[int, Tensor] = {}
        handles = [layer_recorder(self.layers, i, recorded) for i in set(aux_ids)]
        kwargs = {self.cache_argument: cache.cache, "use_cache": True}
        if self.takes_logits_to_keep and logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        try:
            out = self.model(input_ids=input_ids, **kwargs)
        except (TypeError, ValueError, AttributeError, KeyError, NotImplementedError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise TargetError(f"draftsmith cannot serve '{self.model_type}' targets: their forward over a "
                              f"transformers DynamicCache failed ({type(e).__name__}: {first})") from e
        finally:
            for handle in handles:
                handle.remove()
        cache.length += input_ids.shape[1]
        if cache.cache.get_seq_length() != cache.length:  # a cache this path does not understand: never guess
            raise TargetError(f"draftsmith cannot serve '{self.model_type}' targets: their cache holds "
                              f"{cache.cache.get_seq_length()} positions after {cache.length} tokens")
        logits = out.logits if logits_to_keep is None else out.logits[:, -logits_to_keep:]
        aux = torch.cat([recorded[i] for i in aux_ids], dim=-1) if aux_ids else None
        return logits.float(), aux
