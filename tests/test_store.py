"""The hidden-state store: `draftsmith collect` writes the target's states once, training reads them (same loss curve
as online), a SIGKILLed collection resumes to the same store, and damaged or foreign stores are refused by name."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.cli import main as cli_main
from draftsmith.train.collect import collect
from draftsmith.config import recipe_from_dict, save_recipe
from draftsmith.data.store import INDEX, HiddenStateStore, StoreError, _checksum_file, _sha256_file
from draftsmith.models.target import TargetModel
from draftsmith.train import train
from test_train import losses, tiny_recipe, write_conversations

SHARD_BYTES = 600_000  # the fixture's states are 6 kB a token in float32: several shards


def store_recipe(target_dir, tmp_path, store, **training):
    data = write_conversations(tmp_path / "conv.jsonl")
    recipe = tiny_recipe(target_dir, data, tmp_path, **training).model_dump()
    recipe["data"]["hidden_states_path"] = str(store)
    recipe["collect"] = {"max_shard_bytes": SHARD_BYTES, "dtype": "float32", "batch_tokens": 64}
    return recipe_from_dict(recipe)


@pytest.fixture(scope="module")
def collected(tmp_path_factory, fixture_target_dir):
    tmp = tmp_path_factory.mktemp("collected")
    recipe = store_recipe(fixture_target_dir, tmp, tmp / "store")
    collect(recipe, log=lambda *a: None)
    return recipe, tmp / "store"


def test_the_store_holds_the_targets_states_in_bounded_shards(collected, fixture_target_dir):
    recipe, folder = collected
    index = json.loads((folder / INDEX).read_text())
    assert index["num_samples"] == index["num_train"] + index["num_eval"] == 24
    assert index["aux_layer_ids"] and index["dtype"] == "float32" and index["data_sha256"]
    assert len(index["shards"]) > 1
    batch_bytes = 96 * 6 * 1024  # a batch: at most 64 padded tokens, or one sample of up to 96
    assert all(s["bytes"] < SHARD_BYTES + batch_bytes for s in index["shards"].values())  # closed at a batch end
    assert index["num_tokens"] == sum(length for _, _, length in index["samples"])
    assert not list(folder.glob("progress-*")) and not list(folder.glob(".*tmp*"))
    target = TargetModel.from_pretrained(fixture_target_dir, dtype="float32")
    store = HiddenStateStore(folder)
    for i in (0, 7, 23):
        aux, last, ids = store.sample(i)
        alone = target.capture(torch.tensor([ids]), None, index["aux_layer_ids"])
        torch.testing.assert_close(aux, alone.aux_hidden[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(last, alone.last_hidden[0], rtol=1e-4, atol=1e-5)


def test_training_from_the_store_follows_the_online_loss_curve(collected, tmp_path, fixture_target_dir):
    recipe, folder = collected
    online = recipe.model_dump()
    online["data"]["hidden_states_path"] = None
    online["output_dir"] = str(tmp_path / "online")
    train(recipe_from_dict(online), log=lambda *a: None)
    offline = recipe.model_dump()
    offline["output_dir"] = str(tmp_path / "offline")
    lines = []
    train(recipe_from_dict(offline), log=lambda *a: lines.append(" ".join(a)))
    assert any("read from" in line and "the target's layers are not run" in line for line in lines)
    want, got = losses(tmp_path / "online"), losses(tmp_path / "offline")
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5, 6]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-4), step
    evals = [[json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()
              if "eval/loss" in line] for d in ("online", "offline")]
    assert evals[0] and [r["eval/loss"] for r in evals[1]] == pytest.approx([r["eval/loss"] for r in evals[0]],
                                                                              rel=1e-4)


KILLER = textwrap.dedent("""
    import os, signal, sys
    import torch
    torch.set_num_threads(int(sys.argv[2]))  # the test's own: float32 sums differ with the thread count
    import draftsmith.data.store as store
    real, calls = store.write_shard, []
    def save_then_die(*args, **kwargs):
        real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 3:  # the third shard is on disk, its progress record is not
            os.kill(os.getpid(), signal.SIGKILL)
    store.write_shard = save_then_die
    from draftsmith.cli import main
    sys.exit(main(["collect", sys.argv[1]]))
""")


def test_a_killed_collection_resumes_to_the_same_store(collected, tmp_path, fixture_target_dir):
    recipe, reference = collected
    killed = tmp_path / "killed"
    dump = recipe.model_dump()
    dump["data"]["hidden_states_path"] = str(killed)
    save_recipe(recipe_from_dict(dump), tmp_path / "recipe.yaml")
    run = subprocess.run([sys.executable, "-c", KILLER, str(tmp_path / "recipe.yaml"), str(torch.get_num_threads())],
                         capture_output=True, text=True)
    assert run.returncode == -9, run.stderr[-2000:]
    assert not (killed / INDEX).exists()
    progress = json.loads((killed / "progress-r0.json").read_text())
    # shards 0 and 1 are written; 1 may still be checksumming (another thread) when the third one lands
    assert [s["name"] for s in progress["shards"]] in (["shard-r0-00000.safetensors"],
                                                       ["shard-r0-00000.safetensors", "shard-r0-00001.safetensors"])
    collect(recipe_from_dict(dump), log=lambda *a: None)
    want, got = (json.loads((f / INDEX).read_text()) for f in (reference, killed))
    assert got["samples"] == want["samples"]
    assert got["shards"] == want["shards"]  # the same bytes, by checksum: nothing lost, nothing repeated


def copy_store(folder, tmp_path):
    import shutil

    return shutil.copytree(folder, tmp_path / "copy")


def test_a_damaged_shard_is_named(collected, tmp_path):
    folder = copy_store(collected[1], tmp_path)
    index = json.loads((folder / INDEX).read_text())
    name, offset, _ = index["samples"][5]
    with (folder / name).open("r+b") as f:
        f.seek(offset + 16)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(StoreError, match=f"{name}: fails its checksum"):
        HiddenStateStore(folder).sample(5)


def test_a_format_1_store_with_plain_sha256_checksums_is_still_read_and_checked(collected, tmp_path):
    """Stores written before the tree checksum (format 1: each shard's plain sha256) still verify and load, and a
    damaged shard in one is still named."""
    folder = copy_store(collected[1], tmp_path)
    index = json.loads((folder / INDEX).read_text())
    index["format"] = "draftsmith-hidden-states/1"
    del index["checksum_leaf_bytes"]
    for name, shard in index["shards"].items():
        del shard["sha256_tree"]
        shard["sha256"] = _sha256_file(folder / name)
    (folder / INDEX).write_text(json.dumps(index))
    store = HiddenStateStore(folder)
    store.verify()
    store.check_matches({k: json.loads((collected[1] / INDEX).read_text())[k] for k in HiddenStateStore.CHECKED})
    assert store.sample(3)[0].shape[0] == len(store.sample(3)[2])
    name = index["samples"][5][0]
    with (folder / name).open("r+b") as f:
        f.seek(index["samples"][5][1] + 16)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(StoreError, match=f"{name}: fails its checksum"):
        HiddenStateStore(folder).verify()


def test_a_non_finite_sample_is_named(collected, tmp_path):
    folder = copy_store(collected[1], tmp_path)
    index = json.loads((folder / INDEX).read_text())
    name = index["samples"][9][0]
    tensors = load_file(folder / name)
    tensors["9.last"][2, 0] = float("nan")
    save_file(tensors, folder / name, metadata={"format": "pt"})
    index["shards"][name]["sha256_tree"] = _checksum_file(folder / name)
    (folder / INDEX).write_text(json.dumps(index))
    with pytest.raises(StoreError, match=f"{name}: sample 9 holds a non-finite"):
        HiddenStateStore(folder).sample(9)


def test_a_store_of_other_layers_is_refused(collected, tmp_path):
    recipe, folder = collected
    dump = recipe.model_dump()
    dump["model"]["aux_layer_ids"] = [1, 2, 3]
    dump["output_dir"] = str(tmp_path / "run")
    with pytest.raises(StoreError, match=r"index.json: aux_layer_ids is \[.*\] but the recipe gives \[1, 2, 3\]"):
        train(recipe_from_dict(dump), log=lambda *a: None)


def test_collect_refuses_a_disk_too_small_and_a_recipe_without_a_store(collected, tmp_path, monkeypatch, capsys):
    import draftsmith.data.store as store_mod

    recipe, _ = collected
    dump = recipe.model_dump()
    dump["data"]["hidden_states_path"] = str(tmp_path / "new")
    monkeypatch.setattr(store_mod.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
    with pytest.raises(StoreError, match=r"the store needs about .* MB and the disk has 1.00 kB free"):
        collect(recipe_from_dict(dump), log=lambda *a: None)
    assert not (tmp_path / "new" / INDEX).exists()
    dump["data"]["hidden_states_path"] = None
    save_recipe(recipe_from_dict(dump), tmp_path / "r.yaml")
    assert cli_main(["collect", str(tmp_path / "r.yaml")]) == 2
    assert "collect needs data.hidden_states_path" in capsys.readouterr().err


def test_two_ranks_write_disjoint_shards_that_merge_into_the_same_store(collected, tmp_path, fixture_target_dir):
    """What `accelerate launch -m draftsmith.collect` does on two processes, run here one rank after the other."""
    from draftsmith.data import prepare_dataset
    from draftsmith.data.store import collect_rank, store_header, write_index
    from draftsmith.train.setup import load_tokenizer

    recipe, reference = collected
    tokenizer = load_tokenizer(recipe.model.target)
    data = prepare_dataset(recipe.data, tokenizer, log=lambda *a: None)
    samples = [*data.train, *data.eval]
    target = TargetModel.from_pretrained(fixture_target_dir, dtype="float32")
    want = HiddenStateStore(reference)
    ids = want.index["aux_layer_ids"]
    header = store_header(recipe.model.target, tokenizer, ids, 384, samples, len(data.train), "float32")
    folder = tmp_path / "two"
    for rank in (0, 1):
        collect_rank(target, ids, samples, folder, header, rank=rank, world=2, max_shard_bytes=SHARD_BYTES,
                     dtype="float32", batch_tokens=64, log=lambda *a: None)
    index = write_index(folder, header, len(samples), world=2)
    assert {name.split("-")[1] for name in index["shards"]} == {"r0", "r1"}
    assert all((i % 2 == 0) == (shard.startswith("shard-r0")) for i, (shard, _, _) in enumerate(index["samples"]))
    got = HiddenStateStore(folder)
    got.check_matches({k: want.index[k] for k in HiddenStateStore.CHECKED})
    for i in range(len(samples)):
        for a, b in zip(got.sample(i)[:2], want.sample(i)[:2]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_training_from_a_store_loads_only_the_targets_head_and_embeddings(fixture_target_dir):
    full = TargetModel.from_pretrained(fixture_target_dir, dtype="float32")
    light = TargetModel.head_and_embeddings(fixture_target_dir, dtype="float32")
    assert torch.equal(light.embed_tokens.weight, full.embed_tokens.weight)
    assert torch.equal(light.lm_head.weight, full.lm_head.weight)
    assert all(p.is_meta for p in light.layers.parameters())  # the decoder layers take no memory
    assert (light.device, light.dtype) == (torch.device("cpu"), torch.float32)


def test_an_fp8_store_is_a_quarter_of_float32_within_fp8_rounding_and_trains(collected, tmp_path):
    recipe, reference = collected
    dump = recipe.model_dump()
    dump["data"]["hidden_states_path"] = str(tmp_path / "fp8")
    dump["collect"]["dtype"] = "float8_e4m3fn"
    dump["output_dir"] = str(tmp_path / "run")
    fp8_recipe = recipe_from_dict(dump)
    collect(fp8_recipe, log=lambda *a: None)
    want, got = HiddenStateStore(reference), HiddenStateStore(tmp_path / "fp8")
    assert got.index["bytes"] < 0.3 * want.index["bytes"]
    for i in (0, 11):
        for a, b in zip(got.sample(i)[:2], want.sample(i)[:2]):
            row_max = b.abs().amax(-1, keepdim=True)
            assert ((a - b).abs() <= row_max / 16 + 1e-6).all()  # 3 mantissa bits: half an ulp at most 2^-4
            assert not torch.equal(a, b)
    train(fp8_recipe, log=lambda *a: None)
    dump["data"]["hidden_states_path"] = None
    dump["output_dir"] = str(tmp_path / "online")
    train(recipe_from_dict(dump), log=lambda *a: None)
    from_fp8, online = losses(tmp_path / "run"), losses(tmp_path / "online")
    assert sorted(from_fp8) == sorted(online) == [1, 2, 3, 4, 5, 6]
    for step in online:  # fp8 rounding moves the loss a little, not the run
        assert from_fp8[step] == pytest.approx(online[step], rel=0.05), step


def cache_recipe(collected, tmp_path, name, **training):
    recipe, _ = collected
    dump = recipe.model_dump()
    dump["data"]["hidden_states_path"] = None
    dump["data"]["hidden_states_cache"] = str(tmp_path / "cache")
    dump["training"].update({"max_steps": 12, "save_every": 3, "eval_every": 5, **training})  # 5 steps an epoch
    dump["output_dir"] = str(tmp_path / name)
    return recipe_from_dict(dump)


def online_losses(collected, tmp_path):
    dump = cache_recipe(collected, tmp_path, "online").model_dump()
    dump["data"]["hidden_states_cache"] = None
    train(recipe_from_dict(dump), log=lambda *a: None)
    return losses(tmp_path / "online")


def test_the_hybrid_cache_writes_the_first_epoch_and_later_epochs_read_it(collected, tmp_path):
    lines = []
    train(cache_recipe(collected, tmp_path, "hybrid"), log=lambda *a: lines.append(" ".join(a)))
    assert any("the first epoch also writes them" in line for line in lines)
    assert any("read from" in line and "cache" in line for line in lines)  # epochs 2 and 3
    index = json.loads((tmp_path / "cache" / INDEX).read_text())
    assert index["num_samples"] == 24 and not list((tmp_path / "cache").glob("progress-*"))
    want, got = online_losses(collected, tmp_path), losses(tmp_path / "hybrid")
    assert sorted(got) == sorted(want) == list(range(1, 13))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-4), step
    lines.clear()
    again = cache_recipe(collected, tmp_path, "rerun")
    train(again, log=lambda *a: lines.append(" ".join(a)))  # a complete cache: read from the first step
    assert any("the target's layers are not run" in line for line in lines)


def test_a_run_killed_in_the_first_epoch_resumes_its_cache(collected, tmp_path, monkeypatch):
    from draftsmith.train import loop as loop_mod

    real_save = loop_mod.save_checkpoint

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt  # killed right after the step-3 checkpoint, inside the first epoch

    recipe = cache_recipe(collected, tmp_path, "hybrid")
    monkeypatch.setattr(loop_mod, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train(recipe, log=lambda *a: None)
    monkeypatch.setattr(loop_mod, "save_checkpoint", real_save)
    assert not (tmp_path / "cache" / INDEX).exists() and list((tmp_path / "cache").glob("progress-r0.json"))
    train(recipe, log=lambda *a: None)
    index = json.loads((tmp_path / "cache" / INDEX).read_text())  # write_index refuses a sample twice
    assert index["num_samples"] == 24
    want, got = online_losses(collected, tmp_path), losses(tmp_path / "hybrid")
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-4), step


@pytest.mark.slow
@pytest.mark.parametrize("method", ["mtp", "dflash"])
def test_mtp_and_dflash_train_from_a_store_as_online(method, tmp_path, fixture_target_dir):
    dump = store_recipe(fixture_target_dir, tmp_path, tmp_path / "store").model_dump()
    dump["model"]["method"] = method
    dump["model"]["draft_vocab_size"] = None
    offline = recipe_from_dict({**dump, "output_dir": str(tmp_path / "offline")})
    collect(offline, log=lambda *a: None)
    train(offline, log=lambda *a: None)
    dump["data"]["hidden_states_path"] = None
    train(recipe_from_dict({**dump, "output_dir": str(tmp_path / "online")}), log=lambda *a: None)
    want, got = losses(tmp_path / "online"), losses(tmp_path / "offline")
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5, 6]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-4), step


TWO_RANK_COLLECT = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                    "127.0.0.1", "-m", "draftsmith.collect"]


@pytest.mark.slow
def test_two_processes_collect_disjoint_shards_into_one_store(collected, tmp_path):
    """accelerate launch -m draftsmith.collect on two (CPU, gloo) processes, launched by torchrun."""
    import os
    import socket

    recipe, reference = collected
    dump = recipe.model_dump()
    dump["data"]["hidden_states_path"] = str(tmp_path / "two")
    save_recipe(recipe_from_dict(dump), tmp_path / "r.yaml")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    cmd = [*TWO_RANK_COLLECT[:-2], "--master_port", str(port), *TWO_RANK_COLLECT[-2:], str(tmp_path / "r.yaml")]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got, want = HiddenStateStore(tmp_path / "two"), HiddenStateStore(reference)
    assert {name.split("-")[1] for name in got.index["shards"]} == {"r0", "r1"}
    got.check_matches({k: want.index[k] for k in HiddenStateStore.CHECKED})
    for i in range(want.index["num_samples"]):  # other batches and thread counts: float32 rounding apart
        for a, b in zip(got.sample(i)[:2], want.sample(i)[:2]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


def test_the_writer_lands_each_batch_whole_and_names_a_non_finite_sample(tmp_path):
    """Batches land one call late (their host copies run behind the target), shards close at batch boundaries,
    and a NaN state is named by sample before anything of its shard is written."""
    from draftsmith.data.store import ShardWriter

    def batch(ids, width=4, nan=None):
        items = []
        for i in ids:
            aux, last = torch.full((3, 2 * width), float(i)), torch.full((3, width), -float(i))
            if i == nan:
                last[1, 0] = float("nan")
            items.append((i, aux, last, [i] * 3, [1, 1, 0]))
        return items

    writer = ShardWriter(tmp_path / "ok", 0, {"t": 1}, "float32", 100, "a test")  # 159 bytes a sample
    writer.add_batch(batch([0, 1, 2]))
    assert writer.done == {0, 1, 2} and not writer._pending  # queued, not landed
    writer.add_batch(batch([3]))  # lands 0..2 (477 bytes): the shard closes with exactly that batch
    writer.flush()
    shards = [s["samples"] for s in writer.progress["shards"]]
    assert [[i for i, _, _ in s] for s in shards] == [[0, 1, 2], [3]]
    tensors = load_file(str(tmp_path / "ok" / writer.progress["shards"][0]["name"]))
    assert torch.equal(tensors["2.aux"], torch.full((3, 8), 2.0))
    assert torch.equal(tensors["1.last"], torch.full((3, 4), -1.0))
    assert tensors["0.input_ids"].dtype == torch.int32 and tensors["0.loss_mask"].tolist() == [1, 1, 0]

    # with the tokens still to come: shards close at an eighth of max_shard_bytes (125 here) once less than a
    # shard's worth (1,000) is left after a batch, so the final flush writes one batch, not a whole shard
    def shards_of(folder, tokens_after):
        w = ShardWriter(tmp_path / folder, 0, {"t": 1}, "float32", 1000, "a test")  # 159 bytes a sample
        for ids, after in zip([[0, 1, 2], [3, 4], [5, 6], [7, 8, 9]], tokens_after):
            w.add_batch(batch(ids), after)
        w.flush()
        return [[i for i, _, _ in s["samples"]] for s in w.progress["shards"]]

    assert shards_of("tail", [21, 15, 9, 0]) == [[0, 1, 2, 3, 4], [5, 6], [7, 8, 9]]
    assert shards_of("unknown", [None] * 4) == [[0, 1, 2, 3, 4, 5, 6], [7, 8, 9]]

    # progress left by another format's collection (its checksums are not this one's): refused by name, not resumed
    progress = json.loads((tmp_path / "ok" / "progress-r0.json").read_text())
    (tmp_path / "ok" / "progress-r0.json").write_text(json.dumps({**progress, "format": "draftsmith-hidden-states/1"}))
    with pytest.raises(StoreError, match=r"progress-r0.json: a test by another draftsmith version \(format "
                                         r"'draftsmith-hidden-states/1'"):
        ShardWriter(tmp_path / "ok", 0, {"t": 1}, "float32", 100, "a test")

    bad = ShardWriter(tmp_path / "bad", 0, {"t": 1}, "float32", 10_000, "a test")
    bad.add_batch(batch([0, 1], nan=1))
    with pytest.raises(StoreError, match="sample 1 are not finite"):
        bad.flush()
    assert not list((tmp_path / "bad").glob("shard-*"))


def test_a_shard_is_read_back_by_safetensors_with_its_checksum_and_offsets(tmp_path):
    """write_shard writes the safetensors format by hand (no serialised copy): safetensors' reader gets every
    tensor back bit for bit, in each dtype a store holds; the checksum is the file's, taken from memory; each
    offset points at its tensor's bytes; and a failed write leaves nothing."""
    import struct

    from safetensors import safe_open

    from draftsmith.data.store import shard_checksum, shard_layout, write_shard

    g = torch.Generator().manual_seed(0)
    tensors = {
        "0.aux": torch.randn(5, 6, generator=g).to(torch.bfloat16),
        "0.aux_scale": torch.rand(5, 1, generator=g),
        "0.input_ids": torch.arange(5, dtype=torch.int32),
        "0.loss_mask": torch.tensor([0, 1, 1, 0, 1], dtype=torch.int8),
        "1.aux": (torch.randn(3, 6, generator=g) * 100).to(torch.float8_e4m3fn),
        "1.last": torch.randn(2, 3, 4, generator=g).to(torch.float16)[:, 1],  # a view of a bigger tensor
    }
    order, prefix, offsets = shard_layout(tensors)
    path = tmp_path / "shard.safetensors"
    write_shard(tensors, order, prefix, path)
    raw = path.read_bytes()
    for leaf in (7, 64, 1 << 20):  # pieces cut inside a tensor, at tensor ends, and one piece for the whole file
        pieces = b"".join(hashlib.sha256(raw[i:i + leaf]).digest() for i in range(0, len(raw), leaf))
        assert shard_checksum(tensors, order, prefix, leaf) == _checksum_file(path, leaf) \
            == hashlib.sha256(pieces).hexdigest()
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(tensors) and f.metadata() == {"format": "pt"}
        for name, t in tensors.items():
            back = f.get_tensor(name)
            assert back.dtype == t.dtype and back.shape == t.shape
            assert torch.equal(back.view(torch.uint8), t.contiguous().view(torch.uint8)), name
    (header_len,) = struct.unpack("<Q", raw[:8])
    assert (8 + header_len) % 8 == 0 and len(raw) == len(prefix) + sum(t.numel() * t.element_size()
                                                                       for t in tensors.values())
    ids = tensors["0.input_ids"]
    assert raw[offsets["0.input_ids"]:offsets["0.input_ids"] + 20] == ids.numpy().tobytes()
    assert all(offsets[name] % tensors[name].element_size() == 0 for name in tensors)  # every tensor aligned

    broken = dict(tensors, **{"2.aux": "not a tensor"})  # fails mid-write: nothing may be left behind
    with pytest.raises(AttributeError):
        write_shard(broken, [*order, "2.aux"], prefix, tmp_path / "broken.safetensors")
    assert [p.name for p in tmp_path.iterdir()] == ["shard.safetensors"]


def overwrite_tensor_in_place(target, name, scale):
    """Scale one weight tensor of a safetensors target in place: the same names, shapes, dtypes, offsets and file
    size (so the same header), other values. Returns the weight file's name."""
    import struct

    from safetensors import safe_open

    file = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"][name]
    path = target / file
    with safe_open(str(path), framework="pt") as f:
        values = (f.get_tensor(name) * scale).contiguous()
    with path.open("r+b") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        start = json.loads(f.read(header_len))[name]["data_offsets"][0]
        f.seek(8 + header_len + start)
        f.write(values.view(torch.uint8).numpy().tobytes())
    return file


def test_a_target_changed_in_place_refuses_its_store(tmp_path, fixture_target_dir):
    """One tensor of the target overwritten in place (a merged adapter, a fine-tune saved over the original) leaves
    config.json and every safetensors header as they were: the store collected from the old weights is refused,
    naming the store, the target and the weight file."""
    import shutil

    from draftsmith.data.store import target_fingerprint

    target = tmp_path / "target"
    shutil.copytree(fixture_target_dir, target, copy_function=shutil.copyfile)  # writable, unlike the fixture
    target.chmod(0o755)
    recipe = store_recipe(target, tmp_path, tmp_path / "store")
    collect(recipe, log=lambda *a: None)
    before = target_fingerprint(str(target))
    file = overwrite_tensor_in_place(target, "model.layers.4.self_attn.q_proj.weight", 0.5)
    after = target_fingerprint(str(target))
    assert after["weights_header_sha256"] == before["weights_header_sha256"]  # what the store used to compare
    assert after["config_sha256"] == before["config_sha256"]
    with pytest.raises(StoreError, match=rf"store/index.json: the target {target} changed since this store was "
                                         rf"collected \({file} holds other values at the same size\)"):
        train(recipe, log=lambda *a: None)
    with pytest.raises(StoreError, match="changed since this store was collected"):
        collect(recipe, log=lambda *a: None)  # nor does collect call it complete


def test_a_store_without_a_weights_fingerprint_is_refused_with_the_fix(collected, tmp_path):
    """A store written before the index recorded sampled weight bytes cannot show it belongs to the target's
    current weights: refused with one line saying to collect it again, not trusted."""
    recipe, folder = collected
    folder = copy_store(folder, tmp_path)
    index = json.loads((folder / INDEX).read_text())
    del index["weights_sampled"]
    (folder / INDEX).write_text(json.dumps(index))
    dump = recipe.model_dump()
    dump["data"]["hidden_states_path"] = str(folder)
    dump["output_dir"] = str(tmp_path / "run")
    with pytest.raises(StoreError, match=r"copy/index.json: written by an older draftsmith without a fingerprint of "
                                         r"the target's weights.*run draftsmith collect again"):
        train(recipe_from_dict(dump), log=lambda *a: None)


def damage_shard(folder, sample):
    """Flip one byte inside `sample`'s aux tensor; returns the shard's name."""
    index = json.loads((folder / INDEX).read_text())
    name, offset, _ = index["samples"][sample]
    with (folder / name).open("r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 0x01]))
    return name


def recorded_reads(monkeypatch):
    """The store samples read, in order (recorded before the read, so also the one that fails)."""
    reads, real = [], HiddenStateStore.sample

    def sample(self, i):
        reads.append(i)
        return real(self, i)

    monkeypatch.setattr(HiddenStateStore, "sample", sample)
    return reads


def test_a_damaged_shard_stops_training_before_its_first_read(collected, tmp_path, monkeypatch):
    recipe, folder = collected
    folder = copy_store(folder, tmp_path)
    name = damage_shard(folder, sample=len(json.loads((folder / INDEX).read_text())["samples"]) - 1)
    dump = recipe.model_dump()
    dump["data"]["hidden_states_path"] = str(folder)
    dump["output_dir"] = str(tmp_path / "run")
    reads = recorded_reads(monkeypatch)
    with pytest.raises(StoreError, match=f"copy/{name}: fails its checksum"):
        train(recipe_from_dict(dump), log=lambda *a: None)
    assert reads == []  # refused when the store was opened, not when the damaged shard came up
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_verify_store_false_skips_the_check_and_the_read_still_checks(collected, tmp_path, monkeypatch):
    """data.verify_store: false starts training without checksumming the store; a damaged shard is still refused,
    by name, when it is first read."""
    recipe, folder = collected
    folder = copy_store(folder, tmp_path)
    name = damage_shard(folder, sample=0)  # a training sample: every one is read within the run's first epoch
    dump = recipe.model_dump()
    dump["data"].update({"hidden_states_path": str(folder), "verify_store": False})
    dump["output_dir"] = str(tmp_path / "run")
    reads = recorded_reads(monkeypatch)
    with pytest.raises(StoreError, match=f"copy/{name}: fails its checksum"):
        train(recipe_from_dict(dump), log=lambda *a: None)
    assert reads  # training started: the damage was found at a read


def test_verify_checksums_each_shard_once_and_a_shard_changed_since_is_checked_again(collected, tmp_path,
                                                                                   monkeypatch):
    """After `verify` the reads do not checksum a shard again (the store is read from disk once, not twice) unless
    the shard changed since; each of `world` processes checksums only its share."""
    import os

    import draftsmith.data.store as store_mod

    folder = copy_store(collected[1], tmp_path)
    hashed, real = [], store_mod._checksum_file
    monkeypatch.setattr(store_mod, "_checksum_file", lambda path, *a: hashed.append(path.name) or real(path, *a))
    store = HiddenStateStore(folder)
    names = sorted(store.index["shards"])
    store.verify(rank=1, world=2)
    assert hashed == names[1::2]
    hashed.clear()
    store.verify()
    assert sorted(hashed) == names
    hashed.clear()
    for i in range(store.index["num_samples"]):
        store.sample(i)
    assert hashed == []
    store = HiddenStateStore(folder)
    store.verify()
    name = damage_shard(folder, sample=3)  # after verification: a new modification time
    stamp = (folder / name).stat().st_mtime_ns + 1_000_000_000  # set, not left to the clock's resolution
    os.utime(folder / name, ns=(stamp, stamp))
    with pytest.raises(StoreError, match=f"copy/{name}: fails its checksum"):
        store.sample(3)


def test_a_shard_larger_than_the_writeback_chunk_is_written_whole_and_handed_to_the_disk_as_it_goes(tmp_path,
                                                                                                     monkeypatch):
    """write_shard asks the kernel to write each WRITEBACK_CHUNK out as soon as it is copied (posix_fadvise): the
    advised ranges follow one another from byte 0, and the file is the same bytes as without the advice."""
    import os

    from draftsmith.data import store

    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise on this platform: write_shard writes as before")
    g = torch.Generator().manual_seed(1)
    tensors = {"0.aux": torch.randn(300, 50, generator=g).to(torch.bfloat16),
               "0.input_ids": torch.arange(300, dtype=torch.int32)}
    order, prefix, _ = store.shard_layout(tensors)
    size = len(prefix) + 300 * 50 * 2 + 300 * 4
    advised = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, how: (advised.append((off, n, how)),
                                                                      real(fd, off, n, how)))
    monkeypatch.setattr(store, "WRITEBACK_CHUNK", 4096)
    store.write_shard(tensors, order, prefix, tmp_path / "chunked.safetensors")
    assert len(advised) >= size // 4096 - 1 and advised[0][0] == 0
    assert all(a[0] + a[1] == b[0] for a, b in zip(advised, advised[1:]))  # contiguous, in order
    assert all(n >= 4096 and how == os.POSIX_FADV_DONTNEED for _, n, how in advised)
    asked = len(advised)
    monkeypatch.setattr(store, "WRITEBACK_CHUNK", None)
    store.write_shard(tensors, order, prefix, tmp_path / "plain.safetensors")
    assert len(advised) == asked  # None: no advice, the page cache as before
    monkeypatch.setattr(store, "WRITEBACK_CHUNK", 4096)
    monkeypatch.setenv("DRAFTSMITH_SHARD_WRITEBACK", "0")
    store.write_shard(tensors, order, prefix, tmp_path / "switched_off.safetensors")
    assert len(advised) == asked  # the environment's switch turns it off too
    chunked = (tmp_path / "chunked.safetensors").read_bytes()
    assert len(chunked) == size and chunked == (tmp_path / "plain.safetensors").read_bytes()


def test_a_full_disk_during_collect_is_one_line(collected, tmp_path, capsys, monkeypatch):
    """Issue 47 item 12: a full disk was a traceback in collect. One line naming the file, exit 2; the shards
    written before it stay on record, so a rerun resumes."""
    import errno

    from draftsmith.data import store as store_mod

    recipe, _ = collected
    dump = recipe.model_dump()
    dump["data"]["hidden_states_path"] = str(tmp_path / "full")
    save_recipe(recipe_from_dict(dump), tmp_path / "recipe.yaml")
    real, calls = store_mod.write_shard, []

    def fills_up(tensors, order, prefix, path):
        calls.append(path)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(tensors, order, prefix, path)

    monkeypatch.setattr(store_mod, "write_shard", fills_up)
    code = cli_main(["collect", str(tmp_path / "recipe.yaml")])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("draftsmith collect: error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert f"{calls[1]}: disk full (no space left on device): free space and rerun" in errors[0]
