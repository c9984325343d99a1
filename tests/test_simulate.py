"""The teacher-forced acceptance simulation counts exactly what the runtime counts, with a drafter that accepts."""

import pytest
import torch
from conftest import ACCEPTING_NEW_TOKENS

from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.simulate import replay_chains, simulate_greedy_chains
from draftsmith.models.eagle3.io import load_drafter
from draftsmith.models.eagle3.proposer import Eagle3Proposer


def test_replay_follows_the_generators_step_rule():
    """prompt of 3, answer of 8 tokens (generated 1 by prefill), k=3: every chain is right for 2 steps, then
    wrong. Steps: 1 -> 4 -> 7 -> 10, each drafting k=3 as vLLM does, the last too: its 2 accepted drafts pass the
    answer's end and still count (the counters follow vLLM's definitions)."""
    correct = torch.zeros(3, 20, dtype=torch.bool)
    correct[:2] = True
    metrics = replay_chains(correct, prompt_length=3, answer_length=8, k=3)
    assert (metrics.num_drafts, metrics.num_draft_tokens, metrics.num_accepted_tokens) == (3, 9, 6)
    assert metrics.num_accepted_tokens_per_pos == [3, 3, 0]


@pytest.mark.slow
def test_simulated_counters_equal_the_runtimes(fixture_prompts, fixture_lookahead, accepting_drafter):
    """With a drafter that accepts (tests/conftest.py), the simulation over the target's greedy answers (and the
    tokens past them, which the runtime's last drafts are checked against) gives the runtime's counters exactly."""
    target, _, prompts, answers, eos = fixture_prompts
    drafter = load_drafter(accepting_drafter("eagle3"), dtype=torch.float32)
    ks = (1, 3)
    simulated = simulate_greedy_chains(target, drafter, prompts, answers, ks, extended=fixture_lookahead)
    for k in ks:
        generator = SpeculativeGenerator(target, Eagle3Proposer(drafter, target.embed_tokens), k)
        total = None
        for prompt, answer in zip(prompts, answers):
            result = generator.generate(torch.tensor([prompt]), ACCEPTING_NEW_TOKENS, eos)
            assert result.token_ids == answer  # lossless: the committed text is the plain greedy answer
            total = result.metrics if total is None else total.merge(result.metrics)
        assert simulated[k].to_dict() == total.to_dict(), k
    assert simulated[3].mean_acceptance_length > 1.3  # the drafter accepts: acceptance and rollback both ran
    assert 0 < simulated[3].num_accepted_tokens_per_pos[2] < simulated[3].num_drafts  # all and partial accepts
