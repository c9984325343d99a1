"""`draftsmith quickstart` and its shipped demo target: the target loads from the package (and a wheel carries it),
the script that built it still builds a loadable target, and the reading guide follows the measured numbers."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from draftsmith.quickstart import DEMO_DRAFT_START, DEMO_TARGET_DIR, reading_guide

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "build_demo_target.py"
DEMO_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "README.md")


def test_shipped_demo_target_loads_in_float32():
    from transformers import AutoTokenizer

    from draftsmith.models.target import TargetModel

    for name in DEMO_FILES:
        assert (DEMO_TARGET_DIR / name).is_file(), name
    assert (DEMO_TARGET_DIR / "model.safetensors").stat().st_size < 8_000_000  # a few MB in the repository
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET_DIR)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "<s><|user|>\nhi<|end|>\n<|assistant|>\n"
    target = TargetModel.from_pretrained(str(DEMO_TARGET_DIR), dtype="float32", device="cpu")
    assert target.dtype == torch.float32
    assert target.vocab_size == len(tokenizer)


def test_a_missing_demo_target_is_one_line_naming_the_fix(tmp_path, monkeypatch):
    import argparse

    from draftsmith import quickstart

    monkeypatch.setattr(quickstart, "DEMO_TARGET_DIR", tmp_path / "demo_target")
    parser = argparse.ArgumentParser()
    quickstart.add_quickstart_args(parser)
    with pytest.raises(quickstart.QuickstartError, match="scripts/build_demo_target.py") as info:
        quickstart.run_quickstart(parser.parse_args(["--out", str(tmp_path / "run"), "--device", "cpu"]))
    assert str(tmp_path / "demo_target") in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "run").exists()


def test_wheel_ships_the_demo_target(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(REPO / "draftsmith", src / "draftsmith", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp_path / "dist"), str(src)], check=True)
    (wheel,) = (tmp_path / "dist").glob("draftsmith-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"draftsmith/demo_target/{name}" for name in DEMO_FILES} <= names


@pytest.fixture(scope="module")
def build_script():
    """scripts/build_demo_target.py as a module (it is not part of the package)."""
    spec = importlib.util.spec_from_file_location("build_demo_target", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_build_script_writes_a_loadable_target(tmp_path, build_script):
    from transformers import AutoTokenizer

    from draftsmith.models.target import TargetModel

    out = tmp_path / "target"
    args = ["--out", str(out), "--records", "40", "--held-out", "5", "--steps", "2", "--vocab-size", "300",
            "--hidden-size", "64", "--layers", "1", "--seq-len", "32", "--batch-size", "2"]
    threads = torch.get_num_threads()
    try:
        assert build_script.main(args) == 0
    finally:
        torch.set_num_threads(threads)  # the script takes one thread
    assert len(AutoTokenizer.from_pretrained(out)) == 300
    target = TargetModel.from_pretrained(str(out), dtype="float32", device="cpu")
    assert target.num_layers == 1
    readme = (out / "README.md").read_text()
    assert " ".join(args) in readme and "2 AdamW steps" in readme
    assert not out.with_name("target.tmp").exists()


def test_build_script_keeps_the_drafters_records_out(tmp_path, build_script, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_script.main(["--out", str(tmp_path / "t"), "--records", str(DEMO_DRAFT_START + 1)])
    assert exit_info.value.code == 2
    assert f"--records {DEMO_DRAFT_START + 1} would reach the quickstart's drafter records" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def _row(method: str, k: int, tau: float, speedup: float) -> dict:
    return {"method": method, "label": method, "num_speculative_tokens": k, "speedup": speedup,
            "metrics": {"mean_acceptance_length": tau}, "lossless_mismatches": 0}


def _result(*rows: dict) -> dict:
    return {"baseline": {"tokens_per_second": 100.0}, "results": list(rows)}


def test_reading_guide_names_the_fastest_as_measured():
    ngram_wins = reading_guide(_result(_row("ngram", 3, 1.8, 1.5), _row("eagle3", 3, 2.4, 1.2)), "cuda")
    assert "Here eagle3 k=3 (2.40 tokens a step at 2.0 plain steps each: 1.20x) accepted the most" in ngram_wins
    assert "but ngram k=3 (1.80 tokens a step at 1.2 plain steps each: 1.50x) was the fastest" in ngram_wins

    eagle_wins = reading_guide(_result(_row("ngram", 3, 1.8, 1.1), _row("eagle3", 3, 2.4, 1.6)), "cuda")
    assert "eagle3 k=3 (2.40 tokens a step at 1.5 plain steps each: 1.60x) accepted the most" in eagle_wins
    assert "it was also the fastest" in eagle_wins and "ngram k=3 (" not in eagle_wins

    none_faster = reading_guide(_result(_row("ngram", 1, 1.3, 0.9), _row("eagle3", 1, 1.5, 0.95)), "cuda")
    assert "no config was faster than plain decoding (the fastest: eagle3 k=1" in none_faster
    assert "every output here equals plain decoding's" in none_faster


def test_reading_guide_prices_cpu_steps_from_the_table_only_on_a_cpu():
    result = _result(_row("ngram", 1, 1.5, 1.25), _row("ngram", 3, 1.8, 1.5), _row("eagle3", 3, 2.4, 0.8))
    cpu = reading_guide(result, "cpu")
    assert ("Why a CPU's speedups are not a GPU's: here a target pass over 4 tokens cost 1.2 plain steps (ngram k=3, "
            "whose drafts are almost free) and the eagle3 k=3 step 3.0, each of its 3 drafter passes 0.60 of a plain "
            "step") in cpu
    assert "on a GPU, decoding a real target is bound by reading its weights" in cpu
    assert "Why a CPU" not in reading_guide(result, "cuda")


@pytest.mark.slow
def test_quickstart_runs_end_to_end_on_the_shipped_target(tmp_path, monkeypatch, capsys):
    import argparse

    from draftsmith.quickstart import EVAL_NAME, add_quickstart_args, run_quickstart

    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the draft vocabulary cache lands there
    parser = argparse.ArgumentParser()
    add_quickstart_args(parser)
    args = parser.parse_args(["--out", str(tmp_path / "run"), "--steps", "12", "--minutes", "1", "--num-prompts",
                              "2", "--max-new-tokens", "8", "--k", "2", "--device", "cpu"])
    assert run_quickstart(args) == 0
    printed = capsys.readouterr().out
    assert "mean acc. len" in printed and "What the numbers mean:" in printed and "Why a CPU" in printed
    for name in ("eval.json", "eval.txt", f"eval_{EVAL_NAME}.png"):
        assert (tmp_path / "run" / name).is_file(), name
    assert (tmp_path / "run" / "eagle3-sglang" / "config.json").is_file()
