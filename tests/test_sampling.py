"""Speculative sampling is lossless: sequences sampled with speculation follow the target's own distribution.

The target is a tiny random Llama with an 8-token vocabulary, so the exact probability of every continuation
of a prompt can be enumerated; thousands of continuations are sampled as one batch and compared with it by a
chi-square goodness-of-fit test at alpha = 1e-3 (bins: every sequence with expected count >= 5, the rest
pooled; critical value from the Wilson-Hilferty approximation). The seeds are fixed, the bound is the test's,
not tuned: a run fails only if speculation shifts the distribution, or with probability 1e-3 by chance. The
same check must fail when the acceptance rule is wrong.
"""

import math
from collections import Counter

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.models.target import TargetModel
from draftsmith.runtime import verify
from draftsmith.runtime.proposer import PAD_DRAFT_TOKEN, Proposal
from draftsmith.runtime.sampling import Sampler, SamplingError, SamplingParams, logits_to_probs
from draftsmith.runtime.tree import dynamic_tree, parse_token_tree, static_tree

V = 8
PROMPT = [1, 2, 3]
SAMPLES = 4000
Z_ALPHA = 3.0902  # standard normal quantile for alpha = 1e-3


def tiny_target(seed=0):
    config = LlamaConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=32)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # large weights: peaked, varied distributions (default init is nearly uniform)
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.5)
    return TargetModel(model)


@torch.no_grad()
def draft_table(target, seed=1, noise=0.5):
    """(V, V, V) trigram logits: the target's next-token logits after each 2-token context, plus noise; close
    enough to the target that several drafts in a row get accepted, different enough that many are rejected."""
    pairs = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # (V*V, 2)
    logits = target.model(pairs).logits[:, -1].reshape(V, V, V)
    return logits + noise * torch.randn(V, V, V, generator=torch.Generator().manual_seed(seed))


class TableProposer:
    """A draft model that is a trigram table q(x | prev, last): vectorised over ragged rows, drafting chains
    (argmax = one-hot, or sampled with its distributions) or trees (static or dynamic, via tree.py)."""

    aux_layer_ids = None

    def __init__(self, table, probabilistic=False, tree=None, dynamic=None, nodes=None):
        self.table = table  # (prev, last) -> logits
        self.probabilistic, self.tree, self.dynamic, self.nodes = probabilistic, tree, dynamic, nodes

    def begin(self, prompt_ids, sampler=None):
        self.sampler = sampler
        counts = (prompt_ids != PAD_DRAFT_TOKEN).sum(-1)
        self.prev, self.last = self._last_two(prompt_ids, counts, prompt_ids[:, 0], prompt_ids[:, 0])

    @staticmethod
    def _last_two(ids, counts, prev, last):
        rows = torch.arange(ids.shape[0])
        new_last = ids[rows, (counts - 1).clamp_min(0)]
        new_prev = torch.where(counts >= 2, ids[rows, (counts - 2).clamp_min(0)], last)
        return torch.where(counts >= 1, new_prev, prev), torch.where(counts >= 1, new_last, last)

    def extend(self, token_ids, aux_hidden):
        self.prev, self.last = self._last_two(token_ids, (token_ids != PAD_DRAFT_TOKEN).sum(-1), self.prev, self.last)

    def propose(self, num_tokens):
        if self.tree is not None or self.dynamic is not None:
            return self._tree(num_tokens)
        prev, last, drafts, probs = self.prev, self.last, [], []
        for _ in range(num_tokens):
            logits = self.table[prev, last]  # (B, V)
            if self.probabilistic:
                q = self.sampler.probs(logits)
                draft = self.sampler.sample(q)
                probs.append(q)
            else:
                draft = logits.argmax(-1)
            drafts.append(draft)
            prev, last = last, draft
        token_ids = torch.stack(drafts, 1)
        return Proposal(token_ids, torch.full((token_ids.shape[0],), num_tokens),
                        draft_probs=torch.stack(probs, 1) if self.probabilistic else None)

    def _tree(self, max_depth):
        lasts = []  # per expansion: (B, m) the expanded nodes' tokens; their parents' tokens are their "prev"

        def expand(tokens, parents):
            known = torch.cat(lasts, 1) if lasts else torch.zeros(tokens.shape[0], 1, dtype=torch.long)
            parent_token = torch.where(parents < 0, self.last[:, None], known.gather(1, parents.clamp_min(0)))
            lasts.append(tokens)
            return torch.log_softmax(self.table[parent_token, tokens], -1)  # (B, m, V)

        root = torch.log_softmax(self.table[self.prev, self.last], -1)
        if self.tree is not None:
            tokens, parents, scores = static_tree(root, expand, self.tree, max_depth=max_depth)
        else:
            tokens, parents, scores = dynamic_tree(root, expand, *self.dynamic, self.nodes, max_depth=max_depth)
        depth = max(map(len, self.tree)) if self.tree is not None else self.dynamic[0]
        return Proposal(tokens, torch.full((tokens.shape[0],), tokens.shape[1]), scores=scores, parents=parents,
                        depth=min(depth, max_depth))  # the walk stops at the tree's depth, as with EAGLE-3


@torch.no_grad()
def exact_distribution(target, prompt, length, params):
    """P(continuation) for every continuation of `length` tokens with nonzero probability, by enumeration."""
    dist = {(): 1.0}
    for _ in range(length):
        prefixes = list(dist)
        ids = torch.tensor([prompt + list(p) for p in prefixes])
        probs = logits_to_probs(target.model(ids).logits[:, -1], params).tolist()
        dist = {p + (v,): dist[p] * row[v] for p, row in zip(prefixes, probs) for v in range(V) if row[v] > 0}
    return dist


def chi_square(samples, dist):
    """(statistic, critical value at alpha = 1e-3): sequences expected >= 5 times are bins, the rest pooled."""
    n = len(samples)
    counts = Counter(samples)
    big = [s for s, p in dist.items() if n * p >= 5]
    observed = [counts[s] for s in big]
    expected = [n * dist[s] for s in big]
    rest_observed, rest_expected = n - sum(observed), n - sum(expected)
    if rest_expected >= 5:
        observed.append(rest_observed)
        expected.append(rest_expected)
    elif rest_observed > 0 and rest_expected < 1e-6:
        return math.inf, 0.0  # sequences the target can never produce
    else:  # too small a pool for the chi-square approximation: merge it into the smallest bin
        i = min(range(len(expected)), key=expected.__getitem__)
        observed[i] += rest_observed
        expected[i] += rest_expected
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    df = len(expected) - 1
    critical = df * (1 - 2 / (9 * df) + Z_ALPHA * math.sqrt(2 / (9 * df))) ** 3  # Wilson-Hilferty
    return stat, critical


def sample_sequences(target, proposer, k, params, length, n=SAMPLES):
    generator = SpeculativeGenerator(target, proposer, k)
    results = generator.generate_batch([PROMPT] * n, length, sampling=params)
    assert all(len(r.token_ids) == length for r in results)
    return [tuple(r.token_ids) for r in results], results


SCENARIOS = {
    # name: (proposer factory given the target, k, sampling params, generated length). A chain's length is k + 2:
    # the first token, then a first speculative step that accepts all k drafts outputs its bonus token too.
    "plain": (lambda t: None, 0, SamplingParams(temperature=1.0, seed=11), 3),
    "probabilistic chain": (lambda t: TableProposer(draft_table(t, noise=0.2), probabilistic=True), 3,
                            SamplingParams(temperature=1.0, seed=12), 5),
    "one-hot chain, top-k/top-p": (lambda t: TableProposer(draft_table(t)), 3,
                                   SamplingParams(temperature=1.3, top_k=4, top_p=0.95, seed=13), 5),
    "probabilistic chain, top-p": (lambda t: TableProposer(draft_table(t, seed=4), probabilistic=True), 2,
                                   SamplingParams(temperature=1.3, top_p=0.8, seed=14), 4),
    "static tree": (lambda t: TableProposer(draft_table(t),
                                            tree=parse_token_tree("[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]")),
                    6, SamplingParams(temperature=1.0, seed=15), 4),
    "dynamic tree": (lambda t: TableProposer(draft_table(t), dynamic=(3, 2), nodes=6), 6,
                     SamplingParams(temperature=0.9, top_k=5, seed=16), 4),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_speculative_sampling_matches_the_target_distribution(name):
    make, k, params, length = SCENARIOS[name]
    target = tiny_target()
    proposer = make(target)
    samples, results = sample_sequences(target, proposer, k, params, length)
    stat, critical = chi_square(samples, exact_distribution(target, PROMPT, length, params))
    assert stat < critical, f"{name}: chi-square {stat:.1f} >= {critical:.1f}"
    if k:  # speculation really happened: drafts were rejected, accepted, and accepted two in a row
        accepted = sum(r.metrics.num_accepted_tokens for r in results)
        drafted = sum(r.metrics.num_draft_tokens for r in results)
        assert 0 < accepted < drafted
        assert sum(r.metrics.num_accepted_tokens_per_pos[1] for r in results) > 0
    if k and proposer.tree is None and proposer.dynamic is None:
        # A chain's bonus token (drawn from p after all k drafts were accepted) is in the compared sequences: a row
        # whose one speculative step accepted all k drafts ended with it (length k + 2), so a verifier drawing the
        # bonus from the residual of the last draft fails here too.
        assert length == k + 2
        bonus = sum(r.metrics.num_drafts == 1 and r.metrics.num_accepted_tokens == k for r in results)
        assert bonus >= SAMPLES // 100, f"{name}: {bonus} rows end with a bonus token"


@pytest.mark.parametrize("rule", [
    lambda p, q: torch.ones_like(p),  # always accept
    lambda p, q: (q / p.clamp_min(1e-12)).clamp(max=1.0),  # ratio upside down
])
def test_the_check_catches_a_wrong_acceptance_rule(monkeypatch, rule):
    monkeypatch.setattr(verify, "acceptance_probability", rule)
    make, k, params, length = SCENARIOS["probabilistic chain"]
    target = tiny_target()
    samples, _ = sample_sequences(target, make(target), k, params, length)
    stat, critical = chi_square(samples, exact_distribution(target, PROMPT, length, params))
    assert stat > critical


def test_the_check_catches_a_tree_walk_that_keeps_rejected_siblings(monkeypatch):
    """Sampling the recovered token from p (not from p minus the rejected siblings) is biased."""
    monkeypatch.setattr(verify, "_sample_residual", lambda p, removed, sampler: sampler.sample(p))
    make, k, params, length = SCENARIOS["static tree"]
    target = tiny_target()
    samples, _ = sample_sequences(target, make(target), k, params, length)
    stat, critical = chi_square(samples, exact_distribution(target, PROMPT, length, params))
    assert stat > critical


# ---- literal cases -------------------------------------------------------------------------------------------
def test_logits_to_probs_temperature_top_k_top_p_by_hand():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(temperature=1.0)),
                               torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    # top_k 2 -> renormalised over {0.5, 0.2}
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2)),
                               torch.tensor([5 / 7, 2 / 7, 0, 0, 0]))
    # top_p 0.8: 0.5 + 0.2 = 0.7 < 0.8, so 0.15 is needed too; 0.1 is not
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.8)),
                               torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    # temperature 0.5 squares and renormalises
    sq = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]) ** 2
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(temperature=0.5)), sq / sq.sum())
    # the most likely token survives any top_p
    assert logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.01)).tolist() == [1, 0, 0, 0, 0]


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature"), ({"top_k": -2}, "top_k"), ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"seed": 1.5}, "seed"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(SamplingError, match=message):
        SamplingParams(**kwargs)


def test_sampler_is_seeded_and_never_picks_impossible_tokens():
    probs = torch.tensor([[0.0, 0.7, 0.3, 0.0]]).expand(20000, -1)
    a = Sampler(SamplingParams(temperature=1.0, seed=5)).sample(probs)
    b = Sampler(SamplingParams(temperature=1.0, seed=5)).sample(probs)
    assert torch.equal(a, b)
    assert set(a.tolist()) == {1, 2} and abs((a == 1).float().mean().item() - 0.7) < 0.02


def test_rejection_verify_literal_cases():
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0))
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])  # (1, 3, V=3) deterministic target
    # drafts [1, 2] both certain under p: accepted, then the bonus from the last slot
    acc, tokens, n = verify.rejection_verify(torch.tensor([[1, 2]]), torch.tensor([2]), p, None, sampler)
    assert (acc.tolist(), tokens.tolist(), n.tolist()) == ([2], [[1, 2, 0]], [3])
    # draft d_1 = 0 has p = 0: rejected, and the recovered token comes from p without 0 -> 2
    acc, tokens, _ = verify.rejection_verify(torch.tensor([[1, 0]]), torch.tensor([2]), p, None, sampler)
    assert (acc.tolist(), tokens.tolist()) == ([1], [[1, 2, PAD_DRAFT_TOKEN]])
    # padded drafts are never accepted; the token after the valid ones is drawn from p
    acc, tokens, _ = verify.rejection_verify(torch.tensor([[1, PAD_DRAFT_TOKEN]]), torch.tensor([1]), p, None,
                                             sampler)
    assert (acc.tolist(), tokens.tolist()) == ([1], [[1, 2, PAD_DRAFT_TOKEN]])


def test_sampling_is_reproducible_with_a_seed():
    target = tiny_target()
    params = SamplingParams(temperature=1.0, seed=3)
    generator = SpeculativeGenerator(target, TableProposer(draft_table(target), probabilistic=True), 3)
    first = [r.token_ids for r in generator.generate_batch([PROMPT] * 5, 8, sampling=params)]
    again = [r.token_ids for r in generator.generate_batch([PROMPT] * 5, 8, sampling=params)]
    assert first == again and len(set(map(tuple, first))) > 1  # same seed, same rows; rows differ


def test_cli_generate_samples_reproducibly_and_rejects_bad_params(fixture_target_dir, capsys):
    import json

    from draftsmith.cli import main

    args = ["generate", "--target", str(fixture_target_dir), "--prompt", "Tell me about the ocean.",
            "--max-new-tokens", "8", "--json", "--device", "cpu", "--dtype", "float32",
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}']
    outputs = []
    for _ in range(2):
        assert main([*args, "--temperature", "0.9", "--top-p", "0.95", "--seed", "7"]) == 0
        outputs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 8
    assert main([*args, "--top-p", "1.5"]) == 2
    err = capsys.readouterr().err
    assert "--top-p" in err and len(err.strip().splitlines()) == 1


@torch.no_grad()
def test_eagle3_probabilistic_drafts_report_their_distributions():
    """draft_sample_method 'probabilistic': drafts are sampled (seeded), and draft_probs is the processed draft
    distribution spread over target ids, zero outside the draft vocabulary."""
    from test_tree import H, VD, VT, small_proposer

    params = SamplingParams(temperature=0.7, top_k=10, seed=3)
    drafts = []
    for _ in range(2):
        proposer, drafter, _ = small_proposer(draft_sample_method="probabilistic")
        proposer.begin(torch.tensor([[1, 2, 3]]), Sampler(params))
        proposer.extend(torch.tensor([[2, 3, 4]]), torch.randn(1, 3, 2 * H, generator=torch.Generator().manual_seed(0)))
        proposal = proposer.propose(3)
        drafts.append(proposal.token_ids)
        q = proposal.draft_probs  # (1, 3, V)
        assert q.shape == (1, 3, VT)
        torch.testing.assert_close(q.sum(-1), torch.ones(1, 3))
        in_draft = torch.zeros(VT, dtype=torch.bool)
        in_draft[torch.arange(VD) + drafter.d2t] = True
        assert q[..., ~in_draft].abs().sum() == 0 and ((q > 0).sum(-1) <= 10).all()  # top_k applied
        assert (q.gather(-1, proposal.token_ids[..., None]) > 0).all()  # each draft was possible under its q
    assert torch.equal(drafts[0], drafts[1])
    # without a sampler (greedy decoding) the same proposer drafts by argmax, one-hot
    proposer.begin(torch.tensor([[1, 2, 3]]), None)
    proposer.extend(torch.tensor([[2, 3, 4]]), torch.randn(1, 3, 2 * H))
    assert proposer.propose(2).draft_probs is None
