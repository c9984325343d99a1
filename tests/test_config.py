"""Recipe schema: every shipped recipe validates; bad input gives one line naming file and key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from draftsmith.config import (
    Recipe,
    RecipeError,
    apply_overrides,
    load_recipe,
    recipe_from_dict,
    recipe_to_dict,
    save_recipe,
)

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
MINIMAL = {"model": {"target": "t"}, "data": {"path": "sharegpt"}, "output_dir": "out"}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "x.yaml"
    path.write_text(text)
    return path


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(RecipeError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_validates(path):
    assert path.read_text().startswith("#"), "a recipe opens with the command that runs it"
    recipe = load_recipe(path)
    assert recipe.output_dir


def test_shipped_recipes_are_found():
    names = {p.name for p in RECIPES.glob("*.yaml")}
    assert {"eagle3_sharegpt.yaml", "eagle3_math.yaml"} <= names


def test_sharegpt_recipe_values():
    r = load_recipe(RECIPES / "eagle3_sharegpt.yaml")
    assert r.model.target == "meta-llama/Llama-3.1-8B-Instruct"
    assert (r.data.path, r.data.max_length, r.model.draft_vocab_size) == ("sharegpt", 2048, None)  # follows the target
    assert r.training.lr == 1e-4 and isinstance(r.training.lr, float)
    assert (r.model.dtype, r.training.mixed_precision) == ("auto", "auto")  # bf16 on a GPU, float32 on a CPU


@pytest.mark.parametrize("path", sorted((RECIPES / "accelerate").glob("*.yaml")), ids=lambda p: p.name)
def test_accelerate_configs_parse(path):
    data = yaml.safe_load(path.read_text())
    assert data["distributed_type"] in {"MULTI_GPU", "FSDP", "DEEPSPEED"}
    assert data["mixed_precision"] == "bf16"
    from accelerate.commands.config.config_args import load_config_from_file

    load_config_from_file(str(path))  # accelerate's own loader rejects unknown keys


def test_accelerate_configs_present():
    names = {p.stem for p in (RECIPES / "accelerate").glob("*.yaml")}
    assert names >= {"ddp", "fsdp", "deepspeed_zero2", "deepspeed_zero3"}
    for stage in (2, 3):
        config = yaml.safe_load((RECIPES / "accelerate" / f"deepspeed_zero{stage}.yaml").read_text())
        assert config["deepspeed_config"]["zero_stage"] == stage


def test_defaults_fill_in():
    r = recipe_from_dict(MINIMAL)
    assert r.model.method == "eagle3" and r.training.ttt_steps == 7 and r.training.adam_betas == (0.9, 0.95)
    assert r.data.cache_path() == Path("~/.cache/draftsmith").expanduser()


def test_misspelled_key_names_key_file_and_suggestion(tmp_path):
    path = write(tmp_path, "model: {target: t}\ndata: {path: sharegpt}\noutput_dir: o\ntraining:\n  lrr: 1.0e-4\n")
    assert error_of(load_recipe, path) == f"{path}: unknown key 'training.lrr' (did you mean 'training.lr'?)"


def test_key_in_wrong_section_points_to_right_one():
    msg = error_of(recipe_from_dict, {**MINIMAL, "lr": 0.1}, source="r.yaml")
    assert msg == "r.yaml: unknown key 'lr' (did you mean 'training.lr'?)"


def test_type_error_is_one_line(tmp_path):
    path = write(tmp_path, "model: {target: t}\ndata: {path: sharegpt}\noutput_dir: o\ntraining: {lr: fast}\n")
    assert error_of(load_recipe, path) == f"{path}: training.lr: expected a number, got 'fast'"


@pytest.mark.parametrize(
    "patch, expected",
    [
        ({"model": {"target": "t", "method": "medusa"}},
         "model.method: expected 'eagle3', 'eagle', 'mtp', 'gemma4_mtp', 'dflash' or 'dspark', got 'medusa'"),
        ({"training": {"epochs": 2.5}}, "training.epochs: expected an integer, got 2.5"),
        ({"training": {"batch_size": 0}}, "training.batch_size: must be >= 1, got 0"),
        ({"training": {"ttt_decay": 1.5}}, "training.ttt_decay: must be <= 1.0, got 1.5"),
        ({"training": {"adam_betas": [0.9]}}, "training.adam_betas: too few items, got [0.9]"),
        ({"data": {"path": "x", "eval_samples": -1}}, "data.eval_samples: must be >= 0, got -1"),
        ({"data": {"path": "x", "max_length": 8}}, "data.max_length: must be >= 16, got 8"),
        ({"model": {"target": "t", "aux_layer_ids": [1, "a"]}}, "model.aux_layer_ids[1]: expected an integer, got 'a'"),
        ({"model": "llama"}, "model: expected a mapping, got 'llama'"),
    ],
)
def test_bad_values(patch, expected):
    assert error_of(recipe_from_dict, {**MINIMAL, **patch}, source="r.yaml") == f"r.yaml: {expected}"


@pytest.mark.parametrize(
    "patch, fix",
    [
        ({"data": {"path": "x", "max_samples": 10, "eval_samples": 64}},
         "lower data.eval_samples or raise data.max_samples"),
        ({"data": {"path": "sharegpt", "format": "hf"}}, "set data.format to auto or sharegpt"),
        ({"model": {"target": "t", "aux_layer_ids": [2, 2]}}, "list each layer once"),
        # the example: it trained, then failed at export; now every method refuses it when the recipe is read
        *[(patch, "must be strictly increasing (engines concatenate the features in layer order): list the layers "
                  "in increasing order, [1, 4, 6]")
          for patch in ({"model": {"target": "t", "method": "eagle3", "aux_layer_ids": [6, 1, 4]}},
                        {"model": {"target": "t", "method": "dflash"}, "dflash": {"target_layer_ids": [6, 1, 4]}},
                        {"model": {"target": "t", "method": "dspark"}, "dspark": {"target_layer_ids": [6, 1, 4]}})],
        ({"model": {"target": "t", "method": "dflash"}, "training": {"train_draft_head": False}},
         "training.train_draft_head=false is implemented for eagle3; model.method dflash reads out as it always does"),
        ({"model": {"target": "t", "method": "mtp", "aux_layer_ids": [1, 2]}},
         "MTP always reads the target's final-normed last hidden state, no aux layer; set model.aux_layer_ids to null"),
        ({"training": {"adam_betas": [0.9, 1.0]}}, "each beta must be in [0, 1)"),
    ],
)
def test_cross_field_checks_say_the_fix(patch, fix):
    assert fix in error_of(recipe_from_dict, {**MINIMAL, **patch})


def test_missing_required_key():
    d = {**MINIMAL, "model": {"method": "mtp"}}
    assert error_of(recipe_from_dict, d, source="r.yaml") == "r.yaml: missing required key 'model.target'"
    assert error_of(recipe_from_dict, {"model": {"target": "t"}, "data": {"path": "x"}}) == (
        "<dict>: missing required key 'output_dir'"
    )


def test_missing_file_and_empty_file(tmp_path):
    assert error_of(load_recipe, tmp_path / "nope.yaml") == f"recipe file not found: {tmp_path / 'nope.yaml'}"
    assert error_of(load_recipe, write(tmp_path, "# only a comment\n")).endswith("recipe is empty")


def test_invalid_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path, "model:\n  target: t\ndata: [unclosed\noutput_dir: o\n")
    msg = error_of(load_recipe, path)
    assert msg.startswith(f"{path}:4: invalid YAML")


def test_duplicate_key_is_an_error(tmp_path):
    path = write(tmp_path, "model: {target: t}\ndata: {path: x}\noutput_dir: a\noutput_dir: b\n")
    assert error_of(load_recipe, path) == f"{path}:4: invalid YAML: duplicate key 'output_dir'"


def test_yaml_12_scalars_in_files(tmp_path):
    """PyYAML's YAML 1.1 would read 1e-4 as a string, `no` as False and a date-like name as a date."""
    path = write(
        tmp_path,
        "model: {target: t}\ndata: {path: x}\noutput_dir: o\n"
        "training: {lr: 3e-4, mixed_precision: no, run_name: 2024-05-01, max_steps: 1_000}\n",
    )
    t = load_recipe(path).training
    assert t.lr == pytest.approx(3e-4) and isinstance(t.lr, float)
    assert t.mixed_precision == "no"
    assert t.run_name == "2024-05-01"
    assert t.max_steps == 1000


def test_overrides_parse_values():
    d = apply_overrides(
        MINIMAL,
        [
            "training.lr=1e-4",
            "model.aux_layer_ids=[1,4,6]",
            "training.max_minutes=null",
            "data.on_malformed=skip",
            "training.epochs=3",
            "training.run_name=1e3",
        ],
    )
    assert d["training"]["lr"] == 1e-4 and isinstance(d["training"]["lr"], float)
    assert d["model"]["aux_layer_ids"] == [1, 4, 6]
    assert d["training"]["max_minutes"] is None
    assert d["training"]["epochs"] == 3
    assert d["training"]["run_name"] == "1e3"  # string field keeps the raw text
    assert "training" not in MINIMAL  # input not mutated


def test_override_bool_is_parsed():
    # No bool field in the schema today; parsing is still YAML 1.2 (true/false, not yes/no).
    from draftsmith.config import _parse_override

    assert _parse_override("data.on_long=truncate") == ("data.on_long", "truncate")
    assert apply_overrides({}, ["training.seed=true"])["training"]["seed"] is True
    assert apply_overrides({}, ["training.mixed_precision=no"])["training"]["mixed_precision"] == "no"


def test_overrides_reach_the_recipe(tmp_path):
    path = write(tmp_path, "model: {target: t}\ndata: {path: x, max_samples: 500}\noutput_dir: o\n")
    r = load_recipe(path, ["data.max_samples=null", "model.aux_layer_ids=[1,4,6]", "training.lr=2e-5"])
    assert r.data.max_samples is None and r.model.aux_layer_ids == [1, 4, 6] and r.training.lr == 2e-5


@pytest.mark.parametrize(
    "override, expected",
    [
        ("training.lr", "override 'training.lr' is not of the form dotted.key=value"),
        ("training.lrr=1", "override 'training.lrr=1': unknown key 'training.lrr' (did you mean 'training.lr'?)"),
        ("training.lr=fast", "training.lr: expected a number, got 'fast' (from override 'training.lr=fast')"),
        ("model.aux_layer_ids=[1,", "override 'model.aux_layer_ids=[1,': invalid YAML"),
    ],
)
def test_bad_override_names_the_override(override, expected):
    msg = error_of(recipe_from_dict, MINIMAL, source="r.yaml", overrides=[override])
    assert msg.startswith(f"r.yaml: {expected}")


def test_round_trip_through_save(tmp_path):
    recipe = recipe_from_dict(MINIMAL, overrides=["training.lr=1e-5", "training.run_name=1e3", "model.aux_layer_ids=[2,5]"])
    out = tmp_path / "sub" / "recipe.yaml"
    save_recipe(recipe, out)
    assert load_recipe(out) == recipe
    assert [p.name for p in out.parent.iterdir()] == ["recipe.yaml"]  # no temporary left behind
    d = recipe_to_dict(recipe)
    assert d["training"]["adam_betas"] == [0.9, 0.95]
    assert json.loads(json.dumps(d)) == d
    assert isinstance(Recipe.model_validate(d), Recipe)
