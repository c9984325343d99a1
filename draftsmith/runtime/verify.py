"""Verification of draft tokens against the target: greedy and speculative (rejection) sampling, chains and trees.

Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", arXiv 2211.17192 (and
Chen et al. 2023, arXiv 2302.01318). Glossary (vLLM's words, `vllm/v1/sample/rejection_sampler.py`):
  * draft tokens: the k tokens a proposer guessed, d_0 .. d_k-1 (a chain), or the nodes of a draft tree;
  * p, q: the target's and the draft's sampling distributions at a position, *after* temperature, top-k and
    top-p, computed by the same function (`sampling.logits_to_probs`); a draft chosen by argmax (or a
    deterministic tree child) has a one-hot q;
  * accepted tokens: the longest prefix of drafts the target keeps. Greedy: d_j equals the target's argmax.
    Sampling: d_j is kept with probability min(1, p(d_j) / q(d_j)), which for a one-hot q is p(d_j);
  * recovered token: drawn at the first rejected position from the residual norm(max(0, p - q)) (one-hot q:
    p with d_j removed, renormalised; greedy: the target's argmax), replacing the draft there;
  * bonus token: drawn from p after the last draft when all were accepted; free, because the verification
    pass already computed that distribution.
A step therefore always commits accepted + 1 tokens (recovered or bonus last), never fewer than plain decoding,
and the committed tokens are distributed exactly as if the target had sampled them one by one (Leviathan,
App. A.1): the drafts only decide how many come out of one target pass.

Alignment of one row of the verification pass (c = committed context length, `last` = its final token)::

    target input        last      d_0       d_1      ...  d_k-1
    position            c-1       c         c+1      ...  c+k-1
    target_logits[:, j] j=0       j=1       j=2      ...  j=k       (the target's prediction for position c+j)
    compared with       d_0       d_1       d_2      ...  (bonus)

so draft d_j is checked against the target's distribution at input slot j, and slot k gives the bonus.
Trees (see `tree.py`) replace "slot j" by "the slot of the node's parent": the root (slot 0) predicts the first
level, node i (slot i + 1) predicts its children. Tree siblings are tried in order (SpecInfer, EAGLE's
`evaluate_posterior`): each is accepted with p'(x), else removed from p' (renormalised) before the next sibling;
when all are rejected the recovered token is drawn from that residual. This is lossless because the tree is a
function of the context only, never of the acceptance randomness.
"""

from __future__ import annotations

import torch
from torch import Tensor

from draftsmith.runtime.proposer import PAD_DRAFT_TOKEN
from draftsmith.runtime.sampling import Sampler
from draftsmith.runtime.tree import ancestor_mask, node_depths

MIN_MASS = 1e-12  # residuals with less mass than this are numerically empty: fall back to p


def _check_chain(name, draft_ids, draft_lengths, target):
    if draft_ids.dim() != 2 or target.dim() != 3:
        raise ValueError(
            f"{name}: draft_ids must be (B, k) and target distributions (B, k+1, V), got "
            f"{tuple(draft_ids.shape)} and {tuple(target.shape)}"
        )
    batch, k = draft_ids.shape
    if target.shape[:2] != (batch, k + 1) or draft_lengths.shape != (batch,):
        raise ValueError(
            f"{name}: for draft_ids {tuple(draft_ids.shape)} expected target_logits ({batch}, {k + 1}, V) "
            f"and draft_lengths ({batch},), got {tuple(target.shape)} and {tuple(draft_lengths.shape)}"
        )


def _pad_after(tokens: Tensor, accepted: Tensor) -> Tensor:
    """Keep output slots 0..accepted (B, k+1) and put PAD_DRAFT_TOKEN after them."""
    keep = torch.arange(tokens.shape[1], device=tokens.device)[None, :] <= accepted[:, None]
    return torch.where(keep, tokens, torch.full_like(tokens, PAD_DRAFT_TOKEN))


# ---- chains --------------------------------------------------------------------------------------------------
def greedy_verify(draft_ids: Tensor, draft_lengths: Tensor, target_logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Accept the longest prefix of drafts equal to the target's argmax, then the target's token after it.

    draft_ids (B, k) int64, PAD_DRAFT_TOKEN past `draft_lengths` (B,); target_logits (B, k+1, V) aligned as in the
    module docstring. Returns `accepted_counts` (B,) in 0..length, `output_tokens` (B, k+1) = accepted drafts then
    the recovered/bonus token, PAD_DRAFT_TOKEN after, and `output_lengths` (B,) = accepted_counts + 1.
    """
    _check_chain("greedy_verify", draft_ids, draft_lengths, target_logits)
    k = draft_ids.shape[1]
    target_ids = target_logits.argmax(dim=-1)  # (B, k+1)
    valid = torch.arange(k, device=draft_ids.device)[None, :] < draft_lengths[:, None]  # (B, k): drafts that exist
    matches = (draft_ids == target_ids[:, :k]) & valid  # (B, k)
    accepted = matches.long().cumprod(dim=-1).sum(dim=-1)  # (B,) length of the all-match prefix
    # Accepted drafts equal the target's argmax, so the output row is simply the target's tokens up to and
    # including position `accepted` (the recovered or bonus token).
    return accepted, _pad_after(target_ids, accepted), accepted + 1


def acceptance_probability(p_draft: Tensor, q_draft: Tensor) -> Tensor:
    """min(1, p(x) / q(x)) for drafts x ~ q (Leviathan et al., Algorithm 1). A one-hot q gives p(x).

    A separate function so a test can swap in a wrong rule and watch the distribution test fail.
    """
    return (p_draft / q_draft.clamp_min(MIN_MASS)).clamp(max=1.0)


def _sample_residual(p: Tensor, q: Tensor, sampler: Sampler) -> Tensor:
    """One token per row from norm(max(0, p - q)) (B, V); rows whose residual is numerically empty use p."""
    residual = (p - q).clamp_min(0.0)  # (B, V)
    mass = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(mass > MIN_MASS, residual / mass.clamp_min(MIN_MASS), p)
    return sampler.sample(residual)


def rejection_verify(draft_ids: Tensor, draft_lengths: Tensor, target_probs: Tensor, draft_probs: Tensor | None,
                     sampler: Sampler) -> tuple[Tensor, Tensor, Tensor]:
    """Speculative sampling of a chain: the same contract as `greedy_verify`, with distributions.

    target_probs (B, k+1, V): p at each slot after sampling processing. draft_probs (B, k, V): the q each draft
    was sampled from, or None for one-hot drafts (argmax or n-gram). Vectorised: every draft's accept test uses
    its own uniform, and one residual/bonus draw per row happens at its first rejection (or after the last
    draft); no host sync.
    """
    _check_chain("rejection_verify", draft_ids, draft_lengths, target_probs)
    batch, k = draft_ids.shape
    device = draft_ids.device
    slots = torch.arange(k, device=device)
    valid = slots[None, :] < draft_lengths[:, None]  # (B, k)
    safe_ids = draft_ids.clamp_min(0)  # PAD -> 0; masked by `valid`
    p_draft = target_probs[:, :k].gather(-1, safe_ids[..., None])[..., 0]  # (B, k) p(d_j)
    q_draft = (draft_probs.gather(-1, safe_ids[..., None])[..., 0] if draft_probs is not None
               else torch.ones_like(p_draft))  # (B, k) q(d_j)
    accept = (sampler.uniform((batch, k)) < acceptance_probability(p_draft, q_draft)) & valid
    accepted = accept.long().cumprod(dim=-1).sum(dim=-1)  # (B,)

    rows = torch.arange(batch, device=device)
    p_at = target_probs[rows, accepted]  # (B, V) p at the first rejection, or after the last draft
    rejected = accepted < draft_lengths  # (B,) False: all accepted -> bonus from p
    at = accepted.clamp_max(max(k - 1, 0))
    if draft_probs is not None:
        q_at = draft_probs[rows, at] if k else torch.zeros_like(p_at)  # (B, V)
    else:
        q_at = torch.zeros_like(p_at)
        if k:
            q_at.scatter_(1, safe_ids[rows, at][:, None], 1.0)  # one-hot of the rejected draft
    q_at = q_at * rejected[:, None]
    last = _sample_residual(p_at, q_at, sampler)  # (B,)

    tokens = torch.cat([safe_ids, last[:, None]], dim=1)  # (B, k+1)
    tokens = tokens.scatter(1, accepted[:, None], last[:, None])  # recovered/bonus at slot `accepted`
    return accepted, _pad_after(tokens, accepted), accepted + 1


# ---- trees ---------------------------------------------------------------------------------------------------
def _check_tree(name, node_ids, node_valid, parents, target):
    batch, n = node_ids.shape
    if (node_valid.shape != (batch, n) or parents.shape != (batch, n) or target.dim() != 3
            or target.shape[:2] != (batch, n + 1)):
        raise ValueError(
            f"{name}: for node_ids ({batch}, {n}) expected node_valid and parents ({batch}, {n}) and target "
            f"({batch}, {n + 1}, V), got {tuple(node_valid.shape)}, {tuple(parents.shape)}, {tuple(target.shape)}"
        )


def _path_slots(ancestors: Tensor, depths: Tensor, best: Tensor) -> Tensor:
    """(B, n+1): slot of the accepted path at each depth 0..a (root first), then the identity after."""
    batch, slots = depths.shape
    rows = torch.arange(batch, device=depths.device)
    on_path = ancestors[rows, best]  # (B, n+1) ancestors of the deepest accepted slot, itself included
    where = torch.where(on_path, depths, torch.full_like(depths, slots))  # off-path slots go to a spill column
    path = torch.arange(slots + 1, device=depths.device).repeat(batch, 1)  # (B, n+2)
    path.scatter_(1, where, torch.arange(slots, device=depths.device).expand(batch, -1))
    return path[:, :slots]


def greedy_tree_verify(node_ids: Tensor, node_valid: Tensor, parents: Tensor, target_logits: Tensor,
                       ancestors: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Accept the deepest tree path whose every node equals the target's argmax at its parent.

    node_ids (B, n), node_valid (B, n) bool, parents (B, n) as in `Proposal`; target_logits (B, n+1, V) over the
    step's slots (root first). Returns `accepted` (B,) = path length, `output_tokens` (B, n+1) = the accepted
    path's tokens then the bonus, PAD after, and `path` (B, n+1): the step slot of each committed input (slot 0,
    the root, then the accepted nodes), identity past `accepted` (what `tree.compact_kv` keeps).
    """
    _check_tree("greedy_tree_verify", node_ids, node_valid, parents, target_logits)
    if ancestors is None:  # the caller may pass the mask it built the step from
        ancestors = ancestor_mask(parents, node_valid)  # (B, n+1, n+1)
    depths = node_depths(ancestors)  # (B, n+1)
    target_ids = target_logits.argmax(dim=-1)  # (B, n+1) argmax at each slot
    parent_slot = torch.where(node_valid, parents + 1, torch.zeros_like(parents))  # (B, n)
    matches = node_valid & (node_ids == target_ids.gather(1, parent_slot))  # (B, n)
    ok = torch.cat([torch.ones_like(matches[:, :1]), matches], dim=1)  # (B, n+1) root always ok
    path_ok = ~(ancestors & ~ok[:, None, :]).any(dim=-1)  # (B, n+1) every ancestor matched
    best = torch.where(path_ok, depths, torch.full_like(depths, -1)).argmax(dim=-1)  # (B,) deepest (first on ties)
    accepted = depths.gather(1, best[:, None])[:, 0]
    path = _path_slots(ancestors, depths, best)
    # Accepted nodes equal the target's argmax at their parents: the output is the argmax along the path.
    return accepted, _pad_after(target_ids.gather(1, path), accepted), path


def sampling_tree_verify(node_ids: Tensor, node_valid: Tensor, parents: Tensor, target_probs: Tensor,
                         sampler: Sampler, max_depth: int | None = None,
                         ancestors: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Speculative sampling over a deterministic tree: walk down, trying each node's children in order.

    At the current node with target distribution p', child x is accepted with probability p'(x) (q = 1: tree
    children are deterministic); a rejected child is removed from p' (renormalised) before the next is tried,
    which in closed form accepts the j-th child with p(x_j) / (1 - sum_{i<j} p(x_i)). When every child is
    rejected (or there is none) the last token is drawn from the residual p'. Vectorised over rows and
    siblings; one loop iteration per tree level, `max_depth` of them (default n; it must be at least the depth
    of the valid tree, which the caller knows without a host sync). Siblings must be distinct tokens, as top-k
    children are. Same contract as `greedy_tree_verify`.
    """
    _check_tree("sampling_tree_verify", node_ids, node_valid, parents, target_probs)
    batch, n = node_ids.shape
    device = node_ids.device
    rows = torch.arange(batch, device=device)
    if ancestors is None:
        ancestors = ancestor_mask(parents, node_valid)
    depths = node_depths(ancestors)
    parent_slot = torch.where(node_valid, parents + 1, torch.full_like(parents, -1))  # (B, n); invalid -> none
    safe_ids = node_ids.clamp_min(0)
    current = torch.zeros(batch, dtype=torch.long, device=device)  # slot of the deepest accepted node
    walking = torch.ones(batch, dtype=torch.bool, device=device)
    for _ in range(n if max_depth is None else min(max_depth, n)):  # rows that stopped idle
        p = target_probs[rows, current]  # (B, V)
        is_child = (parent_slot == current[:, None]) & walking[:, None]  # (B, n)
        p_child = p.gather(1, safe_ids) * is_child  # (B, n) p(x) of each child, 0 elsewhere
        mass_before = p_child.cumsum(dim=-1) - p_child  # (B, n) mass of earlier siblings
        chance = p_child / (1.0 - mass_before).clamp_min(MIN_MASS)
        accept = is_child & (sampler.uniform((batch, n)) < chance)  # (B, n)
        first = torch.where(accept, torch.arange(n, device=device), torch.full_like(parent_slot, n)).min(-1).values
        moved = first < n
        current = torch.where(moved, first + 1, current)
        walking = walking & moved
    accepted = depths.gather(1, current[:, None])[:, 0]
    # Residual at the final node: p with every child removed (all were rejected), or p itself at a leaf.
    p = target_probs[rows, current]  # (B, V)
    children = (parent_slot == current[:, None]).float()  # (B, n)
    removed = torch.zeros_like(p).scatter_add_(1, safe_ids, children).clamp_max(1.0) * p  # (B, V)
    last = _sample_residual(p, removed, sampler)
    path = _path_slots(ancestors, depths, current)
    slot_tokens = torch.cat([torch.zeros_like(safe_ids[:, :1]), safe_ids], dim=1)  # (B, n+1) token per slot
    tokens = slot_tokens.gather(1, path)  # (B, n+1) path tokens, root first
    tokens = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1).scatter(1, accepted[:, None], last[:, None])
    return accepted, _pad_after(tokens, accepted), path
