"""N-gram prompt lookup: literal sequences, a brute-force reference, and the begin/extend bookkeeping."""

import numpy as np
import pytest
import torch

from draftsmith.inference.ngram import NgramProposer, ngram_lookup
from draftsmith.runtime.proposer import PAD_DRAFT_TOKEN, Proposer

P = PAD_DRAFT_TOKEN


def lookup(seq, min_n, max_n, k):
    return ngram_lookup(np.array(seq, dtype=np.int64), min_n, max_n, k).tolist()


def reference(seq, min_n, max_n, k):
    """vLLM's rule spelled out: longest n first, earliest earlier occurrence, the tokens after it."""
    for n in range(max_n, min_n - 1, -1):
        if n > len(seq) - 1:
            continue
        suffix = seq[len(seq) - n:]
        for s in range(len(seq) - n):  # occurrences ending before the last token
            if seq[s : s + n] == suffix:
                return seq[s + n : s + n + k]
    return []


def test_longest_suffix_wins():
    # "2 3" (n=2) recurs at 1..2 -> propose what followed it; the n=1 match "3" at 5 would give 9.
    assert lookup([1, 2, 3, 4, 5, 3, 9, 2, 3], 1, 3, 2) == [4, 5]


def test_earliest_occurrence_wins():
    # "7 8" occurs at 0 and at 3: the earliest (vLLM's choice) is followed by 1, the later one by 2.
    assert lookup([7, 8, 1, 7, 8, 2, 7, 8], 2, 2, 3) == [1, 7, 8]


def test_proposal_runs_into_the_suffix_and_stops_at_the_end():
    assert lookup([1, 2, 3, 1, 2], 2, 2, 5) == [3, 1, 2]
    assert lookup([5, 5, 5, 5], 1, 2, 4) == [5, 5]  # overlapping occurrence of "5 5" at 1..2


def test_below_min_n_proposes_nothing():
    assert lookup([1, 2, 3, 4, 9, 3, 4], 3, 4, 3) == []  # only "3 4" (n=2) recurs
    assert lookup([1, 2, 3, 4, 9, 3, 4], 2, 4, 3) == [9, 3, 4]
    assert lookup([4], 1, 2, 3) == []


def test_matches_brute_force_reference():
    rng = np.random.default_rng(0)
    for _ in range(300):
        seq = rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 3))
        k = int(rng.integers(1, 6))
        assert lookup(seq, min_n, max_n, k) == reference(seq, min_n, max_n, k), (seq, min_n, max_n, k)


def test_proposer_follows_the_runtime_protocol():
    proposer = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=2, num_speculative_tokens=3)
    assert isinstance(proposer, Proposer) and proposer.aux_layer_ids is None
    prompt = torch.tensor([[1, 2, 3, 4, 1]])
    proposer.begin(prompt)
    # prefill: the prompt restated from position 1, plus the first generated token 2
    proposer.extend(torch.tensor([[2, 3, 4, 1, 2]]), None)
    proposal = proposer.propose(3)  # context 1 2 3 4 1 2: "1 2" recurs at 0 -> 3 4 1
    assert proposal.token_ids.tolist() == [[3, 4, 1]] and proposal.lengths.tolist() == [3]
    proposer.extend(torch.tensor([[3, 9]]), None)  # accepted 3, recovered 9 -> context ... 1 2 3 9
    proposal = proposer.propose(3)
    assert proposal.lengths.tolist() == [0] and proposal.token_ids.tolist() == [[P, P, P]]
    assert proposer.propose(5).token_ids.shape == (1, 3)  # never more than num_speculative_tokens


def test_rows_are_independent_and_padding_is_dropped():
    proposer = NgramProposer(1, 1, 2)
    proposer.begin(torch.tensor([[5, 6, 7], [1, 1, 2]]))
    proposer.extend(torch.tensor([[6, 7, 5], [1, 2, P]]), None)  # row 1 committed one token fewer
    proposal = proposer.propose(2)
    assert proposal.token_ids.tolist() == [[6, 7], [P, P]] and proposal.lengths.tolist() == [2, 0]


def test_bad_bounds_are_rejected():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2, 4)
