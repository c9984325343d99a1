"""The target's context bounds the runtime (issue 25, item 7): a k it can never verify and a prompt that cannot fit
are refused in one line before any model work; a k beyond max_new_tokens drafts and allocates only what can be
output; drafts past the context's end are trimmed as vLLM's scheduler trims them; one rule for generate, eval and
regenerate (models/target.prompt_overflow)."""

import json

import pytest
import torch

from draftsmith.inference.eval import EvalError, PromptRecord, fit_prompts
from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.ngram import NgramProposer
from draftsmith.models.target import TargetError, TargetModel, context_length_of
from draftsmith.runtime.proposer import Proposal

CONTEXT = 64  # max_position_embeddings of the tiny targets here
MAX_NEW = 8


def tiny_target(tiny_llama, context=CONTEXT) -> TargetModel:
    model, _ = tiny_llama(max_position_embeddings=context)
    return TargetModel(model.float().eval())


def plain(target, prompt, max_new_tokens):
    return SpeculativeGenerator(target, None, 0).generate(torch.tensor([prompt]), max_new_tokens).token_ids


class OracleProposer:
    """Drafts the target's own greedy continuation (`reference` = prompt + answer and beyond), so every draft the
    runtime verifies is accepted; records the widths it was asked for."""

    aux_layer_ids = None

    def __init__(self, references):
        self.references, self.asked = references, []

    def begin(self, prompt_ids, sampler=None):
        self.paired = [0] * prompt_ids.shape[0]  # per row: the committed context is paired + 1 tokens

    def extend(self, token_ids, aux_hidden):
        self.paired = [p + int((row >= 0).sum()) for p, row in zip(self.paired, token_ids)]

    def propose(self, num_tokens):
        self.asked.append(num_tokens)
        drafts = [(ref[p + 1: p + 1 + num_tokens] + [0] * num_tokens)[:num_tokens] for ref, p in
                  zip(self.references, self.paired)]
        return Proposal(torch.tensor(drafts), torch.full((len(drafts),), num_tokens))


def spy_steps(target, monkeypatch):
    """Every target step's (first position, number of tokens, highest position id) in a list."""
    steps = []
    real = target.step

    def step(input_ids, cache, *a, position_ids=None, **kw):
        top = cache.length + input_ids.shape[1] - 1 if position_ids is None else int(position_ids.max())
        steps.append((cache.length, input_ids.shape[1], top))
        return real(input_ids, cache, *a, position_ids=position_ids, **kw)

    monkeypatch.setattr(target, "step", step)
    return steps


# ---- k against the context -----------------------------------------------------------------------------------
def test_a_k_the_context_can_never_verify_is_refused_in_one_line(tiny_llama):
    """The shortest request (one prompt token, its first output, k drafts, the bonus token) holds k + 3 tokens."""
    target = tiny_target(tiny_llama)
    assert context_length_of(target.config) == CONTEXT
    with pytest.raises(TargetError, match=r"num_speculative_tokens=62 can never be verified within the target's "
                                          r"context of 64 tokens .*use num_speculative_tokens <= 61$"):
        SpeculativeGenerator(target, NgramProposer(1, 2, 62), 62)
    ok = SpeculativeGenerator(target, NgramProposer(1, 2, 61), 61)
    assert ok.generate(torch.tensor([[5]]), 4).token_ids == plain(target, [5], 4)


def test_cli_refuses_k_past_the_context_before_loading_the_target(fixture_target_dir, capsys, monkeypatch):
    """num_speculative_tokens 100000 against the fixture's 4096 tokens: one line, exit 2, no weights read."""
    from draftsmith.cli import main

    monkeypatch.setattr(TargetModel, "from_pretrained", classmethod(lambda *a, **kw: pytest.fail("target loaded")))
    spec = '{"method": "ngram", "num_speculative_tokens": 100000}'
    rc = main(["generate", "--target", str(fixture_target_dir), "--speculative-config", spec, "--prompt", "Hi",
               "--max-new-tokens", "8", "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "num_speculative_tokens=100000" in err and "context of 4096 tokens" in err and "<= 4093" in err


# ---- k beyond max_new_tokens -------------------------------------------------------------------------------
def _eagle3(target, k):
    from test_eagle3_runtime import untrained_drafter

    from draftsmith.models.eagle3.proposer import Eagle3Proposer

    return Eagle3Proposer(untrained_drafter(target, draft_vocab=128), target.embed_tokens), []


def _mtp(target, k):
    from test_mtp import proposer_for, random_drafter

    drafter = random_drafter(target, num_depths=2)  # recursive: takes any k
    made = []
    real = drafter.new_cache

    def new_cache(*a, **kw):
        made.append(1)
        assert len(made) <= MAX_NEW, "an MTP depth cache made past max_new_tokens"
        return real(*a, **kw)

    drafter.new_cache = new_cache
    return proposer_for(target, drafter, k), made


@pytest.mark.parametrize("make", [_eagle3, _mtp], ids=["eagle3", "mtp"])
def test_k_past_max_new_tokens_drafts_and_allocates_only_what_can_be_output(tiny_llama, monkeypatch, make):
    """num_speculative_tokens 100000 with 8 new tokens ran for minutes (a drafter loop and a target cache of k);
    now each step drafts at most max_new_tokens, the target cache and MTP's per-depth caches are sized by that,
    and the output is plain decoding's. Asserted by what was asked and allocated, not by time."""
    k = 100_000
    target = tiny_target(tiny_llama, context=200_000)
    proposer, depth_caches = make(target, k)
    prompt = [3, 14, 15, 92, 65, 35]
    want = plain(target, prompt, MAX_NEW)
    asked, cache_lengths = [], []
    real_propose, real_new_cache = proposer.propose, target.new_cache

    def propose(num_tokens):
        asked.append(num_tokens)
        assert num_tokens <= MAX_NEW, f"asked for {num_tokens} drafts"  # fails at once, not after minutes
        return real_propose(num_tokens)

    def new_cache(batch, max_length):
        cache_lengths.append(max_length)
        assert max_length <= 64, f"a target cache of {max_length} slots"
        return real_new_cache(batch, max_length)

    monkeypatch.setattr(proposer, "propose", propose)
    monkeypatch.setattr(target, "new_cache", new_cache)
    result = SpeculativeGenerator(target, proposer, k).generate(torch.tensor([prompt]), MAX_NEW)
    assert result.token_ids == want
    assert set(asked) == {MAX_NEW} and cache_lengths == [len(prompt) + 2 * MAX_NEW + 1]
    assert result.metrics.num_spec_tokens == MAX_NEW and result.metrics.num_draft_tokens == MAX_NEW * len(asked)
    assert len(depth_caches) <= MAX_NEW  # MTP: one cache per depth run, none for the 99992 never reached


def test_normal_k_keeps_vllm_counting(tiny_llama):
    """k <= max_new_tokens: every step drafts k, the last one too (vLLM's counters), unchanged by the bound."""
    target = tiny_target(tiny_llama)
    prompt = [7, 8, 9]
    longer = plain(target, prompt, 20)
    proposer = OracleProposer([prompt + longer])
    result = SpeculativeGenerator(target, proposer, 4).generate(torch.tensor([prompt]), 9)
    assert result.token_ids == longer[:9]
    # 9 tokens: 1 from the prefill, 5 from the first step (4 drafts + bonus), 3 of the second step's 4 accepted
    # drafts: all 8 drafts count, the one past max_new_tokens too
    assert proposer.asked == [4, 4] and result.metrics.num_spec_tokens == 4
    assert result.metrics.num_draft_tokens == result.metrics.num_accepted_tokens == 8


# ---- prompts against the context -------------------------------------------------------------------------------
def test_the_drafts_past_the_context_are_trimmed_as_vllm_trims_them(tiny_llama, monkeypatch):
    """A prompt that fills the context with max_new_tokens: every position the target runs stays inside it, the
    last steps verify only the drafts after which the request (bonus token included) still fits, and the output
    is plain decoding's."""
    target = tiny_target(tiny_llama)
    prompt = list(range(1, CONTEXT - 12 + 1))  # 52 + 12 new = 64
    answer = plain(target, prompt, 12)
    steps = spy_steps(target, monkeypatch)
    proposer = OracleProposer([prompt + answer + [0] * 16])
    result = SpeculativeGenerator(target, proposer, 7).generate(torch.tensor([prompt]), 12)
    assert result.token_ids == answer
    assert max(top for _, _, top in steps) <= CONTEXT - 2  # the last output token is never run, as in plain decoding
    # prefill 52 -> 53 committed; step 1 verifies 7 drafts -> 61; step 2 has room for 64 - 61 - 1 = 2 drafts -> 64
    assert [width for _, width, _ in steps] == [52, 8, 3]
    assert result.metrics.num_draft_tokens == 7 + 2


def test_a_batch_trims_each_row_to_its_own_room(tiny_llama):
    """Rows of a batch near the context's end each verify the drafts that fit them and decode as alone."""
    target = tiny_target(tiny_llama)
    prompts = [list(range(1, 53)), [4, 5, 6]]
    alone = []
    for prompt in prompts:
        answer = plain(target, prompt, 12)
        alone.append(answer)
    references = [p + a + [0] * 16 for p, a in zip(prompts, alone)]
    results = SpeculativeGenerator(target, OracleProposer(references), 7).generate_batch(prompts, 12)
    assert [r.token_ids for r in results] == alone
    assert [r.metrics.num_draft_tokens for r in results] == [7 + 2, 7 + 7]  # the short prompt is never trimmed


def test_the_runtime_refuses_a_prompt_that_cannot_fit(tiny_llama):
    """prompt + max_new_tokens <= context, vLLM's rule for max_model_len and regenerate's: 52 + 12 fits, 53 does
    not, refused before any step naming the prompt's index and the limit."""
    target = tiny_target(tiny_llama)
    generator = SpeculativeGenerator(target, NgramProposer(1, 2, 3), 3)
    with pytest.raises(TargetError, match=r"^prompt 1: a prompt of 53 tokens plus max_new_tokens 12 exceeds the "
                                          r"target's context of 64 tokens: shorten it"):
        generator.generate_batch([[1, 2], list(range(1, 54))], 12)


def _records(lengths):
    return [PromptRecord(f"q.jsonl:{i + 1}", f"question number {i} " + "and more words " * 10, list(range(1, n + 1)))
            for i, n in enumerate(lengths)]


def test_fit_prompts_refuses_the_first_that_cannot_fit_or_cuts_every_one(tiny_llama, capsys):
    config = tiny_target(tiny_llama).config
    assert fit_prompts(_records([10, 56]), 8, config) == [list(range(1, 11)), list(range(1, 57))]
    with pytest.raises(EvalError) as refused:
        fit_prompts(_records([10, 57, 80]), 8, config, label="--dataset q")
    assert str(refused.value) == ("--dataset q, q.jsonl:2 ('question number 1 and more words and...'): a prompt of "
                                  "57 tokens plus max_new_tokens 8 exceeds the target's context of 64 tokens: "
                                  "shorten it, lower --max-new-tokens, or pass --truncate-prompts to keep its last "
                                  "56 tokens")
    cut = fit_prompts(_records([10, 57, 80]), 8, config, truncate=True, label="--dataset q")
    assert cut == [list(range(1, 11)), list(range(2, 58)), list(range(25, 81))]  # the end kept, as vLLM's
    assert "--dataset q: cut 2 prompt(s) to their last 56 tokens" in capsys.readouterr().err
    with pytest.raises(EvalError, match="--max-new-tokens 64 leaves no room for a prompt.*<= 63"):
        fit_prompts(_records([1]), 64, config, truncate=True)


def test_sliding_window_is_the_context_it_sets(tiny_llama):
    """A sliding window smaller than max_position_embeddings is the runtime's context (it attends to the whole
    context, which equals the window's attention only inside it), named in the refusal."""
    from transformers import MistralConfig, MistralForCausalLM

    from draftsmith.models.target import prompt_overflow

    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                           sliding_window=24)
    assert context_length_of(config) == 24 and prompt_overflow(16, 8, config) is None
    assert "sliding-window attention (24 tokens)" in prompt_overflow(17, 8, config)
    target = TargetModel(MistralForCausalLM(config).eval())
    assert target.new_cache(1, 40).max_length == 40  # slots are not positions: a tree takes one per node


def test_cli_eval_refuses_a_long_prompt_before_loading_the_target(fixture_target_dir, tmp_path, capsys,
                                                                   monkeypatch):
    """A 5000-word prompt against the fixture's 4096 tokens: one line naming the dataset, the record's line and its
    first words, before the target is loaded (it used to run for minutes)."""
    from draftsmith.cli import main

    monkeypatch.setattr(TargetModel, "from_pretrained", classmethod(lambda *a, **kw: pytest.fail("target loaded")))
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"prompt": "hello there"}) + "\n" + json.dumps({"prompt": "ocean " * 5000}) + "\n")
    rc = main(["eval", "--target", str(fixture_target_dir), "--speculative-config",
               '{"method": "ngram", "num_speculative_tokens": 3}', "--dataset", str(data), "--device", "cpu",
               "--max-new-tokens", "16", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"--dataset long, {data}:2 ('ocean ocean ocean" in err
    assert "plus max_new_tokens 16 exceeds the target's context of 4096 tokens" in err
    assert "--truncate-prompts to keep its last 4080 tokens" in err
