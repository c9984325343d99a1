"""Verified speculative generation: propose, verify with one target step, commit, fix the cache, repeat.

Lossless: greedy output equals plain greedy decoding of the target (up to floating-point ties), and sampled
output is distributed exactly as the target's own sampling (`runtime/verify.py`), whatever the proposer drafts,
chain or tree. With `proposer=None` the same loop is plain decoding, the baseline speedups are measured against.

Batches. Requests of different lengths share one target cache with a *shared write pointer and per-row
validity*: every step writes the same slots for all rows, and a (B, T_max) mask records which slots each row
may attend to. Prompts are left-padded (pad slots invalid) and each row has its own position ids, so a row sees
exactly the keys and positions it would see alone. A row that accepts fewer tokens than the best row of a step
leaves invalid slots behind ("holes"); a finished row keeps riding along, invalid, until the batch ends. When
the pointer reaches the end of the cache, every row's valid slots are gathered to the front (`_defragment`).
A single request never has holes, so it runs with the plain causal mask and no bookkeeping at all.

Context. A request must fit the target's context with all it may generate (prompt + max_new_tokens <= context,
`target.prompt_overflow`, vLLM's rule for max_model_len); drafts need no room of their own: as vLLM's scheduler
does, a step verifies only the drafts after which the row, bonus token included, still fits (a chain is cut, a
tree loses its deeper nodes). That trim happens only in a request's last steps, when the prompt nearly fills the
context.

Metrics (vLLM's counters, `runtime/metrics.py`), per request, counted as vLLM counts them: every step drafts k
tokens, the last one of a request too, and accepted drafts past max_new_tokens are counted though never output. A
chain step counts its drafts as `num_draft_tokens`. A tree step counts every tree node it verified (the nodes within
depth k), as vLLM does for its static trees, whose `num_speculative_tokens` is the node count; `num_accepted_tokens`
is the accepted path's length and `num_accepted_tokens_per_pos[i]` counts steps whose path reached depth i+1. So for
trees the mean acceptance length (1 + accepted / drafts) compares directly with chains, while the draft acceptance
rate (accepted / draft tokens) is low by construction: most nodes lie off the accepted path.

One departure from vLLM: a k above max_new_tokens drafts max_new_tokens a step (`draft_width`; a tree is that deep
at most), since no more can ever be output, where vLLM's k would cost a drafter loop and a target step
proportional to k (num_speculative_tokens 100000 with 8 new tokens once ran for minutes); a chain's
`num_spec_tokens` is then that width.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from draftsmith import device as dev
from draftsmith.models.target import TargetError, check_num_speculative_tokens, context_length_of, prompt_overflow
from draftsmith.runtime.metrics import SpecDecodingMetrics
from draftsmith.runtime.proposer import PAD_DRAFT_TOKEN, Proposal, Proposer
from draftsmith.runtime.sampling import GREEDY, Sampler, SamplingParams
from draftsmith.runtime.tree import ancestor_mask, causal_mask, compact_kv, node_depths, step_attention_mask
from draftsmith.runtime.verify import greedy_tree_verify, greedy_verify, rejection_verify, sampling_tree_verify


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens only (EOS kept when it ended the output)
    metrics: SpecDecodingMetrics
    num_target_steps: int  # target forward passes this request took part in, prefill included
    seconds: float  # wall time of the whole generation (of the whole batch), prefill included


@dataclass
class _StepDrafts:
    """One step's drafts on the target's device, cut to the width that is verified."""

    token_ids: Tensor  # (B, w) PAD_DRAFT_TOKEN where invalid
    lengths: Tensor  # (B,) valid chain drafts / tree nodes
    parents: Tensor | None  # (B, w) tree parents, None for a chain
    draft_probs: Tensor | None  # (B, w, V) or None (one-hot drafts)
    depth: int | None = None  # a tree's depth bound when the proposer gave one (`Proposal.depth`)


class SpeculativeGenerator:
    def __init__(self, target, proposer: Proposer | None, num_speculative_tokens: int):
        """Refuses a k the target's context can never verify (`target.check_num_speculative_tokens`)."""
        if proposer is not None and num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1 with a proposer, got {num_speculative_tokens}")
        self.target = target
        self.proposer = proposer
        self.k = num_speculative_tokens if proposer is not None else 0
        if self.k:
            check_num_speculative_tokens(self.k, target.config)

    def draft_width(self, max_new_tokens: int) -> int:
        """Drafts a step of a generation of `max_new_tokens` asks for: k, or max_new_tokens when k is larger (drafts
        past it could never be output). What a warm-up must also ask for to record the same graphs."""
        return min(self.k, max(max_new_tokens, 0))

    def generate(self, prompt_ids: Tensor, max_new_tokens: int, eos_token_ids: set[int] | None = None,
                 sampling: SamplingParams | None = None) -> GenerationResult:
        """Decode up to `max_new_tokens` tokens after `prompt_ids` (1, S), stopping after an EOS token.

        `sampling` None or temperature 0: greedy. Otherwise speculative sampling with `sampling`'s temperature,
        top-k, top-p and seed.
        """
        if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1 or prompt_ids.shape[1] < 1:
            raise ValueError(
                f"generate: prompt_ids must be (1, S) with S >= 1 (generate_batch takes several prompts), "
                f"got {tuple(prompt_ids.shape)}"
            )
        return self.generate_batch([prompt_ids[0]], max_new_tokens, eos_token_ids, sampling)[0]

    @torch.no_grad()
    def generate_batch(self, prompts: Sequence[Sequence[int] | Tensor], max_new_tokens: int,
                       eos_token_ids: set[int] | None = None,
                       sampling: SamplingParams | None = None) -> list[GenerationResult]:
        """Decode every prompt (token id lists or 1-D tensors of any lengths) together; one result per prompt.

        Greedy results equal those of `generate` on each prompt alone; each row drafts, accepts and stops on its
        own. Cache bookkeeping of one row, with c = committed tokens (prompt + generated): its valid cache
        slots hold positions 0..c-2; the last committed token is not in it yet and is the first input of the
        next step::

            step input   [last, d_0 .. d_w-1]        positions c-1 .. (tree: c-1 + depth)
            verified     a drafts accepted + 1 recovered/bonus token
            committed    c -> c + a + 1               slots of last and the accepted path kept (tree: compacted
                                                      to consecutive slots), the rest invalid or overwritten
        """
        with dev.sdpa_without_cudnn():
            return self._generate_batch(prompts, max_new_tokens, eos_token_ids, sampling)

    def _generate_batch(self, prompts, max_new_tokens, eos_token_ids, sampling) -> list[GenerationResult]:
        rows = [torch.as_tensor(p, dtype=torch.long).flatten().cpu() for p in prompts]
        if not rows or any(r.numel() < 1 for r in rows):
            raise ValueError("generate_batch: need at least one prompt, each of at least one token")
        target, proposer = self.target, self.proposer
        k = self.draft_width(max_new_tokens)  # the drafts a step asks for, whatever num_speculative_tokens says
        for b, r in enumerate(rows):
            overflow = prompt_overflow(r.numel(), max_new_tokens, target.config)
            if overflow:
                raise TargetError(f"prompt {b}: {overflow}: shorten it or lower max_new_tokens")
        context = context_length_of(target.config)
        device = target.device
        batch = len(rows)
        eos = eos_token_ids or set()
        params = sampling or GREEDY
        sampler = None if params.greedy else Sampler(params, device)
        metrics = [SpecDecodingMetrics(num_spec_tokens=k) for _ in rows]
        start_time = time.perf_counter()
        if max_new_tokens <= 0:
            return [GenerationResult([], m, 0, time.perf_counter() - start_time) for m in metrics]

        # ---- prefill: left-padded prompts, one row per request -------------------------------------------
        prompt_lengths = [r.numel() for r in rows]
        width = max(prompt_lengths)
        pads = [width - n for n in prompt_lengths]
        ragged = any(pads)
        ids = torch.zeros(batch, width, dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, pads[b]:] = r
        ids = ids.to(device)
        aux_ids = proposer.aux_layer_ids if proposer is not None else None
        cache = target.new_cache(batch, width + max_new_tokens + k + 1)  # a wider tree grows it (`_grown`)
        valid = None  # (B, T_max) bool per-row valid slots; None while every slot < cache.length is valid
        if ragged:
            valid = torch.zeros(batch, cache.max_length, dtype=torch.bool, device=device)
            pad_t = torch.tensor(pads, device=device)
            valid[:, :width] = torch.arange(width, device=device)[None, :] >= pad_t[:, None]
            positions = (torch.arange(width, device=device)[None, :] - pad_t[:, None]).clamp_min(0)  # (B, S)
            # Pad queries see themselves only, so no softmax row is empty (an all-masked row gives NaN).
            own = torch.eye(width, dtype=torch.bool, device=device)[None]
            mask = (causal_mask(width, device) & (valid[:, None, :width] | own))[:, None]  # (B, 1, S, S)
            out = target.step(ids, cache, aux_layer_ids=aux_ids, logits_to_keep=1, attention_mask=mask,
                              position_ids=positions)
        else:
            out = target.step(ids, cache, aux_layer_ids=aux_ids, logits_to_keep=1)
        last = self._choose(out.logits[:, -1], sampler)[:, None]  # (B, 1) first generated tokens
        outputs = [[t] for t in last[:, 0].tolist()]
        steps = [1] * batch
        active = [not (o[0] in eos or max_new_tokens <= 1) for o in outputs]
        positions_host = list(prompt_lengths)  # position id of each row's `last`
        if proposer is not None:
            proposer.begin(_right_padded(rows, width, device), sampler)
            # Feature at prompt position i pairs with the token at i+1; the last one with the first generated token.
            shifted = [torch.cat([r[1:].to(device), last[b]]) for b, r in enumerate(rows)]
            aux = out.aux_hidden
            if ragged and aux is not None:  # left-aligned -> right-aligned, as the proposer reads rows
                index = (torch.arange(width, device=device)[None, :] + pad_t[:, None]).clamp_max(width - 1)
                aux = aux.gather(1, index[..., None].expand(-1, -1, aux.shape[-1]))  # (B, S, F)
            proposer.extend(_right_padded(shifted, width, device), aux)

        # ---- speculative steps ------------------------------------------------------------------------------
        while any(active):
            # As vLLM does, every step drafts k tokens, a request's last one too: drafts past max_new_tokens are
            # verified and counted (vLLM's counters include them) but never output. So each row drafts what it
            # would alone, and the counters are the ones a vLLM dashboard shows for the same requests.
            num_drafts = k
            if getattr(proposer, "reads_target_cache", False):  # a drafter attending to the target's cache
                proposer.see_target_cache(cache, valid)
            proposal = proposer.propose(num_drafts) if proposer is not None else None
            drafts = _step_drafts(proposal, num_drafts, batch, device)
            # vLLM's trim: the drafts after which a row, bonus token included, still fits the context (c + w + 1).
            rooms = None if context is None else [context - 2 - p for p in positions_host]
            if rooms is not None and drafts.parents is None:
                drafts = _cut_chains(drafts, rooms, active)
            width = drafts.token_ids.shape[1]
            if cache.length + width + 1 > cache.max_length and valid is not None:
                valid = _defragment(cache, valid)
            if cache.length + width + 1 > cache.max_length:  # a tree of more nodes than the chains it was sized for
                cache, valid = _grown(target, cache, valid, cache.max_length + width)
            base = cache.length
            holes = valid is not None
            row_positions = torch.tensor(positions_host, device=device)[:, None] if holes else base  # of `last`

            step_ids = torch.cat([last, drafts.token_ids.clamp_min(0)], dim=1)  # (B, 1+w) PAD -> any valid id
            if drafts.parents is not None:
                node_valid = torch.arange(width, device=device)[None, :] < drafts.lengths[:, None]  # (B, w)
                ancestors = ancestor_mask(drafts.parents, node_valid)  # (B, 1+w, 1+w)
                # Only the levels k allows are verified: a deeper node (and so its subtree) turns invalid. Its mask
                # row may stay: no valid node has it as an ancestor, and an invalid node is never accepted.
                node_valid = node_valid & (node_depths(ancestors)[:, 1:] <= num_drafts)
                if rooms is not None and min(r for r, on in zip(rooms, active) if on) < num_drafts:
                    room_t = torch.tensor(rooms, device=device)[:, None]  # (B, 1) a copy only near the end
                    node_valid = node_valid & (node_depths(ancestors)[:, 1:] <= room_t)
                out = target.step(step_ids, cache, aux_layer_ids=aux_ids,
                                  attention_mask=step_attention_mask(ancestors, valid, base),
                                  position_ids=row_positions + node_depths(ancestors))
                if sampler is None:
                    accepted, tokens, path = greedy_tree_verify(drafts.token_ids, node_valid, drafts.parents,
                                                                out.logits, ancestors)
                else:
                    levels = num_drafts if drafts.depth is None else min(num_drafts, drafts.depth)  # walk steps
                    accepted, tokens, path = sampling_tree_verify(drafts.token_ids, node_valid, drafts.parents,
                                                                  sampler.probs(out.logits), sampler, levels,
                                                                  ancestors)
                drafted = node_valid.sum(dim=-1)
            else:
                lengths = drafts.lengths
                if holes:
                    out = target.step(step_ids, cache, aux_layer_ids=aux_ids,
                                      attention_mask=step_attention_mask(causal_mask(width + 1, device), valid, base),
                                      position_ids=row_positions + torch.arange(width + 1, device=device))
                else:
                    out = target.step(step_ids, cache, aux_layer_ids=aux_ids)  # logits (B, 1+w, V)
                if sampler is None:
                    accepted, tokens, _ = greedy_verify(drafts.token_ids, lengths, out.logits)
                else:
                    accepted, tokens, _ = rejection_verify(drafts.token_ids, lengths, sampler.probs(out.logits),
                                                           drafts.draft_probs, sampler)
                path = None
                drafted = lengths
            # The one host sync of the step: accepted counts, draft counts and the committed tokens.
            host = torch.cat([accepted, drafted, tokens.flatten()]).tolist()
            accepted_h, drafted_h = host[:batch], host[batch: 2 * batch]
            tokens_h = [host[2 * batch + b * (width + 1): 2 * batch + (b + 1) * (width + 1)] for b in range(batch)]

            was_active = list(active)
            kept = [a + 1 if on else 0 for a, on in zip(accepted_h, was_active)]  # slots each row keeps
            for b in range(batch):
                if not was_active[b]:
                    continue
                steps[b] += 1
                if drafted_h[b] > 0:  # a step with no drafts is not a draft (vLLM)
                    if drafted_h[b] > metrics[b].num_spec_tokens:  # a tree: its nodes count against k, its node count
                        metrics[b] = metrics[b].merge(SpecDecodingMetrics(num_spec_tokens=self.k))
                    metrics[b].observe_draft(drafted_h[b], accepted_h[b])
                new_tokens = tokens_h[b][: kept[b]][: max_new_tokens - len(outputs[b])]
                hit = next((i for i, t in enumerate(new_tokens) if t in eos), None)
                if hit is not None:
                    new_tokens = new_tokens[: hit + 1]
                outputs[b].extend(new_tokens)
                kept[b] = len(new_tokens)  # a row that ends here keeps only what it output (its last drafts
                positions_host[b] += kept[b]  # were counted past the end, never committed)
                active[b] = hit is None and len(outputs[b]) < max_new_tokens

            # Fix the cache: keep each row's root + accepted path at base.., make the rest invalid.
            grow = max(kept)
            if path is not None:
                compact_kv(cache, base, path[:, :grow])
            if any(n < grow for n in kept) and valid is None:
                valid = torch.zeros(batch, cache.max_length, dtype=torch.bool, device=device)
                valid[:, :base] = True
            if valid is not None:
                kept_t = torch.tensor(kept, device=device)
                valid[:, base: base + grow] = torch.arange(grow, device=device)[None, :] < kept_t[:, None]
            cache.rollback(base + grow)
            last = tokens.gather(1, accepted[:, None])  # (B, 1) recovered or bonus token

            # Rows still running get their a + 1 tokens, finished rows nothing; a proposer that learns from whole
            # outputs (suffix decoding's global tree, as vLLM feeds it) also gets the last tokens of rows that
            # ended in this step.
            finals = getattr(proposer, "extends_finished_rows", False)
            counts = [n if on or (finals and was) else 0 for n, on, was in zip(kept, active, was_active)]
            if proposer is not None and (any(active) or (finals and any(counts))):
                if getattr(proposer, "extends_on_host", False):  # from this step's sync: no second one
                    extend_ids = torch.tensor([row[:n] + [PAD_DRAFT_TOKEN] * (grow - n)
                                               for row, n in zip(tokens_h, counts)], dtype=torch.long)
                else:
                    extend_ids = tokens[:, :grow]
                    if min(counts) < grow:
                        beyond = (torch.arange(grow, device=device)[None, :]
                                  >= torch.tensor(counts, device=device)[:, None])  # (B, grow)
                        extend_ids = extend_ids.masked_fill(beyond, PAD_DRAFT_TOKEN)
                aux = out.aux_hidden
                if aux is not None:
                    slots = path[:, :grow] if path is not None else None
                    aux = aux[:, :grow] if slots is None else aux.gather(
                        1, slots[..., None].expand(-1, -1, aux.shape[-1]))  # (B, grow, F)
                proposer.extend(extend_ids, aux)

        seconds = time.perf_counter() - start_time
        return [GenerationResult(o, m, s, seconds) for o, m, s in zip(outputs, metrics, steps)]

    @staticmethod
    def _choose(logits: Tensor, sampler: Sampler | None) -> Tensor:
        """(B, V) -> (B,) the target's argmax, or a sample from its processed distribution."""
        return logits.argmax(dim=-1) if sampler is None else sampler.sample(sampler.probs(logits))


def _right_padded(rows: list[Tensor], width: int, device) -> Tensor:
    """(B, width) rows left-aligned, PAD_DRAFT_TOKEN after: the layout proposers read."""
    out = torch.full((len(rows), width), PAD_DRAFT_TOKEN, dtype=torch.long)
    for b, r in enumerate(rows):
        out[b, : r.numel()] = r.cpu()
    return out.to(device)


def _step_drafts(proposal: Proposal | None, num_drafts: int, batch: int, device: torch.device) -> _StepDrafts:
    """This step's drafts on `device`, cut to the width verified.

    Chains are cut to `num_drafts`. Lengths a proposer keeps on the CPU (n-gram) are read for free and the
    drafts cut to them, so a step with no match costs one token like plain decoding. Lengths on an accelerator
    are not read (that would be a second sync); the full width is verified and the lengths mask the padding.
    """
    if proposal is None:
        proposal = Proposal.empty(batch, device)
    if proposal.token_ids.shape[0] != batch:
        raise ValueError(f"proposer returned {proposal.token_ids.shape[0]} rows for {batch} requests")
    token_ids, lengths = proposal.token_ids, proposal.lengths
    parents, draft_probs = proposal.parents, proposal.draft_probs
    if parents is None:
        token_ids, lengths = token_ids[:, :num_drafts], lengths.clamp_max(num_drafts)
    if lengths.device.type == "cpu":
        token_ids = token_ids[:, : int(lengths.max()) if lengths.numel() else 0]
    w = token_ids.shape[1]
    return _StepDrafts(
        token_ids=dev.host_to_device(token_ids, device).long(),
        lengths=dev.host_to_device(lengths, device).long(),
        parents=dev.host_to_device(parents[:, :w], device).long() if parents is not None else None,
        draft_probs=dev.host_to_device(draft_probs[:, :w], device) if draft_probs is not None else None,
        depth=proposal.depth,
    )


def _cut_chains(drafts: _StepDrafts, rooms: list[int], active: list[bool]) -> _StepDrafts:
    """Chains cut to each row's room in the context (`rooms`, drafts that fit); unchanged, with no copy to the
    device, while every running row has room for all of them, as in every step but a long request's last ones."""
    width = drafts.token_ids.shape[1]
    running = [room for room, on in zip(rooms, active) if on]
    if not running or min(running) >= width:
        return drafts
    widest = max(0, min(width, max(running)))
    room_t = torch.tensor([min(max(0, room), widest) for room in rooms], device=drafts.lengths.device)  # (B,)
    return _StepDrafts(token_ids=drafts.token_ids[:, :widest], lengths=torch.minimum(drafts.lengths, room_t),
                       parents=None, draft_probs=None if drafts.draft_probs is None else drafts.draft_probs[:, :widest],
                       depth=drafts.depth)


def _grown(target, cache, valid: Tensor | None, max_length: int):
    """(a cache of `max_length` slots holding `cache`'s, the validity widened to it): a step wider than the cache
    was sized for, a draft tree of more nodes than max_new_tokens, say."""
    bigger = target.new_cache(cache.keys.shape[1], max_length)
    length = cache.length
    bigger.keys[:, :, :, :length] = cache.keys[:, :, :, :length]
    bigger.values[:, :, :, :length] = cache.values[:, :, :, :length]
    bigger.length = length
    if valid is not None:
        wider = torch.zeros(valid.shape[0], bigger.max_length, dtype=torch.bool, device=valid.device)
        wider[:, : valid.shape[1]] = valid
        valid = wider
    return bigger, valid


def _defragment(cache, valid: Tensor) -> Tensor | None:
    """Gather every row's valid slots to the front of the cache; returns the new validity (None: no holes)."""
    length = cache.length
    counts = valid[:, :length].sum(dim=-1)  # (B,)
    order = torch.sort((~valid[:, :length]).to(torch.int8), dim=-1, stable=True).indices  # valid slots first
    new_length = int(counts.max())
    compact_kv(cache, 0, order[:, :new_length])
    cache.rollback(new_length)
    fresh = torch.zeros_like(valid)
    fresh[:, :new_length] = torch.arange(new_length, device=valid.device)[None, :] < counts[:, None]
    return fresh
