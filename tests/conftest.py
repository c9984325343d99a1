"""Fixtures shared by the whole suite: tiny random targets, the fixture target, MT-bench, GPU skipping."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from draftsmith.device import accelerator_type

SHARED = Path(__file__).resolve().parents[2] / "shared"  # ../shared next to the repo root

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


@pytest.fixture
def fixture_target_dir() -> Path:
    """The real tiny Llama chat target (16k vocab, 8 layers, hidden 384)."""
    path = SHARED / "fixtures" / "targets" / "sharegpt-llama-19m"
    if not (path / "config.json").is_file():
        pytest.skip(f"fixture target not found at {path}")
    return path


@pytest.fixture
def mt_bench_path() -> Path:
    path = SHARED / "data" / "mt_bench" / "question.jsonl"
    if not path.is_file():
        pytest.skip(f"MT-bench questions not found at {path}")
    return path


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
