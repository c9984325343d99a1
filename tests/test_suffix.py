"""Suffix decoding: literal drafts, adaptive length, the global trie across requests, trie counts against brute
force, the speculative-config keys, and losslessness on the fixture target."""

import math

import numpy as np
import pytest
import torch

from draftsmith.inference.spec_config import SpecConfigError, build_proposer, parse_spec_config
from draftsmith.inference.suffix import SuffixProposer, SuffixTrie
from draftsmith.runtime.proposer import PAD_DRAFT_TOKEN, Proposer


def draft(context, k=8, outputs=(), **options):
    """Draft after `context` (the prompt); `outputs` are earlier requests' (prompt, output) pairs."""
    proposer = SuffixProposer(k, **options)
    for prompt, output in outputs:
        run_request(proposer, prompt, output)
    proposer.begin(torch.tensor([context]))
    p = proposer.propose(k)
    n = int(p.lengths[0])
    assert p.token_ids[0, n:].eq(PAD_DRAFT_TOKEN).all() and p.scores[0, n:].eq(-math.inf).all()
    return p.token_ids[0, :n].tolist(), [round(math.exp(s), 6) for s in p.scores[0, :n].tolist()]


def run_request(proposer, prompt, output):
    """Drive the proposer as the runtime does: begin, the prefill extend restating the prompt, then commits."""
    proposer.begin(torch.tensor([prompt]))
    proposer.extend(torch.tensor([prompt[1:] + output[:1]]), None)
    for i in range(1, len(output), 2):
        proposer.extend(torch.tensor([output[i : i + 2]]), None)


def test_literal_draft_follows_the_best_match_length():
    # m=1: "2" occurs twice, once followed by 3 -> [3] (score 0.5); m=2: "1 2" -> [3 4] (score 1.0); m=3 is unique.
    assert draft([1, 2, 3, 4, 1, 2]) == ([3, 4], [0.5, 1.0])


def test_speculation_length_adapts_to_the_match_length():
    assert draft([1, 2, 3, 4, 1, 2], max_spec_factor=2.0) == ([3, 4, 1, 2], [0.5, 1, 1, 1])  # 2 * m=2 tokens
    assert draft([1, 2, 3, 4, 1, 2], max_spec_factor=0.5) == ([3], [0.5])  # m=1 earns 0 tokens, m=2 earns 1
    # Longer repeats earn longer drafts: "1 2 3 4" matched (m=4) drafts 4 tokens, the run-out of the context.
    assert draft([1, 2, 3, 4, 5, 6, 1, 2, 3, 4])[0] == [5, 6, 1, 2]


def test_num_speculative_tokens_and_tree_depth_cap_the_draft():
    assert draft([1, 2, 3, 4, 1, 2], k=1) == ([3], [0.5])
    # Depth 3 bounds match + draft: m=1 "2" -> "2 3 4" is as deep as the trie goes; m=2 only reaches "1 2 3".
    assert draft([1, 2, 3, 4, 1, 2], max_tree_depth=3, max_spec_factor=2.0) == ([3, 4], [0.5, 1.0])
    assert draft([1, 2, 3, 4, 1, 2], max_tree_depth=1) == ([], [])


def test_most_frequent_continuation_and_min_token_prob():
    # "9" is followed by 1 twice and by 2 once: 1 wins at m=1; the longest recurring match "9 1 9" knows what
    # followed it: 2 (0.5 of its 2 occurrences), then 9 1 with certainty (running probability stays 0.5).
    assert draft([9, 1, 9, 2, 9, 1, 9]) == ([2, 9, 1], [0.5, 1.0, 1.0])
    # "5" occurs 4 times, followed once each by 6, 7, 8: each continuation has probability 0.25.
    assert draft([5, 6, 5, 7, 5, 8, 5]) == ([6], [0.25])
    assert draft([5, 6, 5, 7, 5, 8, 5], min_token_prob=0.3) == ([], [])


def test_global_trie_learns_from_earlier_outputs():
    earlier = [([10, 11], [20, 21, 22, 23, 24])]
    assert draft([30, 20, 21]) == ([], [])  # nothing recurs in this prompt alone
    assert draft([30, 20, 21], outputs=earlier) == ([22, 23], [1.0, 1.0])  # m=2 "20 21" from the earlier output
    assert draft([30, 20, 21], outputs=earlier, max_cached_requests=0) == ([], [])  # no global trie


def test_global_trie_evicts_the_oldest_request():
    outputs = [([1], [40, 41, 42]), ([1], [50, 51, 52]), ([1], [60, 61, 62])]
    assert draft([7, 40, 41], outputs=outputs)[0] == [42]
    # Two slots: the drafting request takes one, the newest earlier output keeps the other.
    assert draft([7, 50, 51], outputs=outputs, max_cached_requests=2)[0] == []
    assert draft([7, 60, 61], outputs=outputs, max_cached_requests=2)[0] == [62]
    proposer = SuffixProposer(4, max_cached_requests=2)
    for prompt, output in outputs:
        run_request(proposer, prompt, output)
    assert proposer.cached_requests == [1, 2]


def test_local_draft_wins_ties_and_prompt_is_not_global():
    # The prompt [3 4 3 5] is local only: a later request ending in 3 does not see "3 -> 4/5" globally.
    proposer = SuffixProposer(4)
    run_request(proposer, [3, 4, 3, 5], [8])
    proposer.begin(torch.tensor([[9, 3]]))
    assert proposer.propose(4).lengths.tolist() == [0]


def test_protocol_bookkeeping_and_batches():
    proposer = SuffixProposer(4)
    assert isinstance(proposer, Proposer) and proposer.aux_layer_ids is None
    P = PAD_DRAFT_TOKEN
    proposer.begin(torch.tensor([[1, 2, 3, P], [7, 7, 7, 7]]), None)  # prompts are right-padded
    # Prefill restates prompt[1:] and adds t0; ragged commits are right-padded too.
    proposer.extend(torch.tensor([[2, 3, 1, P], [7, 7, 7, 8]]), None)
    proposer.extend(torch.tensor([[2, 3], [7, P]]), None)
    assert proposer._contexts == [[1, 2, 3, 1, 2, 3], [7, 7, 7, 7, 8, 7]]
    p = proposer.propose(3)
    assert p.token_ids.shape == (2, 3) and p.lengths.tolist() == [3, 1]
    # Row 1: "7" occurs 5 times, followed by 7 three times and by 8 once; "8 7" is unique.
    assert p.token_ids[0].tolist() == [1, 2, 3] and p.token_ids[1, :1].tolist() == [7]
    with pytest.raises(ValueError, match="call begin first"):
        proposer.extend(torch.tensor([[1]]), None)
    assert proposer.propose(0).token_ids.shape == (2, 0)


def brute_force_counts(sequences, depth):
    counts = {}
    for seq in sequences:
        for start in range(len(seq)):
            for end in range(start + 1, min(len(seq), start + depth) + 1):
                key = tuple(seq[start:end])
                counts[key] = counts.get(key, 0) + 1
    return counts


def trie_counts(trie):
    found, stack = {}, [((), trie.root)]
    while stack:
        prefix, node = stack.pop()
        if prefix:
            assert node.best is not None or not node.children
            if node.children:  # the best child has the highest count
                assert node.children[node.best].count == max(c.count for c in node.children.values())
            order = [node.children[t].count for t in node.order]  # sibling order: every child once, by count
            assert sorted(node.order) == sorted(node.children) and order == sorted(order, reverse=True)
            found[prefix] = node.count
        stack.extend((prefix + (t,), child) for t, child in node.children.items())
    return found


def test_trie_counts_match_brute_force_through_appends_and_removals():
    rng = np.random.default_rng(0)
    for trial in range(40):
        depth = int(rng.integers(1, 6))
        trie = SuffixTrie(depth)
        live = {}
        for seq_id in range(int(rng.integers(1, 6))):
            seq = rng.integers(0, 3, size=int(rng.integers(1, 15))).tolist()
            trie.extend(seq_id, seq)
            live[seq_id] = seq
        for seq_id in list(live)[: int(rng.integers(0, len(live) + 1))]:
            trie.remove(seq_id)
            del live[seq_id]
        assert trie_counts(trie) == brute_force_counts(live.values(), depth), trial
        assert trie.root.count == sum(len(s) for s in live.values())
        # Suffix nodes kept for the live sequences are the nodes of their last tokens.
        for seq_id, seq in live.items():
            for m in range(1, min(len(seq), depth - 1) + 1):
                assert trie.suffix_node(seq_id, m) is trie.match(seq[-m:])


def test_spec_config_keys_defaults_and_errors():
    spec = parse_spec_config({"method": "suffix"}, device_type="cpu")
    assert spec.num_speculative_tokens == 24  # vLLM: defaults to the tree depth
    assert spec.to_dict() == {
        "method": "suffix", "num_speculative_tokens": 24, "suffix_decoding_max_tree_depth": 24,
        "suffix_decoding_max_cached_requests": 10000, "suffix_decoding_max_spec_factor": 1.0,
        "suffix_decoding_min_token_prob": 0.1,
    }
    spec = parse_spec_config({"method": "suffix", "num_speculative_tokens": 5, "suffix_decoding_max_tree_depth": 8,
                              "suffix_decoding_max_spec_factor": 2, "suffix_decoding_min_token_prob": 0.2}, "cpu")
    proposer = build_proposer(spec, None)
    assert isinstance(proposer, SuffixProposer)
    assert (proposer.num_speculative_tokens, proposer.max_tree_depth, proposer.max_spec_factor,
            proposer.min_token_prob) == (5, 8, 2.0, 0.2)
    # The keys are vLLM's, accepted (and unused) with other methods, as vLLM accepts them.
    ngram = parse_spec_config({"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 8},
                              "cpu")
    assert "suffix_decoding_max_tree_depth" not in ngram.to_dict()
    for key, bad in [("suffix_decoding_max_tree_depth", 0), ("suffix_decoding_max_cached_requests", -1),
                     ("suffix_decoding_max_spec_factor", -0.5), ("suffix_decoding_min_token_prob", 1.5)]:
        with pytest.raises(SpecConfigError, match=key):
            parse_spec_config({"method": "suffix", key: bad}, "cpu")
    with pytest.raises(SpecConfigError, match="suffix_decoding_max_tree_dept'"):
        parse_spec_config({"method": "suffix", "suffix_decoding_max_tree_dept": 3}, "cpu")
    with pytest.raises(SpecConfigError, match="vllm-ascend"):  # default k = 24 > 15 verified drafts on an NPU
        parse_spec_config({"method": "suffix"}, "npu")


def test_fixture_suffix_is_lossless_on_mt_bench(fixture_target_dir, mt_bench_path):
    """Greedy output with suffix drafts equals plain greedy; one proposer serves every prompt (global trie)."""
    from transformers import AutoTokenizer

    from draftsmith.inference.eval import load_prompts
    from draftsmith.inference.generator import SpeculativeGenerator
    from draftsmith.models.target import TargetModel

    target = TargetModel.from_pretrained(fixture_target_dir, dtype="float32", device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(fixture_target_dir)
    prompts = load_prompts(mt_bench_path, tokenizer, limit=3)
    spec = parse_spec_config({"method": "suffix", "num_speculative_tokens": 6}, device_type="cpu")
    proposer = build_proposer(spec, target)
    plain = SpeculativeGenerator(target, None, 0)
    speculative = SpeculativeGenerator(target, proposer, spec.num_speculative_tokens)
    total_accepted = 0
    for ids in prompts:
        prompt = torch.tensor([ids])
        expected = plain.generate(prompt, 48, {6, 2})
        got = speculative.generate(prompt, 48, {6, 2})
        assert got.token_ids == expected.token_ids
        m = got.metrics
        assert 0 <= m.num_accepted_tokens <= m.num_draft_tokens <= 6 * m.num_drafts
        # every accepted draft saves a target step, but those of the last step past max_new_tokens (counted,
        # as vLLM counts them, never output)
        saved = expected.num_target_steps - got.num_target_steps
        assert m.num_accepted_tokens - m.num_spec_tokens <= saved <= m.num_accepted_tokens
        total_accepted += m.num_accepted_tokens
    assert total_accepted > 0
    assert proposer.cached_requests == [0, 1, 2]


def test_fixture_suffix_batch_rows_finish_apart_and_stay_lossless(fixture_prompts):
    """Rows of one batch accept their own amounts and finish at different steps (by EOS or max_new_tokens); each is
    plain greedy decoding's output. (The global trie is shared within a batch, as vLLM shares it, so counters are
    not compared with runs alone.)"""
    from draftsmith.inference.generator import SpeculativeGenerator

    target, _, prompts, answers, eos = fixture_prompts
    spec = parse_spec_config({"method": "suffix", "num_speculative_tokens": 6}, device_type="cpu")
    batch = SpeculativeGenerator(target, build_proposer(spec, target), 6).generate_batch(prompts, 40, eos)
    assert [r.token_ids for r in batch] == answers
    accepted = [r.metrics.num_accepted_tokens for r in batch]
    assert min(accepted) > 0 and len(set(accepted)) > 1
    assert len({r.num_target_steps for r in batch}) > 1  # the rows finished at different steps


def test_a_finished_requests_last_tokens_reach_the_global_tree(fixture_prompts):
    """vLLM adds every output token of a request to its global suffix tree, those of the request's last step
    too; draftsmith's used to drop them (issue 14)."""
    from draftsmith.inference.generator import SpeculativeGenerator

    target, _, prompts, answers, eos = fixture_prompts
    spec = parse_spec_config({"method": "suffix", "num_speculative_tokens": 6}, device_type="cpu")
    proposer = build_proposer(spec, target)
    result = SpeculativeGenerator(target, proposer, 6).generate(torch.tensor([prompts[0]]), 40, eos)
    assert result.token_ids == answers[0]
    request = proposer.cached_requests[-1]
    assert proposer.global_trie._tokens[request] == answers[0]  # the whole output, its last step's tokens too
