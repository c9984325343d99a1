"""The teacher-forced acceptance simulation counts exactly what the runtime counts, with a drafter that accepts."""

import json

import pytest
import torch
from transformers import AutoTokenizer

from draftsmith.inference.eval import eos_token_ids, render_prompt
from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.simulate import plain_answers, replay_chains, simulate_greedy_chains
from draftsmith.models.eagle3.io import load_drafter
from draftsmith.models.eagle3.proposer import Eagle3Proposer
from draftsmith.models.target import TargetModel
from draftsmith.train import train
from test_train import tiny_recipe  # shared helper, same folder

QUESTIONS = ["What is the capital of France?", "How do I sort a list in Python?", "Why is the sky blue?",
             "Give me three tips for sleeping well.", "What is a prime number?", "Write a haiku about rain."]
MAX_NEW = 40


def test_replay_follows_the_generators_step_rule():
    """prompt of 3, answer of 8 tokens (generated 1 by prefill), k=3: every chain is right for 2 steps, then
    wrong. Steps: 1 -> 4 -> 7 -> then room for min(3, 10 - 7 - 1) = 2 drafts, both right -> 10 > 8 is cut by the
    answer's end; the counters follow vLLM's definitions."""
    correct = torch.zeros(3, 20, dtype=torch.bool)
    correct[:2] = True
    metrics = replay_chains(correct, prompt_length=3, answer_length=8, k=3, max_new_tokens=10)
    assert (metrics.num_drafts, metrics.num_draft_tokens, metrics.num_accepted_tokens) == (3, 8, 6)
    assert metrics.num_accepted_tokens_per_pos == [3, 3, 0]


def _fixture_target_dir():
    from conftest import SHARED

    path = SHARED / "fixtures" / "targets" / "sharegpt-llama-19m"
    if not (path / "config.json").is_file():
        pytest.skip(f"fixture target not found at {path}")
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The fixture target, its greedy answers to QUESTIONS, and an EAGLE-3 drafter trained for a few seconds on
    exactly those answers, so that it accepts a fair share of its drafts on them (asserted in the test)."""
    root = tmp_path_factory.mktemp("simulate")
    target_dir = _fixture_target_dir()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = TargetModel.from_pretrained(target_dir, dtype="float32", device="cpu")
    eos = eos_token_ids(target, tokenizer)
    prompts = [render_prompt(tokenizer, q) for q in QUESTIONS]
    answers = plain_answers(target, prompts, MAX_NEW, eos)
    data = root / "own_answers.jsonl"
    with data.open("w") as f:
        for q, a in zip(QUESTIONS * 4, answers * 4):
            reply = tokenizer.decode([t for t in a if t not in eos])
            f.write(json.dumps({"conversations": [{"role": "user", "content": q},
                                                  {"role": "assistant", "content": reply}]}) + "\n")
    recipe = tiny_recipe(target_dir, data, root, max_steps=60, batch_size=4, grad_accum_steps=1, ttt_steps=3,
                         lr=3e-3, eval_every=1000, save_every=1000, warmup_ratio=0.05)
    recipe.data.eval_samples = 0
    train(recipe, log=lambda *a: None)
    drafter = load_drafter(root / "run", dtype=torch.float32)
    return target, drafter, prompts, answers, eos


@pytest.mark.slow
def test_simulated_counters_equal_the_runtimes(trained):
    target, drafter, prompts, answers, eos = trained
    ks = (1, 3)
    simulated = simulate_greedy_chains(target, drafter, prompts, answers, ks, MAX_NEW)
    for k in ks:
        generator = SpeculativeGenerator(target, Eagle3Proposer(drafter, target.embed_tokens), k)
        total = None
        for prompt, answer in zip(prompts, answers):
            result = generator.generate(torch.tensor([prompt]), MAX_NEW, eos)
            assert result.token_ids == answer  # lossless: the committed text is the plain greedy answer
            total = result.metrics if total is None else total.merge(result.metrics)
        assert simulated[k].to_dict() == total.to_dict(), k
    assert simulated[3].mean_acceptance_length > 1.5  # the drafter accepts: acceptance and rollback both ran
    assert 0 < simulated[3].num_accepted_tokens_per_pos[2] < simulated[3].num_drafts  # all and partial accepts
