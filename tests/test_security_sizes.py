"""Hostile sizes (issue 47, items 4 and 5): a drafter config whose sizes its weights do not have, and a recipe whose
YAML aliases expand a kilobyte into gigabytes, are each refused in one short line before anything is built.

Nothing here allocates what the hostile input asks for: every drafter class fails the test when it is built outside
the meta device (`no_real_build`), which is where today's code built them before checking anything, and the YAML
bomb is a small one (9**6 leaves, a few MB printed) that today's code prints whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_dflash import make_checkpoint as dflash_checkpoint  # shared helpers, same folder
from test_dflash import tiny_config as dflash_config
from test_dflash import tiny_drafter as dflash_drafter
from test_dspark import checkpoint as dspark_checkpoint
from test_eagle import checkpoint as eagle_checkpoint
from test_eagle import tiny_drafter as eagle_drafter
from test_eagle import tiny_target as eagle_target
from test_export import make_checkpoint as eagle3_checkpoint
from test_gemma4_mtp import published as gemma4_published
from transformers import LlamaConfig

from draftsmith.config import RecipeError, load_recipe, recipe_from_dict
from draftsmith.models.checkpoint import CheckpointImportError
from draftsmith.models.dflash.export import export_dflash
from draftsmith.models.dflash.io import load_drafter as load_dflash
from draftsmith.models.dflash.model import DflashDrafter
from draftsmith.models.drafter_config import DrafterLoadError
from draftsmith.models.dspark.export import export_dspark
from draftsmith.models.dspark.io import load_drafter as load_dspark
from draftsmith.models.dspark.model import DsparkDrafter
from draftsmith.models.eagle.export import export_native_eagle
from draftsmith.models.eagle.io import load_drafter as load_eagle
from draftsmith.models.eagle.model import EagleDrafter
from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.eagle3.io import load_drafter as load_eagle3
from draftsmith.models.eagle3.model import Eagle3Drafter
from draftsmith.models.gemma4_mtp.io import Gemma4MtpLoadError
from draftsmith.models.gemma4_mtp.io import load_drafter as load_gemma4
from draftsmith.models.gemma4_mtp.model import Gemma4MtpDrafter
from draftsmith.models.importer import import_checkpoint

HIDDEN, INTERMEDIATE = 65536, 1 << 20  # the sizes: 33 to 275 GB once built


# ---- item 4: a config of absurd sizes -------------------------------------------------------------------------------
@pytest.fixture
def no_real_build(monkeypatch):
    """`arm()`: from then on, fail the test the moment a drafter is built with real memory (with the sizes below
    that would take tens to hundreds of GB); a build on the meta device (shapes only) is allowed."""

    def arm():
        for cls in (DflashDrafter, DsparkDrafter, EagleDrafter, Eagle3Drafter, Gemma4MtpDrafter):
            original = cls.__init__

            def guarded(self, *args, _original=original, **kwargs):
                if torch.empty(0).device.type != "meta":
                    raise AssertionError(f"{type(self).__name__} built with real memory before its config's sizes "
                                         "were checked against the weights")
                _original(self, *args, **kwargs)

            monkeypatch.setattr(cls, "__init__", guarded)

    return arm


def absurd(config: dict, *path: str) -> dict:
    """`config` with hidden_size and intermediate_size (at `path`, nested keys) set to the issue's sizes."""
    node = config
    for key in path:
        node = node[key]
    node["hidden_size"], node["intermediate_size"] = HIDDEN, INTERMEDIATE
    return config


def edit_config(folder: Path, *path: str) -> Path:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(absurd(config, *path)))
    return folder


def assert_one_line(message: str, key: str = "hidden_size") -> None:
    """One short line naming the config file, the weights file, the config key and a size the config asks for."""
    assert "\n" not in message and len(message) < 600, message
    assert "config.json" in message and ".safetensors" in message, message
    assert key in message and str(HIDDEN) in message, message
    assert "(" in message and ")" in message  # both shapes, as tuples


def dflash_export(tmp_path: Path) -> Path:
    cfg = dflash_config(learned_mask=False)
    dflash_checkpoint(tmp_path / "run", dflash_drafter(cfg))
    return export_dflash(tmp_path / "run", tmp_path / "public", dtype=None).out_dir


def dspark_export(tmp_path: Path) -> Path:
    ckpt, _ = dspark_checkpoint(tmp_path / "ckpt")
    return export_dspark(ckpt, tmp_path / "public", dtype=None).out_dir


IMPORTS = {  # a published folder of each method whose import built the drafter before checking its sizes
    "dflash": (dflash_export, ()),
    "dspark": (dspark_export, ()),
    "gemma4_mtp": (lambda tmp_path: gemma4_published(tmp_path / "public"), ("text_config",)),
}


@pytest.mark.parametrize("method", sorted(IMPORTS))
def test_import_checks_the_configs_sizes_against_the_weights_before_building(tmp_path, method, no_real_build):
    make, path = IMPORTS[method]
    folder = edit_config(make(tmp_path), *path)
    no_real_build()
    with pytest.raises(CheckpointImportError) as info:
        import_checkpoint(folder, tmp_path / "imported")
    assert_one_line(str(info.value))
    assert not (tmp_path / "imported").exists()


def eagle3_ckpt(tmp_path: Path) -> Path:
    cfg = Eagle3Config.from_target(LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=8,
                                               num_attention_heads=4, num_key_value_heads=2, intermediate_size=128),
                                   32, target_name_or_path="org/target")
    return eagle3_checkpoint(tmp_path / "run", cfg)


LOADS = {  # the runtime's loader (`draftsmith generate`) of each method, on a folder whose config was edited
    "dflash": (lambda tmp_path: dflash_checkpoint(tmp_path / "run", dflash_drafter(dflash_config())), load_dflash,
               DrafterLoadError),
    "dflash-public": (dflash_export, load_dflash, DrafterLoadError),
    "dspark": (lambda tmp_path: dspark_checkpoint(tmp_path / "ckpt")[0], load_dspark, DrafterLoadError),
    "eagle": (lambda tmp_path: eagle_checkpoint(tmp_path / "ckpt", eagle_drafter(eagle_target())), load_eagle,
              DrafterLoadError),
    "eagle-public": (lambda tmp_path: export_native_eagle(
        eagle_checkpoint(tmp_path / "ckpt", eagle_drafter(eagle_target())), tmp_path / "public", dtype=None).out_dir,
        load_eagle, DrafterLoadError),
    "eagle3": (eagle3_ckpt, load_eagle3, DrafterLoadError),
    "gemma4_mtp": (lambda tmp_path: gemma4_published(tmp_path / "public"), load_gemma4, Gemma4MtpLoadError),
}


@pytest.mark.parametrize("case", sorted(LOADS))
def test_the_runtime_checks_the_configs_sizes_against_the_weights_before_building(tmp_path, case, no_real_build):
    make, load, error = LOADS[case]
    folder = edit_config(make(tmp_path), *(("text_config",) if case == "gemma4_mtp" else ()))
    no_real_build()
    with pytest.raises(error) as info:
        load(folder)
    assert_one_line(str(info.value))


def test_only_intermediate_size_wrong_is_named_as_such(tmp_path, no_real_build):
    folder = dflash_export(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": INTERMEDIATE}))
    no_real_build()
    with pytest.raises(DrafterLoadError) as info:
        load_dflash(folder)
    message = str(info.value)
    assert "intermediate_size" in message and str(INTERMEDIATE) in message and "\n" not in message, message
    assert "mlp" in message and "128)" in message, message  # the tensor, as the weights hold it


def test_sound_folders_still_load(tmp_path):
    """The check costs a meta-device build: a folder whose config fits its weights loads as before."""
    assert load_dflash(dflash_export(tmp_path / "a")).config.hidden_size == 64
    assert load_eagle3(eagle3_ckpt(tmp_path / "b")).config.hidden_size == 64
    assert isinstance(load_gemma4(gemma4_published(tmp_path / "c")), Gemma4MtpDrafter)


# ---- item 5: YAML aliases and long values in recipe errors ---------------------------------------------------------
def alias_bomb(levels: int) -> str:
    """A recipe whose model.target is the classic "billion laughs": each level lists the one before nine times."""
    lines = ["# draftsmith train bomb.yaml", "model:", "  target:", "    - &l0 [" + ", ".join(["lol"] * 9) + "]"]
    for level in range(1, levels + 1):
        lines.append(f"    - &l{level} [" + ", ".join([f"*l{level - 1}"] * 9) + "]")
    return "\n".join(lines + ["data:", "  path: sharegpt", "output_dir: out", ""])


@pytest.mark.parametrize("text", [
    alias_bomb(5),  # 9**6 leaves, 4 MB printed today; the 1.2 KB one printed 140 MB
    "model:\n  target: &a [*a]\ndata: {path: sharegpt}\noutput_dir: out\n",  # an alias inside what it names
], ids=["bomb", "endless"])
def test_a_yaml_alias_bomb_is_refused_in_one_line_naming_the_file(tmp_path, text):
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    assert len(path.read_text()) < 1000
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    message = str(info.value)
    assert "\n" not in message and len(message) < 600, message[:600]
    assert message.startswith(f"{path}: ") and "alias" in message.replace(str(path), ""), message


def test_a_few_aliases_still_work(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("model:\n  target: &t org/target\n  method: eagle3\ndata:\n  path: sharegpt\n"
                    "output_dir: *t\n")
    assert load_recipe(path).output_dir == "org/target"


MINIMAL = {"model": {"target": "t"}, "data": {"path": "sharegpt"}, "output_dir": "out"}
LONG = "x" * 100_000


@pytest.mark.parametrize("recipe, overrides", [
    ({**MINIMAL, "model": {"target": list(range(5000))}}, []),  # a value quoted back: 24 KB of repr
    (MINIMAL, [f"training.lr={LONG}"]),  # the value and the override quoted
    (MINIMAL, [f"training.lrr={LONG}"]),  # an unknown key: the override quoted
    (MINIMAL, [f"training{LONG}"]),  # not key=value: the override quoted
    ({**MINIMAL, "model": {"target": "t", "aux_layer_ids": [str(i) + "x" for i in range(5000)]}}, []),  # 5000 errors
    ({**MINIMAL, "model": {"target": "t", "aux_layer_ids": [1] * 5000}}, []),  # a validator's sentence quotes them
], ids=["value", "override-value", "override-key", "override-form", "many-errors", "validator"])
def test_an_error_quotes_at_most_a_few_hundred_characters_of_a_value(recipe, overrides):
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(recipe, "r.yaml", overrides)
    message = str(info.value)
    assert "\n" not in message and len(message) < 1200, (len(message), message[:300])
    assert message.startswith("r.yaml: ")
