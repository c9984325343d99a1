"""MTP as a runtime `Proposer`: chain drafting, one depth per draft token, each depth with its own KV cache.

Each depth d is its own causal sequence (model.py): position i holds (embed(t_{i+d}), h^{d-1}_i). With the
context t_0..t_p (p = positions paired by `extend`), depth d's entries at positions <= p-d use committed tokens
only and are kept; the entries at p-d+1..p-1 need drafts d_1..d_{d-1} (t_{p+j} = d_j) and are recomputed each
round. Drafting from the last committed position p-1, for p = 5:

    position                 0   1   2   3   4
    depth 1  token t_{i+1}   t1  t2  t3  t4  t5       all committed            h^1_4 -> d1 = t6
    depth 2  token t_{i+2}   t2  t3  t4  t5  d1       0..3 committed, 4 draft  h^2_4 -> d2 = t7
    depth 3  token t_{i+3}   t3  t4  t5  d1  d2       0..2 committed           h^3_4 -> d3 = t8

So each draft is exactly what the training forward (one causal pass per depth) gives on the context followed by
the earlier drafts, and depth d re-runs only its d-1 speculative positions. All model work happens in
`propose`; `extend` only records tokens and h^0, the target's final norm applied to capture id L: the state the
target's own logits (and vLLM's forward output) come from, as in training. Drafts are argmax (one-hot), so the
sampler is not used. Rows of a batch commit different numbers of tokens, so each row keeps its own state and
drafts on its own; a row that got no new token since its last proposal has finished and drafts nothing (its
state stays as it was, and the runtime ignores its drafts anyway).

Engines differ past depth 1: vLLM and SGLang run depth d+1 at the *next* position of one shared MTP cache
(EAGLE-style), which matches neither DeepSeek-V3's training nor this runtime, so their acceptance at positions
>= 2 can be lower than measured here; depth 1 is the same everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from draftsmith import device as dev
from draftsmith.models.mtp.io import load_mtp_drafter
from draftsmith.models.mtp.model import MtpDrafter
from draftsmith.models.target import KVCache
from draftsmith.runtime.proposer import MAX_GRAPHED_DRAFT_WIDTH, PAD_DRAFT_TOKEN, Proposal

INITIAL_CACHE_LENGTH = 2048


class MtpProposer:
    def __init__(self, drafter: MtpDrafter, embed_tokens: torch.nn.Module, final_norm: torch.nn.Module,
                 lm_head: torch.nn.Module, num_speculative_tokens: int):
        cfg = drafter.config
        if cfg.max_depth is not None and num_speculative_tokens > cfg.max_depth:
            raise ValueError(f"MTP drafter has {cfg.num_modules} sequential module(s) and was not trained to reuse "
                             f"them: use num_speculative_tokens <= {cfg.max_depth}, or train with mtp.recursive=true")
        problem = drafter.runtime_support_error()
        if problem:
            raise ValueError(problem)
        self.drafter = drafter
        self.embed_tokens = embed_tokens  # the target's, shared
        self.final_norm = final_norm  # the target's: h^0 = final_norm(capture id L)
        self.lm_head = lm_head  # the target's, shared
        self.num_depths = num_speculative_tokens
        self.aux_layer_ids = (cfg.num_target_layers,)  # the last layer's output, normed in extend
        param = next(drafter.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.rows: list[_Row] = []
        self._cache_length = INITIAL_CACHE_LENGTH  # slots of a depth's cache made for this request (`begin`)
        self._graphs_on = dev.graphs_supported(self.device)
        self._graphs = dev.GraphPool()  # one request: (depth, positions run, cache id) -> graph of one depth
        self._kept_caches: list[KVCache] = []  # one request's per-depth caches, kept so the graphs stay valid

    @classmethod
    def from_config(cls, spec, target) -> "MtpProposer":
        """`spec.model`: an MTP checkpoint or export; omitted = the target's own native MTP weights (as vLLM)."""
        path = spec.model or target.name_or_path
        try:
            drafter = load_mtp_drafter(path, device=target.device, dtype=target.dtype)
        except ValueError as e:
            hint = "" if spec.model else " (no \"model\" given, so the target's own MTP weights were looked for)"
            raise ValueError(f"speculative config: method mtp: {e}{hint}") from None
        cfg = drafter.config
        target.check_drafter_fits(path, "MTP drafter", cfg.vocab_size, cfg.hidden_size, cfg.num_target_layers)
        return cls(drafter, target.embed_tokens, target.final_norm, target.lm_head, spec.num_speculative_tokens)

    def begin(self, prompt_ids: torch.Tensor, sampler=None) -> None:
        """Per-depth state (a cache each) is made when `propose` first reaches that depth: a recursive drafter takes
        any k, and the runtime asks for fewer when max_new_tokens is smaller."""
        length = max(INITIAL_CACHE_LENGTH, 2 * prompt_ids.shape[1])
        self.rows = []
        self._cache_length = length
        single = self._graphs_on and prompt_ids.shape[0] == 1
        if single and not (self._kept_caches and self._kept_caches[0].max_length >= length):
            self._graphs.clear()
            self._kept_caches = []
        for cache in self._kept_caches if single else []:
            cache.length = 0
        for row in prompt_ids.to(self.device, torch.long):
            self.rows.append(_Row(
                caches=list(self._kept_caches) if single else [],
                committed=[0],
                pending=[self._no_hidden()],
                tokens=row[row != PAD_DRAFT_TOKEN][None] if prompt_ids.shape[0] > 1 else row[None],
            ))

    def _no_hidden(self) -> torch.Tensor:
        return torch.empty(1, 0, self.drafter.config.hidden_size, dtype=self.dtype, device=self.device)

    def _reach(self, row: "_Row", num: int) -> None:
        """`row`'s state for depths 1..num: a depth not run yet starts as `begin` would have made it (nothing
        committed, no pending states), which is what its state is until it first runs."""
        single = self._graphs_on and len(self.rows) == 1  # the row holds every kept cache already (`begin`)
        while len(row.caches) < num:
            cache = self.drafter.new_cache(1, self._cache_length, self.dtype, self.device)
            row.caches.append(cache)
            if single:
                self._kept_caches.append(cache)  # kept across requests, with the graphs recorded on it
        row.committed += [0] * (num - len(row.committed))
        row.pending += [self._no_hidden() for _ in range(num + 1 - len(row.pending))]

    def extend(self, token_ids: torch.Tensor, aux_hidden: torch.Tensor | None) -> None:
        if aux_hidden is None:
            raise ValueError("MTP needs the target's last hidden state in extend()")
        token_ids = token_ids.to(self.device, torch.long)
        # one row: every token is real; a batch: each row's count, PAD_DRAFT_TOKEN after it (one host sync)
        counts = [token_ids.shape[1]] if len(self.rows) == 1 else (token_ids != PAD_DRAFT_TOKEN).sum(1).tolist()
        h0 = self.final_norm(aux_hidden).to(self.dtype)  # (B, n, H) what the engines hand MTP (model.py)
        for b, (row, n) in enumerate(zip(self.rows, counts)):
            p = row.paired
            # token_ids[b, j] is the token at position p + 1 + j (restated prompt tokens included, Proposer docs)
            row.tokens = torch.cat([row.tokens[:, : p + 1], token_ids[b: b + 1, :n]], dim=1)
            row.pending[0] = torch.cat([row.pending[0], h0[b: b + 1, :n]], dim=1)
            row.paired = p + n

    @torch.no_grad()
    def propose(self, num_tokens: int) -> Proposal:
        num = min(num_tokens, self.num_depths)
        if num <= 0:
            return Proposal.empty(len(self.rows), self.device)
        # A finished row (extended by nothing since it last drafted) has no new position to run depth 1 on.
        live = [row.paired > row.committed[0] for row in self.rows]
        chains = [self._propose_row(row, num) if on else self._no_drafts(num) for row, on in zip(self.rows, live)]
        token_ids = torch.cat([c[0] for c in chains])  # (B, num)
        lengths = torch.full((len(self.rows),), num, dtype=torch.long, device=self.device)  # (B,)
        if not all(live):  # a host-to-device copy only in the steps after a row finished
            lengths = torch.tensor([num if on else 0 for on in live], dtype=torch.long, device=self.device)
        return Proposal(token_ids=token_ids, lengths=lengths, scores=torch.cat([c[1] for c in chains]))

    def _no_drafts(self, num: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(PAD_DRAFT_TOKEN (1, num), -inf log-probs (1, num)): the drafts of a row that has finished."""
        return (torch.full((1, num), PAD_DRAFT_TOKEN, dtype=torch.long, device=self.device),
                torch.full((1, num), float("-inf"), device=self.device))

    def _propose_row(self, row: "_Row", num: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(drafts (1, num), their log-probs (1, num)) for one row, updating its committed per-depth state."""
        self._reach(row, num)
        p = row.paired
        sequence = row.tokens  # (1, p+1), drafts appended below: index p+j holds d_j
        speculative = row.pending[0][:, :0]  # h^{d-1} at positions beyond depth d-1's committed ones
        drafts, scores = [], []
        for depth in range(1, num + 1):
            start = row.committed[depth - 1]
            hidden = torch.cat([row.pending[depth - 1], speculative], dim=1)  # h^{d-1} at start..p-1
            assert hidden.shape[1] == p - start, (depth, hidden.shape, p, start)
            tokens = sequence[:, start + depth: p + depth]  # t_{i+d} for i in start..p-1
            row.caches[depth - 1].rollback(start)
            cache = row.ensure_capacity(depth, p, self.drafter)
            out, score, token = self._depth(depth, tokens, hidden, cache, start)  # h^d at start..p-1, its draft
            done = max(0, p - depth + 1 - start)  # positions start..p-d use committed tokens only: keep them
            row.pending[depth] = torch.cat([row.pending[depth], out[:, :done]], dim=1)
            row.pending[depth - 1] = row.pending[depth - 1][:, done:]
            row.committed[depth - 1] = start + done
            speculative = out[:, done:]
            drafts.append(token)
            scores.append(score)
            sequence = torch.cat([sequence, token[:, None]], dim=1)
        return torch.stack(drafts, dim=1), torch.stack(scores, dim=1)

    def _depth(self, depth: int, tokens, hidden, cache: KVCache, start: int):
        """Depth `depth` over positions start.. (tokens (1, T) = t_{i+d}, hidden (1, T, H) = h^{d-1}): h^d (1, T, H)
        and the draft its last position reads (log-prob (1,), id (1,)). One request on CUDA replays a graph per
        (depth, T): the eager form launches a few hundred small kernels per depth."""
        if not (self._graphs_on and len(self.rows) == 1 and tokens.shape[1] <= MAX_GRAPHED_DRAFT_WIDTH):
            return self._depth_eager(depth, tokens, hidden, cache)
        starts = torch.full((1,), start, dtype=torch.long, device=self.device)
        key = (depth, tokens.shape[1], id(cache))
        out, score, token = self._graphs.run(key, partial(self._depth_static, depth, cache), tokens, hidden, starts)
        cache.length = start + tokens.shape[1]
        return out.clone(), score.clone(), token.clone()

    def _depth_eager(self, depth, tokens, hidden, cache):
        out = self.drafter.step(depth, self.embed_tokens(tokens), hidden, cache)
        return (out, *self._read_draft(out))

    def _depth_static(self, depth, cache, tokens, hidden, starts):
        out = self.drafter.step_static(depth, self.embed_tokens(tokens), hidden, cache, starts)
        return (out, *self._read_draft(out))

    def _read_draft(self, out):
        """(log-prob (1,), id (1,)) of the argmax at the last position: lm_head(h^d_{p-1}) predicts t_{p+d} (out is
        normed, model.py)."""
        logits = self.lm_head(out[:, -1]).float()  # (1, V)
        return torch.log_softmax(logits, dim=-1).max(dim=-1)


@dataclass
class _Row:
    """One request's drafting state."""

    caches: list[KVCache]  # per depth (index d-1)
    committed: list[int]  # per depth: cache positions 0..committed-1 hold entries built from committed tokens
    pending: list[torch.Tensor]  # index d: committed h^d (1, n, H) not yet consumed by depth d+1; 0 = target h^0
    tokens: torch.Tensor  # (1, p+1) committed context
    paired: int = 0  # p: positions whose next token `extend` has given

    def ensure_capacity(self, depth: int, needed: int, drafter: MtpDrafter) -> KVCache:
        cache = self.caches[depth - 1]
        if needed > cache.max_length:
            bigger = drafter.new_cache(1, max(needed, 2 * cache.max_length), cache.keys.dtype, cache.keys.device)
            bigger.keys[..., : cache.length, :] = cache.keys[..., : cache.length, :]
            bigger.values[..., : cache.length, :] = cache.values[..., : cache.length, :]
            bigger.length = cache.length
            self.caches[depth - 1] = cache = bigger
        return cache
