"""What every target family shares: the protocol the runtime's forward calls, one step's state, its masks.

`TargetModel._layers_forward` runs any family the same way: `embed`, then `layer(i)` for every decoder layer,
then `logits`. A family adapter (one module each: llama.py, gpt_oss.py, gemma4.py) says how its decoder layer
runs over the runtime's preallocated cache, once, for the eager step and the shape-static step (CUDA graphs) alike.

Masks. A step's boolean mask (B or 1, 1, T, S), True = may attend, lets each query see its context: one slot per
position 0..p, in slot order (prompt, committed tokens, the query's tree ancestors, compacted in order: see
generator.py). So the keys a query sees, counted from the right, are its distances + 1, and a sliding window of w
keeps the last w keys it sees (`windowed`): exact for chains, trees and batches with holes alike, as transformers'
`kv_idx > q_idx - w` is for one plain sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn


class TargetError(ValueError):
    """A target model draftsmith cannot use as it is."""


class TargetFamily(Protocol):
    """How the runtime runs one family of targets over its own KV cache."""

    windows: tuple[int, ...]  # sliding windows its layers apply exactly (each gets a mask); () for none
    graphs: bool  # a step can be recorded as a CUDA graph (no host syncs, no data-dependent shapes)

    def cache_shape(self) -> tuple[int, int, int]:
        """(cache layers, K/V heads, head dim) of its `KVCache`."""

    def embed(self, input_ids: Tensor, state: StepState) -> Tensor:
        """(B, T, H) the residual stream entering layer 0; fills what every layer reads into `state`."""

    def layer(self, index: int, hidden: Tensor, state: StepState) -> Tensor:
        """Decoder layer `index` over the cache: writes its K/V, returns the residual stream after it."""

    def logits(self, hidden: Tensor) -> Tensor:
        """Final norm and head (and softcapping where the family has it): (B, T, V)."""


@dataclass
class StepState:
    """One step of the runtime's forward, as every layer reads it."""

    cache: Any  # KVCache: keys/values (L_cache, B, kv, T_max, hd), or flat rows (L_cache, B, 1, T_max, F)
    start: int | None  # first slot this step writes; None: the shape-static step, written at `slots`
    end: int | None
    slots: Tensor | None  # (T,) slots of the static step
    position_ids: Tensor  # (B, T)
    masks: dict[int | None, Tensor | None]  # window (None: full attention) -> (B or 1, 1, T, S) bool, None = all
    rotary: Any = None  # the family's position embeddings for this step
    extras: dict[str, Any] = field(default_factory=dict)  # anything else a family computes once a step

    def write_kv(self, index: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Store this step's keys/values (B, kv, T, hd) in cache layer `index`; return all of that layer's
        (B, kv, S, hd), these included (the static step: the whole cache, stale slots masked)."""
        cache = self.cache
        if self.start is None:
            cache.keys[index].index_copy_(2, self.slots, keys)
            cache.values[index].index_copy_(2, self.slots, values)
            return cache.keys[index], cache.values[index]
        cache.keys[index, :, :, self.start:self.end] = keys
        cache.values[index, :, :, self.start:self.end] = values
        return cache.keys[index, :, :, :self.end], cache.values[index, :, :, :self.end]

    def write_kv_flat(self, index: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """`write_kv` for a cache of flat rows, (L_cache, B, 1, T_max, F): a family whose layers differ in K/V
        heads or head dim keeps one row of kv * hd <= F values a slot, whatever the layer."""
        batch, _, num_new, _ = keys.shape
        for store, new in ((self.cache.keys, keys), (self.cache.values, values)):
            rows = store[index, :, 0, :, :new.shape[1] * new.shape[-1]]  # (B, T_max, kv*hd) a view
            flat = new.transpose(1, 2).reshape(batch, num_new, -1)
            if self.start is None:
                rows.index_copy_(1, self.slots, flat)
            else:
                rows[:, self.start:self.end] = flat
        return self.read_kv_flat(index, keys.shape[1], keys.shape[-1])

    def read_kv_flat(self, index: int, num_kv: int, head_dim: int) -> tuple[Tensor, Tensor]:
        """Flat cache layer `index`'s keys and values as (B, kv, S, hd) views, S up to this step's end."""
        end = self.cache.max_length if self.end is None else self.end
        return tuple(store[index, :, 0, :end, :num_kv * head_dim].unflatten(-1, (num_kv, head_dim)).transpose(1, 2)
                     for store in (self.cache.keys, self.cache.values))


def config_attribute(config, key: str, default=None):
    """`config.key`, or where layers differ in it (Gemma 4's head_dim, which transformers then refuses to read
    globally) the config's own global value (Gemma 4: its sliding layers')."""
    try:
        return getattr(config, key, default)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return vars(config).get(key, default)


def windowed(mask: Tensor, window: int) -> Tensor:
    """`mask` (B or 1, 1, T, S) keeping, for each query, only the last `window` keys it may attend to (see the
    module docstring: its own position and the window - 1 before it)."""
    seen_from_right = mask.flip(-1).cumsum(-1, dtype=torch.int32).flip(-1)  # (.., T, S) keys seen at or after
    return mask & (seen_from_right <= window)


def step_masks(mask: Tensor | None, position_ids: Tensor, end: int | None, windows: tuple[int, ...]
               ) -> dict[int | None, Tensor | None]:
    """The full-attention mask and one per sliding window. `mask` None (one request's single-token step, slot =
    position): attend to everything, so only windows need a mask, by position."""
    masks: dict[int | None, Tensor | None] = {None: mask}
    for window in windows:
        if mask is None:
            key_pos = torch.arange(end, device=position_ids.device)
            masks[window] = (key_pos[None, None, :] > position_ids[:, :, None] - window)[:, None]  # (B, 1, T, S)
        else:
            masks[window] = windowed(mask, window)
    return masks


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE by halves (Llama's and most families'), cos/sin broadcast over x's heads."""
    return x * cos + rotate_half(x) * sin


def repeat_kv(x: Tensor, groups: int) -> Tensor:
    """(B, kv, S, hd) -> (B, kv*groups, S, hd), each K/V head repeated for its query heads (transformers' order)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def layer_recorder(layers: nn.ModuleList, layer_id: int, recorded: dict[int, Tensor]):
    """A hook handle storing in `recorded[layer_id]` the residual stream entering decoder layer `layer_id`, the
    aux-layer convention (id L: the last layer's output, before the final norm)."""
    if layer_id < len(layers):
        def entering(module, args, kwargs):
            recorded[layer_id] = args[0] if args else kwargs["hidden_states"]

        return layers[layer_id].register_forward_pre_hook(entering, with_kwargs=True)

    def leaving(module, args, output):
        recorded[layer_id] = output[0] if isinstance(output, tuple) else output

    return layers[-1].register_forward_hook(leaving)
