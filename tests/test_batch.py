"""Batched generation: prompts of different lengths, each row accepting its own number of tokens per step,
give exactly the results of running every prompt alone (greedy), with n-gram, EAGLE-3 and tree drafts."""

import pytest
import torch

from draftsmith.inference import generator as generator_module
from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.ngram import NgramProposer
from draftsmith.models.eagle3.proposer import Eagle3Proposer
from draftsmith.models.target import TargetModel
from draftsmith.runtime.proposer import PAD_DRAFT_TOKEN, Proposal
from test_tree import OracleTreeProposer

P = PAD_DRAFT_TOKEN
LENGTHS = (5, 11, 2, 8)


class ChainOracle:
    """Per row, drafts the known greedy continuation with the row's scripted number of correct tokens per step
    (the rest wrong), so rows accept different amounts and the shared cache gets holes."""

    aux_layer_ids = None

    def __init__(self, references, scripts, vocab):
        self.references, self.scripts, self.vocab = references, scripts, vocab

    def begin(self, prompt_ids, sampler=None):
        self.n = [1] * prompt_ids.shape[0]
        self.calls = 0

    def extend(self, token_ids, aux):
        for b, row in enumerate(token_ids.tolist()):
            self.n[b] += sum(t != P for t in row)

    def propose(self, num_tokens):
        rows = []
        for ref, n, script in zip(self.references, self.n, self.scripts):
            good = script[self.calls % len(script)]
            drafts = [ref[n + i] if n + i < len(ref) else 0 for i in range(num_tokens)]
            rows.append([t if i < good else (t + 1) % self.vocab for i, t in enumerate(drafts)])
        self.calls += 1
        return Proposal(torch.tensor(rows), torch.full((len(rows),), num_tokens))


@pytest.fixture
def tiny_target(tiny_llama):
    model, _ = tiny_llama()
    return TargetModel(model.float().eval())


def random_prompts(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def assert_same_as_alone(make_generator, prompts, max_new, eos=None):
    """Batch results equal the per-prompt results: tokens, metrics, target steps. `make_generator(rows)` builds
    a generator for the prompts at indices `rows` (scripted proposers need to know whose script to follow)."""
    batch = make_generator(range(len(prompts))).generate_batch(prompts, max_new, eos)
    for row, (prompt, got) in enumerate(zip(prompts, batch)):
        alone = make_generator([row]).generate(torch.tensor([prompt]), max_new, eos)
        assert got.token_ids == alone.token_ids
        assert got.metrics.to_dict() == alone.metrics.to_dict()
        assert got.num_target_steps == alone.num_target_steps
    return batch


def test_plain_and_ngram_batches_equal_single_runs(tiny_target):
    prompts = random_prompts()
    prompts[1] = prompts[1][:4] * 3  # a repetitive prompt: n-gram matches in one row only
    assert_same_as_alone(lambda rows: SpeculativeGenerator(tiny_target, None, 0), prompts, 20)
    batch = assert_same_as_alone(lambda rows: SpeculativeGenerator(tiny_target, NgramProposer(1, 3, 4), 4),
                                 prompts, 20)
    assert len({r.metrics.num_accepted_tokens for r in batch}) > 1  # rows really accepted different amounts


def test_ragged_acceptance_eos_and_cache_defragmentation(tiny_target, monkeypatch):
    prompts = random_prompts(seed=1)
    max_new = 40
    plain = SpeculativeGenerator(tiny_target, None, 0)
    references = [p + plain.generate(torch.tensor([p]), max_new).token_ids for p in prompts]
    # row 0 accepts everything, row 1 nothing, rows 2 and 3 mixed: one row's step fills the cache faster than
    # the others commit, until the shared write pointer reaches the end and the cache is defragmented
    scripts = [[4], [0], [1, 3, 0], [2]]
    calls = []
    original = generator_module._defragment
    monkeypatch.setattr(generator_module, "_defragment", lambda *a: calls.append(1) or original(*a))
    def make(rows):
        oracle = ChainOracle([references[r] for r in rows], [scripts[r] for r in rows], 256)
        return SpeculativeGenerator(tiny_target, oracle, 4)

    batch = assert_same_as_alone(make, prompts, max_new)
    assert calls, "the cache was never defragmented"
    assert [r.metrics.num_accepted_tokens > 0 for r in batch] == [True, False, True, True]
    # EOS: a token of row 2's output ends it early while the others go on
    eos = {references[2][len(prompts[2]) + 5]}
    batch = assert_same_as_alone(make, prompts, max_new, eos)
    assert len(batch[2].token_ids) <= 6 and batch[2].token_ids[-1] in eos


def test_tree_batches_equal_single_runs(tiny_target):
    prompts = random_prompts(seed=2)
    plain = SpeculativeGenerator(tiny_target, None, 0)
    references = [p + plain.generate(torch.tensor([p]), 25).token_ids for p in prompts]
    def make(rows):
        oracle = OracleTreeProposer([references[r] for r in rows], [3, 0, 2, 1], 256)
        return SpeculativeGenerator(tiny_target, oracle, 6)

    batch = assert_same_as_alone(make, prompts, 25)
    assert all(r.metrics.num_accepted_tokens_per_pos[2] > 0 for r in batch)


def test_bad_batches_are_refused(tiny_target):
    with pytest.raises(ValueError, match="at least one prompt"):
        SpeculativeGenerator(tiny_target, None, 0).generate_batch([[1, 2], []], 4)
    with pytest.raises(ValueError, match="generate_batch"):
        SpeculativeGenerator(tiny_target, None, 0).generate(torch.tensor([[1, 2], [3, 4]]), 4)


# ---- the fixture target ---------------------------------------------------------------------------------------
@pytest.fixture
def fixture_setup(fixture_target_dir, mt_bench_path):
    from transformers import AutoTokenizer

    from draftsmith.inference.eval import load_prompts

    target = TargetModel.from_pretrained(fixture_target_dir, dtype="float32", device="cpu")
    prompts = load_prompts(mt_bench_path, AutoTokenizer.from_pretrained(fixture_target_dir), limit=3)
    assert len({len(p) for p in prompts}) == 3  # different lengths
    return target, prompts


def test_fixture_ngram_batch_equals_single_runs(fixture_setup):
    target, prompts = fixture_setup
    make = lambda rows: SpeculativeGenerator(target, NgramProposer(1, 3, 4), 4)  # noqa: E731
    batch = assert_same_as_alone(make, prompts, 24, {6, 2})
    assert sum(r.metrics.num_accepted_tokens for r in batch) > 0


@pytest.mark.parametrize("tree", [{}, {"dynamic_tree": {"depth": 3, "top_k": 2}, "num_nodes": 5}],
                         ids=["chain", "tree"])
@pytest.mark.slow
def test_fixture_eagle3_batch_equals_single_runs(fixture_prompts, accepting_drafter, tree):
    """A drafter that accepts: rows accept different counts per step and finish at different steps (one by EOS
    when this was written), and each row is exactly what it is alone."""
    from conftest import ACCEPTING_NEW_TOKENS

    from draftsmith.models.eagle3.io import load_drafter

    target, _, prompts, answers, eos = fixture_prompts
    drafter = load_drafter(accepting_drafter("eagle3"))
    k = 3 if not tree else 5
    make = lambda rows: SpeculativeGenerator(target, Eagle3Proposer(drafter, target.embed_tokens, **tree), k)  # noqa
    batch = assert_same_as_alone(make, prompts, ACCEPTING_NEW_TOKENS, eos)
    assert [r.token_ids for r in batch] == answers
    accepted = [r.metrics.num_accepted_tokens for r in batch]
    assert min(accepted) > 0 and len(set(accepted)) > 1  # every row accepted, and each its own amount
    assert len({len(r.token_ids) for r in batch}) > 1 or len({r.num_target_steps for r in batch}) > 1
