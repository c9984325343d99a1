"""`draftsmith import-data`: a peer's hidden-state dataset in speculators' offline layout (written here as its writer
writes it) becomes the store `draftsmith collect` writes for the same recipe, trains to the same losses, is never
unpickled, and bad peer data is refused in one line before anything is written."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from draftsmith.cli import main as cli_main
from draftsmith.config import recipe_from_dict, save_recipe
from draftsmith.data import prepare_dataset
from draftsmith.data.peer_store import import_data
from draftsmith.data.store import INDEX, HiddenStateStore
from draftsmith.data.vllm_capture import VllmLayers
from draftsmith.models.target import TargetModel, load_target_tokenizer
from draftsmith.train import train
from draftsmith.train.collect import collect
from draftsmith.train.setup import method_class
from test_store import store_recipe
from test_train import losses

# The peer's states and collect's come from the same float32 forward of the same weights; they differ only in how
# the samples were batched (collect pads several samples into one forward, the peer ran each alone) and in where the
# final norm runs (here on the file's pre-norm state, there inside the model), which may sum floats in another order
# on other hardware or thread counts. Measured here: bitwise equal. The bound is test_store.py's store-against-capture
# one (states of magnitude up to about 20).
RTOL, ATOL = 1e-4, 1e-5
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
NOT_DATA = [1, 2, 3, 4, 5]  # a conversation the recipe's data does not hold: speculators' folder can hold more


def quantize_tensor_to_fp8(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hs-connectors' FP8 writer (fp8_utils.quantize_tensor_to_fp8): one float32 scale per token, amax / 448 over
    its (n_ids, H); its own function where the package is installed, the same steps written from its source if not."""
    try:
        from hs_connectors.fp8_utils import quantize_tensor_to_fp8 as theirs
    except ImportError:
        x = states.float()
        scale = (x.abs().amax(dim=(1, 2), keepdim=True) / FP8_MAX).clamp(min=1e-12)  # (S, 1, 1)
        return (x / scale).to(torch.float8_e4m3fn), scale
    return theirs(states)


def write_peer(folder, rows, fp8=False):
    """What `speculators generate-offline-data` leaves: hs_{i}.safetensors per request, as vLLM's
    ExampleHiddenStatesConnector (or hs-connectors' FP8 one) saved it, numbered in the peer's own order (here the
    reverse of draftsmith's), and the pickled token frequencies speculators trains its vocabulary from."""
    folder.mkdir(parents=True)
    for i, (tokens, states) in enumerate(reversed(rows)):
        tensors = {"hidden_states": states, "token_ids": torch.tensor(tokens, dtype=torch.int64)}
        if fp8:
            tensors["hidden_states"], tensors["hidden_states_scales"] = quantize_tensor_to_fp8(states)
        save_file(tensors, folder / f"hs_{i}.safetensors")
    torch.save({7: 3, 9: 1}, folder / "token_freq.pt")  # speculators' format: a pickle, never to be loaded here
    return folder


def recipe_layers(recipe) -> VllmLayers:
    """The ids draftsmith collect asks vLLM for: the recipe's method's aux ids and N."""
    target = TargetModel.head_and_embeddings(recipe.model.target, dtype=recipe.model.dtype)
    return VllmLayers(tuple(method_class(recipe.model.method)(recipe, target).aux_layer_ids), target.num_layers)


def capture_rows(recipe, layer_ids):
    """(input ids, hidden_states (S, n_ids, H)) per prepared sample: draftsmith's own capture at vLLM's ids (id N is
    the last layer's output before the final norm, as vLLM's file holds it), each sample alone as vLLM runs it."""
    tokenizer = load_target_tokenizer(recipe.model.target, "model.target", ValueError)
    data = prepare_dataset(recipe.data, tokenizer, log=lambda *a: None)
    target = TargetModel.from_pretrained(recipe.model.target, dtype=recipe.model.dtype)
    rows = [(s.input_ids, target.capture(torch.tensor([s.input_ids]), None, layer_ids).aux_hidden[0].view(
        len(s.input_ids), len(layer_ids), target.hidden_size)) for s in [*data.train, *data.eval]]
    stray = target.capture(torch.tensor([NOT_DATA]), None, layer_ids).aux_hidden[0]
    return rows + [(NOT_DATA, stray.view(len(NOT_DATA), len(layer_ids), target.hidden_size))]


def with_store(recipe, folder, **collect_keys):
    dump = recipe.model_dump()
    dump["data"]["hidden_states_path"] = str(folder)
    dump["collect"].update(collect_keys)
    return recipe_from_dict(dump)


def refuse_pickles(monkeypatch):
    """torch.load and pickle fail the test: the peer's token_freq.pt (or any pickle) must never be read."""
    def refuse(*args, **kwargs):
        raise AssertionError("a pickle was loaded")

    for module, name in ((torch, "load"), (pickle, "load"), (pickle, "loads"), (pickle, "Unpickler")):
        monkeypatch.setattr(module, name, refuse)


@pytest.fixture
def never_unpickled(monkeypatch):
    refuse_pickles(monkeypatch)


@pytest.fixture(scope="module")
def peer(tmp_path_factory, fixture_target_dir):
    """The recipe (its store: data.hidden_states_path), the layer ids, the states per sample (and one more, of a
    conversation not in the data) and the peer folder holding them."""
    tmp = tmp_path_factory.mktemp("peer")
    recipe = store_recipe(fixture_target_dir, tmp, tmp / "collected")
    layers = recipe_layers(recipe)
    rows = capture_rows(recipe, layers.requested)
    return recipe, layers, rows, write_peer(tmp / "hidden_states", rows)


@pytest.fixture(scope="module")
def collected(peer):
    """The store `draftsmith collect` (engine hf) writes for the same recipe."""
    recipe = peer[0]
    collect(recipe, log=lambda *a: None)
    return Path(recipe.data.hidden_states_path)


@pytest.fixture(scope="module")
def imported(peer, tmp_path_factory):
    """The store `draftsmith import-data PEER RECIPE` writes, through the command line, nothing unpickled."""
    recipe, _, _, folder = peer
    tmp = tmp_path_factory.mktemp("imported")
    save_recipe(recipe, tmp / "recipe.yaml")
    with pytest.MonkeyPatch.context() as mp:
        refuse_pickles(mp)
        assert cli_main(["import-data", str(folder), str(tmp / "recipe.yaml"),
                         f"data.hidden_states_path={tmp / 'store'}"]) == 0
    return tmp / "store"


def speculators_offline():
    """speculators 0.9.0's own offline-data helpers (speculators/data_generation/offline.py), from the --no-deps
    install test_speculators.py uses; its package __init__ reaches speculators.train.data, which needs openai and
    hs_connectors for a type alias only: a stub holds the alias, as test_speculators.py does."""
    import types
    from typing import Any

    from test_speculators import SPECULATORS_DIR

    if not (SPECULATORS_DIR / "speculators").is_dir():
        pytest.skip(f"speculators not installed at {SPECULATORS_DIR} (make test installs it there, --no-deps)")
    if str(SPECULATORS_DIR) not in sys.path:
        sys.path.append(str(SPECULATORS_DIR))
    if "speculators.train.data" not in sys.modules:
        stub = types.ModuleType("speculators.train.data")
        stub.BatchType = dict[str, Any]
        sys.modules["speculators.train.data"] = stub
    from speculators.data_generation import offline

    return offline


def test_the_peer_folder_is_what_speculators_writes_and_checks(peer):
    """The files pass speculators' own checks of a generate-offline-data folder: each index is found, none is
    unreadable, and each file holds its sample's tokens with finite states (what `--validate-outputs` runs)."""
    from safetensors.torch import load_file

    offline = speculators_offline()
    _, layers, rows, folder = peer
    assert offline.get_existing_hidden_state_indices(folder) == list(range(len(rows)))
    assert offline.find_corrupt_hidden_state_indices(folder, list(range(len(rows)))) == {}
    for i, (tokens, _) in enumerate(reversed(rows)):
        loaded = load_file(folder / f"hs_{i}.safetensors")
        offline.check_hidden_states(loaded, tokens)
        assert tuple(loaded["hidden_states"].shape) == (len(tokens), len(layers.requested), 384)  # 384: the fixture's H


def assert_same_samples(got: HiddenStateStore, want: HiddenStateStore, **tolerance):
    assert got.index["num_samples"] == want.index["num_samples"] == 24
    for i in range(want.index["num_samples"]):
        (a, h, ids), (a0, h0, ids0) = got.sample(i), want.sample(i)
        assert ids == ids0, i
        torch.testing.assert_close(a, a0, **tolerance, msg=lambda m: f"sample {i} aux: {m}")
        torch.testing.assert_close(h, h0, **tolerance, msg=lambda m: f"sample {i} last: {m}")


def test_the_imported_store_is_the_collected_one(collected, imported):
    got, want = HiddenStateStore(imported), HiddenStateStore(collected)
    shard_only = {"shards", "bytes"}  # the shards' checksums and sizes: values equal within RTOL, not bit for bit
    assert {k: v for k, v in got.index.items() if k not in shard_only} == \
        {k: v for k, v in want.index.items() if k not in shard_only}  # header, samples, where each lies
    assert got.index["bytes"] == want.index["bytes"] and sorted(got.index["shards"]) == sorted(want.index["shards"])
    got.verify()
    assert_same_samples(got, want, rtol=RTOL, atol=ATOL)
    assert not list(imported.glob("progress-*"))


def test_training_from_the_imported_store_gives_the_collected_stores_losses(peer, collected, imported, tmp_path):
    """tiny_recipe's six steps (two evals) from each store: the same losses, step by step."""
    recipe = peer[0]
    runs = {}
    for name, store in (("collected", collected), ("imported", imported)):
        dump = with_store(recipe, store).model_dump()
        dump["output_dir"] = str(tmp_path / name)
        train(recipe_from_dict(dump), log=lambda *a: None)
        runs[name] = losses(tmp_path / name)
    assert sorted(runs["imported"]) == sorted(runs["collected"]) == [1, 2, 3, 4, 5, 6]
    for step, loss in runs["collected"].items():
        assert runs["imported"][step] == pytest.approx(loss, rel=1e-4), step


def test_an_fp8_peer_is_dequantized_with_its_per_token_scales(peer, tmp_path, never_unpickled):
    """hs-connectors' FP8 files: the store holds exactly fp8 * scale (the recipe's slots, id N final-normed), which
    is the peer's full-precision states within FP8 rounding."""
    recipe, layers, rows, _ = peer
    folder = write_peer(tmp_path / "fp8", rows, fp8=True)
    import_data(with_store(recipe, tmp_path / "store"), folder, log=lambda *a: None)
    got = HiddenStateStore(tmp_path / "store")
    norm = TargetModel.head_and_embeddings(recipe.model.target, dtype=recipe.model.dtype).final_norm
    for i in range(24):
        tokens, states = rows[i]
        fp8, scale = quantize_tensor_to_fp8(states)
        aux, pre_norm = layers.split(fp8.float() * scale)  # what the file holds, by hand
        a, h, ids = got.sample(i)
        assert ids == tokens
        torch.testing.assert_close(a, aux, rtol=0, atol=0)
        torch.testing.assert_close(h, norm(pre_norm), rtol=1e-6, atol=1e-6)
        exact = layers.split(states)[0]
        assert ((a - exact).abs() <= scale.view(-1, 1) * FP8_MAX / 16).all()  # 3 mantissa bits: 2^-4 of amax at most
        assert not torch.equal(a, exact)


def test_the_store_dtype_is_the_recipes_fp8_too(peer, imported, tmp_path, never_unpickled):
    recipe, _, _, folder = peer
    import_data(with_store(recipe, tmp_path / "store", dtype="float8_e4m3fn"), folder, log=lambda *a: None)
    got, want = HiddenStateStore(tmp_path / "store"), HiddenStateStore(imported)
    assert got.index["dtype"] == "float8_e4m3fn" and got.index["bytes"] < 0.3 * want.index["bytes"]
    for i in (0, 11, 23):
        for a, b in zip(got.sample(i)[:2], want.sample(i)[:2]):
            assert ((a - b).abs() <= b.abs().amax(-1, keepdim=True) / 16 + 1e-5).all()  # as test_store.py's FP8


def test_layer_ids_the_peer_declares_are_mapped_to_the_recipes(peer, tmp_path, never_unpickled):
    """A peer that captured more ids than the method reads, given unsorted: the recipe's (here the embeddings, a
    middle layer and N itself as an aux id) are picked out of vLLM's sorted slots."""
    dump = with_store(peer[0], tmp_path / "store").model_dump()
    dump["model"]["aux_layer_ids"] = [0, 3, 8]
    dump["data"]["max_samples"] = 8  # 4 to train, 4 held out: enough to map, a third of the captures
    mine = recipe_from_dict(dump)
    folder = write_peer(tmp_path / "wide", capture_rows(mine, [0, 1, 3, 6, 8]))
    save_recipe(mine, tmp_path / "recipe.yaml")
    assert cli_main(["import-data", str(folder), str(tmp_path / "recipe.yaml"), "--layer-ids", "8,0,3,1,6"]) == 0
    store = HiddenStateStore(tmp_path / "store")
    assert store.index["aux_layer_ids"] == [0, 3, 8]
    target = TargetModel.from_pretrained(mine.model.target, dtype=mine.model.dtype)
    for i in range(8):
        aux, last, ids = store.sample(i)
        alone = target.capture(torch.tensor([ids]), None, [0, 3, 8])
        torch.testing.assert_close(aux, alone.aux_hidden[0], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(last, alone.last_hidden[0], rtol=RTOL, atol=ATOL)


KILLER = textwrap.dedent("""
    import os, signal, sys
    import torch
    torch.set_num_threads(int(sys.argv[3]))  # the test's own, as test_store.py's kill does
    import draftsmith.data.store as store
    real, calls = store.write_shard, []
    def save_then_die(*args, **kwargs):
        real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 3:  # the third shard is on disk, its progress record is not
            os.kill(os.getpid(), signal.SIGKILL)
    store.write_shard = save_then_die
    from draftsmith.cli import main
    sys.exit(main(["import-data", sys.argv[1], sys.argv[2]]))
""")


def test_a_killed_import_resumes_to_the_same_store(peer, imported, tmp_path, never_unpickled):
    """SIGKILLed with a shard on disk but not on record (test_store.py's kill): the rerun keeps the shards on record,
    redoes the rest, and gives the uninterrupted import's store byte for byte; a third run has nothing to do."""
    recipe, _, _, folder = peer
    again = with_store(recipe, tmp_path / "store")
    save_recipe(again, tmp_path / "recipe.yaml")
    run = subprocess.run([sys.executable, "-c", KILLER, str(folder), str(tmp_path / "recipe.yaml"),
                          str(torch.get_num_threads())], capture_output=True, text=True)
    assert run.returncode == -9, run.stderr[-2000:]
    progress = json.loads((tmp_path / "store" / "progress-r0.json").read_text())
    assert progress["shards"] and not (tmp_path / "store" / INDEX).exists()
    lines = []
    import_data(again, folder, log=lines.append)
    assert any("resuming rank 0" in line for line in lines)
    assert json.loads((tmp_path / "store" / INDEX).read_text()) == json.loads((imported / INDEX).read_text())
    lines.clear()
    import_data(again, folder, log=lines.append)
    assert any("nothing to do" in line for line in lines)


# --------------------------------------------------------------------------- bad peer data: one line, nothing written


def linked_peer(source, folder):
    """A copy of the peer folder made of links to its files, to break one of them."""
    folder.mkdir()
    for path in source.iterdir():
        (folder / path.name).symlink_to(path)
    return folder


def refused(tmp_path, capsys, recipe, folder, *extra):
    save_recipe(with_store(recipe, tmp_path / "store"), tmp_path / "recipe.yaml")
    assert cli_main(["import-data", str(folder), str(tmp_path / "recipe.yaml"), *extra]) == 2
    err = capsys.readouterr().err  # progress bars (\r-separated), then the error
    last = err.rstrip("\n").split("\n")[-1]
    assert last.startswith("draftsmith import-data: error: ") and "Traceback" not in err, err
    assert not (tmp_path / "store").exists()  # refused before anything was written
    return last


def test_a_file_with_other_layer_slots_is_named(peer, tmp_path, capsys, never_unpickled):
    recipe, _, rows, source = peer
    folder = linked_peer(source, tmp_path / "peer")
    tokens, states = rows[0]
    name = f"hs_{len(rows) - 1}.safetensors"  # sample 0's file (write_peer numbers them in reverse)
    (folder / name).unlink()
    save_file({"hidden_states": states[:, 1:].contiguous(), "token_ids": torch.tensor(tokens)}, folder / name)
    err = refused(tmp_path, capsys, recipe, folder)
    assert f"{folder / name}: holds 3 layer slots" in err and "--layer-ids" in err


def test_a_sample_without_a_peer_file_is_counted_and_named(peer, tmp_path, capsys, never_unpickled):
    recipe, _, rows, source = peer
    folder = linked_peer(source, tmp_path / "peer")
    (folder / f"hs_{len(rows) - 1 - 5}.safetensors").unlink()  # sample 5's file
    err = refused(tmp_path, capsys, recipe, folder)
    assert "1 of 24 samples have no file" in err and "(first: sample 5," in err
    assert "draftsmith collect" in err and "data." in err


@pytest.mark.parametrize(("ids", "lacking"), [("2,5,8", "[4]"), ("2,4,5", "[8]")], ids=["aux", "last"])
def test_layer_ids_without_the_methods_are_refused(peer, tmp_path, capsys, ids, lacking, never_unpickled):
    recipe, layers, _, folder = peer
    assert layers.requested == [2, 4, 5, 8]  # eagle3's default on the 8-layer fixture
    err = refused(tmp_path, capsys, recipe, folder, "--layer-ids", ids)
    assert f"lack {lacking}" in err and "aux layer ids [2, 4, 5] and N=8" in err
