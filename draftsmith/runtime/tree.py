"""Draft trees: static trees from a list of paths, EAGLE-2 dynamic expansion, tree masks, KV compaction.

A tree step verifies every node of a draft tree in one target forward. Its input is the root (the last committed
token) followed by the nodes, so *slot* s = 0 is the root and slot j + 1 is node j of `Proposal.token_ids`::

    nodes      a  b  c  d           parents [-1, -1, 0, 0]: a, b continue the context, c, d continue a
    slots   r  a  b  c  d           depth    0  1  1  2  2  -> position ids base + depth
    mask    r: r                    a query sees the committed cache, its ancestors and itself
            a: r a                  (rows of `ancestor_mask`, root and self included)
            b: r    b
            c: r a     c
            d: r a        d

After verification the accepted path r -> a -> d (say) is compacted in the cache to consecutive slots, so the
cache looks as if the path had been decoded as a chain (`compact_kv`).

Static trees use vLLM's `speculative_token_tree` notation: a list of paths of child ranks, `(0,)` = the draft's
most likely first token, `(1,)` its second most likely, `(0, 0)` the most likely token after `(0,)`, ...
Dynamic trees follow EAGLE-2 (Li et al. 2024, arXiv 2406.16858): from the root, expand the `top_k` nodes of the
newest level with the highest cumulative log-probability into their `top_k` children, `depth` levels deep, then
keep the `num_nodes` best nodes over all levels. A child's cumulative score never exceeds its parent's, so the
kept set is a connected subtree.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from draftsmith.runtime.proposer import ROOT_PARENT


class TreeError(ValueError):
    """A draft tree specification that cannot be used; the message says what to fix."""


# ---- static trees ------------------------------------------------------------------------------------------
def parse_token_tree(value: str | Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """vLLM's `speculative_token_tree`, a string like "[(0,), (1,), (0, 0)]" or a list of paths, validated and
    sorted breadth-first (by depth, then rank), the order nodes are drafted and verified in."""
    raw = value
    if isinstance(value, str):
        try:
            raw = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise TreeError(f"speculative_token_tree: cannot parse {value!r}; expected e.g. \"[(0,), (1,), (0, 0)]\"")
    if not isinstance(raw, (list, tuple)) or not raw:
        raise TreeError(f"speculative_token_tree: expected a non-empty list of paths, got {raw!r}")
    paths = []
    for path in raw:
        if (not isinstance(path, (list, tuple)) or not path
                or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path)):
            raise TreeError(f"speculative_token_tree: path {path!r} must be a non-empty tuple of child ranks >= 0")
        paths.append(tuple(path))
    if len(set(paths)) != len(paths):
        raise TreeError("speculative_token_tree: a path is listed twice")
    known = set(paths)
    for path in paths:
        if len(path) > 1 and path[:-1] not in known:
            raise TreeError(f"speculative_token_tree: path {path} needs its parent {path[:-1]} in the tree too")
    return sorted(paths, key=lambda p: (len(p), p))


def static_tree_parents(paths: Sequence[tuple[int, ...]]) -> list[int]:
    """Parent index of every path of a breadth-first-sorted tree (ROOT_PARENT for first-level nodes)."""
    index = {path: i for i, path in enumerate(paths)}
    return [index[p[:-1]] if len(p) > 1 else ROOT_PARENT for p in paths]


def chain_parents(batch: int, length: int, device: torch.device | str = "cpu") -> Tensor:
    """(B, k) parents of a chain: [-1, 0, 1, ..., k-2]."""
    return (torch.arange(length, device=device) - 1).expand(batch, -1)


# ---- masks and positions ---------------------------------------------------------------------------------
def ancestor_mask(parents: Tensor, valid: Tensor | None = None) -> Tensor:
    """(B, n+1, n+1) bool over slots: [b, s, t] is True when slot t is slot s or one of its ancestors.

    parents (B, n) in topological order; `valid` (B, n) marks real nodes: an invalid node is treated as a child
    of the root, so its row stays well defined (it is never accepted). Transitive closure by repeated squaring:
    ceil(log2(n + 1)) small matmuls instead of a loop over nodes.
    """
    batch, n = parents.shape
    parent_slot = parents + 1  # (B, n) root -1 -> slot 0
    if valid is not None:
        parent_slot = torch.where(valid, parent_slot, torch.zeros_like(parent_slot))
    eye = torch.eye(n + 1, device=parents.device).expand(batch, -1, -1)  # (B, n+1, n+1)
    edges = torch.zeros(batch, n + 1, n + 1, device=parents.device)
    edges[:, 1:].scatter_(2, parent_slot.unsqueeze(-1), 1.0)  # node slot -> parent slot
    reach = ((eye + edges) > 0).float()
    for _ in range(max(1, math.ceil(math.log2(n + 1)))):
        reach = ((reach @ reach) > 0).float()  # paths of length <= 2^i
    return reach > 0


def node_depths(ancestors: Tensor) -> Tensor:
    """(B, n+1) depth of every slot (root 0) from an `ancestor_mask`."""
    return ancestors.sum(dim=-1) - 1


def step_attention_mask(new_mask: Tensor, cache_valid: Tensor | None, cache_length: int) -> Tensor:
    """The (B, 1, T, L+T) bool mask of one step over a cache of length L: keys [0, L) where `cache_valid`
    (B, L_max) says so (all when None), then `new_mask` (B or 1, T, T) among the step's own tokens."""
    batch = max(new_mask.shape[0], cache_valid.shape[0] if cache_valid is not None else 1)
    num_new = new_mask.shape[-1]
    if cache_valid is None:
        old = torch.ones(batch, num_new, cache_length, dtype=torch.bool, device=new_mask.device)
    else:
        old = cache_valid[:, None, :cache_length].expand(batch, num_new, cache_length)  # (B, T, L)
    return torch.cat([old, new_mask.expand(batch, -1, -1)], dim=-1)[:, None]  # (B, 1, T, L+T)


def causal_mask(num_new: int, device: torch.device | str = "cpu") -> Tensor:
    """(1, T, T) lower-triangular bool mask."""
    return torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril()[None]


# ---- compaction --------------------------------------------------------------------------------------------
def compact_kv(cache, start: int, keep: Tensor) -> None:
    """Move the step's kept slots to the front of the step's region, per row.

    The step wrote slots [start, start+T); `keep` (B, m) lists, per row, the step slots (0 = the root) to keep in
    order: afterwards slot start + j holds what slot start + keep[b, j] held. Rows that keep fewer than m pad
    `keep` with anything; what lands past their count is garbage the caller masks or overwrites. Works on any
    cache with `keys`/`values` of shape (L, B, kv, T_max, hd).
    """
    m = keep.shape[1]
    layers, batch, heads, _, dim = cache.keys.shape
    index = (start + keep).view(1, batch, 1, m, 1).expand(layers, batch, heads, m, dim)
    for store in (cache.keys, cache.values):
        store[:, :, :, start:start + m] = store.gather(3, index)  # gather copies: safe to write in place after


# ---- drafting ------------------------------------------------------------------------------------------------
# expand(tokens (B, m) draft-vocab ids, parents (B, m) indices into earlier expanded nodes or ROOT_PARENT)
#   -> (B, m, V_d) log-probs of each node's children. Nodes are numbered in the order they were expanded.
ExpandFn = Callable[[Tensor, Tensor], Tensor]


def _rank_order(scores: Tensor) -> Tensor:
    """Indices sorting `scores` (B, N) descending, ties to the lower index (a parent precedes its children)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices


def dynamic_tree(root_logprobs: Tensor, expand: ExpandFn, depth: int, top_k: int, num_nodes: int,
                 max_depth: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """EAGLE-2 expansion and rerank (see the module docstring).

    root_logprobs (B, V_d): the draft's log-probs after the last committed token. `max_depth` caps `depth`
    (generation nearly done). Returns (token_ids, parents, scores), each (B, num_nodes'): draft-vocab ids in
    topological order, parent indices (ROOT_PARENT for first-level nodes), and each node's own log-prob given
    its parent. num_nodes' = min(num_nodes, nodes generated).
    """
    depth = min(depth, max_depth) if max_depth is not None else depth
    batch = root_logprobs.shape[0]
    device = root_logprobs.device
    k = min(top_k, root_logprobs.shape[-1])
    level_lp, level_tok = root_logprobs.topk(k, dim=-1)  # (B, k)
    pool_cum, pool_lp, pool_tok = [level_lp], [level_lp], [level_tok]  # per level, each (B, m)
    pool_parent = [torch.full((batch, k), ROOT_PARENT, dtype=torch.long, device=device)]  # pool indices
    frontier = torch.arange(k, device=device).expand(batch, -1)  # (B, k) pool indices to expand next
    frontier_parent = torch.full((batch, k), ROOT_PARENT, dtype=torch.long, device=device)  # expanded indices
    pool_size, expanded = k, 0
    for _ in range(depth - 1):
        cum = torch.cat(pool_cum, dim=1)  # (B, P)
        tok = torch.cat(pool_tok, dim=1)
        frontier_tok = tok.gather(1, frontier)  # (B, k)
        child_lp = expand(frontier_tok, frontier_parent)  # (B, k, V_d)
        lp, ids = child_lp.topk(k, dim=-1)  # (B, k, k)
        child_cum = cum.gather(1, frontier)[:, :, None] + lp  # (B, k, k)
        pool_cum.append(child_cum.flatten(1))
        pool_lp.append(lp.flatten(1))
        pool_tok.append(ids.flatten(1))
        pool_parent.append(frontier.repeat_interleave(k, dim=1))  # (B, k*k) parent pool index
        # The expanded nodes of this level are numbered expanded .. expanded+k-1 in the drafter's order.
        best = _rank_order(child_cum.flatten(1))[:, :k]  # (B, k) positions within this level
        frontier_parent = expanded + best // k  # the expanded index of each new frontier node's parent
        frontier = pool_size + best
        expanded += k
        pool_size += k * k

    cum, lp, tok, parent = (torch.cat(x, dim=1) for x in (pool_cum, pool_lp, pool_tok, pool_parent))
    keep = min(num_nodes, pool_size)
    chosen = _rank_order(cum)[:, :keep].sort(dim=-1).values  # (B, n) pool indices, topological order
    # Parent pool index -> position among the chosen nodes; the chosen set is ancestor-closed (see docstring).
    position = torch.full((batch, pool_size), ROOT_PARENT, dtype=torch.long, device=device)
    position.scatter_(1, chosen, torch.arange(keep, device=device).expand(batch, -1))
    chosen_parent = parent.gather(1, chosen)  # (B, n) pool indices or ROOT_PARENT
    parents = torch.where(chosen_parent == ROOT_PARENT, chosen_parent,
                          position.gather(1, chosen_parent.clamp_min(0)))
    return tok.gather(1, chosen), parents, lp.gather(1, chosen)


def static_tree(root_logprobs: Tensor, expand: ExpandFn, paths: Sequence[tuple[int, ...]],
                max_depth: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Fill a static tree (breadth-first `paths`, see `parse_token_tree`) with the draft's ranked tokens.

    Node (r_1, ..., r_d) is the r_d-th most likely token after node (r_1, ..., r_{d-1}). Paths deeper than
    `max_depth` are dropped. Returns (token_ids, parents, scores) like `dynamic_tree`.
    """
    if max_depth is not None:
        paths = [p for p in paths if len(p) <= max_depth]
    parents_list = static_tree_parents(paths)
    batch, device = root_logprobs.shape[0], root_logprobs.device
    tokens: list[Tensor] = [None] * len(paths)  # each (B,)
    logprobs: list[Tensor] = [None] * len(paths)
    expanded_index: dict[int, int] = {}  # node -> its index among expanded nodes
    by_depth: dict[int, list[int]] = {}
    for i, p in enumerate(paths):
        by_depth.setdefault(len(p), []).append(i)
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents_list):
        children.setdefault(parent, []).append(i)

    def fill(parent_nodes: list[int], child_lp: Tensor) -> None:
        """child_lp (B, m, V_d) for `parent_nodes` (ROOT_PARENT for the root): rank and place their children."""
        widest = max(paths[c][-1] for p in parent_nodes for c in children[p]) + 1
        lp, ids = child_lp.topk(min(widest, child_lp.shape[-1]), dim=-1)  # (B, m, r)
        for j, p in enumerate(parent_nodes):
            for c in children[p]:
                rank = min(paths[c][-1], lp.shape[-1] - 1)
                tokens[c], logprobs[c] = ids[:, j, rank], lp[:, j, rank]

    fill([ROOT_PARENT], root_logprobs[:, None])
    for d in sorted(by_depth):
        to_expand = [i for i in by_depth[d] if i in children]
        if not to_expand:
            continue
        tok = torch.stack([tokens[i] for i in to_expand], dim=1)  # (B, m)
        par = torch.tensor([expanded_index.get(parents_list[i], ROOT_PARENT) for i in to_expand],
                           device=device).expand(batch, -1)
        start = len(expanded_index)
        for j, i in enumerate(to_expand):
            expanded_index[i] = start + j
        fill(to_expand, expand(tok, par))
    parents = torch.tensor(parents_list, dtype=torch.long, device=device).expand(batch, -1)
    return torch.stack(tokens, dim=1), parents, torch.stack(logprobs, dim=1)
