"""`draftsmith import` and the runtime loader on public EAGLE-3 layouts, and export -> import -> export round trips.

The public checkpoints are built here by hand with the published key names and config shapes (engines.md §1.8:
yuhuili/SpecForge native configs, a speculators config as RedHatAI publishes them), not with draftsmith's maps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM
from test_export import make_checkpoint, random_eagle3_tensors  # shared helpers, same folder

from draftsmith.cli import main as cli_main
from draftsmith.models.checkpoint import save_safetensors_atomic, write_json_atomic
from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.eagle3.io import DrafterLoadError, load_drafter
from draftsmith.models.eagle3.model import Eagle3Drafter
from draftsmith.models.export import exporter
from draftsmith.models.importer import CheckpointImportError, import_checkpoint

TARGET = dict(vocab_size=256, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, max_position_embeddings=512)
DRAFT_VOCAB = 32
LAYER = ("input_layernorm.weight", "hidden_norm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
         "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
         "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("target") / "tiny-llama-8l"
    model = LlamaForCausalLM(LlamaConfig(**TARGET))
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(path)
    return path


def ours(target: str | Path) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """A draftsmith config and random weights (draftsmith names) to publish in the layouts below."""
    cfg = Eagle3Config.from_target(LlamaConfig(**TARGET), DRAFT_VOCAB, target_name_or_path=str(target))
    return cfg, random_eagle3_tensors(cfg, seed=3)


def target_embedding(target_dir: Path) -> torch.Tensor:
    return load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"]


def write_folder(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True)
    write_json_atomic(config, folder / "config.json")
    save_safetensors_atomic(tensors, folder / "model.safetensors")
    return folder


def native_public(folder: Path, cfg: Eagle3Config, weights: dict[str, torch.Tensor], embedding=None,
                  aux_ids: bool = True, max_position_embeddings: int = 2048) -> Path:
    """yuhuili/EAGLE3-LLaMA3.1-Instruct-8B shape (SpecForge configs/llama3-8B-eagle3.json), scaled down; the
    SpecForge export adds the aux ids, the original has none."""
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
        "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": max_position_embeddings, "vocab_size": 256,
        "draft_vocab_size": DRAFT_VOCAB, "tie_word_embeddings": False, "torch_dtype": "float16",
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "use_cache": True, "transformers_version": "4.28.1",
    }
    if aux_ids:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.aux_layer_ids]}
    tensors = {"fc.weight": weights["fc.weight"], "norm.weight": weights["norm.weight"],
               "lm_head.weight": weights["lm_head.weight"], "d2t": weights["d2t"], "t2d": weights["t2d"]}
    tensors.update({f"midlayer.{n}": weights[f"midlayer.{n}"] for n in LAYER})
    if embedding is not None:
        tensors["embed_tokens.weight"] = embedding
    return write_folder(folder, config, {n: t.half() if t.is_floating_point() else t for n, t in tensors.items()})


def speculators_public(folder: Path, cfg: Eagle3Config, weights: dict[str, torch.Tensor], embedding,
                       **overrides) -> Path:
    """The speculators layout as vllm-project/speculators#796 shows it (trimmed), scaled down."""
    config = {
        "architectures": ["Eagle3DraftModel"], "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "speculators_model_type": "eagle3", "speculators_version": "0.7.0.dev80", "draft_vocab_size": DRAFT_VOCAB,
        "eagle_aux_hidden_state_layer_ids": cfg.aux_layer_ids, "norm_before_residual": False,
        "norm_before_fc": False, "fc_norm": False, "norm_output": False, "embed_requires_grad": False,
        "target_hidden_size": None,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": cfg.target_name_or_path},
        },
        "transformer_layer_config": {
            "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 256,
            "rms_norm_eps": cfg.rms_norm_eps, "layer_types": ["full_attention"], "max_position_embeddings": 512,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        **overrides,
    }
    tensors = {"fc.weight": weights["fc.weight"], "norm.weight": weights["norm.weight"],
               "lm_head.weight": weights["lm_head.weight"], "embed_tokens.weight": embedding}
    if config["draft_vocab_size"] != 256:
        tensors.update(d2t=weights["d2t"], t2d=weights["t2d"])
    tensors.update({f"layers.0.{n}": weights[f"midlayer.{n}"] for n in LAYER})
    tensors.update({n: t for n, t in weights.items() if n.startswith(("input_norm.", "fc_norm."))})
    return write_folder(folder, config, tensors)


def assert_same_drafter(drafter: Eagle3Drafter, cfg: Eagle3Config, weights: dict[str, torch.Tensor]) -> None:
    """Same tensors under draftsmith's names, and the same logits on the same inputs."""
    reference = Eagle3Drafter(cfg)
    reference.load_state_dict(weights, strict=False)
    reference.eval()
    got = drafter.state_dict()
    for name, t in reference.state_dict().items():
        if not name.startswith("rotary_emb."):
            assert torch.equal(got[name], t), name
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(1, 6, 3 * 64, generator=g)
    embeds = torch.randn(1, 6, 64, generator=g)
    with torch.no_grad():
        for a, b in zip(drafter.forward_ttt(aux, embeds, 2), reference.forward_ttt(aux, embeds, 2)):
            assert torch.equal(a, b)


# ---- public layouts into draftsmith's runtime ---------------------------------------------------------------
def test_runtime_loads_a_native_checkpoint(tmp_path, target_dir):
    cfg, weights = ours(target_dir)
    folder = native_public(tmp_path / "native", cfg, weights, embedding=target_embedding(target_dir).half())
    drafter = load_drafter(folder)  # fp16 on disk, fp32 here
    assert drafter.config.aux_layer_ids == cfg.aux_layer_ids  # SGLang's nested ids read back as capture ids
    rounded = {n: t.half().float() if t.is_floating_point() else t for n, t in weights.items()}
    assert_same_drafter(drafter, cfg, rounded)


def test_runtime_loads_a_speculators_checkpoint(tmp_path, target_dir):
    cfg, weights = ours(target_dir)
    folder = speculators_public(tmp_path / "spec", cfg, weights, target_embedding(target_dir))
    drafter = load_drafter(folder)
    assert (drafter.config.aux_layer_ids, drafter.config.target_name_or_path) == (cfg.aux_layer_ids, str(target_dir))
    assert_same_drafter(drafter, cfg, weights)


def test_full_vocab_speculators_checkpoint_gets_identity_maps(tmp_path, target_dir):
    """speculators saves no d2t/t2d when the draft vocab is the target's (its buffers are None)."""
    cfg, weights = ours(target_dir)
    cfg.draft_vocab_size = 256
    weights["lm_head.weight"] = torch.randn(256, 64)
    folder = speculators_public(tmp_path / "spec", cfg, weights, target_embedding(target_dir), draft_vocab_size=256)
    drafter = load_drafter(folder)
    assert torch.equal(drafter.d2t, torch.zeros(256, dtype=torch.long)) and bool(drafter.t2d.all())


def test_runtime_loads_a_checkpoint_of_speculators_defaults(tmp_path, target_dir):
    """speculators 0.9.0 trains EAGLE-3 with norm_before_fc, norm_before_residual and norm_output on (EAGLE 3.1):
    the flags are read, the extra input_norm tensor is loaded, and the drafter computes what one built with those
    flags computes."""
    flags = dict(norm_before_fc=True, norm_before_residual=True, norm_output=True)
    cfg = Eagle3Config.from_target(LlamaConfig(**TARGET), DRAFT_VOCAB, target_name_or_path=str(target_dir), **flags)
    weights = random_eagle3_tensors(cfg, seed=3)
    folder = speculators_public(tmp_path / "spec", cfg, weights, target_embedding(target_dir), **flags)
    drafter = load_drafter(folder)
    assert drafter.config.variants() == {**flags, "fc_norm": False}
    assert_same_drafter(drafter, cfg, weights)


def test_runtime_refuses_what_it_cannot_compute(tmp_path, target_dir):
    cfg, weights = ours(target_dir)
    emb = target_embedding(target_dir)
    folder = speculators_public(tmp_path / "b", cfg, weights, emb)
    config = json.loads((folder / "config.json").read_text())
    del config["norm_before_residual"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterLoadError, match="missing: speculators reads that as false and vLLM as true"):
        load_drafter(folder)
    with pytest.raises(DrafterLoadError, match="no eagle_aux_hidden_state_layer_ids and the target's layer count"):
        load_drafter(native_public(tmp_path / "c", cfg, weights, aux_ids=False))


# ---- draftsmith import ----------------------------------------------------------------------------------------
def test_import_native_without_aux_ids_uses_the_targets_default(tmp_path, target_dir):
    """The original EAGLE-3 release names no aux layers; engines use (2, L//2, L-3), so the import does too."""
    cfg, weights = ours(target_dir)
    src = native_public(tmp_path / "yuhuili", cfg, weights, embedding=target_embedding(target_dir).half(),
                        aux_ids=False, max_position_embeddings=256)  # shorter than the target's, as yuhuili's
    with pytest.raises(CheckpointImportError, match="give the target"):
        import_checkpoint(src, tmp_path / "x")
    result = import_checkpoint(src, tmp_path / "ckpt", target=str(target_dir))
    assert result.format == "native-eagle3"
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["method"] == "eagle3" and config["aux_layer_ids"] == [2, 4, 5]  # (2, 8//2, 8-3)
    assert (config["num_target_layers"], config["target_name_or_path"]) == (8, str(target_dir))
    assert config["target_architectures"] == ["LlamaForCausalLM"]
    assert config["max_position_embeddings"] == 512
    assert any("assumed vLLM's and SGLang's default [2, 4, 5]" in n for n in result.notes)
    assert any("max_position_embeddings raised from 256 to the target's 512" in n for n in result.notes)
    state = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert "embed_tokens.weight" not in state and torch.equal(state["midlayer.mlp.up_proj.weight"],
                                                              weights["midlayer.mlp.up_proj.weight"].half())
    record = json.loads((tmp_path / "ckpt" / "import.json").read_text())
    assert record["format"] == "native-eagle3" and record["notes"] == result.notes


def test_import_speculators_keeps_its_proposal_length(tmp_path, target_dir):
    cfg, weights = ours(target_dir)
    src = speculators_public(tmp_path / "spec", cfg, weights, target_embedding(target_dir))
    import_checkpoint(src, tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "import.json").read_text())["num_speculative_tokens"] == 4
    out = exporter("speculators")(tmp_path / "ckpt", tmp_path / "again").out_dir
    assert json.loads((out / "config.json").read_text())["speculators_config"]["proposal_methods"][0][
        "speculative_tokens"] == 4


def test_import_notes_an_embedding_that_is_not_the_targets(tmp_path, target_dir):
    cfg, weights = ours(target_dir)
    src = speculators_public(tmp_path / "spec", cfg, weights, torch.zeros(256, 64))
    result = import_checkpoint(src, tmp_path / "ckpt")
    assert any("embed_tokens.weight differs from the target's" in n for n in result.notes)


def test_import_refusals_name_the_problem(tmp_path, target_dir):
    cfg, weights = ours(target_dir)
    emb = target_embedding(target_dir)
    bad = dict(weights)
    bad["fc.weight"] = bad["fc.weight"][:, :128]
    with pytest.raises(CheckpointImportError, match=r"fc.weight: shape \(64, 128\), expected \(64, 192\)"):
        import_checkpoint(speculators_public(tmp_path / "a", cfg, bad, emb), tmp_path / "o1")
    odd = write_folder(tmp_path / "b", {"architectures": ["MistralForCausalLM"]}, {"x": torch.zeros(1)})
    with pytest.raises(CheckpointImportError, match="not a format draftsmith imports.*MistralForCausalLM"):
        import_checkpoint(odd, tmp_path / "o2")
    ckpt = make_checkpoint(tmp_path / "run", cfg)
    with pytest.raises(CheckpointImportError, match="already a draftsmith checkpoint"):
        import_checkpoint(ckpt, tmp_path / "o3")
    broken = speculators_public(tmp_path / "c", cfg, weights, emb)
    (broken / "config.json").write_text('{\n  "speculators_model_type": "eagle3",\n  oops\n}')
    with pytest.raises(CheckpointImportError, match=r"config.json:3: invalid JSON"):
        import_checkpoint(broken, tmp_path / "o4")
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 5))


def test_a_nan_in_a_public_checkpoint_is_refused_by_import_and_by_the_runtime(tmp_path, target_dir):
    """Issue 47 item 10: a NaN passed import and generate silently (acceptance 0). Import, the runtime loader and a
    draftsmith checkpoint's load each refuse it in one line naming the tensor and the file."""
    cfg, weights = ours(target_dir)
    weights["midlayer.self_attn.q_proj.weight"][1, 2] = float("nan")
    src = speculators_public(tmp_path / "spec", cfg, weights, target_embedding(target_dir))
    named = r"spec/model.safetensors: 1 tensor\(s\) hold NaN or inf values \(layers.0.self_attn.q_proj.weight\)"
    with pytest.raises(CheckpointImportError, match=named):
        import_checkpoint(src, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(DrafterLoadError, match=named):
        load_drafter(src)
    from draftsmith.models.checkpoint import CheckpointError, load_checkpoint

    ckpt = make_checkpoint(tmp_path / "run", cfg, weights)
    with pytest.raises(CheckpointError, match=r"model.safetensors: 1 tensor\(s\) hold NaN or inf values "
                                              r"\(midlayer.self_attn.q_proj.weight\)"):
        load_checkpoint(ckpt)


def test_imported_settings_are_checked_the_same_at_import_and_at_load(tmp_path, target_dir):
    """Issue 47 item 9: speculators' speculative_tokens 1e9 went into the export and its `vllm serve` line, and the
    runtime loaded a d2t that import refused."""
    cfg, weights = ours(target_dir)
    emb = target_embedding(target_dir)
    spec = speculators_public(tmp_path / "k", cfg, weights, emb)
    config = json.loads((spec / "config.json").read_text())
    config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 1_000_000_000
    (spec / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointImportError, match=r"proposal_methods\[0\].speculative_tokens 1000000000: expected "
                                                    r"an integer in 1..32"):
        import_checkpoint(spec, tmp_path / "o1")

    bad = dict(weights)
    bad["d2t"] = bad["d2t"].clone()
    bad["d2t"][3] = bad["d2t"][2] - 5  # target ids no longer increasing
    src = speculators_public(tmp_path / "d2t", cfg, bad, emb)
    with pytest.raises(CheckpointImportError, match="d2t: target ids arange \\+ d2t are not strictly increasing"):
        import_checkpoint(src, tmp_path / "o2")
    with pytest.raises(DrafterLoadError, match="d2t: target ids arange \\+ d2t are not strictly increasing"):
        load_drafter(src)
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


# ---- round trips -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, None], ids=["bf16", "keep"])
def test_export_import_export_is_unchanged(tmp_path, target_dir, fmt, dtype):
    cfg, weights = ours(target_dir)
    cfg.target_architectures = ["LlamaForCausalLM"]
    ckpt = make_checkpoint(tmp_path / "run", cfg, weights, step=42,
                           eval_result={"num_speculative_tokens": 5, "results": []})
    first = exporter(fmt)(ckpt, tmp_path / "first", dtype=dtype).out_dir
    import_checkpoint(first, tmp_path / "imported")
    second = exporter(fmt)(tmp_path / "imported", tmp_path / "second", dtype=dtype).out_dir

    assert json.loads((first / "config.json").read_text()) == json.loads((second / "config.json").read_text())
    a, b = load_file(str(first / "model.safetensors")), load_file(str(second / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    if dtype is None:  # fp32 export: the import gives back the very checkpoint that was exported
        assert json.loads((tmp_path / "imported" / "config.json").read_text()) == cfg.to_dict()
        imported = load_file(str(tmp_path / "imported" / "model.safetensors"))
        assert imported.keys() == weights.keys() and all(torch.equal(imported[n], weights[n]) for n in weights)


# ---- command line --------------------------------------------------------------------------------------------
def test_cli(tmp_path, target_dir, capsys):
    cfg, weights = ours(target_dir)
    src = speculators_public(tmp_path / "spec", cfg, weights, target_embedding(target_dir))
    assert cli_main(["import", str(src), "--out", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "from speculators-eagle3" in out and "model.safetensors" in out and "draftsmith export" in out

    assert cli_main(["import", str(src), "--out", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--overwrite" in err
    assert cli_main(["import", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2
    assert "no such folder" in capsys.readouterr().err
