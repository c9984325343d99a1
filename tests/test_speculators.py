"""speculators export: the layout, the contract check, `--format all`, and parity with the real `speculators` package.

The parity tests import speculators 0.9.0 from the `--no-deps` install that `make test` puts in the venv
(`$VENV/speculators`, or $DRAFTSMITH_SPECULATORS_DIR) and skip when it is absent.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM
from test_export import leftovers, make_checkpoint, random_eagle3_tensors  # shared helpers, same folder

from draftsmith.models.checkpoint import EXPORT_MARKER, ExportError
from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.eagle3.model import Eagle3Drafter
from draftsmith.models.eagle3.speculators import (
    SPECULATORS_KEY_MAP,
    check_speculators,
    export_speculators,
    speculators_config,
    verifier_name,
)
from draftsmith.models.export import add_export_args, export_all, run_export
from draftsmith.models.target_files import load_target_embedding

DRAFT_VOCAB = 32
SPECULATORS_DIR = Path(os.environ.get("DRAFTSMITH_SPECULATORS_DIR", Path(sys.prefix) / "speculators"))


# ---- fixtures ------------------------------------------------------------------------------------------------
TARGET_CONFIG = dict(vocab_size=256, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """A tiny random Llama target saved as a Hub model folder (one model.safetensors)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("target") / "tiny-llama"
    LlamaForCausalLM(LlamaConfig(**TARGET_CONFIG)).save_pretrained(path)
    return path


def eagle3_config(target: str | Path, **overrides) -> Eagle3Config:
    cfg = Eagle3Config.from_target(LlamaConfig(**{**TARGET_CONFIG, **overrides}), DRAFT_VOCAB,
                                   target_name_or_path=str(target))
    cfg.target_architectures = ["LlamaForCausalLM"]
    return cfg


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_export_args(p)
    return p.parse_args(list(argv))


# ---- the layout ----------------------------------------------------------------------------------------------
def test_key_map_renames_only_the_layer():
    assert SPECULATORS_KEY_MAP["midlayer.self_attn.q_proj.weight"] == "layers.0.self_attn.q_proj.weight"
    assert SPECULATORS_KEY_MAP["midlayer.hidden_norm.weight"] == "layers.0.hidden_norm.weight"
    for name in ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"):
        assert SPECULATORS_KEY_MAP[name] == name
    assert not any(v.startswith("midlayer.") for v in SPECULATORS_KEY_MAP.values())


def test_export_writes_the_speculators_layout(tmp_path, target_dir):
    cfg = eagle3_config(target_dir)
    tensors = random_eagle3_tensors(cfg)
    out = tmp_path / "out"
    result = export_speculators(make_checkpoint(tmp_path / "run", cfg, tensors), out, dtype=None)

    assert sorted(p.name for p in out.iterdir()) == [EXPORT_MARKER, "README.md", "config.json", "model.safetensors"]
    assert leftovers(tmp_path) == []
    assert len(result.warnings) == 1 and "local path" in result.warnings[0] and "--verifier" in result.warnings[0]
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["norm_before_residual"] is False  # explicit: vLLM's speculators path would default it to true
    assert config["eagle_aux_hidden_state_layer_ids"] == cfg.aux_layer_ids  # capture ids, as vLLM reads them
    assert (config["draft_vocab_size"], config["target_hidden_size"]) == (DRAFT_VOCAB, 64)
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 3
    assert spec["verifier"] == {"name_or_path": str(target_dir), "architectures": ["LlamaForCausalLM"]}
    layer = config["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"], layer["vocab_size"]) == ("llama", 1, 256)
    assert layer["max_position_embeddings"] == 512 and layer["head_dim"] == 16

    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        names = set(f.keys())
        assert names == {SPECULATORS_KEY_MAP[n] for n in tensors} | {"embed_tokens.weight"}
        assert torch.equal(f.get_tensor("layers.0.mlp.down_proj.weight"), tensors["midlayer.mlp.down_proj.weight"])
        with safe_open(target_dir / "model.safetensors", "pt") as t:
            assert torch.equal(f.get_tensor("embed_tokens.weight"), t.get_tensor("model.embed_tokens.weight"))


def test_the_verifier_is_the_targets_hub_id_wherever_one_is_known(tmp_path):
    """A pushed checkpoint used to name a folder on the trainer's machine as its verifier (issue 16, item 6)."""
    snapshot = tmp_path / "hub" / "models--meta-llama--Llama-3.1-8B-Instruct" / "snapshots" / "0e9e39f"
    snapshot.mkdir(parents=True)
    assert verifier_name("meta-llama/Llama-3.1-8B-Instruct") == ("meta-llama/Llama-3.1-8B-Instruct", None)
    assert verifier_name(str(snapshot)) == ("meta-llama/Llama-3.1-8B-Instruct", None)  # loaded from the HF cache
    assert verifier_name(str(tmp_path), "org/my-target") == ("org/my-target", None)  # export --verifier
    name, why = verifier_name(str(tmp_path))
    assert name == str(tmp_path) and "pass --verifier ORG/NAME" in why


def test_export_verifier_override_reaches_config_and_serve_command(tmp_path, target_dir, capsys):
    cfg = eagle3_config(target_dir)
    ckpt = make_checkpoint(tmp_path / "run", cfg)
    result = export_speculators(ckpt, tmp_path / "out", verifier="org/target")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/target" and result.warnings == []
    assert result.serve_commands["vLLM, naming the target"].startswith("vllm serve org/target ")
    # the CLI flag, for one format and for --format all (whose sglang export does not take it)
    for fmt, folder in (("speculators", tmp_path / "cli"), ("all", tmp_path / "cli-all")):
        assert run_export(_args(str(ckpt), "--format", fmt, "--out", str(folder), "--verifier", "org/t2")) == 0
        written = folder / "config.json" if fmt == "speculators" else folder / "speculators" / "config.json"
        assert json.loads(written.read_text())["speculators_config"]["verifier"]["name_or_path"] == "org/t2"
    assert "local path" not in capsys.readouterr().err


def test_embedding_is_read_through_the_shard_index(fixture_target_dir):
    """The fixture target is sharded (4 files + index): only the embedding's shard is opened."""
    embedding, why_not = load_target_embedding(str(fixture_target_dir))
    assert why_not == "" and embedding.shape == (16000, 384)
    index = json.loads((fixture_target_dir / "model.safetensors.index.json").read_text())
    with safe_open(fixture_target_dir / index["weight_map"]["model.embed_tokens.weight"], "pt") as f:
        assert torch.equal(embedding, f.get_tensor("model.embed_tokens.weight"))


def test_unreachable_target_is_refused_with_the_way_out(tmp_path):
    """speculators needs the embedding in the file (it leaves a missing one uninitialised), so no silent export."""
    cfg = eagle3_config(tmp_path / "not-here")
    with pytest.raises(ExportError, match="cannot write embed_tokens.weight.*hf download .*--format sglang"):
        export_speculators(make_checkpoint(tmp_path / "run", cfg), tmp_path / "out")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_default_dtype_is_bfloat16_embedding_included(tmp_path, target_dir):
    export_speculators(make_checkpoint(tmp_path / "run", eagle3_config(target_dir)), tmp_path / "out")
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
        assert f.get_tensor("embed_tokens.weight").dtype == torch.bfloat16
        assert f.get_tensor("d2t").dtype == torch.int64


def test_serve_commands_and_model_card(tmp_path, target_dir):
    cfg = eagle3_config(target_dir)
    recipe = "data:\n  path: Aeala/ShareGPT_Vicuna_unfiltered\n"
    evaluation = {"num_speculative_tokens": 5, "results": [
        {"dataset": "mt_bench", "num_drafts": 10, "num_draft_tokens": 50, "num_accepted_tokens": 20}]}
    out = tmp_path / "out"
    result = export_speculators(make_checkpoint(tmp_path / "run", cfg, recipe=recipe, eval_result=evaluation), out)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5  # the measured k

    assert result.serve_commands["vLLM"] == f"vllm serve {out}"
    card = (out / "README.md").read_text()
    _, front, body = card.split("---\n", 2)
    meta = yaml.safe_load(front)
    assert meta["library_name"] == "draftsmith" and meta["datasets"] == ["Aeala/ShareGPT_Vicuna_unfiltered"]
    assert {"speculative-decoding", "eagle3", "speculators"} <= set(meta["tags"])
    assert "base_model" not in meta  # a local target is not a Hub id
    assert f"vllm serve {out}\n" in body
    assert "--speculative-algorithm EAGLE3" in body and f"--format sglang --out {out}-sglang" in body
    assert "| mt_bench | 5 |" in body and "| 3.000 | 40.0% |" in body  # 1 + 20/10; 20/50
    assert f"`{cfg.aux_layer_ids}`" in body


# ---- the contract check --------------------------------------------------------------------------------------
def _valid(target_dir) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    cfg = eagle3_config(target_dir)
    tensors = {SPECULATORS_KEY_MAP[n]: t for n, t in random_eagle3_tensors(cfg).items()}
    tensors["embed_tokens.weight"] = torch.zeros(256, 64)
    return speculators_config(cfg), tensors


def _set(path: str, value):
    def corrupt(config, tensors):
        *parents, key = path.split(".")
        node = config
        for p in parents:
            node = node[p][0] if p == "proposal_methods" else node[p]
        if value is KeyError:
            del node[key]
        else:
            node[key] = value
    return corrupt


def _leftover(config, tensors):
    tensors["midlayer.mlp.up_proj.weight"] = tensors.pop("layers.0.mlp.up_proj.weight")  # native name slipped in


def _bad_embedding(config, tensors):
    tensors["embed_tokens.weight"] = torch.zeros(255, 64)


def _d2t_off(config, tensors):
    tensors["d2t"][7] += 1


@pytest.mark.parametrize("corrupt, reason", [
    (_set("norm_before_residual", KeyError), "norm_before_residual: None, expected true or false.*vLLM as true"),
    (_set("norm_output", "yes"), "norm_output: 'yes', expected true or false"),
    (_set("eagle_aux_hidden_state_layer_ids", KeyError), "eagle_aux_hidden_state_layer_ids: None, expected capture"),
    (_set("eagle_aux_hidden_state_layer_ids", [5, 3, 1]), "strictly increasing"),
    (_set("eagle_aux_hidden_state_layer_ids", [1, 3, 7]), r"exceed the target's 6 layers"),
    (_set("speculators_config.verifier.name_or_path", ""), "verifier.name_or_path: missing"),
    (_set("speculators_config.proposal_methods.speculative_tokens", 0), "speculative_tokens: 0"),
    (_set("speculators_config.default_proposal_method", "tree"), "default_proposal_method: 'tree'"),
    (_set("transformer_layer_config.model_type", "qwen3"), "model_type: 'qwen3', expected 'llama'"),
    (_set("transformer_layer_config.max_position_embeddings", 256), "max_position_embeddings 256 < the target's 512"),
    (_set("speculators_model_type", "dflash"), "speculators_model_type: 'dflash'"),
    (_leftover, "unexpected tensors .*midlayer.mlp.up_proj.weight"),
    (_bad_embedding, r"embed_tokens.weight: shape \(255, 64\), expected \(256, 64\)"),
    (_d2t_off, "d2t and t2d disagree: draft id 7"),
])
def test_contract_problems_are_named(target_dir, corrupt, reason):
    config, tensors = _valid(target_dir)
    assert check_speculators(config, tensors) == ([], [])
    corrupt(config, tensors)
    problems, _ = check_speculators(config, tensors)
    assert any(re.search(reason, p) for p in problems), problems


def test_embedding_is_required_and_target_width_difference_warns(target_dir):
    config, tensors = _valid(target_dir)
    del tensors["embed_tokens.weight"]
    assert check_speculators(config, tensors)[0] == ["missing tensors: embed_tokens.weight"]
    config, tensors = _valid(target_dir)
    config["target_hidden_size"] = 96
    tensors["fc.weight"] = torch.zeros(64, 3 * 96)
    problems, warnings = check_speculators(config, tensors)
    assert problems == [] and any("speculators package sizes fc from hidden_size" in w for w in warnings)


def test_refused_export_writes_nothing(tmp_path, target_dir):
    cfg = eagle3_config(target_dir)
    tensors = random_eagle3_tensors(cfg)
    tensors["fc.weight"] = tensors["fc.weight"][:, :128]  # two aux layers' worth, the config says three
    with pytest.raises(ExportError, match=r"refusing to export as speculators.*fc.weight: shape \(64, 128\)"):
        export_speculators(make_checkpoint(tmp_path / "run", cfg, tensors), tmp_path / "out")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_what_vllm_reads(tmp_path, target_dir):
    """vLLM's speculators reader (transformers_utils/configs/speculators/{base,algos}.py), followed by hand: the
    draft model config is transformer_layer_config plus the Eagle3 keys; k comes from proposal_methods[0]."""
    export_speculators(make_checkpoint(tmp_path / "run", eagle3_config(target_dir)), tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    model = dict(config["transformer_layer_config"])
    for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
        model[key] = config[key]
    model["norm_before_residual"] = config.get("norm_before_residual", True)  # vLLM's default on this path
    llama = LlamaConfig(**model)
    assert (llama.hidden_size, llama.num_hidden_layers, llama.head_dim, llama.vocab_size) == (64, 1, 16, 256)
    assert llama.norm_before_residual is False and llama.draft_vocab_size == DRAFT_VOCAB
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(target_dir)  # what `vllm serve` loads


# ---- --format all --------------------------------------------------------------------------------------------
def test_format_all_writes_every_eagle3_format_and_skips_others(tmp_path, target_dir, capsys):
    make_checkpoint(tmp_path / "run", eagle3_config(target_dir))
    out = tmp_path / "all"
    assert run_export(_args(str(tmp_path / "run"), "--format", "all", "--out", str(out))) == 0
    assert sorted(p.name for p in out.iterdir()) == [EXPORT_MARKER, "sglang", "speculators"]
    assert json.loads((out / "sglang" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert json.loads((out / "speculators" / "config.json").read_text())["speculators_model_type"] == "eagle3"
    captured = capsys.readouterr()
    assert "dflash: skipped, it exports dflash drafters and this is eagle3" in captured.err
    assert f"vllm serve {out / 'speculators'}" in captured.out


def test_sglang_refuses_forward_variants_and_format_all_skips_it(tmp_path, target_dir, capsys):
    """SGLang's LlamaForCausalLMEagle3 reads none of the flags: it would serve wrong drafts, so the native export
    says so, and `--format all` writes the speculators layout (which vLLM reads with the flags) alone."""
    cfg = eagle3_config(target_dir)
    cfg.norm_before_fc = cfg.norm_output = True
    ckpt = make_checkpoint(tmp_path / "run", cfg, random_eagle3_tensors(cfg, seed=2))
    assert run_export(_args(str(ckpt), "--format", "sglang", "--out", str(tmp_path / "native"))) == 2
    err = capsys.readouterr().err
    assert "eagle3.norm_before_fc=true, eagle3.norm_output=true" in err and "--format speculators" in err
    assert not (tmp_path / "native").exists()
    assert run_export(_args(str(ckpt), "--format", "all", "--out", str(tmp_path / "all"))) == 0
    assert sorted(p.name for p in (tmp_path / "all").iterdir()) == [EXPORT_MARKER, "speculators"]
    captured = capsys.readouterr()
    assert "sglang: skipped:" in captured.err and "SGLang" not in captured.out.split("serve with")[-1]
    config = json.loads((tmp_path / "all" / "speculators" / "config.json").read_text())
    assert (config["norm_before_fc"], config["norm_output"], config["norm_before_residual"]) == (True, True, False)


def test_format_all_removes_what_it_wrote_when_one_format_is_refused(tmp_path):
    cfg = eagle3_config(tmp_path / "gone")  # native exports fine; speculators refuses (no target embedding)
    ckpt = make_checkpoint(tmp_path / "run", cfg)
    with pytest.raises(ExportError, match="format speculators: .*cannot write embed_tokens.weight"):
        export_all(ckpt, tmp_path / "all")
    assert not (tmp_path / "all").exists() and leftovers(tmp_path) == []


# ---- parity with the real speculators package --------------------------------------------------------------
def speculators_eagle3():
    """(Eagle3DraftModel, Eagle3SpeculatorConfig) from the --no-deps install of speculators 0.9.0.

    speculators.models.eagle3 imports `BatchType`, a type alias, from speculators.train.data, whose module needs
    openai, hs_connectors and a vLLM client. A stub module holding only that alias is the narrowest way in; the
    Eagle3 model, its config and its weight loading (which needs loguru, installed alongside) are the real code.
    """
    if not (SPECULATORS_DIR / "speculators").is_dir():
        pytest.skip(f"speculators not installed at {SPECULATORS_DIR} (make test installs it there, --no-deps)")
    if str(SPECULATORS_DIR) not in sys.path:
        sys.path.append(str(SPECULATORS_DIR))  # appended: never shadows the venv's own packages
    if "speculators.train.data" not in sys.modules:
        stub = types.ModuleType("speculators.train.data")
        stub.BatchType = dict[str, Any]
        sys.modules["speculators.train.data"] = stub
    from loguru import logger
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    logger.disable("speculators")
    return Eagle3DraftModel, Eagle3SpeculatorConfig


def _load_with_speculators(folder: Path):
    model_cls, config_cls = speculators_eagle3()
    config = config_cls.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention needs a GPU build
    return model_cls.from_pretrained(folder, config=config).eval()


SPECULATORS_DEFAULTS = dict(norm_before_fc=True, norm_before_residual=True, norm_output=True)  # its eagle3 defaults


@pytest.mark.parametrize("flags", [{}, SPECULATORS_DEFAULTS, {"fc_norm": True, "norm_output": True}],
                         ids=["reference", "speculators-defaults", "fc-norm"])
def test_speculators_package_matches_draftsmith_logits(tmp_path, target_dir, flags):
    """Same weights, same inputs (real target hidden states), three TTT steps: the same draft logits, for the
    reference drafter and for the forward variants speculators trains by default."""
    cfg = eagle3_config(target_dir)
    for flag, value in flags.items():
        setattr(cfg, flag, value)
    tensors = random_eagle3_tensors(cfg, seed=1)
    export_speculators(make_checkpoint(tmp_path / "run", cfg, tensors), tmp_path / "out", dtype=None)
    theirs = _load_with_speculators(tmp_path / "out")
    ours = Eagle3Drafter(cfg)
    ours.load_state_dict(tensors, strict=False)
    ours.eval()

    target = LlamaForCausalLM.from_pretrained(target_dir).eval()
    s, steps = 16, 3
    ids = torch.randint(0, 256, (1, s + 1), generator=torch.Generator().manual_seed(0))  # x_0 .. x_s
    with torch.no_grad():
        hidden = target(ids[:, :s], output_hidden_states=True).hidden_states
        aux = torch.cat([hidden[k] for k in cfg.aux_layer_ids], dim=-1)  # (1, S, 3H): g_0 .. g_{S-1}
        our_logits = ours.forward_ttt(aux, target.model.embed_tokens(ids[:, :s]), steps)
        captured: list[torch.Tensor] = []
        hook = theirs.lm_head.register_forward_hook(lambda module, args, out: captured.append(out))
        # speculators takes the shifted batch: position t holds (x_{t+1}, g_t), as draftsmith's step 0 does.
        theirs(hidden_states=aux, input_ids=ids[:, 1:], document_ids=torch.zeros(1, s, dtype=torch.long),
               position_ids=torch.arange(s)[None], ttt_steps=steps)
        hook.remove()
    assert len(captured) == steps
    for i, (a, b) in enumerate(zip(our_logits, captured)):
        valid = s - 1 - i  # later positions have no input token left (draftsmith zero-fills, speculators pads 0)
        torch.testing.assert_close(a[:, :valid], b[:, :valid], rtol=1e-4, atol=1e-4, msg=f"TTT step {i}")
