"""SpecDecodingMetrics: vLLM's counters and derived values on literal step sequences."""

import math

import pytest

from draftsmith.runtime.metrics import SpecDecodingMetrics


def observed(k, steps):
    m = SpecDecodingMetrics(num_spec_tokens=k)
    for drafted, accepted in steps:
        m.observe_draft(drafted, accepted)
    return m


def test_counters_and_prefix_counts():
    m = observed(3, [(3, 3), (3, 1), (2, 0), (3, 2)])
    assert (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens) == (4, 11, 6)
    # per_pos[i] = drafts with at least i+1 accepted
    assert m.num_accepted_tokens_per_pos == [3, 2, 1]
    assert m.mean_acceptance_length == pytest.approx(1 + 6 / 4)  # bonus included
    assert m.draft_acceptance_rate == pytest.approx(6 / 11)
    assert m.per_position_acceptance == pytest.approx([0.75, 0.5, 0.25])


def test_merge_sums_counters_and_leaves_inputs_alone():
    a, b = observed(3, [(3, 3)]), observed(3, [(3, 1), (1, 0)])
    merged = a.merge(b)
    assert merged.to_dict() == observed(3, [(3, 3), (3, 1), (1, 0)]).to_dict()
    assert a.num_drafts == 1 and b.num_drafts == 2


def test_to_dict_uses_vllm_names_and_is_json_safe_without_drafts():
    empty = SpecDecodingMetrics(num_spec_tokens=2).to_dict()
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos"):
        assert name in empty
    assert empty["mean_acceptance_length"] is None and empty["per_position_acceptance"] == [None, None]
    assert math.isnan(SpecDecodingMetrics(num_spec_tokens=2).mean_acceptance_length)


def test_log_line_matches_vllm_format():
    m = observed(2, [(2, 2), (2, 1)])
    line = m.log_line(elapsed_seconds=2.0)
    assert line == (
        "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 1.50 tokens/s, "
        "Drafted throughput: 2.00 tokens/s, Accepted: 3 tokens, Drafted: 4 tokens, "
        "Per-position acceptance rate: 1.000, 0.500, Avg Draft acceptance rate: 75.0%"
    )


@pytest.mark.parametrize("drafted, accepted", [(2, 3), (4, 1), (-1, 0)])
def test_impossible_observations_are_rejected(drafted, accepted):
    with pytest.raises(ValueError, match="observe_draft"):
        SpecDecodingMetrics(num_spec_tokens=3).observe_draft(drafted, accepted)
