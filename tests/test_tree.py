"""Draft trees: masks as grids, static and dynamic construction, tree verification, KV compaction, and greedy
tree decoding on the fixture target equal to plain greedy decoding token for token."""

import pytest
import torch
from torch import nn

from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.spec_config import SpecConfigError, parse_spec_config
from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.eagle3.model import Eagle3Drafter
from draftsmith.models.eagle3.proposer import Eagle3Proposer
from draftsmith.models.target import KVCache, TargetModel
from draftsmith.runtime.proposer import PAD_DRAFT_TOKEN, ROOT_PARENT, Proposal
from draftsmith.runtime.sampling import Sampler, SamplingParams
from draftsmith.runtime.tree import (TreeError, ancestor_mask, chain_parents, compact_kv, dynamic_tree,
                                       node_depths, parse_token_tree, static_tree, step_attention_mask)
from draftsmith.runtime.verify import greedy_tree_verify, greedy_verify, sampling_tree_verify

P = PAD_DRAFT_TOKEN
R = ROOT_PARENT
TREE = [R, R, 0, 0, 2]  # nodes a b c d e: a, b under the root, c, d under a, e under c


def one_hot_logits(argmax_per_slot, vocab=10):
    return torch.nn.functional.one_hot(torch.tensor(argmax_per_slot), vocab).float() * 5.0


# ---- masks and structure -------------------------------------------------------------------------------------
def test_ancestor_mask_as_a_grid():
    mask = ancestor_mask(torch.tensor([TREE]))[0].int().tolist()
    assert mask == [  # slot: r a b c d e
        [1, 0, 0, 0, 0, 0],  # r
        [1, 1, 0, 0, 0, 0],  # a
        [1, 0, 1, 0, 0, 0],  # b
        [1, 1, 0, 1, 0, 0],  # c
        [1, 1, 0, 0, 1, 0],  # d
        [1, 1, 0, 1, 0, 1],  # e
    ]
    assert node_depths(ancestor_mask(torch.tensor([TREE])))[0].tolist() == [0, 1, 1, 2, 2, 3]
    # a chain is lower-triangular
    chain = ancestor_mask(chain_parents(1, 4))[0]
    assert torch.equal(chain, torch.ones(5, 5, dtype=torch.bool).tril())
    # invalid nodes hang off the root, whatever their parent says
    masked = ancestor_mask(torch.tensor([TREE]), torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool))[0]
    assert masked[5].int().tolist() == [1, 0, 0, 0, 0, 1]


def test_step_attention_mask_joins_cache_and_tree():
    valid = torch.tensor([[1, 0, 1], [1, 1, 1]], dtype=torch.bool)
    tree = ancestor_mask(torch.tensor([[R, 0], [R, R]]))  # (2, 3, 3)
    mask = step_attention_mask(tree, valid, 3)
    assert mask.shape == (2, 1, 3, 6)
    assert mask[0, 0].int().tolist() == [[1, 0, 1, 1, 0, 0], [1, 0, 1, 1, 1, 0], [1, 0, 1, 1, 1, 1]]
    assert mask[1, 0, 2].int().tolist() == [1, 1, 1, 1, 0, 1]


def test_parse_token_tree_sorts_breadth_first_and_rejects_bad_trees():
    assert parse_token_tree("[(1, 0), (0,), (1,), (0, 0)]") == [(0,), (1,), (0, 0), (1, 0)]
    assert parse_token_tree([[0], [0, 0]]) == [(0,), (0, 0)]
    for bad, message in [("[(0,), (1, 0)]", r"needs its parent \(1,\)"), ("[(0,), (0,)]", "twice"),
                         ("[(0,), ()]", "non-empty"), ("[(0,", "cannot parse"), ("[]", "non-empty list")]:
        with pytest.raises(TreeError, match=message):
            parse_token_tree(bad)


def test_spec_config_tree_keys():
    spec = parse_spec_config({"method": "eagle3", "model": "/d", "speculative_token_tree": "[(0,), (1,), (0, 0)]"},
                             "cpu")
    assert spec.num_speculative_tokens == 3 and spec.speculative_token_tree == "[(0,), (1,), (0, 0)]"
    spec = parse_spec_config({"method": "eagle3", "model": "/d", "num_speculative_tokens": 20,
                              "dynamic_tree": {"depth": 4, "top_k": 3}}, "cpu")
    assert spec.dynamic_tree == {"depth": 4, "top_k": 3} and spec.to_dict()["dynamic_tree"]["top_k"] == 3
    bad = [
        ({"speculative_token_tree": "[(0,)]", "num_speculative_tokens": 2}, "must equal the number of nodes"),
        ({"dynamic_tree": {"depth": 2, "topk": 2}, "num_speculative_tokens": 2}, "did you mean 'top_k'"),
        ({"dynamic_tree": {"depth": 2, "top_k": 2}, "num_speculative_tokens": 7}, "exceeds the 6 nodes"),
        ({"dynamic_tree": {"depth": 2}, "num_speculative_tokens": 2}, "needs top_k"),
        ({"spec_token_tree": "[(0,)]", "num_speculative_tokens": 1}, "'speculative_token_tree'"),
        ({"draft_sample_method": "random", "num_speculative_tokens": 1}, "greedy, probabilistic"),
        ({"speculative_token_tree": "[(0,)]", "draft_sample_method": "probabilistic"}, "one-hot"),
    ]
    for extra, message in bad:
        with pytest.raises(SpecConfigError, match=message):
            parse_spec_config({"method": "eagle3", "model": "/d", **extra}, "cpu")
    with pytest.raises(SpecConfigError, match="per-token scores"):
        parse_spec_config({"method": "ngram", "num_speculative_tokens": 3, "speculative_token_tree": "[(0,)]"}, "cpu")


# ---- construction ---------------------------------------------------------------------------------------------
def markov_expand(table):
    """An ExpandFn over a (V, V) log-prob table: a node's children depend on the node's token only."""
    def expand(tokens, parents):
        return table[tokens]  # (B, m, V)
    return expand


def brute_force_tree(root, table, depth, top_k, num_nodes):
    """EAGLE-2 written out over explicit paths: (path, cumulative score) of the kept nodes."""
    level = [((t,), root[t].item()) for t in root.topk(top_k).indices.tolist()]
    pool = list(level)
    for _ in range(depth - 1):
        children = []
        for path, score in level:
            lp = table[path[-1]]
            children += [(path + (t,), score + lp[t].item()) for t in lp.topk(top_k).indices.tolist()]
        pool += children
        level = sorted(children, key=lambda c: -c[1])[:top_k]
    return sorted(pool, key=lambda c: -c[1])[:num_nodes]


def test_dynamic_tree_keeps_the_best_nodes_as_a_connected_subtree():
    torch.manual_seed(0)
    vocab = 12
    table = torch.log_softmax(torch.randn(vocab, vocab) * 2, -1)
    root = torch.log_softmax(torch.randn(vocab) * 2, -1)
    tokens, parents, scores = dynamic_tree(root[None], markov_expand(table),
                                           depth=3, top_k=3, num_nodes=8)
    tokens, parents, scores = tokens[0].tolist(), parents[0].tolist(), scores[0]
    paths = []
    for i, (t, p) in enumerate(zip(tokens, parents)):
        assert p < i  # topological order
        paths.append((paths[p] if p != R else ()) + (t,))
    cumulative = [sum(scores[j].item() for j in range(len(paths)) if paths[j] == path[:len(paths[j])]
                      and len(paths[j]) <= len(path)) for path in paths]
    expected = brute_force_tree(root, table, 3, 3, 8)
    assert sorted(paths) == sorted(p for p, _ in expected)
    for path, cum in zip(paths, cumulative):
        assert cum == pytest.approx(dict(expected)[path], abs=1e-5)
    # max_depth cuts the expansion
    tokens, parents, _ = dynamic_tree(root[None], markov_expand(table), depth=3, top_k=3, num_nodes=8, max_depth=1)
    assert parents.tolist() == [[R, R, R]]


def test_static_tree_fills_ranks():
    vocab = 6
    table = torch.log_softmax(torch.arange(vocab, dtype=torch.float).flip(0).expand(vocab, -1).clone(), -1)
    table[2] = torch.log_softmax(torch.tensor([0.0, 1, 2, 3, 4, 5]), -1)  # after token 2: 5 is best, then 4
    root = torch.log_softmax(torch.tensor([[0.0, 1, 9, 8, 2, 3]]), -1)  # 2 best, then 3
    paths = parse_token_tree("[(0,), (1,), (0, 0), (0, 1), (1, 0)]")
    tokens, parents, scores = static_tree(root, markov_expand(table), paths)
    assert tokens.tolist() == [[2, 3, 5, 4, 0]] and parents.tolist() == [[R, R, 0, 0, 1]]
    assert scores[0, 0].item() == pytest.approx(root[0, 2].item())
    tokens, _, _ = static_tree(root, markov_expand(table), paths, max_depth=1)
    assert tokens.tolist() == [[2, 3]]


# ---- verification ---------------------------------------------------------------------------------------------
def test_greedy_tree_verify_picks_the_matching_branch():
    # target argmax per slot r a b c d e: root -> 4, b -> 7, ... a is wrong, b (token 4) right, and b has no
    # children; the accepted path is [b], bonus = argmax at b.
    nodes = torch.tensor([[3, 4, 1, 2, 9]])
    valid = torch.ones(1, 5, dtype=torch.bool)
    logits = one_hot_logits([[4, 1, 7, 9, 0, 0]])
    accepted, tokens, path = greedy_tree_verify(nodes, valid, torch.tensor([TREE]), logits)
    assert accepted.tolist() == [1] and tokens.tolist() == [[4, 7, P, P, P, P]] and path[0, :2].tolist() == [0, 2]
    # a (3) right, c (1 after a) right, e (9 after c) right: depth 3, bonus = argmax at e
    logits = one_hot_logits([[3, 1, 0, 9, 0, 5]])
    accepted, tokens, path = greedy_tree_verify(nodes, valid, torch.tensor([TREE]), logits)
    assert accepted.tolist() == [3] and tokens.tolist() == [[3, 1, 9, 5, P, P]] and path[0, :4].tolist() == [0, 1, 3, 5]
    # the same, with e invalid (past the row's budget): stops at c
    valid[0, 4] = False
    accepted, tokens, _ = greedy_tree_verify(nodes, valid, torch.tensor([TREE]), logits)
    assert accepted.tolist() == [2] and tokens.tolist() == [[3, 1, 9, P, P, P]]


def test_tree_verify_on_a_chain_equals_chain_verify():
    torch.manual_seed(0)
    for _ in range(20):
        drafts = torch.randint(0, 4, (3, 5))
        lengths = torch.randint(0, 6, (3,))
        drafts = torch.where(torch.arange(5) < lengths[:, None], drafts, P)
        logits = torch.randn(3, 6, 4)
        chain = greedy_verify(drafts, lengths, logits)
        tree = greedy_tree_verify(drafts, torch.arange(5) < lengths[:, None], chain_parents(3, 5), logits)
        assert torch.equal(chain[0], tree[0]) and torch.equal(chain[1], tree[1])
        assert torch.equal(tree[2], torch.arange(6).expand(3, -1))  # a chain's path is the identity


def test_sampling_tree_verify_with_certain_targets():
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0))
    nodes = torch.tensor([[3, 4, 1, 2, 9]])
    valid = torch.ones(1, 5, dtype=torch.bool)
    # deterministic p: the walk must follow exactly the argmax branch (b), then draw p at b
    probs = torch.softmax(one_hot_logits([[4, 1, 7, 9, 0, 0]]) * 10, -1)
    accepted, tokens, _ = sampling_tree_verify(nodes, valid, torch.tensor([TREE]), probs, sampler)
    assert accepted.tolist() == [1] and tokens.tolist() == [[4, 7, P, P, P, P]]
    # no child has mass: both rejected, the recovered token comes from p without them
    probs = torch.tensor([[0.5, 0.5] + [0.0] * 8]).expand(1, 6, -1).clone()
    accepted, tokens, _ = sampling_tree_verify(nodes, valid, torch.tensor([TREE]), probs, sampler)
    assert accepted.tolist() == [0] and tokens[0, 0].item() in (0, 1)


def test_compact_kv_moves_the_accepted_path_per_row():
    cache = KVCache(2, 2, 1, 1, 8, torch.float32, "cpu")  # (L, B, kv, hd, T_max)
    cache.keys[:] = torch.arange(8, dtype=torch.float32).view(1, 1, 1, 8, 1)
    cache.values[:] = -cache.keys
    cache.length = 8
    # step region starts at 2 (slots 2..7 = root + 5 nodes); row 0 keeps root, node slot 2, node slot 4;
    # row 1 keeps root and node slot 1 (padding after)
    compact_kv(cache, 2, torch.tensor([[0, 2, 4], [0, 1, 2]]))
    assert cache.keys[0, 0, 0, :5, 0].tolist() == [0, 1, 2, 4, 6]
    assert cache.keys[1, 1, 0, :4, 0].tolist() == [0, 1, 2, 3]
    assert cache.values[0, 0, 0, :5, 0].tolist() == [0, -1, -2, -4, -6]


# ---- the EAGLE-3 drafter's tree attention ---------------------------------------------------------------------
H, VT, VD = 32, 40, 24


def small_proposer(**tree):
    torch.manual_seed(0)
    config = Eagle3Config(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, vocab_size=VT, draft_vocab_size=VD, target_hidden_size=H,
                          num_target_layers=4, aux_layer_ids=[1, 2])
    drafter = Eagle3Drafter(config).eval()
    for p in drafter.parameters():
        nn.init.normal_(p, std=0.3)
    used = torch.randperm(VT)[:VD].sort().values
    drafter.d2t.copy_(used - torch.arange(VD))
    embed = nn.Embedding(VT, H)
    return Eagle3Proposer(drafter, embed, **tree), drafter, embed


@torch.no_grad()
def test_drafter_tree_scores_equal_chain_drafting_along_each_path():
    """Each node's score is its log-prob given its path, computed by plain causal chain steps; a row of a ragged
    batch drafts the same tree as the row alone (tree mask, positions and validity in the drafter cache)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VT, (6,), generator=g), torch.randint(0, VT, (3,), generator=g)]
    aux = [torch.randn(1, 6, 2 * H, generator=g), torch.randn(1, 3, 2 * H, generator=g)]
    proposer, drafter, embed = small_proposer(dynamic_tree={"depth": 3, "top_k": 3}, num_nodes=7)

    nxt = torch.tensor([[5], [9]])  # the first generated token of each row
    pad = torch.full((3,), P)
    proposer.begin(torch.stack([prompts[0], torch.cat([prompts[1], pad])]))  # right-padded, as the runtime does
    proposer.extend(torch.stack([torch.cat([prompts[0][1:], nxt[0]]), torch.cat([prompts[1][1:], nxt[1], pad])]),
                    torch.cat([aux[0], torch.cat([aux[1], torch.zeros(1, 3, 2 * H)], 1)]))
    batch_tree = proposer.propose(3)
    for b in range(2):
        alone, _, _ = small_proposer(dynamic_tree={"depth": 3, "top_k": 3}, num_nodes=7)
        alone.begin(prompts[b][None])
        alone.extend(torch.cat([prompts[b][1:], nxt[b]])[None], aux[b])
        tree = alone.propose(3)
        assert torch.equal(tree.token_ids[0], batch_tree.token_ids[b])
        assert torch.equal(tree.parents[0], batch_tree.parents[b])
        torch.testing.assert_close(tree.scores[0], batch_tree.scores[b], atol=1e-4, rtol=1e-4)
        # chain recomputation: hidden chain along the path through plain causal drafter steps
        tokens, parents = tree.token_ids[0].tolist(), tree.parents[0].tolist()
        t2d = {t: i for i, t in enumerate((torch.arange(VD) + drafter.d2t).tolist())}
        for node in range(len(tokens)):
            path, j = [], node
            while j != R:
                path.insert(0, tokens[j])
                j = parents[j]
            alone.cache.rollback(alone.committed)
            hidden = alone.next_hidden
            for t in path[:-1]:
                hidden = drafter.step(embed(torch.tensor([[t]])), hidden, alone.cache)
            logprob = torch.log_softmax(drafter.logits(hidden)[0, -1], -1)[t2d[path[-1]]]
            assert logprob.item() == pytest.approx(tree.scores[0, node].item(), abs=1e-4)


@torch.no_grad()
@pytest.mark.parametrize("tree", [dict(dynamic_tree={"depth": 4, "top_k": 2}, num_nodes=12),
                                  dict(token_tree=parse_token_tree("[(0,), (1,), (0, 0), (0, 0, 0)]"))],
                         ids=["dynamic", "static"])
def test_tree_proposal_states_a_depth_bound_that_holds(tree):
    """`Proposal.depth` is how many levels sampling verification walks (without reading the device), so it must
    never be below the depth of the tree drafted, and it follows the depth asked for."""
    g = torch.Generator().manual_seed(2)
    proposer, _, _ = small_proposer(**tree)
    proposer.begin(torch.randint(0, VT, (1, 5), generator=g))
    proposer.extend(torch.randint(0, VT, (1, 5), generator=g), torch.randn(1, 5, 2 * H, generator=g))
    for asked in (1, 2, 3, 6):
        proposal = proposer.propose(asked)
        deepest = int(node_depths(ancestor_mask(proposal.parents)).max())
        full = tree["dynamic_tree"]["depth"] if "dynamic_tree" in tree else 3
        assert proposal.depth == min(asked, full) and deepest <= proposal.depth
        assert deepest == proposal.depth or "dynamic_tree" in tree  # a static tree always fills its paths


# ---- the fixture target -------------------------------------------------------------------------------------------
@pytest.fixture
def fixture_target(fixture_target_dir):
    return TargetModel.from_pretrained(fixture_target_dir, dtype="float32", device="cpu")


@pytest.fixture
def prompts(fixture_target_dir, mt_bench_path):
    from transformers import AutoTokenizer

    from draftsmith.inference.eval import load_prompts

    return load_prompts(mt_bench_path, AutoTokenizer.from_pretrained(fixture_target_dir), limit=2)


def untrained_drafter(target, draft_vocab=500, seed=0):
    """A fixture-sized EAGLE-3 drafter with random weights and a random draft vocabulary."""
    from test_eagle3_runtime import untrained_drafter as random_eagle3

    return random_eagle3(target, draft_vocab, seed)


class OracleTreeProposer:
    """Drafts a fixed-shape tree around the known greedy continuation ref[n], ref[n+1], ... of each row::

        node  parent  token                     the true path is node 1 -> 3 -> 4: the *second* root child, so
        0     root    ref[n] + 1   (wrong)      accepting it needs the tree walk and a compaction of slots
        1     root    ref[n]                    [0, 2, 4, 5] into [0, 1, 2, 3]; node 5 (depth 2) comes after
        2     1       ref[n+1] + 1 (wrong)      node 4 (depth 3): topological, not breadth-first order
        3     1       ref[n+1]
        4     3       ref[n+2]
        5     0       ref[n+1]
    A per-step script gives the true depth (0..3); nodes deeper than it are made wrong."""

    aux_layer_ids = None
    parents = [R, R, 1, 1, 3, 0]

    def __init__(self, references, script, vocab):
        self.references, self.script, self.vocab = references, script, vocab

    def begin(self, prompt_ids, sampler=None):
        self.n = [1] * prompt_ids.shape[0]  # committed context length: 1 + tokens paired so far
        self.calls = 0

    def extend(self, token_ids, aux):
        for b, row in enumerate(token_ids.tolist()):
            self.n[b] += sum(t != P for t in row)

    def propose(self, num_tokens):
        depth = self.script[self.calls % len(self.script)]
        self.calls += 1
        rows = []
        for ref, n in zip(self.references, self.n):
            at = lambda i: ref[n + i] if n + i < len(ref) else 0
            wrong = lambda t: (t + 1) % self.vocab
            truth = [at(0), at(1), at(2)]
            true_path = [t if d < depth else wrong(t) for d, t in enumerate(truth)]
            rows.append([wrong(at(0)), true_path[0], wrong(at(1)), true_path[1], true_path[2], at(1)])
        batch = len(rows)
        return Proposal(torch.tensor(rows), torch.full((batch,), 6),
                        parents=torch.tensor([self.parents] * batch))


def test_tree_paths_are_accepted_and_compacted_on_fixture(fixture_target, prompts):
    plain = SpeculativeGenerator(fixture_target, None, 0)
    for ids in prompts:
        prompt = torch.tensor([ids])
        want = plain.generate(prompt, 30)
        oracle = OracleTreeProposer([ids + want.token_ids], [3, 0, 2, 1, 3], fixture_target.vocab_size)
        got = SpeculativeGenerator(fixture_target, oracle, 6).generate(prompt, 30)
        assert got.token_ids == want.token_ids
        m = got.metrics
        # accepted = path length; num_draft_tokens = every node verified (6, fewer where depth is capped)
        assert m.num_accepted_tokens_per_pos[2] > 0 and m.num_accepted_tokens_per_pos[3] == 0
        assert sum(m.num_accepted_tokens_per_pos) == m.num_accepted_tokens
        assert m.num_draft_tokens <= 6 * m.num_drafts
        # every accepted draft saves a target step, but those of the last step past max_new_tokens (counted,
        # as vLLM counts them, never output)
        saved = want.num_target_steps - got.num_target_steps
        assert m.num_accepted_tokens - m.num_spec_tokens <= saved <= m.num_accepted_tokens


TREES = {
    "static": (dict(token_tree=parse_token_tree("[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]")), 6),
    "dynamic": (dict(dynamic_tree={"depth": 4, "top_k": 3}, num_nodes=10), 10),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(TREES))
def test_eagle3_greedy_tree_decoding_equals_plain_greedy_on_fixture(fixture_prompts, accepting_drafter, kind):
    """Trees of a drafter that accepts: deep paths are accepted, others cut short, and the output is plain
    greedy decoding's."""
    from conftest import generate_lossless

    from draftsmith.models.eagle3.io import load_drafter

    target, _, prompts, answers, eos = fixture_prompts
    kwargs, k = TREES[kind]
    proposer = Eagle3Proposer(load_drafter(accepting_drafter("eagle3")), target.embed_tokens, **kwargs)
    m = generate_lossless(target, proposer, k, prompts, answers, eos)
    assert m.num_drafts > 0 and m.num_draft_tokens > m.num_drafts  # whole trees were verified
    assert m.num_accepted_tokens_per_pos[1] >= 5  # paths of depth 2 and more were accepted
    assert m.num_accepted_tokens_per_pos[0] < m.num_drafts  # and some trees had no accepted node


def test_eagle3_tree_sampling_runs(fixture_target, prompts):
    proposer = Eagle3Proposer(untrained_drafter(fixture_target), fixture_target.embed_tokens, **TREES["dynamic"][0])
    tree = SpeculativeGenerator(fixture_target, proposer, TREES["dynamic"][1])
    sampled = tree.generate(torch.tensor([prompts[0]]), 12, sampling=SamplingParams(temperature=0.8, top_p=0.95,
                                                                                      seed=0))
    assert len(sampled.token_ids) == 12 and all(0 <= t < fixture_target.vocab_size for t in sampled.token_ids)


def test_spec_config_builds_tree_proposers(tmp_path, tiny_llama):
    """speculative_token_tree / dynamic_tree reach the EAGLE-3 proposer through build_proposer, and greedy tree
    decoding of a tiny target equals plain decoding."""
    from draftsmith.inference.spec_config import build_proposer
    from draftsmith.models.checkpoint import save_safetensors_atomic, write_json_atomic

    model, config = tiny_llama()
    target = TargetModel(model.float().eval())
    torch.manual_seed(0)
    drafter = Eagle3Drafter(Eagle3Config.from_target(config, 64))
    drafter.d2t.copy_(torch.arange(64) * 3 - torch.arange(64))
    drafter.t2d.zero_()
    drafter.t2d[torch.arange(64) * 3] = True  # the same draft vocabulary as d2t: the loader checks the pair
    tensors = {k: v for k, v in drafter.state_dict().items() if not k.startswith("rotary_emb.")}
    tmp_path.mkdir(exist_ok=True)
    save_safetensors_atomic(tensors, tmp_path / "model.safetensors")
    write_json_atomic(drafter.config.to_dict(), tmp_path / "config.json")
    prompt = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(0))
    want = SpeculativeGenerator(target, None, 0).generate(prompt, 12).token_ids
    for tree in ({"speculative_token_tree": "[(0,), (1,), (0, 0)]"},
                 {"dynamic_tree": {"depth": 2, "top_k": 2}, "num_speculative_tokens": 4}):
        spec = parse_spec_config({"method": "eagle3", "model": str(tmp_path), **tree}, "cpu")
        proposer = build_proposer(spec, target)
        assert (proposer.token_tree is not None) == ("speculative_token_tree" in tree)
        got = SpeculativeGenerator(target, proposer, spec.num_speculative_tokens).generate(prompt, 12)
        assert got.token_ids == want
        assert got.metrics.num_draft_tokens > got.metrics.num_drafts  # trees, not chains, were verified
