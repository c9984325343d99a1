"""Issue 47, items 2 and 3: nothing outside a folder is read or written because a file or a recipe names it, and a
store index cannot switch its own checksums off.

Item 2: a path taken from a file (a safetensors index's `weight_map`, a hidden-state store's index.json or progress
file) or from a recipe (`training.run_name`) that is absolute or goes through `..` is refused in one line naming the
file and the entry, before anything is read. Item 3: the store reader takes its checksum's piece size from the
store's format, so `checksum_leaf_bytes: 0` (which, with empty-piece digests, lets any file pass) or a string there
is one line naming index.json and the key, and a format 1 store is still checked by its plain sha256."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM
from test_import import native_public, ours  # shared helpers, same folder

from draftsmith.cli import main as cli_main
from draftsmith.config import RecipeError, load_recipe, recipe_from_dict
from draftsmith.data.store import (
    CHECKSUM_LEAF_BYTES,
    INDEX,
    STORE_FORMAT,
    HiddenStateStore,
    ShardWriter,
    StoreError,
    shard_checksum,
    shard_layout,
    write_shard,
)
from draftsmith.models.mtp.native import NativeMtpError, weight_files
from draftsmith.models.target import TargetModel
from draftsmith.models.target_files import load_target_embedding
from draftsmith.models.targets.base import TargetError

INDEX_FILE = "model.safetensors.index.json"
ESCAPES = ["../outside/model.safetensors", "absolute"]  # "absolute": the outside file's absolute path


def escaping(name: str, outside_file: Path) -> str:
    return str(outside_file.resolve()) if name == "absolute" else name


def moved_outside(folder: Path, tmp_path: Path) -> Path:
    """`folder`'s model.safetensors, moved to tmp_path/outside/ (next to the folder, not in it)."""
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    return Path(shutil.move(str(folder / "model.safetensors"), str(outside / "model.safetensors")))


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


# ---- item 2a: a safetensors index naming weights outside its folder --------------------------------------------
@pytest.mark.parametrize("name", ESCAPES)
def test_import_refuses_an_index_naming_weights_outside_the_source_folder(tmp_path, capsys, name):
    cfg, weights = ours("some/target")
    src = native_public(tmp_path / "src", cfg, weights)
    outside = moved_outside(src, tmp_path)
    from safetensors import safe_open

    with safe_open(str(outside), "pt") as f:
        keys = list(f.keys())
    (src / INDEX_FILE).write_text(json.dumps({"weight_map": dict.fromkeys(keys, escaping(name, outside))}))
    assert cli_main(["import", str(src), "--out", str(tmp_path / "out")]) == 2
    line = one_line(capsys.readouterr().err)
    assert f"{src / INDEX_FILE}: weight_map[" in line and "outside" in line, line
    assert not (tmp_path / "out").exists()


def tiny_target(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    path = tmp_path / "target"
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64))
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(path)
    return path


def target_with_escaping_index(tmp_path: Path, name: str) -> Path:
    target = tiny_target(tmp_path)
    from safetensors import safe_open

    outside = moved_outside(target, tmp_path)
    with safe_open(str(outside), "pt") as f:
        keys = list(f.keys())
    (target / INDEX_FILE).write_text(json.dumps({"weight_map": dict.fromkeys(keys, escaping(name, outside))}))
    return target


@pytest.mark.parametrize("name", ESCAPES)
def test_the_targets_head_and_embeddings_are_not_read_from_outside_its_folder(tmp_path, name):
    target = target_with_escaping_index(tmp_path, name)
    with pytest.raises(TargetError, match=rf"{INDEX_FILE}: weight_map\['model.embed_tokens.weight'\] is .*outside"):
        TargetModel.head_and_embeddings(target, dtype="float32", device="cpu")


@pytest.mark.parametrize("name", ESCAPES)
def test_the_targets_embedding_for_a_speculators_export_is_not_read_from_outside(tmp_path, name):
    target = target_with_escaping_index(tmp_path, name)
    embedding, why = load_target_embedding(str(target))
    assert embedding is None
    assert f"{INDEX_FILE}: weight_map['model.embed_tokens.weight'] is" in why and "outside" in why


@pytest.mark.parametrize("name", ESCAPES)
def test_native_mtp_weights_are_not_read_from_outside_the_targets_folder(tmp_path, name):
    target = target_with_escaping_index(tmp_path, name)
    with pytest.raises(NativeMtpError, match=rf"{INDEX_FILE}: weight_map\['.*'\] is .*outside"):
        weight_files(target)


# ---- item 2b and 3: a hidden-state store's index and progress files --------------------------------------------
SHARD = "shard-r0-00000.safetensors"


def shard_tensors() -> dict[str, torch.Tensor]:
    """One sample of 3 tokens, two aux layers of hidden size 4, float32."""
    g = torch.Generator().manual_seed(0)
    return {"0.aux": torch.randn(3, 8, generator=g), "0.last": torch.randn(3, 4, generator=g),
            "0.input_ids": torch.tensor([5, 6, 7], dtype=torch.int32),
            "0.loss_mask": torch.tensor([0, 1, 1], dtype=torch.int8)}


def make_store(folder: Path) -> dict:
    """A complete one-shard store written as `collect` writes it (format 2, tree checksums); returns its index."""
    folder.mkdir(parents=True)
    tensors = shard_tensors()
    order, prefix, offsets = shard_layout(tensors)
    write_shard(tensors, order, prefix, folder / SHARD)
    index = {"format": STORE_FORMAT, "dtype": "float32", "hidden_size": 4, "num_aux": 2,
             "checksum_leaf_bytes": CHECKSUM_LEAF_BYTES, "num_samples": 1, "num_tokens": 3,
             "bytes": (folder / SHARD).stat().st_size,
             "shards": {SHARD: {"sha256_tree": shard_checksum(tensors, order, prefix),
                                "bytes": (folder / SHARD).stat().st_size, "samples": 1}},
             "samples": [[SHARD, offsets["0.aux"], 3]]}
    (folder / INDEX).write_text(json.dumps(index))
    return index


def rename_shard(index: dict, name: str) -> dict:
    index["shards"] = {name: index["shards"][SHARD]}
    index["samples"] = [[name, *rest] for _, *rest in index["samples"]]
    return index


def test_a_store_written_as_collect_writes_it_is_read(tmp_path):
    make_store(tmp_path / "store")
    store = HiddenStateStore(tmp_path / "store")
    store.verify()
    assert store.sample(0)[2] == [5, 6, 7]


@pytest.mark.parametrize("name", ["../outside/shard.safetensors", "absolute", "sub/../../outside/shard.safetensors"])
def test_a_store_index_naming_a_shard_outside_the_store_is_refused(tmp_path, name):
    folder = tmp_path / "store"
    index = make_store(folder)
    (tmp_path / "outside").mkdir()
    outside = Path(shutil.move(str(folder / SHARD), str(tmp_path / "outside" / "shard.safetensors")))
    name = str(outside) if name == "absolute" else name
    (folder / INDEX).write_text(json.dumps(rename_shard(index, name)))
    with pytest.raises(StoreError, match=rf"{INDEX}: shard .* is .*outside") as info:
        store = HiddenStateStore(folder)
        store.verify()
        store.sample(0)
    assert "\n" not in str(info.value)


def test_a_resumed_collection_refuses_a_progress_file_naming_a_shard_outside(tmp_path):
    folder = tmp_path / "store"
    make_store(folder)
    (folder / INDEX).unlink()
    (tmp_path / "outside").mkdir()
    outside = Path(shutil.move(str(folder / SHARD), str(tmp_path / "outside" / "shard.safetensors")))
    plan = {"header": {"target": "t"}, "rank": 0}
    digest = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()
    progress = {"format": STORE_FORMAT, "plan_sha256": digest, "rank": 0,
                "shards": [{"name": "../outside/shard.safetensors", "sha256_tree": "0" * 64,
                            "bytes": outside.stat().st_size, "samples": [[0, 0, 3]]}]}
    (folder / "progress-r0.json").write_text(json.dumps(progress))
    with pytest.raises(StoreError, match=r"progress-r0.json: shards\[0\]\.name is '\.\./outside/shard.safetensors'"
                                         r".*outside"):
        ShardWriter(folder, 0, plan, "float32", 1 << 20, "a test")


def damaged_store(tmp_path: Path) -> tuple[Path, dict]:
    """A store whose shard was changed after collection (same size, other bytes)."""
    folder = tmp_path / "store"
    index = make_store(folder)
    with (folder / SHARD).open("r+b") as f:
        f.seek(index["samples"][0][1] + 4)
        f.write(b"\x00\x01\x02\x03")
    return folder, index


def test_a_damaged_shard_fails_its_checksum(tmp_path):
    folder, _ = damaged_store(tmp_path)
    with pytest.raises(StoreError, match=f"{SHARD}: fails its checksum"):
        HiddenStateStore(folder).verify()


EMPTY_TREE = hashlib.sha256(b"").hexdigest()  # the tree checksum of no pieces: what any file gives with pieces of 0


@pytest.mark.parametrize("leaf", [0, "64MiB", 1024, -1, True, None, 2 * CHECKSUM_LEAF_BYTES])
def test_a_store_index_cannot_choose_its_own_checksum_piece_size(tmp_path, leaf):
    folder, index = damaged_store(tmp_path)
    index["checksum_leaf_bytes"] = leaf
    if leaf == 0:
        index["shards"][SHARD]["sha256_tree"] = EMPTY_TREE
    (folder / INDEX).write_text(json.dumps(index))
    with pytest.raises(StoreError, match=rf"{INDEX}: checksum_leaf_bytes is .*{CHECKSUM_LEAF_BYTES}") as info:
        store = HiddenStateStore(folder)
        store.verify()
        store.sample(0)
    assert "\n" not in str(info.value)


def test_a_format_1_index_is_checked_by_the_plain_sha256_whatever_else_it_records(tmp_path):
    """Format 1 recorded each shard's plain sha256: a tree checksum there (with pieces of 0, so empty) is not
    what format 1 checks, so the damaged shard is refused, by name."""
    folder, index = damaged_store(tmp_path)
    index.update(format="draftsmith-hidden-states/1", checksum_leaf_bytes=0)
    index["shards"][SHARD]["sha256_tree"] = EMPTY_TREE
    (folder / INDEX).write_text(json.dumps(index))
    with pytest.raises(StoreError, match=rf"{INDEX}: shard '{SHARD}' records no sha256"):
        HiddenStateStore(folder).verify()


def make_clean_copy(tmp_path: Path) -> bytes:
    """The bytes of an undamaged copy of the store's shard (in tmp_path/clean)."""
    make_store(tmp_path / "clean")
    return (tmp_path / "clean" / SHARD).read_bytes()


def test_a_format_1_store_is_still_read_and_a_damaged_shard_named(tmp_path):
    folder, index = damaged_store(tmp_path)
    index["format"] = "draftsmith-hidden-states/1"
    del index["checksum_leaf_bytes"]
    del index["shards"][SHARD]["sha256_tree"]
    index["shards"][SHARD]["sha256"] = hashlib.sha256(make_clean_copy(tmp_path)).hexdigest()
    (folder / INDEX).write_text(json.dumps(index))
    with pytest.raises(StoreError, match=f"{SHARD}: fails its checksum"):
        HiddenStateStore(folder).verify()
    shutil.copy(tmp_path / "clean" / SHARD, folder / SHARD)
    store = HiddenStateStore(folder)
    store.verify()
    assert store.sample(0)[2] == [5, 6, 7]


def test_a_format_2_shard_without_its_tree_checksum_is_refused(tmp_path):
    folder, index = damaged_store(tmp_path)
    index["shards"][SHARD] = {"bytes": index["shards"][SHARD]["bytes"], "samples": 1, "sha256_tree": 7}
    (folder / INDEX).write_text(json.dumps(index))
    with pytest.raises(StoreError, match=rf"{INDEX}: shard '{SHARD}' records no sha256_tree"):
        HiddenStateStore(folder)


# ---- item 2c: recipe strings that become paths -----------------------------------------------------------------
MINIMAL = {"model": {"target": "t"}, "data": {"path": "sharegpt"}, "output_dir": "out"}


@pytest.mark.parametrize("run_name", ["../../x", "/tmp/x", "a/b", "..", ".", "a\\..\\..\\b"])
def test_a_run_name_that_is_a_path_is_refused_when_the_recipe_is_read(tmp_path, run_name):
    with pytest.raises(RecipeError, match=r"training\.run_name") as info:
        recipe_from_dict({**MINIMAL, "training": {"run_name": run_name}})
    assert "\n" not in str(info.value)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {target: t}\ndata: {path: sharegpt}\noutput_dir: out\n")
    with pytest.raises(RecipeError, match=r"training\.run_name"):
        load_recipe(recipe, [f"training.run_name={run_name}"])


@pytest.mark.parametrize("run_name", ["exp-1", "v1..2", "2024-05-01", "lr=1e-4 warm"])
def test_a_run_name_that_is_a_name_is_kept(run_name):
    assert recipe_from_dict({**MINIMAL, "training": {"run_name": run_name}}).training.run_name == run_name


def test_train_stops_in_one_line_before_tensorboard_writes_outside_output_dir(tmp_path, capsys, fixture_target_dir):
    """Today's escape, end to end: TensorBoard's folder is output_dir / run_name, so "../escaped" lands next to it."""
    from test_train import tiny_recipe, write_conversations

    recipe = tiny_recipe(fixture_target_dir, write_conversations(tmp_path / "conv.jsonl"), tmp_path).model_dump()
    recipe["training"].update(max_steps=1, report_to="tensorboard", run_name="../escaped")
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert cli_main(["train", str(path)]) == 2
    line = one_line(capsys.readouterr().err)
    assert f"{path}: training.run_name" in line and "'../escaped'" in line, line
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "run").exists()
