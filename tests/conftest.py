"""Fixtures shared by the whole suite: tiny random targets, the fixture target, MT-bench, GPU skipping."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from draftsmith.device import accelerator_type

# Triton chooses between its compiler and its interpreter (numpy, CPU tensors) when triton.language is imported,
# and without an accelerator only the interpreter runs: set it before anything imports Triton, so that where Triton
# is installed on a CPU machine, tests/test_fused_head_loss.py runs the head-loss kernel. A GPU machine keeps the
# compiler (its gpu tests compile the same kernel).
if accelerator_type() == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The real-vLLM tests need their own venv (`make interop`, which sets DRAFTSMITH_INTEROP=1), and the SGLang ones
# theirs (`make interop-sglang`, DRAFTSMITH_INTEROP_SGLANG=1).
collect_ignore = [] if os.environ.get("DRAFTSMITH_INTEROP") == "1" else ["interop"]
if os.environ.get("DRAFTSMITH_INTEROP_SGLANG") != "1":
    collect_ignore.append("interop_sglang")

SHARED = Path(__file__).resolve().parents[2] / "shared"  # ../shared next to the repo root
FIXTURE_TARGET = SHARED / "fixtures" / "targets" / "sharegpt-llama-19m"
MT_BENCH = SHARED / "data" / "mt_bench" / "question.jsonl"


def missing_fixture_reason(what: str, path: Path) -> str:
    """The skip reason of a test whose shared fixture is absent: the path looked at and where the README says how
    to get it."""
    return f"{what} not found at {path} (see README.md, 'Tests and the fixture target')"

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
)


@pytest.fixture(autouse=True, scope="session")
def _few_threads():
    """Two threads: the CI machine has two cores, and more threads only add contention in tiny models."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def pytest_collection_modifyitems(config, items):
    if accelerator_type() != "cpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm/NPU device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not item.keywords: a param id "gpu" is a keyword too
            item.add_marker(skip)


@pytest.fixture(scope="session")
def fixture_target_dir() -> Path:
    """The real tiny Llama chat target (16k vocab, 8 layers, hidden 384)."""
    if not (FIXTURE_TARGET / "config.json").is_file():
        pytest.skip(missing_fixture_reason("fixture target", FIXTURE_TARGET))
    return FIXTURE_TARGET


@pytest.fixture
def mt_bench_path() -> Path:
    if not MT_BENCH.is_file():
        pytest.skip(missing_fixture_reason("MT-bench questions", MT_BENCH))
    return MT_BENCH


def _factory(config_cls, model_cls, **fixed) -> Callable[..., tuple[torch.nn.Module, object]]:
    def make(**overrides):
        """Build a seeded random model; keyword arguments override the tiny config."""
        config = config_cls(**{**TINY, **fixed, **overrides})
        torch.manual_seed(0)
        return model_cls(config), config

    return make


@pytest.fixture
def tiny_llama():
    """Factory: ``model, config = tiny_llama(num_hidden_layers=6)``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _factory(LlamaConfig, LlamaForCausalLM)


@pytest.fixture
def tiny_qwen3():
    """Factory like ``tiny_llama``; Qwen3 sets head_dim explicitly (its default, 128, would dwarf hidden 64)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _factory(Qwen3Config, Qwen3ForCausalLM, head_dim=16)


# ---- drafters that accept ---------------------------------------------------------------------------------------
# A lossless test whose drafter accepts nothing proves only the rejection path. These drafters are trained for a few
# seconds on the first half of the fixture target's own greedy answers to the first MT-bench prompts: on those
# prompts they accept most drafts early in an answer and fewer later (each test asserts how much), so acceptance,
# partial acceptance and rollback all run.
ACCEPTING_PROMPTS = 3  # MT-bench first turns, of different lengths
ACCEPTING_NEW_TOKENS = 40
ACCEPTING_RECIPES = {  # name -> (method, steps, recipe overrides)
    "eagle3": ("eagle3", 60, {"training": {"ttt_steps": 3, "lr": 3e-3}}),
    "eagle3_norms": ("eagle3", 60, {"training": {"ttt_steps": 3, "lr": 3e-3},
                                    "eagle3": {"norm_before_fc": True, "norm_before_residual": True,
                                               "norm_output": True}}),
    "dflash": ("dflash", 80, {"training": {"lr": 2e-3}, "dflash": {"num_layers": 1, "block_size": 4,
                                                                    "anchors_per_sequence": 64}}),
    "mtp": ("mtp", 60, {"training": {"lr": 3e-3}, "mtp": {"num_depths": 3}}),
    "eagle": ("eagle", 60, {"training": {"lr": 3e-3}}),
    "dspark": ("dspark", 80, {"model": {"draft_vocab_size": None},  # the target's whole vocabulary
                              "training": {"lr": 2e-3}, "dspark": {"num_layers": 1, "block_size": 4,
                                                                   "anchors_per_sequence": 64, "markov_rank": 32}}),
    # vLLM's reduced-vocabulary DSpark: 1,000 of the 16,000 ids, its own frozen head rows and d2t
    "dspark_pruned": ("dspark", 80, {"model": {"draft_vocab_size": 1000},
                                     "training": {"lr": 2e-3}, "dspark": {"num_layers": 1, "block_size": 4,
                                                                          "anchors_per_sequence": 64,
                                                                          "markov_rank": 32}}),
}


@pytest.fixture(scope="session")
def fixture_prompts():
    """(the fixture target's float32 TargetModel, tokenizer, the first ACCEPTING_PROMPTS MT-bench prompt ids, the
    target's greedy answers to them, its EOS ids)."""
    path = SHARED / "fixtures" / "targets" / "sharegpt-llama-19m"
    questions = SHARED / "data" / "mt_bench" / "question.jsonl"
    if not (path / "config.json").is_file() or not questions.is_file():
        pytest.skip("fixture target or MT-bench questions not found under ../shared")
    from transformers import AutoTokenizer

    from draftsmith.inference.eval import eos_token_ids, load_prompts
    from draftsmith.inference.simulate import plain_answers
    from draftsmith.models.target import TargetModel

    tokenizer = AutoTokenizer.from_pretrained(path)
    target = TargetModel.from_pretrained(path, dtype="float32", device="cpu")
    eos = eos_token_ids(target, tokenizer)
    prompts = load_prompts(questions, tokenizer, limit=ACCEPTING_PROMPTS)
    answers = plain_answers(target, prompts, ACCEPTING_NEW_TOKENS, eos)
    return target, tokenizer, prompts, answers, eos


ACCEPTING_LOOKAHEAD = 8  # the target's greedy tokens past each answer, for the simulation (>= every k used)


@pytest.fixture(scope="session")
def fixture_lookahead(fixture_prompts):
    """Each answer of `fixture_prompts` followed by the target's next ACCEPTING_LOOKAHEAD greedy tokens."""
    from draftsmith.inference.simulate import plain_answers

    target, _, prompts, _, eos = fixture_prompts
    return plain_answers(target, prompts, ACCEPTING_NEW_TOKENS, eos, lookahead=ACCEPTING_LOOKAHEAD)[1]


_trained: dict[str, Path] = {}


@pytest.fixture(scope="session")
def accepting_drafter(fixture_prompts, tmp_path_factory):
    """`accepting_drafter(name)` -> the checkpoint folder of a drafter (ACCEPTING_RECIPES) trained on the fixture
    target's own answers (trained once per session)."""
    import json

    from draftsmith.config import recipe_from_dict
    from draftsmith.train import train

    target, tokenizer, prompts, answers, eos = fixture_prompts

    def make(name: str) -> Path:
        if name in _trained:
            return _trained[name]
        method, steps, overrides = ACCEPTING_RECIPES[name]
        root = tmp_path_factory.mktemp(f"accepting-{name}")
        data = root / "own_answers.jsonl"
        with data.open("w") as f:
            for _ in range(8):
                for prompt, answer in zip(prompts, answers):
                    question = tokenizer.decode(prompt, skip_special_tokens=True).strip()
                    reply = tokenizer.decode([t for t in answer[: ACCEPTING_NEW_TOKENS // 2] if t not in eos])
                    f.write(json.dumps({"conversations": [{"role": "user", "content": question},
                                                          {"role": "assistant", "content": reply}]}) + "\n")
        recipe = {"model": {"target": target.name_or_path, "method": method, "draft_vocab_size": 4000,
                            "dtype": "float32"},
                  "data": {"path": str(data), "max_length": 512, "eval_samples": 0, "cache_dir": str(root / "c")},
                  "training": {"max_steps": steps, "batch_size": 4, "warmup_ratio": 0.05, "log_every": 1000,
                               "eval_every": 100000, "save_every": 100000, "mixed_precision": "no", "seed": 0},
                  "output_dir": str(root / "run")}
        for section, values in overrides.items():
            recipe.setdefault(section, {}).update(values)
        train(recipe_from_dict(recipe), log=lambda *a: None)
        _trained[name] = root / "run"
        return _trained[name]

    return make


def generate_lossless(target, proposer, k, prompts, answers, eos, max_new_tokens=ACCEPTING_NEW_TOKENS):
    """Generate every prompt with `proposer` at k, assert each output equals the target's plain greedy answer, and
    return the counters summed over the prompts."""
    from draftsmith.inference.generator import SpeculativeGenerator

    generator = SpeculativeGenerator(target, proposer, k)
    total = None
    for prompt, answer in zip(prompts, answers):
        result = generator.generate(torch.tensor([prompt]), max_new_tokens, eos)
        assert result.token_ids == answer[:max_new_tokens]
        total = result.metrics if total is None else total.merge(result.metrics)
    return total
