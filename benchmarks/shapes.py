"""Target shapes the benchmarks build from config with random weights (no download), and the one way they build
them: random weights make losses meaningless but not timing, memory or bytes."""

from __future__ import annotations

import torch

from draftsmith.models.target import TargetModel

LLAMA_31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                   tie_word_embeddings=False)
FIXTURE = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2,
               head_dim=64, vocab_size=16000, max_position_embeddings=4096, tie_word_embeddings=True)  # sharegpt-llama-19m
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=2048, max_position_embeddings=4096, tie_word_embeddings=False)  # a CPU smoke run


def random_target(shape: dict, dtype: torch.dtype, device: torch.device, name: str) -> TargetModel:
    """A Llama of `shape` with seeded random weights, built on `device`, as a (frozen) TargetModel."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=dtype, attn_implementation="sdpa")
    return TargetModel(model, name_or_path=name)  # which puts it in eval mode and freezes it
