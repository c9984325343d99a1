"""EAGLE-3 as a runtime `Proposer`: chain drafting (argmax or sampled) and EAGLE-2 draft trees, any batch size.

State between calls: the drafter cache holds the committed pairs (embed(x_{t+1}), g_t) for t < p, and
`self.next_hidden` is the drafter's output hidden at the last committed position, whose logits give the first
draft. Drafting appends speculative slots to the cache; the next `extend` drops them (rolls back to the
committed slots) and appends the accepted tokens paired with the *target's* features, so the drafter never
needs its tree slots compacted: only the target's cache is.

Batches (B > 1) use the layout of the target's cache in the generator: one write pointer for all rows, a (B, T)
validity mask and per-row positions, because rows commit different numbers of tokens per step. Position of a
pair = the number of committed pairs before it in its row; draft node at tree depth d sits at position p + d - 1.

Trees: `tree.static_tree` (vLLM's `speculative_token_tree`) or `tree.dynamic_tree` (EAGLE-2), each expansion
one drafter step over a level of nodes with a tree mask: a node attends to the committed context, its
expanded ancestors and itself.
"""

from __future__ import annotations

import torch
from torch import Tensor

from draftsmith import device as dev
from draftsmith.models.eagle3.io import load_drafter
from draftsmith.models.eagle3.model import Eagle3Drafter
from draftsmith.models.target import KVCache
from draftsmith.runtime.proposer import MAX_GRAPHED_DRAFT_WIDTH, PAD_DRAFT_TOKEN, ROOT_PARENT, Proposal
from draftsmith.runtime.sampling import Sampler
from draftsmith.runtime.tree import causal_mask, dynamic_tree, parse_token_tree, static_tree, step_attention_mask

INITIAL_CACHE_LENGTH = 2048
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")  # vLLM's draft_sample_method values


class Eagle3Proposer:
    def __init__(self, drafter: Eagle3Drafter, embed_tokens: torch.nn.Module, draft_sample_method: str = "greedy",
                 token_tree: list[tuple[int, ...]] | None = None, dynamic_tree: dict | None = None,
                 num_nodes: int | None = None):
        """`token_tree` (breadth-first paths) or `dynamic_tree` ({"depth", "top_k"}, with `num_nodes` kept)
        turn on tree drafting; neither: chains."""
        if draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"eagle3: draft_sample_method must be one of {DRAFT_SAMPLE_METHODS}, "
                             f"got {draft_sample_method!r}")
        if token_tree is not None and dynamic_tree is not None:
            raise ValueError("eagle3: give a static token tree or a dynamic tree, not both")
        if dynamic_tree is not None and not num_nodes:
            raise ValueError("eagle3: a dynamic tree needs num_nodes (num_speculative_tokens)")
        self.drafter = drafter
        self.embed_tokens = embed_tokens  # the target's, shared
        self.aux_layer_ids = tuple(drafter.config.aux_layer_ids)
        self.draft_sample_method = draft_sample_method
        self.token_tree = token_tree
        self.dynamic_tree = dynamic_tree
        self.num_nodes = num_nodes
        param = next(drafter.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.draft_ids_in_target = torch.arange(drafter.config.draft_vocab_size, device=self.device) + drafter.d2t
        self.cache: KVCache | None = None
        self.committed = 0  # slots in the cache that belong to the committed context
        self.next_hidden: Tensor | None = None  # (B, 1, H)
        self.sampler: Sampler | None = None
        self.ragged = False  # B > 1: per-row validity and positions
        self.valid: Tensor | None = None  # (B, T_max) bool, used when ragged
        self.positions: Tensor | None = None  # (B,) committed pairs per row = position of the next pair
        self._graphs_on = dev.graphs_supported(self.device)
        # one request: ("chain", k, sampling | "extend", width | "tree", depth; cache id)
        self._graphs = dev.GraphPool()
        self._tree_slots: dict = {}  # tree graph key -> drafter cache slots its expansions take

    @classmethod
    def from_config(cls, spec, target) -> "Eagle3Proposer":
        if not spec.model:
            raise ValueError("speculative config: method eagle3 needs \"model\": the drafter folder")
        drafter = load_drafter(spec.model, device=target.device, dtype=target.dtype)
        cfg = drafter.config
        target.check_drafter_fits(spec.model, "drafter", cfg.vocab_size, cfg.target_hidden_size)
        target.check_aux_layer_ids(cfg.aux_layer_ids)
        tree = getattr(spec, "speculative_token_tree", None)
        return cls(drafter, target.embed_tokens,
                   draft_sample_method=getattr(spec, "draft_sample_method", None) or "greedy",
                   token_tree=parse_token_tree(tree) if tree else None,
                   dynamic_tree=getattr(spec, "dynamic_tree", None), num_nodes=spec.num_speculative_tokens)

    # ---- committed context ---------------------------------------------------------------------------------
    def begin(self, prompt_ids: Tensor, sampler: Sampler | None = None) -> None:
        batch = prompt_ids.shape[0]
        length = max(INITIAL_CACHE_LENGTH, 2 * prompt_ids.shape[1])
        reusable = (self._graphs_on and self.cache is not None and self.cache.keys.shape[1] == batch
                    and self.cache.max_length >= length)
        if reusable:  # keep the cache (and the graphs recorded on it) across requests
            self.cache.length = 0
        else:
            self._graphs.clear()
            self.cache = self.drafter.new_cache(batch, length, self.dtype, self.device)
        self.committed = 0
        self.next_hidden = None
        self.sampler = sampler
        self.ragged = batch > 1  # a single request never has padding: plain causal steps
        self.valid = torch.zeros(batch, length, dtype=torch.bool, device=self.device) if self.ragged else None
        self.positions = torch.zeros(batch, dtype=torch.long, device=self.device)

    def _ensure_capacity(self, needed: int) -> None:
        if needed <= self.cache.max_length:
            return
        length = max(needed, 2 * self.cache.max_length)
        bigger = self.drafter.new_cache(self.cache.keys.shape[1], length, self.dtype, self.device)
        bigger.keys[..., : self.cache.length, :] = self.cache.keys[..., : self.cache.length, :]
        bigger.values[..., : self.cache.length, :] = self.cache.values[..., : self.cache.length, :]
        bigger.length = self.cache.length
        self.cache = bigger
        self._graphs.clear()  # recorded on the old cache's memory
        if self.valid is not None:
            grown = torch.zeros(self.valid.shape[0], length, dtype=torch.bool, device=self.device)
            grown[:, : self.valid.shape[1]] = self.valid
            self.valid = grown

    def _run(self, token_ids: Tensor, hidden: Tensor, new_mask: Tensor, depth: Tensor) -> Tensor:
        """One drafter step over T new slots: `new_mask` (B or 1, T, T) among them, `depth` (B or 1, T) offsets
        of their positions from each row's committed count. Plain causal step when nothing needs a mask."""
        embeds = self.embed_tokens(token_ids.clamp_min(0))  # (B, T, H) PAD -> any id, masked
        if not self.ragged and new_mask is None:
            return self.drafter.step(embeds, hidden, self.cache)
        if new_mask is None:
            new_mask = causal_mask(token_ids.shape[1], self.device)
        length = self.cache.length
        mask = step_attention_mask(new_mask, self.valid if self.ragged else None, length)  # (B, 1, T, L+T)
        positions = self.positions[:, None] + depth  # (B, T)
        return self.drafter.step(embeds, hidden, self.cache, attention_mask=mask, position_ids=positions)

    @torch.no_grad()
    def extend(self, token_ids: Tensor, aux_hidden: Tensor | None) -> None:
        if aux_hidden is None:
            raise ValueError("EAGLE-3 needs the target's aux hidden states in extend()")
        self.cache.rollback(self.committed)  # drop the speculative slots of the last draft
        batch, n = token_ids.shape
        self._ensure_capacity(self.committed + n + 1)
        if not self.ragged and self._graphs_on and n <= MAX_GRAPHED_DRAFT_WIDTH:
            start = torch.full((1, 1), self.committed, dtype=torch.long, device=self.device)
            out = self._graphs.run(("extend", n, id(self.cache)), self._extend_static, token_ids,
                                   aux_hidden.to(self.dtype), start)
            self.next_hidden = out[:, -1:].clone()
            self.positions += n
            self.cache.length = self.committed + n
            self.committed = self.cache.length
            return
        fused = self.drafter.fuse(aux_hidden.to(self.dtype))  # (B, n, H)
        if not self.ragged:
            out = self._run(token_ids, fused, None, None)  # (B, n, H)
            self.next_hidden = out[:, -1:]
            self.positions += n
        else:
            real = token_ids != PAD_DRAFT_TOKEN  # (B, n) a prefix of each row
            counts = real.sum(dim=-1)  # (B,)
            own = torch.eye(n, dtype=torch.bool, device=self.device)[None]
            new_mask = causal_mask(n, self.device) & (real[:, None, :] | own)  # pad queries see themselves
            out = self._run(token_ids, fused, new_mask, torch.arange(n, device=self.device)[None])
            last = out.gather(1, (counts - 1).clamp_min(0)[:, None, None].expand(-1, 1, out.shape[-1]))
            self.next_hidden = last if self.next_hidden is None else torch.where(
                counts[:, None, None] > 0, last, self.next_hidden)  # rows given nothing keep their state
            self.valid[:, self.committed: self.committed + n] = real
            self.positions += counts
        self.committed = self.cache.length

    def _extend_static(self, token_ids, aux_hidden, start):
        """The extend step of one request with fixed shapes (CUDA graphs): pairs at positions start..start+n-1."""
        positions = start + torch.arange(token_ids.shape[1], device=self.device)  # (1, n)
        embeds = self.embed_tokens(token_ids.clamp_min(0))
        return self.drafter.step_static(embeds, self.drafter.fuse(aux_hidden), self.cache, positions)

    # ---- drafting -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, num_tokens: int) -> Proposal:
        batch = self.next_hidden.shape[0]
        if num_tokens <= 0:
            return Proposal.empty(batch, self.device)
        self.cache.rollback(self.committed)  # a repeated propose replaces the previous drafts
        if self.token_tree is not None or self.dynamic_tree is not None:
            return self._propose_tree(num_tokens)
        self._ensure_capacity(self.committed + num_tokens)
        sampled = self.draft_sample_method == "probabilistic" and self.sampler is not None
        # sampled drafts race on Exp(1) draws made here, one (B, V_d) per step: the graphed chain cannot draw them
        race = self.sampler.race((num_tokens, batch, self.drafter.config.draft_vocab_size)) if sampled else None
        if self._graphs_on and batch == 1 and not self.ragged:
            return self._graphed_chain(num_tokens, race)
        hidden = self.next_hidden
        drafts, scores, probs = [], [], []
        if self.ragged:  # draft slots of this call see each other causally, the committed context per row
            self.valid[:, self.committed: self.committed + num_tokens] = True
        for i in range(num_tokens):
            logits = self.drafter.logits(hidden)[:, -1].float()  # (B, V_d)
            draft_id, score, q = self._choose(logits, None if race is None else race[i])
            if q is not None:
                probs.append(q)
            token = self.drafter.draft_to_target(draft_id)  # (B,) target ids
            drafts.append(token)
            scores.append(score)
            if i + 1 < num_tokens:
                hidden = self._run(token[:, None], hidden, None, torch.full((1, 1), i, device=self.device))
        token_ids = torch.stack(drafts, dim=1)  # (B, k)
        lengths = torch.full((batch,), num_tokens, dtype=torch.long, device=self.device)
        return Proposal(token_ids=token_ids, lengths=lengths, scores=torch.stack(scores, dim=1),
                        draft_probs=torch.stack(probs, dim=1) if sampled else None)

    def _choose(self, logits: Tensor, race: Tensor | None):
        """A draft id (B,) from float32 logits (B, V_d) and its score (B,): the argmax and its log-prob, or, with
        `race` (B, V_d), a sample of q (the sampler's processing of the logits) and log q of it. Third: q over the
        target's vocabulary (B, V), the draft distribution verification needs, or None for greedy drafts."""
        if race is None:
            score, draft_id = torch.log_softmax(logits, dim=-1).max(dim=-1)
            return draft_id, score, None
        q = self.sampler.probs(logits)  # (B, V_d) processed like the target's p
        draft_id = self.sampler.sample(q, race)
        q_target = torch.zeros(q.shape[0], self.drafter.config.vocab_size, device=self.device)
        q_target.index_copy_(1, self.draft_ids_in_target, q)
        return draft_id, q.gather(1, draft_id[:, None])[:, 0].log(), q_target

    def _graphed_chain(self, num_tokens: int, race: Tensor | None) -> Proposal:
        """The chain of one request replayed as one CUDA graph per k (`Eagle3Drafter.chain_static`): k drafter
        steps cost one launch instead of a few hundred. Sampled chains (`race` given) record the sampler's
        processing too, so the graph is keyed by its parameters as well."""
        cache, embed = self.cache, self.embed_tokens
        start = torch.full((1, 1), self.committed, dtype=torch.long, device=self.device)
        params = None if race is None else self.sampler.params
        sampling_key = None if params is None else (params.temperature, params.top_k, params.top_p)

        def record(hidden, start, *drawn):  # drawn: (race,) for sampled drafts, () for greedy ones
            probs = []

            def choose(i, logits):
                draft_id, score, q = self._choose(logits, drawn[0][i] if drawn else None)
                if q is not None:
                    probs.append(q)
                return draft_id, score

            tokens, scores = self.drafter.chain_static(hidden, start, cache, embed, num_tokens, choose)
            return (tokens, scores, torch.stack(probs, dim=1)) if probs else (tokens, scores)

        inputs = (self.next_hidden, start) if race is None else (self.next_hidden, start, race)
        outputs = self._graphs.run(("chain", num_tokens, sampling_key, id(cache)), record, *inputs)
        self.cache.length = self.committed + num_tokens - 1  # the chain's pairs, as the eager loop leaves them
        lengths = torch.full((1,), num_tokens, dtype=torch.long, device=self.device)
        return Proposal(token_ids=outputs[0].clone(), lengths=lengths, scores=outputs[1].clone(),
                        draft_probs=outputs[2].clone() if race is not None else None)

    def _propose_tree(self, max_depth: int) -> Proposal:
        """Static or dynamic tree of at most `max_depth` levels; see tree.py. One request on CUDA replays the
        whole tree (every expansion, the top-k ranking and the rerank) as one CUDA graph per depth."""
        batch = self.next_hidden.shape[0]
        if self._graphs_on and batch == 1 and not self.ragged:
            self._ensure_capacity(self.committed + self._max_tree_slots() + 1)
            start = torch.full((1, 1), self.committed, dtype=torch.long, device=self.device)
            key = ("tree", max_depth, id(self.cache))

            def record(hidden, start):
                tokens, parents, scores, count = self._tree(hidden, self._static_level(start), max_depth)
                self._tree_slots[key] = count  # known while recording, a constant of the graph
                return tokens, parents, scores

            tokens, parents, scores = (t.clone() for t in self._graphs.run(key, record, self.next_hidden, start))
            self.cache.length = self.committed + self._tree_slots[key]  # the expanded nodes, as eager leaves them
        else:
            tokens, parents, scores, _ = self._tree(self.next_hidden, self._eager_level, max_depth)
        lengths = torch.full((batch,), tokens.shape[1], dtype=torch.long, device=self.device)
        if self.token_tree is not None:
            depth = max(len(path) for path in self.token_tree)
        else:
            depth = self.dynamic_tree["depth"]
        return Proposal(token_ids=tokens, lengths=lengths, scores=scores, parents=parents,
                        depth=min(depth, max_depth))

    def _max_tree_slots(self) -> int:
        """Drafter cache slots a tree's expansions may take at most: one per expanded node."""
        if self.token_tree is not None:
            return len(self.token_tree)
        return max(self.dynamic_tree["depth"] - 1, 0) * self.dynamic_tree["top_k"]

    def _tree(self, root_hidden: Tensor, run_level, max_depth: int):
        """Draft a tree from `root_hidden` (B, 1, H). `run_level(embeds, parent_hidden, tree_rows, depth)` runs
        one drafter step over a level of m nodes whose `tree_rows` (B, m, E+m) mark, over the E nodes expanded
        before and the level itself, what each node attends to besides the committed context. Returns target
        token ids, parents, scores (each (B, n)) and the number of nodes expanded."""
        batch = root_hidden.shape[0]
        expanded_hidden: list[Tensor] = []  # per expansion, (B, m, H) output hiddens
        expanded_depth: list[Tensor] = []  # per expansion, (B, m) depth of each expanded node
        state = {"ancestors": torch.zeros(batch, 0, 0, dtype=torch.bool, device=self.device)}  # (B, E, E)

        def expand(tokens: Tensor, parents: Tensor) -> Tensor:
            """tokens (B, m) draft ids whose parents (B, m) index earlier expanded nodes (ROOT_PARENT: the root)."""
            m = tokens.shape[1]
            anc = state["ancestors"]  # (B, E, E)
            count = anc.shape[1]
            is_root = parents == ROOT_PARENT
            safe = parents.clamp_min(0)
            if count:
                hiddens = torch.cat(expanded_hidden, dim=1)  # (B, E, H)
                depths = torch.cat(expanded_depth, dim=1)  # (B, E)
                parent_hidden = hiddens.gather(1, safe[..., None].expand(-1, -1, hiddens.shape[-1]))
                parent_depth = depths.gather(1, safe)
                # a new node's ancestors among the expanded: its parent's row, the parent itself
                rows = anc.gather(1, safe[..., None].expand(-1, -1, count))  # (B, m, E)
                rows = rows | torch.nn.functional.one_hot(safe, count).bool()
                rows = rows & ~is_root[..., None]
            else:
                parent_hidden = torch.zeros(batch, m, root_hidden.shape[-1], dtype=root_hidden.dtype,
                                            device=self.device)
                parent_depth = torch.zeros(batch, m, dtype=torch.long, device=self.device)
                rows = torch.zeros(batch, m, 0, dtype=torch.bool, device=self.device)
            parent_hidden = torch.where(is_root[..., None], root_hidden, parent_hidden)  # (B, m, H)
            depth = torch.where(is_root, torch.zeros_like(parent_depth), parent_depth) + 1  # (B, m)
            own = torch.eye(m, dtype=torch.bool, device=self.device).expand(batch, -1, -1)  # (B, m, m)
            tree_rows = torch.cat([rows, own], dim=-1)  # (B, m, E+m)
            state["ancestors"] = torch.cat([
                torch.cat([anc, torch.zeros(batch, count, m, dtype=torch.bool, device=self.device)], dim=-1),
                tree_rows,
            ], dim=1)  # (B, E+m, E+m)
            embeds = self.embed_tokens(self.drafter.draft_to_target(tokens))
            out = run_level(embeds, parent_hidden, tree_rows, depth)
            expanded_hidden.append(out)
            expanded_depth.append(depth)
            return torch.log_softmax(self.drafter.logits(out).float(), dim=-1)  # (B, m, V_d)

        root = torch.log_softmax(self.drafter.logits(root_hidden)[:, -1].float(), dim=-1)  # (B, V_d)
        if self.token_tree is not None:
            tokens, parents, scores = static_tree(root, expand, self.token_tree, max_depth=max_depth)
        else:
            tokens, parents, scores = dynamic_tree(root, expand, self.dynamic_tree["depth"],
                                                   self.dynamic_tree["top_k"], self.num_nodes, max_depth=max_depth)
        return self.drafter.draft_to_target(tokens), parents, scores, state["ancestors"].shape[1]

    def _eager_level(self, embeds, parent_hidden, tree_rows, depth):
        """A tree level over the slots after cache.length: the committed context (per-row valid slots in a batch),
        the nodes expanded before, the level itself."""
        batch, m = depth.shape
        self._ensure_capacity(self.cache.length + m)
        committed = (self.valid[:, None, : self.committed].expand(-1, m, -1) if self.ragged
                     else torch.ones(batch, m, self.committed, dtype=torch.bool, device=self.device))
        mask = torch.cat([committed, tree_rows], dim=-1)[:, None]  # (B, 1, m, L+m)
        positions = self.positions[:, None] + depth - 1  # (B, m)
        return self.drafter.step(embeds, parent_hidden, self.cache, attention_mask=mask, position_ids=positions)

    def _static_level(self, start: Tensor):
        """`_eager_level` with fixed shapes for one request (CUDA graphs): the level's slots follow the E expanded
        nodes after `start` (1, 1), the committed count, and its mask spans the whole cache."""
        key_pos = torch.arange(self.cache.max_length, device=self.device)
        relative = key_pos - start[0]  # (T_max,) slot - committed count

        def run_level(embeds, parent_hidden, tree_rows, depth):
            m, span = tree_rows.shape[1], tree_rows.shape[2]  # span = E + m slots after the committed ones
            in_tree = (relative >= 0) & (relative < span)
            spread = tree_rows.gather(2, relative.clamp(0, span - 1)[None, None].expand(1, m, -1)) & in_tree
            mask = ((relative < 0) | spread)[:, None]  # (1, 1, m, T_max)
            slots = start[0, 0] + span - m + torch.arange(m, device=self.device)  # (m,)
            return self.drafter.step_static(embeds, parent_hidden, self.cache, start + depth - 1,
                                            attention_mask=mask, slots=slots)

        return run_level
