"""Issue 47, items 1 and 6: `push` publishes only the regular files inside the export folder (a symlink is refused
in one line before any request), and `export --overwrite` replaces only a folder that holds a draftsmith export
(its marker file), never a folder of someone else's files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from test_export import make_checkpoint, tiny_eagle3_config  # shared helpers, same folder
from test_push import REPO, TOKEN, export_dir, hub  # noqa: F401  (fixtures: a tiny export and the fake Hub)

from draftsmith.cli import main as cli_main
from draftsmith.models.checkpoint import EXPORT_MARKER, ExportError
from draftsmith.models.eagle3.export import export_native_eagle3

SECRET = "hf_the_secret_that_must_stay_home"


def _copy(export: Path, dest: Path) -> Path:
    shutil.copytree(export, dest)
    return dest


def _refused(capsys, *names: str) -> str:
    """The one error line of a refused push, checked to name every one of `names` and to leak nothing."""
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("draftsmith push: error: "), err
    assert all(name in err for name in names), err
    assert SECRET not in out + err and TOKEN not in out + err
    return err


# ---- item 1: push and symlinks -------------------------------------------------------------------------------
@pytest.fixture
def outside(tmp_path) -> Path:
    """A folder outside the export, standing for a home directory: a token file and a dot folder."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / "token").write_text(SECRET)
    (home / ".ssh" / "id_ed25519").write_text(SECRET)
    return home


@pytest.mark.parametrize("dry_run", [False, True])
def test_push_refuses_a_link_to_a_file_outside_the_folder(hub, export_dir, tmp_path, outside, capsys, dry_run):
    folder = _copy(export_dir, tmp_path / "export")
    (folder / "notes.txt").symlink_to(outside / "token")
    assert cli_main(["push", str(folder), "--repo-id", REPO, *(["--dry-run"] if dry_run else [])]) == 2
    err = _refused(capsys, "notes.txt")
    assert "symbolic link" in err
    assert hub.requests == []


def test_push_refuses_a_link_to_a_folder_and_lists_nothing_behind_it(hub, export_dir, tmp_path, outside, capsys):
    folder = _copy(export_dir, tmp_path / "export")
    (folder / "extras").mkdir()
    (folder / "extras" / "home").symlink_to(outside, target_is_directory=True)
    assert cli_main(["push", str(folder), "--repo-id", REPO, "--dry-run"]) == 2
    _refused(capsys, "extras/home")
    assert hub.requests == []


def test_push_refuses_a_link_that_stays_inside_the_folder(hub, export_dir, tmp_path, capsys):
    """A link inside is refused too: what the Hub gets must be what the folder holds, with no second look."""
    folder = _copy(export_dir, tmp_path / "export")
    (folder / "copy.safetensors").symlink_to("model.safetensors")
    assert cli_main(["push", str(folder), "--repo-id", REPO]) == 2
    _refused(capsys, "copy.safetensors")
    assert hub.requests == []


def test_push_refuses_a_linked_config_before_reading_it(hub, export_dir, tmp_path, outside, capsys):
    """config.json is read (and quoted in errors) before the upload is planned: a link there is refused first."""
    folder = _copy(export_dir, tmp_path / "export")
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(outside / "token")
    assert cli_main(["push", str(folder), "--repo-id", REPO]) == 2
    _refused(capsys, "config.json", "symbolic link")
    assert hub.requests == []


def test_push_still_uploads_a_plain_folder_with_subfolders(hub, export_dir, tmp_path, capsys):
    folder = _copy(export_dir, tmp_path / "export")
    (folder / "docs").mkdir()
    (folder / "docs" / "notes.txt").write_text("how this drafter was trained")
    assert cli_main(["push", str(folder), "--repo-id", REPO]) == 0
    assert TOKEN not in "".join(capsys.readouterr())
    _, files = hub.commit()
    assert sorted(files) == ["README.md", "config.json", "docs/notes.txt", "model.safetensors"]
    assert EXPORT_MARKER not in files  # draftsmith's own bookkeeping stays local


# ---- item 6: export --overwrite ------------------------------------------------------------------------------
def _checkpoint(tmp_path: Path) -> Path:
    """A tiny EAGLE-3 checkpoint whose target is a local folder, so that every format (`--format all`) exports."""
    target = tmp_path / "target"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=128,
                                 max_position_embeddings=512)).save_pretrained(target)
    cfg = tiny_eagle3_config()
    cfg.target_name_or_path, cfg.target_architectures = str(target), ["LlamaForCausalLM"]
    return make_checkpoint(tmp_path / "run", cfg)


def _unrelated(folder: Path) -> dict[str, str]:
    """Someone's files, in the folder an export is pointed at."""
    files = {"a.txt": "thesis draft", "b/notes.md": "do not lose", "config.json": "{}"}
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return files


def _intact(folder: Path, files: dict[str, str]) -> None:
    assert {name: (folder / name).read_text() for name in files} == files
    assert not (folder / EXPORT_MARKER).exists()


def test_overwrite_refuses_a_folder_of_unrelated_files(tmp_path):
    ckpt = make_checkpoint(tmp_path / "run", tiny_eagle3_config())
    out = tmp_path / "out"
    files = _unrelated(out)
    with pytest.raises(ExportError) as info:
        export_native_eagle3(ckpt, out, overwrite=True)
    message = str(info.value)
    assert message == (f"refusing to overwrite {out}: it holds files that are not a draftsmith export (a.txt, b/, "
                       "config.json); remove them or choose another --out")
    _intact(out, files)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]  # no temporary left beside it


@pytest.mark.parametrize("fmt", ["sglang", "all"])
def test_cli_overwrite_refuses_unrelated_files_in_one_line(tmp_path, capsys, fmt):
    _checkpoint(tmp_path)
    out = tmp_path / "out"
    files = _unrelated(out)
    capsys.readouterr()  # the target's save_pretrained progress bars
    assert cli_main(["export", str(tmp_path / "run"), "--format", fmt, "--out", str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a draftsmith export (a.txt, b/, config.json)" in err
    _intact(out, files)


def test_without_overwrite_the_refusal_does_not_suggest_it(tmp_path, capsys):
    """Naming --overwrite as the fix for a folder it would refuse sends the user in a circle."""
    make_checkpoint(tmp_path / "run", tiny_eagle3_config())
    out = tmp_path / "out"
    files = _unrelated(out)
    assert cli_main(["export", str(tmp_path / "run"), "--format", "sglang", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refusing to write into" in err and "--overwrite" not in err
    _intact(out, files)


def test_the_listing_is_short_and_one_line_whatever_the_names(tmp_path):
    ckpt = make_checkpoint(tmp_path / "run", tiny_eagle3_config())
    out = tmp_path / "out"
    out.mkdir()
    for i in range(9):
        (out / f"f{i}.bin").write_bytes(b"x")
    (out / "evil\nname").write_text("x")
    with pytest.raises(ExportError) as info:
        export_native_eagle3(ckpt, out, overwrite=True)
    message = str(info.value)
    assert "\n" not in message and "'evil\\nname'" in message and "f0.bin" in message and "..." in message
    assert "f8.bin" not in message and len(message) < 300
    assert len(list(out.iterdir())) == 10


def test_every_export_carries_the_marker_and_is_overwritten_in_place(tmp_path):
    ckpt = make_checkpoint(tmp_path / "run", tiny_eagle3_config())
    out = tmp_path / "out"
    export_native_eagle3(ckpt, out)
    marker = json.loads((out / EXPORT_MARKER).read_text())
    assert marker["written_by"] == "draftsmith export"
    (out / "README.md").write_text("edited by hand")
    export_native_eagle3(ckpt, out, overwrite=True)  # ours: replaced whole
    assert (out / "README.md").read_text() != "edited by hand" and (out / EXPORT_MARKER).is_file()


def test_an_empty_folder_is_written_into(tmp_path):
    ckpt = make_checkpoint(tmp_path / "run", tiny_eagle3_config())
    for overwrite in (False, True):
        out = tmp_path / f"empty-{overwrite}"
        out.mkdir()
        export_native_eagle3(ckpt, out, overwrite=overwrite)
        assert (out / "config.json").is_file() and (out / EXPORT_MARKER).is_file()


def test_format_all_marks_the_set_and_its_formats(tmp_path, capsys):
    _checkpoint(tmp_path)
    out = tmp_path / "all"
    argv = ["export", str(tmp_path / "run"), "--format", "all", "--out", str(out)]
    assert cli_main(argv) == 0
    for folder in (out, out / "sglang", out / "speculators"):
        assert (folder / EXPORT_MARKER).is_file(), folder
    assert cli_main([*argv, "--overwrite"]) == 0  # a set replaces a set
    single = tmp_path / "single"
    assert cli_main(["export", str(tmp_path / "run"), "--format", "sglang", "--out", str(single)]) == 0
    assert cli_main([*argv[:-1], str(single), "--overwrite"]) == 0  # and a single export, both ours
    assert sorted(p.name for p in single.iterdir() if p.name != EXPORT_MARKER) == ["sglang", "speculators"]
    capsys.readouterr()


def test_a_linked_marker_does_not_vouch_for_a_folder(tmp_path):
    """Only a regular marker file vouches for a folder: a link named like it could point anywhere."""
    ckpt = make_checkpoint(tmp_path / "run", tiny_eagle3_config())
    out = tmp_path / "out"
    files = _unrelated(out)
    (tmp_path / "elsewhere.json").write_text("{}")
    os.symlink(tmp_path / "elsewhere.json", out / EXPORT_MARKER)
    with pytest.raises(ExportError, match="not a draftsmith export"):
        export_native_eagle3(ckpt, out, overwrite=True)
    assert {name: (out / name).read_text() for name in files} == files


def test_quickstart_refuses_an_unrelated_export_folder_before_training(tmp_path, monkeypatch):
    """The quickstart exports with overwrite into `--out/eagle3-sglang`: a folder there that is not an export is
    refused before minutes of training, not after them."""
    import argparse

    import draftsmith.train
    from draftsmith import quickstart

    def no_training(*args, **kwargs):
        raise AssertionError("trained before refusing the export folder")

    monkeypatch.setattr(draftsmith.train, "train", no_training)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the demo's one thread, not the suite's
    files = _unrelated(tmp_path / "run" / "eagle3-sglang")
    parser = argparse.ArgumentParser()
    quickstart.add_quickstart_args(parser)
    with pytest.raises(ExportError, match="refusing to overwrite .*eagle3-sglang: it holds files that are not"):
        quickstart.run_quickstart(parser.parse_args(["--out", str(tmp_path / "run"), "--device", "cpu"]))
    _intact(tmp_path / "run" / "eagle3-sglang", files)
