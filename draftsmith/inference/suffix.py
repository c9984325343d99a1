"""Suffix decoding (Oliaro et al. 2024, arXiv 2411.04975), as vLLM's `method: "suffix"` runs it.

No model: drafts are the most frequent continuations of the context's last tokens, counted in two suffix tries,
  * a *local* trie per request over its prompt + output, rebuilt by `begin`;
  * a *global* trie over the outputs of earlier requests (and the current one's, as it grows), kept across
    `begin` calls and bounded to the last `max_cached_requests` requests (oldest evicted first). This is how
    suffix decoding learns across requests: agentic and templated workloads repeat whole answers.

Counts. Each trie holds every substring of length <= `max_tree_depth` of its sequences; a node's `count` is how
often its string occurs (end positions). The empirical probability of a continuation is count(child) / count(node),
so the occurrence at the very end of the context, which has no continuation yet, counts in the denominator.

Drafting (ArcticInference's path mode, the one vLLM uses). For every match length m = 1 .. min(L, depth) - 1 where
the context's last m tokens occur in a trie, follow the most frequent child from their node, multiplying the
running probability by count(child) / count(node); stop before a token whose running probability falls below
`min_token_prob`, after floor(max_spec_factor * m) tokens (longer matches earn longer drafts), after the requested
number of tokens, or at the trie's depth. A draft's score is the sum of its running probabilities (its expected
accepted length if the counts were the truth). The best score over match lengths wins (the longer match on ties),
and the global trie's draft replaces the local one only with a strictly higher score.
Children of equal count are ordered as ArcticInference's sibling list orders them (`_Node.increment`) and
probabilities are float32 as it computes them, so drafts equal vLLM's token for token (tests/interop).

Example, depth 24, factor 1, context [1 2 3 4 1 2]: m=1 "2" occurs twice, once followed by 3 -> draft [3]
(p 0.5, score 0.5); m=2 "1 2" -> [3 4] (p 0.5, 0.5; score 1.0); m=3 "4 1 2" occurs once, no continuation.
Draft [3 4] with scores log [0.5, 1.0].

Cost in pure Python: appending a token touches one node per depth level (O(depth)); drafting walks at most
depth - 1 match lengths with early exit at the first length that does not occur. Memory is one node per
distinct substring of length <= depth, so keep `max_cached_requests` modest for long outputs.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from draftsmith.runtime.proposer import PAD_DRAFT_TOKEN, Proposal

# vLLM's suffix_decoding_* defaults (vllm/config/speculative.py); suffix's num_speculative_tokens defaults to the depth.
SUFFIX_DEFAULTS = {"suffix_decoding_max_tree_depth": 24, "suffix_decoding_max_cached_requests": 10000,
                   "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1}

SPEC_FACTOR_EPS = 1e-6  # floor(m * factor) must not lose a whole token to float rounding (1.0 * 3 -> 2.9999)


class _Node:
    __slots__ = ("children", "count", "order")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0  # occurrences of this node's string (end positions) in the trie's sequences
        self.order: list[int] = []  # child tokens in ArcticInference's sibling order: by count, ties as it moves them

    @property
    def best(self) -> int | None:
        """The child token a draft follows: the first in sibling order (highest count), None for a leaf."""
        return self.order[0] if self.order else None

    def increment(self, token: int) -> None:
        """Count one more occurrence of child `token`, moving it as ArcticInference's sibling list does: a child
        overtaking (or joining) the counts before it goes just ahead of the first child of its predecessor's count,
        which puts it behind earlier children of its new count when it was not the first of its old one."""
        child = self.children[token]
        i = self.order.index(token)
        if i > 0 and self.children[self.order[i - 1]].count <= child.count + 1:
            ahead = self.children[self.order[i - 1]].count
            j = i - 1
            while j > 0 and self.children[self.order[j - 1]].count == ahead:
                j -= 1
            self.order.insert(j, self.order.pop(i))
        child.count += 1

    def decrement(self, token: int) -> None:
        """The reverse: a child falling behind children of its old count goes to the front of the next lower count."""
        child = self.children[token]
        i = self.order.index(token)
        after = [self.children[t].count for t in self.order[i + 1 :]]
        if after and after[0] == child.count:
            k = next((n for n, c in enumerate(after) if c < child.count), len(after))  # first lower count after i
            self.order.insert(i + k, self.order.pop(i))
        child.count -= 1


class SuffixTrie:
    """All substrings of length <= `max_depth` of several token sequences, with occurrence counts.

    A sequence is grown with `append`; `_active[seq]` holds the nodes of its current suffixes of lengths
    1 .. max_depth-1, the only nodes a new token can extend (a suffix of length max_depth is as deep as it gets).
    """

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = _Node()
        self._active: dict[int, list[_Node]] = {}  # seq id -> suffix nodes, index i = length i + 1
        self._tokens: dict[int, list[int]] = {}  # seq id -> the sequence (kept to undo it in `remove`)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._tokens

    def extend(self, seq_id: int, tokens) -> None:
        for token in tokens:
            self.append(seq_id, int(token))

    def append(self, seq_id: int, token: int) -> None:
        """Count the new token as the end of every suffix of length 1 .. max_depth: O(max_depth)."""
        active = self._active.setdefault(seq_id, [])
        self._tokens.setdefault(seq_id, []).append(token)
        self.root.count += 1
        child = self.root.children.get(token)
        if child is None:
            child = self.root.children[token] = _Node()
        child.count += 1  # the root keeps no sibling order: drafts start at a matched node of depth >= 1
        grown = [child]
        for node in active:  # suffix lengths 1 .. len(active)
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
                child.count = 1
                node.order.append(token)  # a new child joins at the end of the sibling list
            else:
                node.increment(token)
            grown.append(child)
        # New suffixes have lengths 1 .. len(active)+1; the one of length max_depth cannot grow further.
        self._active[seq_id] = grown[: self.max_depth - 1]

    def remove(self, seq_id: int) -> None:
        """Forget a sequence: uncount each of its substrings, drop nodes that no longer occur."""
        tokens = self._tokens.pop(seq_id)
        self._active.pop(seq_id, None)
        for start in range(len(tokens)):
            node = self.root
            node.count -= 1
            for token in tokens[start : start + self.max_depth]:
                child = node.children[token]
                if node is self.root:
                    child.count -= 1
                else:
                    node.decrement(token)
                if child.count == 0:
                    del node.children[token]  # its whole subtree occurred only here
                    if node is not self.root:
                        node.order.remove(token)
                    break
                node = child

    def match(self, pattern: list[int]) -> _Node | None:
        """The node of `pattern` (a string of length <= max_depth), or None when it does not occur."""
        node = self.root
        for token in pattern:
            node = node.children.get(token)
            if node is None:
                return None
        return node

    def suffix_node(self, seq_id: int, length: int) -> _Node:
        """The node of the last `length` tokens of sequence `seq_id` (1 <= length < max_depth): no walk needed."""
        return self._active[seq_id][length - 1]


def speculate_path(node: _Node, max_tokens: int, min_token_prob: float) -> tuple[list[int], list[float]]:
    """Follow the most frequent child from `node`: draft tokens and each one's count(child) / count(parent).

    Stops before the token whose running probability (the product of those ratios) falls below `min_token_prob`.
    In float32, as ArcticInference computes it: a probability at the threshold is kept or dropped as vLLM does.
    """
    tokens, ratios = [], []
    prob, threshold = np.float32(1.0), np.float32(min_token_prob)
    while len(tokens) < max_tokens and node.best is not None:
        child = node.children[node.best]
        ratio = np.float32(child.count) / np.float32(node.count)
        prob = prob * ratio
        if prob < threshold:
            break
        tokens.append(node.best)
        ratios.append(float(ratio))
        node = child
    return tokens, ratios


def path_score(ratios: list[float]) -> float:
    """Sum of running probabilities: the draft's expected accepted length if the counts were the truth (float32)."""
    score, prob = np.float32(0.0), np.float32(1.0)
    for ratio in ratios:
        prob = prob * np.float32(ratio)
        score = score + prob
    return float(score)


class SuffixProposer:
    """Drafts by suffix decoding over prompt + output (local) and earlier outputs (global). No target features.

    The object is the cache: one proposer serves a whole run, and `begin` keeps the global trie, so later
    requests draft from earlier answers.
    """

    aux_layer_ids = None
    extends_on_host = True  # the runtime hands extend() host token ids (Proposer)
    extends_finished_rows = True  # a request's last tokens reach the global tree too, as vLLM feeds it

    def __init__(
        self,
        num_speculative_tokens: int,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ):
        if max_tree_depth < 1 or max_cached_requests < 0 or max_spec_factor < 0 or not 0 <= min_token_prob <= 1:
            raise ValueError(
                "suffix: need suffix_decoding_max_tree_depth >= 1, suffix_decoding_max_cached_requests >= 0, "
                "suffix_decoding_max_spec_factor >= 0 and 0 <= suffix_decoding_min_token_prob <= 1"
            )
        self.num_speculative_tokens = num_speculative_tokens
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests  # 0: no global trie (vLLM: prompt trees only)
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.global_trie = SuffixTrie(max_tree_depth)
        self._cached: dict[int, None] = {}  # request ids whose outputs are in the global trie, oldest first
        self._next_request = 0
        self._requests: list[int] = []  # per row: its request id (its sequence id in the global trie)
        self._locals: list[SuffixTrie] = []  # per row: trie over prompt + output (sequence id 0)
        self._contexts: list[list[int]] = []  # per row: prompt + committed output
        self._paired: list[int] = []  # per row: positions whose next token `extend` has given (Proposer docs)

    @classmethod
    def from_config(cls, spec, target=None) -> "SuffixProposer":
        """From a `SpecConfig`; suffix_decoding_* keys it leaves unset (a hybrid's) take vLLM's defaults."""
        def setting(key):
            value = getattr(spec, key)
            return SUFFIX_DEFAULTS[key] if value is None else value

        return cls(
            spec.num_speculative_tokens,
            max_tree_depth=setting("suffix_decoding_max_tree_depth"),
            max_cached_requests=setting("suffix_decoding_max_cached_requests"),
            max_spec_factor=setting("suffix_decoding_max_spec_factor"),
            min_token_prob=setting("suffix_decoding_min_token_prob"),
        )

    @property
    def num_rows(self) -> int:
        """Requests of the current `begin` (rows of the batch)."""
        return len(self._contexts)

    @property
    def cached_requests(self) -> list[int]:
        """Ids of the requests whose outputs are in the global trie, oldest first (ids count `begin` rows)."""
        return list(self._cached)

    def begin(self, prompt_ids: Tensor, sampler=None) -> None:
        """New requests, one per row (PAD_DRAFT_TOKEN-padded); the global trie stays. Drafts are deterministic
        (most frequent continuation), so `sampler` is not needed: they verify as one-hot drafts."""
        rows = prompt_ids.detach().to("cpu", torch.long).tolist()  # (B, S)
        self._locals, self._contexts, self._requests, self._paired = [], [], [], []
        for row in rows:
            row = [t for t in row if t != PAD_DRAFT_TOKEN]
            local = SuffixTrie(self.max_tree_depth)
            local.extend(0, row)
            self._locals.append(local)
            self._contexts.append(list(row))
            self._paired.append(0)
            self._requests.append(self._next_request)
            if self.max_cached_requests > 0:
                self._cached[self._next_request] = None
            self._next_request += 1
        while len(self._cached) > self.max_cached_requests:  # FIFO eviction, as ArcticInference does
            oldest = next(iter(self._cached))
            del self._cached[oldest]
            if oldest in self.global_trie:
                self.global_trie.remove(oldest)

    def extend(self, token_ids: Tensor, aux_hidden: Tensor | None = None) -> None:
        rows = token_ids.detach().to("cpu", torch.long).tolist()  # (B, n)
        if len(rows) != len(self._contexts):
            raise ValueError(
                f"suffix: extend got {len(rows)} rows for {len(self._contexts)} requests; call begin first"
            )
        for b, row in enumerate(rows):
            row = [t for t in row if t != PAD_DRAFT_TOKEN]
            context = self._contexts[b]
            # row[j] is the token at position paired + 1 + j; positions already in the context restate the prompt.
            new = row[max(0, len(context) - self._paired[b] - 1) :]
            self._paired[b] += len(row)
            context.extend(new)
            self._locals[b].extend(0, new)
            if self._requests[b] in self._cached:
                self.global_trie.extend(self._requests[b], new)

    def draft(self, row: int, max_spec_tokens: int) -> tuple[list[int], list[float]]:
        """Best draft for one row: its tokens and their count ratios (see the module docstring)."""
        context, local = self._contexts[row], self._locals[row]
        longest = min(len(context), self.max_tree_depth) - 1  # a match leaves room for one token in the trie
        best: tuple[float, list[int], list[float]] = (0.0, [], [])
        for is_local in (True, False):
            winner = (0.0, [], [])
            for m in range(1, longest + 1):
                if is_local:
                    node = local.suffix_node(0, m)  # always present: the context itself ends here
                    if node.count == 1:  # only that occurrence: neither this nor any longer suffix recurs
                        break
                else:
                    node = self.global_trie.match(context[-m:])
                    if node is None:  # nor does any longer suffix
                        break
                budget = min(max_spec_tokens, int(m * self.max_spec_factor + SPEC_FACTOR_EPS))
                tokens, ratios = speculate_path(node, budget, self.min_token_prob)
                score = path_score(ratios)
                if tokens and score >= winner[0]:  # ties: the longer match
                    winner = (score, tokens, ratios)
            if winner[0] > best[0]:  # the global draft replaces the local one only when strictly better
                best = winner
        return best[1], best[2]

    def drafts(self, num_tokens: int) -> list[tuple[list[int], list[float]]]:
        """Every row's best draft of at most `num_tokens` (and num_speculative_tokens) tokens, with its ratios."""
        k = max(0, min(num_tokens, self.num_speculative_tokens))
        return [self.draft(b, k) if k else ([], []) for b in range(self.num_rows)]

    @staticmethod
    def proposal(drafts: list[tuple[list[int], list[float]]], width: int) -> Proposal:
        """`drafts` (as `drafts` returns them) as a Proposal `width` wide, on the CPU: the runtime reads its lengths
        without a device sync and copies the drafts once."""
        token_ids = np.full((len(drafts), width), PAD_DRAFT_TOKEN, dtype=np.int64)  # (B, width)
        scores = np.full((len(drafts), width), -math.inf, dtype=np.float32)  # log count ratio, -inf past lengths
        lengths = np.zeros(len(drafts), dtype=np.int64)  # (B,)
        for b, (tokens, ratios) in enumerate(drafts):
            tokens, ratios = tokens[:width], ratios[:width]
            token_ids[b, : len(tokens)] = tokens
            scores[b, : len(tokens)] = np.log(ratios) if tokens else []
            lengths[b] = len(tokens)
        return Proposal(torch.from_numpy(token_ids), torch.from_numpy(lengths), torch.from_numpy(scores))

    def propose(self, num_tokens: int) -> Proposal:
        return self.proposal(self.drafts(num_tokens), max(0, min(num_tokens, self.num_speculative_tokens)))
