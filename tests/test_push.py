"""`draftsmith push`, tested at the network boundary: huggingface_hub runs for real and its HTTP requests are
answered by a fake Hub installed with `huggingface_hub.set_client_factory` (public since huggingface_hub 1.0;
the client is httpx's or httpx2's, whichever this huggingface_hub uses), so the exact files, commit message and
headers that would reach huggingface.co are asserted, and the token is checked to never reach stdout/stderr.
"""

from __future__ import annotations

import base64
import gzip
import importlib
import json
from pathlib import Path

import huggingface_hub
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from test_export import make_checkpoint  # shared helpers, same folder

from draftsmith.cli import main as cli_main
from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.export import exporter

TOKEN = "hf_FAKEtokenThatMustNeverBePrinted42"
REPO = "draftsmith-test/tiny-eagle3"


class FakeHub:
    """Answers the Hub API calls an upload makes and records every request (method, path, headers, body)."""

    def __init__(self, fail_commit_with: tuple[int, dict] | None = None):
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        self.fail_commit_with = fail_commit_with

    def handle(self, request):
        body = request.read()
        if request.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        path = request.url.path
        self.requests.append((request.method, path, dict(request.headers), body))
        http = importlib.import_module(type(request).__module__.split(".")[0])  # httpx or httpx2
        if path == "/api/repos/create":
            return http.Response(200, json={"url": f"https://huggingface.co/{REPO}", "name": REPO})
        if path == "/api/validate-yaml":
            return http.Response(200, json={"errors": [], "warnings": []})
        if "/preupload/" in path:  # everything inline ("regular"), so the commit body carries the bytes
            files = json.loads(body)["files"]
            return http.Response(200, json={"files": [{"path": f["path"], "uploadMode": "regular",
                                                       "shouldIgnore": False} for f in files]})
        if "/branch/" in path:
            return http.Response(200, json={})
        if "/commit/" in path:
            if self.fail_commit_with:
                status, payload = self.fail_commit_with
                return http.Response(status, json=payload)
            return http.Response(200, json={"commitUrl": f"https://huggingface.co/{REPO}/commit/{'a' * 40}",
                                            "commitOid": "a" * 40, "pullRequestUrl": None})
        return http.Response(404, json={"error": f"fake hub: no route for {request.method} {path}"})

    def posts(self) -> list[tuple[str, dict[str, str], bytes]]:
        return [(path, headers, body) for method, path, headers, body in self.requests if method == "POST"]

    def commit(self) -> tuple[dict, dict[str, bytes]]:
        """(header value, {path in repo: bytes}) of the one commit request."""
        bodies = [body for path, _, body in self.posts() if "/commit/" in path]
        assert len(bodies) == 1, "expected exactly one commit"
        lines = [json.loads(line) for line in bodies[0].decode().splitlines() if line.strip()]
        header = next(line["value"] for line in lines if line["key"] == "header")
        files = {line["value"]["path"]: base64.b64decode(line["value"]["content"])
                 for line in lines if line["key"] == "file"}
        assert not [line for line in lines if line["key"] not in ("header", "file")]  # no LFS pointers, no deletes
        return header, files


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A fake Hub behind huggingface_hub's own HTTP client; HF_TOKEN set, no login cache or offline mode."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-login-cache"))
    fake = FakeHub()
    client_cls = type(huggingface_hub.get_session())
    http = importlib.import_module(client_cls.__module__.split(".")[0])
    huggingface_hub.set_client_factory(lambda: client_cls(transport=http.MockTransport(fake.handle)))
    yield fake
    default = importlib.import_module("huggingface_hub.utils._http").default_client_factory
    huggingface_hub.set_client_factory(default)


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    """A speculators export (and a native one next to it) of a tiny drafter for a local tiny target."""
    root = tmp_path_factory.mktemp("push")
    target = LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512)
    torch.manual_seed(0)
    LlamaForCausalLM(target).save_pretrained(root / "target")
    cfg = Eagle3Config.from_target(target, 32, target_name_or_path=str(root / "target"))
    cfg.target_architectures = ["LlamaForCausalLM"]
    ckpt = make_checkpoint(root / "run", cfg)
    out = exporter("speculators")(ckpt, root / "export").out_dir
    native = exporter("sglang")(ckpt, root / "export-sglang").out_dir
    assert native.is_dir()
    return out


def _push(*argv: str) -> int:
    return cli_main(["push", *argv])


def test_dry_run_lists_files_and_sends_nothing(hub, export_dir, capsys):
    assert _push(str(export_dir), "--repo-id", REPO, "--dry-run") == 0
    out, err = capsys.readouterr()
    assert hub.requests == []
    for name in ("config.json", "model.safetensors", "README.md"):
        assert name in out
    size = (export_dir / "model.safetensors").stat().st_size / 1024
    assert f"{size:.1f} KiB" in out
    assert "model card re-rendered for the repo" in out and "token found" in out
    assert TOKEN not in out + err


def test_push_uploads_the_folder_in_one_commit(hub, export_dir, capsys):
    assert _push(str(export_dir), "--repo-id", REPO, "--private") == 0
    out, err = capsys.readouterr()
    assert TOKEN not in out + err
    assert f"https://huggingface.co/{REPO}/commit/" in out

    paths = [path for path, _, _ in hub.posts()]
    assert paths[0] == "/api/repos/create" and paths[-1] == f"/api/models/{REPO}/commit/main"
    create = json.loads(hub.posts()[0][2])
    assert (create["organization"], create["name"]) == tuple(REPO.split("/"))
    assert create.get("private") is True or create.get("visibility") == "private"
    for _, headers, _ in hub.posts():
        assert headers["authorization"] == f"Bearer {TOKEN}"

    header, files = hub.commit()
    assert header["summary"] == "Upload speculators-eagle3 export with draftsmith push"
    assert sorted(files) == ["README.md", "config.json", "model.safetensors"]
    assert files["config.json"] == (export_dir / "config.json").read_bytes()
    assert files["model.safetensors"] == (export_dir / "model.safetensors").read_bytes()
    card = files["README.md"].decode()
    assert f"vllm serve {REPO}\n" in card and f"vllm serve {export_dir}" not in card
    assert f'"model":"{REPO}"' in card  # the explicit form names the repo too
    assert card.split("## Serving")[0] == (export_dir / "README.md").read_text().split("## Serving")[0]
    assert f"vllm serve {export_dir}" in (export_dir / "README.md").read_text()  # the local folder is untouched


def test_push_to_a_revision_creates_the_branch(hub, export_dir):
    assert _push(str(export_dir), "--repo-id", REPO, "--revision", "v1") == 0
    paths = [path for path, _, _ in hub.posts()]
    assert f"/api/models/{REPO}/branch/v1" in paths and paths[-1] == f"/api/models/{REPO}/commit/v1"


def test_native_export_card_names_the_repo_for_both_engines(hub, export_dir):
    assert _push(str(export_dir.parent / "export-sglang"), "--repo-id", REPO) == 0
    card = hub.commit()[1]["README.md"].decode()
    assert f"--speculative-draft-model-path {REPO} " in card and f'"model":"{REPO}"' in card


def test_no_token_is_refused_before_any_request(hub, export_dir, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN")
    assert _push(str(export_dir), "--repo-id", REPO) == 2
    assert "no Hugging Face token: set HF_TOKEN or run `hf auth login`" in capsys.readouterr().err
    assert hub.posts() == []


def test_server_errors_are_one_line_without_the_token(hub, export_dir, capsys):
    hub.fail_commit_with = (403, {"error": f"token {TOKEN} cannot write to {REPO}"})
    assert _push(str(export_dir), "--repo-id", REPO) == 2
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("draftsmith push: error:")]
    assert TOKEN not in out + err and len(errors) == 1 and "***" in errors[0] and "403" in errors[0]


def test_bad_folders_and_ids_are_refused_without_network(hub, export_dir, tmp_path, capsys):
    assert _push(str(export_dir), "--repo-id", "no-slash") == 2
    assert "expected ORG/NAME" in capsys.readouterr().err
    assert _push(str(export_dir.parent), "--repo-id", REPO) == 2  # holds exports, is not one
    assert "push one of them" in capsys.readouterr().err
    assert _push(str(export_dir.parent / "run" / "checkpoint-100"), "--repo-id", REPO) == 2
    assert "export it first" in capsys.readouterr().err

    tampered = tmp_path / "tampered"
    tampered.mkdir()
    for f in export_dir.iterdir():
        (tampered / f.name).write_bytes(f.read_bytes())
    config = json.loads((tampered / "config.json").read_text())
    del config["norm_before_residual"]
    (tampered / "config.json").write_text(json.dumps(config))
    assert _push(str(tampered), "--repo-id", REPO) == 2
    err = capsys.readouterr().err
    assert "refusing to push" in err and "norm_before_residual" in err
    assert hub.requests == []


@pytest.mark.parametrize(("repo_id", "reason"), [
    ("org/na--me..git", "'--' and '..' are not allowed"),
    ("org/name.git", "may not end in '.git'"),
    ("org/" + "n" * 97, "is 97 characters; the Hub allows at most 96"),
    ("o" * 97 + "/name", "is 97 characters; the Hub allows at most 96"),
    ("org/-name", "may not start or end with '-' or '.'"),
    ("org/name.", "may not start or end with '-' or '.'"),
    ("org/caf\u00e9", "may hold only letters, digits"),
    ("org/a/b", "expected ORG/NAME"),
    ("org/", "expected ORG/NAME"),
])
def test_dry_run_refuses_repo_ids_the_hub_refuses(hub, export_dir, capsys, repo_id, reason):
    """huggingface_hub's validate_repo_id rules (the Hub's own): checked before a dry run says all is well."""
    assert _push(str(export_dir), "--repo-id", repo_id, "--dry-run") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--repo-id {repo_id!r}: " in err and reason in err
    assert hub.requests == []


def test_the_longest_name_the_hub_takes_is_accepted(hub, export_dir, capsys):
    repo_id = "org-1/" + "n" * 95 + "2"
    assert _push(str(export_dir), "--repo-id", repo_id, "--dry-run") == 0
    assert f"to {repo_id}@main" in capsys.readouterr().out
