"""Native EAGLE-3 export: the key/shape/dtype contract, both aux-id conventions, all-or-nothing writes, the card."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.models.checkpoint import (
    EXPORT_MARKER,
    CheckpointError,
    absolute_target,
    ExportError,
    load_checkpoint,
    resolve_checkpoint,
    save_safetensors_atomic,
    write_json_atomic,
)
from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.eagle3.section import default_aux_layer_ids
from draftsmith.models.spec import capture_from_output, output_from_capture
from draftsmith.models.eagle3.export import (
    AUX_IDS_KEY,
    check_native_eagle3,
    export_native_eagle3,
    native_config,
    validate_native_eagle3,
)
from draftsmith.models.export import add_export_args, exporter, run_export

TARGET = "meta-llama/Llama-3.1-8B-Instruct"
DRAFT_VOCAB = 32


def tiny_eagle3_config(num_layers: int = 8, aux_layer_ids=None, **target_overrides) -> Eagle3Config:
    target = LlamaConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=512, **target_overrides,
    )
    return Eagle3Config.from_target(target, DRAFT_VOCAB, aux_layer_ids=aux_layer_ids, target_name_or_path=TARGET)


def random_eagle3_tensors(cfg: Eagle3Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under draftsmith's names, shapes written out by hand (not taken from the exporter)."""
    g = torch.Generator().manual_seed(seed)
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes = {
        "fc.weight": (h, len(cfg.aux_layer_ids) * cfg.target_hidden_size),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
    }
    n_aux = len(cfg.aux_layer_ids)
    if cfg.norm_before_fc:
        shapes["input_norm.weight"] = (n_aux * cfg.target_hidden_size,)
    if cfg.fc_norm:
        shapes.update({f"fc_norm.{j}.weight": (cfg.target_hidden_size,) for j in range(n_aux)})
    tensors = {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}
    used = torch.randperm(cfg.vocab_size, generator=g)[: cfg.draft_vocab_size].sort().values  # (V_d,) target ids
    tensors["d2t"] = used - torch.arange(cfg.draft_vocab_size)  # target_id = i + d2t[i]
    tensors["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    tensors["t2d"][used] = True
    return tensors


def make_checkpoint(
    root: Path, cfg: Eagle3Config, tensors=None, step: int = 100, recipe: str | None = None, eval_result=None
) -> Path:
    """A checkpoint folder laid out as the trainer writes it: root/checkpoint-<step>/ plus root/latest."""
    ckpt = root / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    write_json_atomic(cfg.to_dict(), ckpt / "config.json")
    save_safetensors_atomic(random_eagle3_tensors(cfg) if tensors is None else tensors, ckpt / "model.safetensors")
    write_json_atomic({"step": step}, ckpt / "trainer_state.json")
    if recipe is not None:
        (ckpt / "recipe.yaml").write_text(recipe)
    if eval_result is not None:
        write_json_atomic(eval_result, ckpt / "eval.json")
    (root / "latest").write_text(ckpt.name + "\n")
    return ckpt


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


# ---- aux layer ids -------------------------------------------------------------------------------------------
def test_default_aux_ids_for_32_layers_in_both_conventions():
    ids = default_aux_layer_ids(32)
    assert ids == [2, 16, 29]  # vLLM capture convention
    assert output_from_capture(ids) == [1, 15, 28]  # SGLang output-of-layer convention
    assert capture_from_output([1, 15, 28]) == [2, 16, 29]

    config = native_config(tiny_eagle3_config(num_layers=32))
    assert config[AUX_IDS_KEY] == [2, 16, 29]
    assert config["eagle_config"] == {AUX_IDS_KEY: [1, 15, 28], "use_aux_hidden_state": True}


def test_capture_id_zero_has_no_sglang_form():
    with pytest.raises(ValueError, match="embedding output"):
        output_from_capture([0, 4, 6])


def test_sglang_ids_not_starting_at_one_warn_but_export(tmp_path):
    cfg = tiny_eagle3_config(aux_layer_ids=[3, 5, 7])
    result = export_native_eagle3(make_checkpoint(tmp_path / "run", cfg), tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["eagle_config"][AUX_IDS_KEY] == [2, 4, 6]
    assert any("SGLang" in w and "[2, 4, 6]" in w for w in result.warnings)

    _, warnings = check_native_eagle3(native_config(tiny_eagle3_config()), random_eagle3_tensors(tiny_eagle3_config()))
    assert warnings == []  # default ids (2, 4, 5) -> SGLang [1, 3, 4]: nothing to warn about


# ---- the export itself -----------------------------------------------------------------------------------------
def test_export_writes_the_native_format(tmp_path):
    cfg = tiny_eagle3_config()
    tensors = random_eagle3_tensors(cfg)
    out = tmp_path / "export"
    result = export_native_eagle3(make_checkpoint(tmp_path / "run", cfg, tensors), out)

    assert sorted(p.name for p in out.iterdir()) == [EXPORT_MARKER, "README.md", "config.json", "model.safetensors"]
    assert [p.name for p in result.files] == ["config.json", "model.safetensors", "README.md"]
    assert leftovers(tmp_path) == []
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(tensors)
        assert f.get_tensor("d2t").dtype == torch.int64
        assert f.get_tensor("t2d").dtype == torch.bool
        assert torch.equal(f.get_tensor("fc.weight"), tensors["fc.weight"].to(torch.bfloat16))  # default dtype
        assert torch.equal(f.get_tensor("d2t"), tensors["d2t"])

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1
    assert (config["vocab_size"], config["draft_vocab_size"]) == (256, DRAFT_VOCAB)
    assert config["target_hidden_size"] == 64
    assert config["max_position_embeddings"] >= 512
    assert config["tie_word_embeddings"] is False
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    assert config["rope_scaling"] is None  # plain RoPE: transformers 4 expects null, not {"rope_type": "default"}
    assert config[AUX_IDS_KEY] == [2, 4, 5]
    assert config["eagle_config"][AUX_IDS_KEY] == [1, 3, 4]
    assert config["draftsmith"]["target"] == TARGET
    assert config["draftsmith"]["step"] == 100
    assert validate_native_eagle3(config, tensors) == []


def test_exported_config_loads_in_transformers(tmp_path):
    cfg = tiny_eagle3_config(rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    export_native_eagle3(make_checkpoint(tmp_path / "run", cfg), tmp_path / "out")
    loaded = LlamaConfig.from_pretrained(tmp_path / "out")
    assert (loaded.hidden_size, loaded.intermediate_size, loaded.num_hidden_layers) == (64, 128, 1)
    assert (loaded.num_attention_heads, loaded.num_key_value_heads, loaded.head_dim) == (4, 2, 16)
    assert loaded.vocab_size == 256 and loaded.draft_vocab_size == DRAFT_VOCAB
    assert loaded.rope_parameters["rope_theta"] == 500000.0
    assert loaded.eagle_config[AUX_IDS_KEY] == [1, 3, 4]


def test_scaled_rope_keeps_legacy_keys():
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    config = native_config(tiny_eagle3_config(rope_parameters=rope))
    assert config["rope_theta"] == 500000.0
    assert config["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}
    assert config["rope_parameters"] == rope


@pytest.mark.parametrize("bias", [False, True])
def test_drafter_state_dict_matches_the_contract(bias):
    """The model's own parameter names are the export contract: drift in either shows up here."""
    from draftsmith.models.eagle3.model import Eagle3Drafter

    cfg = tiny_eagle3_config()
    cfg.attention_bias = cfg.mlp_bias = bias
    drafter = Eagle3Drafter(cfg)
    vocab = random_eagle3_tensors(cfg)
    drafter.set_draft_vocab(vocab["d2t"], vocab["t2d"])
    problems, warnings = check_native_eagle3(native_config(cfg), drafter.state_dict())
    assert problems == []
    assert any("biases" in w for w in warnings) == bias  # SGLang's draft layer has no biases


def _drop_norm(t):
    del t["norm.weight"]


def _add_embedding(t):
    t["embed_tokens.weight"] = torch.zeros(256, 64)


def _wrong_fc(t):
    t["fc.weight"] = torch.zeros(64, 128)  # two aux layers' worth, config says three


def _shift_d2t(t):
    t["d2t"][5] += 1  # draft id 5 now points at a target id t2d does not mark


def _int32_d2t(t):
    t["d2t"] = t["d2t"].int()


def _unsorted_vocab(t):
    t["d2t"][3], t["d2t"][4] = t["d2t"][4] + 1, t["d2t"][3] - 1  # swaps the target ids of draft ids 3 and 4


@pytest.mark.parametrize(
    "corrupt, reason",
    [
        (_drop_norm, "missing tensors: norm.weight"),
        (_add_embedding, "unexpected tensors .*embed_tokens.weight"),
        (_wrong_fc, r"fc.weight: shape \(64, 128\), expected \(64, 192\)"),
        (_shift_d2t, "d2t and t2d disagree: draft id 5"),
        (_int32_d2t, "d2t: dtype torch.int32, expected torch.int64"),
        (_unsorted_vocab, "not strictly increasing"),
    ],
)
def test_bad_checkpoints_are_refused_and_nothing_is_written(tmp_path, corrupt, reason):
    cfg = tiny_eagle3_config()
    tensors = random_eagle3_tensors(cfg)
    corrupt(tensors)
    ckpt = make_checkpoint(tmp_path / "run", cfg, tensors)
    with pytest.raises(ExportError, match=reason):
        export_native_eagle3(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path) == []


def test_config_problems_are_reported_by_key():
    cfg = tiny_eagle3_config()
    config = native_config(cfg)
    config["eagle_config"][AUX_IDS_KEY] = [2, 4, 5]  # capture ids copied into SGLang's key: off by one
    config["max_position_embeddings"] = 128
    del config["draft_vocab_size"]
    problems = validate_native_eagle3(config, random_eagle3_tensors(cfg))
    assert any("eagle_config.eagle_aux_hidden_state_layer_ids: [2, 4, 5], expected [1, 3, 4]" in p for p in problems)
    assert any("max_position_embeddings 128 < the target's 512" in p for p in problems)
    assert any(p == "config: missing draft_vocab_size" for p in problems)


def test_occupied_out_dir_needs_overwrite(tmp_path):
    ckpt = make_checkpoint(tmp_path / "run", tiny_eagle3_config())
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("keep me")
    with pytest.raises(ExportError, match="not empty; pass --overwrite"):
        export_native_eagle3(ckpt, out)
    assert (out / "old.txt").read_text() == "keep me"
    with pytest.raises(ExportError, match=r"not a draftsmith export \(old.txt\)"):  # only an export is replaced
        export_native_eagle3(ckpt, out, overwrite=True)
    assert (out / "old.txt").read_text() == "keep me"

    (out / "old.txt").unlink()
    export_native_eagle3(ckpt, out)
    export_native_eagle3(ckpt, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [EXPORT_MARKER, "README.md", "config.json", "model.safetensors"]
    assert leftovers(tmp_path) == []
    with pytest.raises(ExportError, match="checkpoint being exported"):
        export_native_eagle3(ckpt, tmp_path / "run", overwrite=True)
    assert (ckpt / "model.safetensors").is_file()


def test_wrong_method_is_refused(tmp_path):
    cfg = tiny_eagle3_config()
    ckpt = make_checkpoint(tmp_path / "run", cfg)
    write_json_atomic({**cfg.to_dict(), "method": "dflash"}, ckpt / "config.json")
    with pytest.raises(ExportError, match="method 'dflash' cannot be exported as native EAGLE-3"):
        export_native_eagle3(ckpt, tmp_path / "out")


# ---- checkpoint folders ----------------------------------------------------------------------------------------
def test_resolve_checkpoint_in_an_output_dir(tmp_path):
    cfg = tiny_eagle3_config()
    run = tmp_path / "run"
    for step in (9, 10, 3):
        make_checkpoint(run, cfg, step=step)  # `latest` now names checkpoint-3
    assert resolve_checkpoint(run) == run / "checkpoint-3"
    assert resolve_checkpoint(run / "checkpoint-9") == run / "checkpoint-9"
    (run / "latest").unlink()
    assert resolve_checkpoint(run) == run / "checkpoint-10"  # numeric, not lexicographic
    (run / "latest").write_text("checkpoint-77\n")
    with pytest.raises(CheckpointError, match="names 'checkpoint-77'"):
        resolve_checkpoint(run)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no `latest` file or complete checkpoint-N"):
        resolve_checkpoint(tmp_path / "empty")

    config, state = load_checkpoint(run / "checkpoint-9")
    assert config["method"] == "eagle3" and state["t2d"].dtype == torch.bool


def test_broken_config_json_names_file_and_line(tmp_path):
    ckpt = make_checkpoint(tmp_path / "run", tiny_eagle3_config())
    (ckpt / "config.json").write_text('{\n  "method": "eagle3",\n  oops\n}')
    with pytest.raises(CheckpointError, match=r"config.json:3: invalid JSON"):
        load_checkpoint(ckpt)


# ---- model card and command line -------------------------------------------------------------------------------
RECIPE = "data:\n  path: Aeala/ShareGPT_Vicuna_unfiltered\n  max_length: 2048\ntrain:\n  lr: 1.0e-4\n"
EVAL = {
    "num_speculative_tokens": 3, "temperature": 0.0, "max_new_tokens": 256,
    "results": [{"dataset": "mt_bench", "num_drafts": 100, "num_draft_tokens": 300, "num_accepted_tokens": 150,
                 "num_accepted_tokens_per_pos": [80, 50, 20]}],
}


def test_model_card(tmp_path):
    ckpt = make_checkpoint(tmp_path / "run", tiny_eagle3_config(), recipe=RECIPE, eval_result=EVAL)
    out = tmp_path / "out"
    export_native_eagle3(ckpt, out)
    card = (out / "README.md").read_text()
    _, front, body = card.split("---\n", 2)
    meta = yaml.safe_load(front)
    assert meta["base_model"] == TARGET
    assert meta["library_name"] == "draftsmith"
    assert meta["tags"] == ["speculative-decoding", "eagle3", "draftsmith", "vllm", "sglang"]
    assert meta["datasets"] == ["Aeala/ShareGPT_Vicuna_unfiltered"]
    assert "pipeline_tag" not in meta
    spec = f'{{"method":"eagle3","model":"{out}","num_speculative_tokens":3}}'
    assert f"vllm serve {TARGET} --speculative-config '{spec}'" in body
    assert (
        f"python -m sglang.launch_server --model {TARGET} --speculative-algorithm EAGLE3 "
        f"--speculative-draft-model-path {out} --speculative-num-steps 3 --speculative-eagle-topk 1 "
        "--speculative-num-draft-tokens 4" in body
    )
    assert "`[2, 4, 5]`" in body and "`[1, 3, 4]`" in body
    assert "| mt_bench | 3 | 0.0 | 256 | 2.500 | 50.0% | 0.800, 0.500, 0.200 |" in body  # 1 + 150/100
    assert "max_length: 2048" in body


def test_model_card_with_a_local_target_has_no_base_model(tmp_path):
    cfg = tiny_eagle3_config()
    cfg.target_name_or_path = str(tmp_path)  # a local folder is not a Hub id
    export_native_eagle3(make_checkpoint(tmp_path / "run", cfg), tmp_path / "out")
    meta = yaml.safe_load((tmp_path / "out" / "README.md").read_text().split("---\n")[1])
    assert "base_model" not in meta and "datasets" not in meta


def _cli(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_export_args(p)
    return p.parse_args(list(argv))


def test_cli(tmp_path, capsys):
    make_checkpoint(tmp_path / "run", tiny_eagle3_config())
    out = tmp_path / "out"
    assert run_export(_cli(str(tmp_path / "run"), "--format", "sglang", "--out", str(out))) == 0
    printed = capsys.readouterr().out
    assert "model.safetensors" in printed and "vllm serve" in printed and "sglang.launch_server" in printed

    assert run_export(_cli(str(tmp_path / "run"), "--format", "sglang", "--out", str(out))) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--overwrite" in err

    assert run_export(_cli(str(tmp_path / "missing"), "--format", "sglang", "--out", str(tmp_path / "o2"))) == 2
    assert "no such checkpoint" in capsys.readouterr().err


def test_written_files_follow_the_umask(tmp_path):
    """safetensors creates its files 0600; exported drafters are meant to be shared and served by other users."""
    import os

    from draftsmith.models.checkpoint import save_safetensors_atomic

    save_safetensors_atomic({"w": torch.zeros(2)}, tmp_path / "m.safetensors")
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "m.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask


# ---- NaN weights, full disks, killed exports (issue 16, items 9, 11, 12) ---------------------------------------
def test_non_finite_weights_are_refused_and_nothing_is_written(tmp_path):
    cfg = tiny_eagle3_config()
    tensors = random_eagle3_tensors(cfg)
    tensors["midlayer.mlp.up_proj.weight"][3, 5] = float("nan")
    ckpt = make_checkpoint(tmp_path / "run", cfg, tensors)
    with pytest.raises(CheckpointError, match=r"model.safetensors: 1 tensor\(s\) hold NaN or inf values "
                                              r"\(midlayer.mlp.up_proj.weight\): .* diverged run"):
        export_native_eagle3(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    import errno

    from draftsmith.models import checkpoint

    ckpt = make_checkpoint(tmp_path / "run", tiny_eagle3_config())

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_file", no_space)
    out = tmp_path / "out"
    assert run_export(_cli(str(ckpt), "--format", "sglang", "--out", str(out))) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{out / 'model.safetensors'}: disk full" in err and "free space" in err
    assert not out.exists() and leftovers(tmp_path) == []


# What safetensors 0.8 raises when the disk fills (its Rust io::Error text inside a SafetensorError; no errno).
SAFETENSORS_WRITE_ERRORS = {
    "ENOSPC": "Error while serializing: I/O error: No space left on device (os error 28)",
    "EDQUOT": "Error while serializing: I/O error: Disk quota exceeded (os error 122)",
}


@pytest.mark.parametrize("fmt", ["sglang", "all"])
@pytest.mark.parametrize("errno_name", sorted(SAFETENSORS_WRITE_ERRORS))
def test_safetensors_full_disk_error_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch, fmt, errno_name):
    """safetensors' own full-disk error once escaped as a 28-line SafetensorError traceback."""
    from safetensors import SafetensorError

    from draftsmith.models import checkpoint

    ckpt = make_checkpoint(tmp_path / "run", tiny_eagle3_config())

    def disk_full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")  # what was written before the disk filled
        raise SafetensorError(SAFETENSORS_WRITE_ERRORS[errno_name])

    monkeypatch.setattr(checkpoint, "save_file", disk_full)
    out = tmp_path / "out"
    assert run_export(_cli(str(ckpt), "--format", fmt, "--out", str(out))) == 2
    err = capsys.readouterr().err
    weights = out / "sglang" / "model.safetensors" if fmt == "all" else out / "model.safetensors"
    assert err.count("\n") == 1 and f"{weights}: disk full (no space left on device)" in err and "free space" in err
    assert "Traceback" not in err and "SafetensorError" not in err
    assert not out.exists() and leftovers(tmp_path) == []


def test_safetensors_full_disk_is_an_oserror_naming_the_file(tmp_path, monkeypatch):
    """Training's save_checkpoint tells a full disk by the OSError's errno; safetensors' error carries none."""
    import errno

    from safetensors import SafetensorError

    from draftsmith.models import checkpoint

    def disk_full(tensors, filename, metadata=None):
        raise SafetensorError(SAFETENSORS_WRITE_ERRORS["ENOSPC"])

    monkeypatch.setattr(checkpoint, "save_file", disk_full)
    with pytest.raises(OSError) as raised:
        save_safetensors_atomic({"a": torch.zeros(2)}, tmp_path / "m.safetensors")
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(tmp_path / "m.safetensors")
    assert checkpoint.is_disk_full(raised.value) and list(tmp_path.iterdir()) == []


def test_safetensors_errors_that_are_not_io_stay_as_they_are(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    from draftsmith.models import checkpoint

    def refused(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: Misaligned slice")

    monkeypatch.setattr(checkpoint, "save_file", refused)
    with pytest.raises(SafetensorError, match="Misaligned slice"):
        save_safetensors_atomic({"a": torch.zeros(2)}, tmp_path / "m.safetensors")
    assert list(tmp_path.iterdir()) == []


KILLED_MID_WRITE = """
import os, signal, sys
from draftsmith.models import checkpoint

def half_then_die(tensors, filename, metadata=None):  # kill -9 while the weights are half on disk
    with open(filename, "wb") as f:
        f.write(b"partial")
    os.kill(os.getpid(), signal.SIGKILL)

checkpoint.save_file = half_then_die
from draftsmith.models.export import main
main(sys.argv[1:])
"""


def _export_killed_mid_write(*argv: str) -> None:
    import signal
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", KILLED_MID_WRITE, *argv], cwd=repo, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]


def test_a_killed_export_leaves_nothing_the_next_run_trips_on(tmp_path):
    ckpt = make_checkpoint(tmp_path / "run", tiny_eagle3_config())
    out = tmp_path / "out"
    _export_killed_mid_write(str(ckpt), "--format", "sglang", "--out", str(out))
    assert not out.exists()
    export_native_eagle3(ckpt, out)  # the next run removes the killed one's temporary folder
    assert sorted(p.name for p in out.iterdir()) == [EXPORT_MARKER, "README.md", "config.json", "model.safetensors"]
    assert leftovers(tmp_path) == []


def test_a_killed_format_all_leaves_no_partial_folder(tmp_path):
    """`--format all` killed inside its first format once left `out/` holding a partial `sglang.tmp-*`, which
    blocked the rerun without --overwrite: the set is now built beside `out` and renamed into place whole."""
    from transformers import LlamaForCausalLM

    from draftsmith.models.export import export_all

    target = tmp_path / "target"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=128,
                                 max_position_embeddings=512)).save_pretrained(target)
    cfg = tiny_eagle3_config()
    cfg.target_name_or_path, cfg.target_architectures = str(target), ["LlamaForCausalLM"]
    ckpt = make_checkpoint(tmp_path / "run", cfg)
    out = tmp_path / "out"
    _export_killed_mid_write(str(ckpt), "--format", "all", "--out", str(out))
    assert not out.exists(), sorted(p.name for p in out.rglob("*"))
    results, _ = export_all(ckpt, out)  # no --overwrite needed
    assert sorted(results) == ["sglang", "speculators"]
    assert sorted(p.name for p in out.iterdir()) == [EXPORT_MARKER, "sglang", "speculators"]
    assert str(out / "sglang") in (out / "sglang" / "README.md").read_text()  # the card names the final folder
    assert leftovers(tmp_path) == []


def test_only_stale_temporaries_of_this_folder_are_removed(tmp_path):
    """Ours and stale: the name pattern of this folder, and a writer that is gone (its pid not running, or a
    pid-less name from before this run). A live writer's folder and other folders' stay."""
    import os
    import subprocess
    import sys

    from draftsmith.models.checkpoint import remove_stale_temporaries

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    out = tmp_path / "out"
    names = {
        "dead": f"out.tmp-{gone.pid}-0123abcd",
        "live": f"out.tmp-{os.getppid()}-0123abcd",  # pytest's parent: running, and started before the folder
        "legacy": "out.tmp-89abcdef",
        "other": f"other.tmp-{gone.pid}-0123abcd",
        "old": f"out.old-{gone.pid}-0123abcd",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    os.utime(tmp_path / names["legacy"], (0, 0))  # written long before this run
    removed = remove_stale_temporaries(out)
    assert sorted(p.name for p in removed) == sorted([names["dead"], names["legacy"]])
    assert (out / "config.json").is_file()  # the .old- folder of a replace killed halfway is the export again
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", names["live"], names["other"]])


# ---- a local target named from anywhere (issue 25, item 18e) ----------------------------------------------------
def test_a_relative_local_target_is_named_by_its_absolute_path(tmp_path, monkeypatch):
    """Serve commands, cards and configs once carried model.target as typed ("models/target"), which names the
    target only from the directory training ran in."""
    from test_dflash import make_checkpoint as make_dflash_checkpoint
    from test_dflash import tiny_config as tiny_dflash_config
    from test_dflash import tiny_drafter as tiny_dflash_drafter

    cfg = tiny_eagle3_config()
    target_dir = tmp_path / "models" / "target"
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512)
                     ).save_pretrained(target_dir)
    monkeypatch.chdir(tmp_path)
    typed = "models/target"
    cfg.target_name_or_path, cfg.target_architectures = typed, ["LlamaForCausalLM"]
    dflash_cfg = tiny_dflash_config(learned_mask=False)
    dflash_cfg.target_name_or_path = typed
    checkpoints = {"eagle3": make_checkpoint(tmp_path / "run", cfg),
                   "dflash": make_dflash_checkpoint(tmp_path / "run-dflash", tiny_dflash_drafter(dflash_cfg))}

    for fmt, method in (("sglang", "eagle3"), ("speculators", "eagle3"), ("dflash", "dflash")):
        result = exporter(fmt)(checkpoints[method], tmp_path / fmt)
        card = (result.out_dir / "README.md").read_text()
        config = json.loads((result.out_dir / "config.json").read_text())
        commands = "\n".join(result.serve_commands.values())
        named = [card, commands, json.dumps(config)]
        assert all(str(target_dir) in text for text in named), fmt
        assert not any(typed in text.replace(str(target_dir), "") for text in named), fmt
        assert config["draftsmith"]["target"] == str(target_dir)


def test_a_hub_id_or_an_unknown_path_is_left_as_typed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "here").mkdir()
    assert absolute_target("here") == str(tmp_path / "here")
    assert absolute_target(TARGET) == TARGET
    assert absolute_target("gone/target") == "gone/target"  # nothing here to resolve it against
    assert absolute_target(str(tmp_path / "here")) == str(tmp_path / "here")


def test_an_export_records_its_tokenizer_and_eval_refuses_another(tmp_path, fixture_target_dir, mt_bench_path,
                                                                     capsys):
    """Issue 47 item 11: eval and generate stayed silent for a drafter trained with another tokenizer. The export
    records its target tokenizer's fingerprint (token ids and special ids); generate and eval compare it with their
    target's and refuse a difference in one line, before loading any model."""
    import json as json_mod

    from transformers import AutoTokenizer

    from draftsmith.cli import main
    from draftsmith.models.target_files import tokenizer_fingerprint

    tokenizer = AutoTokenizer.from_pretrained(str(fixture_target_dir))
    cfg = tiny_eagle3_config()
    cfg.target_name_or_path = str(fixture_target_dir)
    export_native_eagle3(make_checkpoint(tmp_path / "run", cfg), tmp_path / "out")
    recorded = json_mod.loads((tmp_path / "out" / "config.json").read_text())["draftsmith"]["tokenizer"]
    assert recorded == tokenizer_fingerprint(tokenizer)

    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(5)  # one special id moved: another tokenizer
    assert tokenizer_fingerprint(tokenizer) != recorded

    other = json_mod.loads((tmp_path / "out" / "config.json").read_text())
    other["draftsmith"]["tokenizer"] = "0123456789abcdef"  # the export of a drafter for another tokenizer
    (tmp_path / "out" / "config.json").write_text(json_mod.dumps(other))
    spec = json_mod.dumps({"method": "eagle3", "model": str(tmp_path / "out"), "num_speculative_tokens": 2})
    for command in (["generate", "--prompt", "hi"], ["eval", "--dataset", str(mt_bench_path)]):
        code = main([*command, "--target", str(fixture_target_dir), "--device", "cpu", "--speculative-config",
                     spec, "--max-new-tokens", "4"])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err, err[-2000:]
        assert f"{tmp_path / 'out' / 'config.json'}: this drafter was trained with another tokenizer" in err
        assert "fingerprint 0123456789abcdef" in err
