"""Greedy verification: literal scenarios with hand-made logits (one-hot rows pick the target's argmax)."""

import pytest
import torch

from draftsmith.runtime.proposer import PAD_DRAFT_TOKEN
from draftsmith.runtime.verify import greedy_verify

V = 10
P = PAD_DRAFT_TOKEN


def logits_for(target_tokens):
    """(B, k+1, V) logits whose argmax at [b, j] is target_tokens[b][j]."""
    ids = torch.tensor(target_tokens)
    return torch.nn.functional.one_hot(ids, V).float() * 5.0 - 1.0


def verify(drafts, lengths, target_tokens):
    accepted, tokens, out_len = greedy_verify(torch.tensor(drafts), torch.tensor(lengths), logits_for(target_tokens))
    return accepted.tolist(), tokens.tolist(), out_len.tolist()


def test_perfect_match():
    # Every draft agrees: all 3 accepted plus the bonus from the last position.
    assert verify([[1, 2, 3]], [3], [[1, 2, 3, 4]]) == ([3], [[1, 2, 3, 4]], [4])


def test_early_mismatch():
    # d_1 = 5 but the target wants 2: accept d_0, then the recovered token 2; d_2 is dropped though it matches.
    assert verify([[1, 5, 3]], [3], [[1, 2, 3, 4]]) == ([1], [[1, 2, P, P]], [2])


def test_first_token_rejected():
    assert verify([[7, 2, 3]], [3], [[1, 2, 3, 4]]) == ([0], [[1, P, P, P]], [1])


def test_zero_length_draft():
    # k = 0: a plain decoding step, the target's token is the only output.
    accepted, tokens, out_len = greedy_verify(
        torch.empty(1, 0, dtype=torch.long), torch.zeros(1, dtype=torch.long), logits_for([[8]])
    )
    assert (accepted.tolist(), tokens.tolist(), out_len.tolist()) == ([0], [[8]], [1])


def test_padded_rows():
    # Row 0 drafted 2 of 3 (both accepted -> the token at position 2 is the target's, not the pad);
    # row 1 drafted nothing; row 2 drafted all 3 and mismatches at the last one.
    drafts = [[1, 2, P], [P, P, P], [4, 4, 9]]
    targets = [[1, 2, 3, 0], [6, 6, 6, 6], [4, 4, 4, 4]]
    assert verify(drafts, [2, 0, 3], targets) == (
        [2, 0, 2],
        [[1, 2, 3, P], [6, P, P, P], [4, 4, 4, P]],
        [3, 1, 3],
    )


def test_drafts_past_length_are_never_accepted():
    # Valid-looking tokens past `lengths` (a proposer that does not pad) are ignored.
    assert verify([[1, 2, 3]], [1], [[1, 2, 3, 4]]) == ([1], [[1, 2, P, P]], [2])


def test_shape_errors_name_the_expected_shapes():
    with pytest.raises(ValueError, match=r"expected target_logits \(1, 3, V\)"):
        greedy_verify(torch.zeros(1, 2, dtype=torch.long), torch.tensor([2]), torch.zeros(1, 2, V))
