"""suffix_hybrid: suffix decoding where its draft scores high enough, the drafter's chain elsewhere, per row."""

import pytest
import torch

from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.hybrid import SuffixHybridProposer
from draftsmith.inference.report import NOT_IN_VLLM
from draftsmith.inference.spec_config import SpecConfigError, build_proposer, parse_spec_config
from draftsmith.models.target import TargetModel


def test_spec_config_takes_suffix_hybrid_for_a_drafter_only():
    spec = parse_spec_config({"method": "eagle3", "model": "d", "num_speculative_tokens": 4,
                              "suffix_hybrid": {"min_score": 2}, "suffix_decoding_min_token_prob": 0.2}, "cpu")
    assert spec.suffix_hybrid == {"min_score": 2.0}
    assert spec.suffix_decoding_min_token_prob == 0.2  # as given; the rest keep vLLM's defaults, unwritten
    assert "suffix_decoding_max_tree_depth" not in spec.to_dict()
    assert "suffix_hybrid" in NOT_IN_VLLM  # never recommended as a vLLM --speculative-config
    bad = [
        ({"method": "ngram", "num_speculative_tokens": 3, "suffix_hybrid": {"min_score": 1}}, "not 'ngram'"),
        ({"method": "eagle3", "model": "d", "num_speculative_tokens": 6, "dynamic_tree": {"depth": 2, "top_k": 2},
          "suffix_hybrid": {"min_score": 1}}, "greedy chains"),
        ({"method": "eagle3", "model": "d", "num_speculative_tokens": 3, "draft_sample_method": "probabilistic",
          "suffix_hybrid": {"min_score": 1}}, "greedy chains"),
        ({"method": "eagle3", "model": "d", "num_speculative_tokens": 3, "suffix_hybrid": {"min_scor": 1}},
         "did you mean 'min_score'"),
        ({"method": "eagle3", "model": "d", "num_speculative_tokens": 3, "suffix_hybrid": {"min_score": 0}},
         "min_score must be a number > 0"),
        ({"method": "eagle3", "model": "d", "num_speculative_tokens": 3, "suffix_hybrid": 2}, "must be an object"),
    ]
    for raw, message in bad:
        with pytest.raises(SpecConfigError, match=message):
            parse_spec_config(raw, "cpu")


@pytest.fixture
def fixture_setup(tmp_path, fixture_target_dir, mt_bench_path):
    from transformers import AutoTokenizer

    from draftsmith.inference.eval import load_prompts
    from test_eagle3_runtime import untrained_checkpoint

    target = TargetModel.from_pretrained(fixture_target_dir, dtype="float32", device="cpu")
    folder, _ = untrained_checkpoint(tmp_path / "eagle3", target)
    prompts = load_prompts(mt_bench_path, AutoTokenizer.from_pretrained(fixture_target_dir), limit=2)
    return target, str(folder), prompts


def test_hybrid_suffix_half_takes_the_given_settings_and_vllm_defaults(fixture_setup):
    target, folder, _ = fixture_setup
    spec = parse_spec_config({"method": "eagle3", "model": folder, "num_speculative_tokens": 3,
                              "suffix_hybrid": {"min_score": 1}, "suffix_decoding_min_token_prob": 0.3}, "cpu")
    suffix = build_proposer(spec, target).suffix
    assert (suffix.min_token_prob, suffix.max_tree_depth, suffix.max_spec_factor) == (0.3, 24, 1.0)


def _generator(target, folder, min_score=None, k=4):
    raw = {"method": "eagle3", "model": folder, "num_speculative_tokens": k}
    if min_score is not None:
        raw["suffix_hybrid"] = {"min_score": min_score}
    return SpeculativeGenerator(target, build_proposer(parse_spec_config(raw, "cpu"), target), k)


def test_hybrid_is_lossless_and_takes_suffix_drafts_where_they_score(fixture_setup):
    """With an untrained drafter, the suffix half carries the acceptance on the fixture's repetitive answers; a
    threshold no draft reaches leaves exactly the drafter's run."""
    target, folder, prompts = fixture_setup
    plain = SpeculativeGenerator(target, None, 0)
    for ids in prompts:
        prompt = torch.tensor([ids])
        want = plain.generate(prompt, 48)
        drafter_only = _generator(target, folder).generate(prompt, 48)
        hybrid_gen = _generator(target, folder, min_score=0.5)
        hybrid = hybrid_gen.generate(prompt, 48)
        never = _generator(target, folder, min_score=1e9)
        unreachable = never.generate(prompt, 48)
        assert hybrid.token_ids == want.token_ids == drafter_only.token_ids == unreachable.token_ids
        assert isinstance(hybrid_gen.proposer, SuffixHybridProposer)
        assert hybrid_gen.proposer.suffix_steps > 0 and hybrid_gen.proposer.drafter_steps > 0
        assert never.proposer.suffix_steps == 0
        assert unreachable.metrics.to_dict() == drafter_only.metrics.to_dict()
        assert hybrid.metrics.num_accepted_tokens > drafter_only.metrics.num_accepted_tokens


def test_hybrid_batch_rows_choose_alone(fixture_setup):
    """Rows of a batch pick their drafts independently and decode as they would alone."""
    target, folder, prompts = fixture_setup
    alone = [_generator(target, folder, min_score=0.5).generate(torch.tensor([ids]), 32) for ids in prompts]
    batch = _generator(target, folder, min_score=0.5).generate_batch(prompts, 32)
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]


class FixedDrafter:
    """A drafter stand-in that always drafts token 7."""

    aux_layer_ids = None

    def begin(self, prompt_ids, sampler=None):
        self.rows = prompt_ids.shape[0]

    def extend(self, token_ids, aux_hidden):
        pass

    def propose(self, num_tokens):
        from draftsmith.runtime.proposer import Proposal

        return Proposal(torch.full((self.rows, num_tokens), 7), torch.full((self.rows,), num_tokens))


def test_each_row_takes_the_suffix_draft_only_where_it_scores():
    from draftsmith.inference.suffix import SuffixProposer, path_score

    suffix = SuffixProposer(8)
    hybrid = SuffixHybridProposer(FixedDrafter(), suffix, min_score=1.0)
    repeats = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]  # "1 2 3" came twice before, followed by "4 1 2 ..."
    fresh = [5, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41]  # nothing recurs: no suffix draft
    hybrid.begin(torch.tensor([repeats, fresh]))
    tokens, ratios = suffix.draft(0, 6)
    assert 0 < len(tokens) < 6 and path_score(ratios) >= 1.0 and not suffix.draft(1, 6)[0]
    proposal = hybrid.propose(6)
    assert proposal.token_ids[0, : len(tokens)].tolist() == tokens and proposal.lengths[0] == len(tokens)
    assert proposal.token_ids[1].tolist() == [7] * 6 and proposal.lengths[1] == 6
    assert (hybrid.suffix_steps, hybrid.drafter_steps) == (1, 1)
    hybrid.min_score = path_score(ratios) + 1e-6  # now no row's suffix draft is good enough
    assert hybrid.propose(6).token_ids.tolist() == [[7] * 6, [7] * 6]
