"""A tiny DeepSeek-V3 target with one native MTP layer, the family whose MTP vLLM serves (`method: mtp`).

Its attention is MLA, which vLLM's CPU backend runs only through its AMX kernels: they want bfloat16 weights and
DeepSeek's head sizes (qk_nope 128, qk_rope 64, v 128, kv_lora_rank 512), so the model is narrow (hidden 256, two
layers) but its heads are full size. bfloat16 verification of several tokens at once rounds differently from
one token at a time, so a random model's near-tied logits would flip greedy choices between vLLM's plain and
speculative runs: here the embedding dominates the residual stream and the head is a permutation of the
embedding, so the next token is mostly a function of the current one with a wide margin. It borrows the fixture target's tokenizer and chat template, so draftsmith's
trainer can render conversations for it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

NUM_LAYERS = 2  # decoder layers; the MTP layer is model.layers.2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def write_deepseek_target(folder: Path, tokenizer_from: Path) -> Path:
    """Write the target to `folder`: its MTP block is decoder layer NUM_LAYERS of a model one layer deeper, as
    transformers itself writes it (per-expert tensors and all), plus random enorm/hnorm/eh_proj/shared_head."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    fixture = json.loads((tokenizer_from / "config.json").read_text())
    config = DeepseekV3Config(
        vocab_size=fixture["vocab_size"], hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=NUM_LAYERS + 1, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=256, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=2048, n_group=1,
        topk_group=1, bos_token_id=fixture.get("bos_token_id"), eos_token_id=fixture.get("eos_token_id"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(config).save_pretrained(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    h, L = config.hidden_size, NUM_LAYERS
    tensors["model.embed_tokens.weight"] = 25 * tensors["model.embed_tokens.weight"]  # std 0.5 over the layers' ~0.1
    permutation = torch.randperm(config.vocab_size, generator=g)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"][permutation].clone()  # wide logit margins
    tensors.update({
        f"model.layers.{L}.enorm.weight": torch.ones(h), f"model.layers.{L}.hnorm.weight": torch.ones(h),
        f"model.layers.{L}.eh_proj.weight": 0.02 * torch.randn(h, 2 * h, generator=g),
        f"model.layers.{L}.shared_head.norm.weight": torch.ones(h),
        f"model.layers.{L}.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
        f"model.layers.{L}.shared_head.head.weight": tensors["lm_head.weight"].clone(),
    })
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    saved = json.loads((folder / "config.json").read_text())
    saved.update(num_hidden_layers=L, num_nextn_predict_layers=1,
                 topk_method="noaux_tc")  # vLLM then loads the e_score_correction_bias transformers writes
    (folder / "config.json").write_text(json.dumps(saved, indent=2))
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, folder / name)
    return folder
