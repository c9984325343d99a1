"""`draftsmith push DIR --repo-id ORG/NAME [--private] [--revision R] [--dry-run]`: publish an export folder.

The folder is checked against its format's contract again (it may have been edited since the export), its model
card is re-rendered so the serve commands name the Hub repo instead of the local folder, and everything goes up
in one commit (`HfApi.create_commit`, the call `upload_folder` makes, given the files one by one so that the
re-rendered card is uploaded without rewriting the folder). The token comes from `HF_TOKEN` or the login cache
(`huggingface_hub.get_token`) and is never printed; `--dry-run` lists what would be uploaded and touches no network.
Only the regular files inside the folder go up: a symbolic link is refused, never followed.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.models import registry
from draftsmith.models.checkpoint import (
    CONFIG_FILE,
    CheckpointError,
    CheckpointImportError,
    human_size,
    load_folder_tensors,
    read_json,
)
from draftsmith.models.model_card import replace_serving_section
from draftsmith.models.spec import resolve

CARD_FILE = "README.md"
# A model repo id as the Hub accepts it. huggingface_hub's validate_repo_id (utils/_validators.py, which mirrors the
# Hub's own rules in moon-landing's Names.ts) allows: each of NAMESPACE and NAME 1 to 96 characters of
# [A-Za-z0-9_.-], neither starting nor ending with '-' or '.', no '--' or '..', not ending in '.git'. It also takes a
# bare NAME (the caller's own namespace); push names the ORG explicitly, so the card's serve commands are right.
REPO_NAME_MAX = 96
_REPO_PART = re.compile(r"[A-Za-z0-9_.-]+")


class PushError(ValueError):
    """A push refused before any upload: bad folder, bad repo id, failed contract check, no token."""


@dataclass
class PushPlan:
    """What one `push` uploads: (path in repo, local file or the bytes that replace it, size) per file."""

    folder: Path
    repo_id: str
    format: str | None
    files: list[tuple[str, Path | bytes, int]]
    commit_message: str
    warnings: list[str] = field(default_factory=list)


def _served_target(config: dict[str, Any]) -> str:
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    return verifier.get("name_or_path") or (config.get("draftsmith") or {}).get("target") or ""


# ---- planning (no network) ---------------------------------------------------------------------------------
def _repo_id_problem(repo_id: str) -> str | None:
    """Why the Hub would refuse `repo_id` (the rules above), or None."""
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts):
        return "expected ORG/NAME"
    for part in parts:
        if not _REPO_PART.fullmatch(part):
            return f"{part!r} may hold only letters, digits, '-', '_' and '.'"
        if len(part) > REPO_NAME_MAX:
            return f"{part[:12]!r}... is {len(part)} characters; the Hub allows at most {REPO_NAME_MAX}"
        if part[0] in "-." or part[-1] in "-.":
            return f"{part!r} may not start or end with '-' or '.'"
    if "--" in repo_id or ".." in repo_id:
        return "'--' and '..' are not allowed"
    if repo_id.endswith(".git"):
        return "may not end in '.git'"
    return None


def check_repo_id(repo_id: str) -> None:
    """Refuse, before any file is read, a repo id the Hub would refuse only once the upload starts."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    problem = _repo_id_problem(repo_id or "")
    if problem is None:
        try:
            validate_repo_id(repo_id)  # whatever rule a newer huggingface_hub adds
        except HFValidationError as e:
            problem = str(e)
    if problem is not None:
        raise PushError(f"--repo-id {repo_id!r}: {problem}")


def _uploadable(folder: Path) -> list[Path]:
    """Regular files under `folder`, minus hidden ones (the export marker among them) and leftovers of interrupted
    atomic writes. A symbolic link, to a file or a folder, inside or outside, is refused rather than followed: it
    could name any file on this machine (a token, a key), and what the Hub gets must be what the folder holds."""
    files, pending = [], [folder]
    while pending:
        for path in sorted(pending.pop().iterdir()):
            if path.name.startswith(".") or ".tmp-" in path.name or ".old-" in path.name:
                continue  # never uploaded, so never looked into
            if path.is_symlink():
                shown = path.relative_to(folder).as_posix()
                raise PushError(f"{folder}: {shown if shown.isprintable() else repr(shown)} is a symbolic link; "
                                "push uploads only the regular files inside the folder: replace it with a copy of "
                                "what it points to, or remove it")
            if path.is_dir():
                pending.append(path)
            elif path.is_file():
                files.append(path)
    return sorted(files)


def plan_push(folder: str | Path, repo_id: str) -> PushPlan:
    """Check the folder and build the exact upload; raises PushError with the reason."""
    folder = Path(folder)
    check_repo_id(repo_id)
    if not folder.is_dir():
        raise PushError(f"{folder}: no such folder; push the --out folder of `draftsmith export`")
    if not (folder / CONFIG_FILE).is_file():
        subs = sorted(p.name for p in folder.iterdir() if (p / CONFIG_FILE).is_file())
        hint = f"; it holds the exports {', '.join(str(folder / s) for s in subs)}: push one of them" if subs else ""
        raise PushError(f"{folder}: no {CONFIG_FILE}, not an export folder{hint}")
    uploadable = _uploadable(folder)  # refuses links before any file is read (config.json itself may be one)
    try:
        config = read_json(folder / CONFIG_FILE)
    except CheckpointError as e:
        raise PushError(str(e)) from None
    if not isinstance(config, dict):
        raise PushError(f"{folder / CONFIG_FILE}: expected a JSON object")
    if "method" in config and "architectures" not in config:
        raise PushError(f"{folder}: a draftsmith training checkpoint, which no engine loads; export it first "
                        f"(draftsmith export {folder} --format FORMAT --out DIR)")

    warnings: list[str] = []
    found = registry.detect_layout(config)
    fmt = found[1] if found is not None and found[1].check is not None else None
    files: list[tuple[str, Path | bytes, int]] = [
        (p.relative_to(folder).as_posix(), p, p.stat().st_size) for p in uploadable
    ]
    if fmt is not None:
        try:
            tensors = load_folder_tensors(folder)
        except CheckpointImportError as e:
            raise PushError(str(e)) from None
        problems, more = resolve(fmt.check)(config, tensors)
        if problems:
            raise PushError(f"{folder}: refusing to push, the {fmt.layout} contract fails: " + "; ".join(problems))
        warnings += more
        card_path = folder / CARD_FILE
        if card_path.is_file():
            card = replace_serving_section(card_path.read_text(encoding="utf-8"),
                                           resolve(fmt.serve_commands)(config, repo_id))
            if card is None:
                warnings.append(f"{CARD_FILE} has no Serving section; uploaded unchanged")
            else:
                data = card.encode("utf-8")
                files = [(name, data, len(data)) if name == CARD_FILE else (name, src, size)
                         for name, src, size in files]
        else:
            warnings.append(f"no {CARD_FILE} model card in {folder}; the Hub page will be empty")
        target = _served_target(config)
        if target and (Path(target).is_absolute() or target.startswith(".")):
            warnings.append(f"the target is the local path {target!r}; whoever serves {repo_id} needs it at the same "
                            "path (export from a checkpoint whose model.target is a Hub id to avoid this)")
    else:
        warnings.append(f"{folder / CONFIG_FILE}: format not recognised; uploaded as is, without a contract check, "
                        "and the model card's serve commands still name the local folder")
    if not files:
        raise PushError(f"{folder}: nothing to upload")
    what = fmt.layout if fmt is not None else "drafter"
    return PushPlan(folder=folder, repo_id=repo_id, format=what if fmt is not None else None, files=files,
                    warnings=warnings,
                    commit_message=f"Upload {what} export with draftsmith push")


# ---- upload ------------------------------------------------------------------------------------------------
def find_token() -> str | None:
    """`HF_TOKEN` or the token `hf auth login` saved; never printed."""
    from huggingface_hub import get_token

    return get_token()


def push(plan: PushPlan, *, private: bool = False, revision: str | None = None, token: str | None = None) -> str:
    """Create the repo if needed (and the branch, for a revision) and upload `plan.files` in one commit; returns
    the commit URL. Errors are re-raised as PushError with the token scrubbed from the message."""
    from huggingface_hub import CommitOperationAdd, HfApi

    token = token or find_token()
    if not token:
        raise PushError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (write access to "
                        f"{plan.repo_id.split('/')[0]} is needed)")
    api = HfApi(token=token)
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=src if isinstance(src, bytes) else str(src))
                  for name, src, _ in plan.files]
    try:
        api.create_repo(plan.repo_id, repo_type="model", private=private, exist_ok=True)
        if revision and revision != "main":
            api.create_branch(plan.repo_id, branch=revision, repo_type="model", exist_ok=True)
        info = api.create_commit(plan.repo_id, operations, commit_message=plan.commit_message, repo_type="model",
                                 revision=revision)
    except Exception as e:  # HTTP, auth, network: one line, never the token
        message = " ".join(str(e).split()) or type(e).__name__
        raise PushError(f"upload to {plan.repo_id} failed: {message.replace(token, '***')}") from None
    return str(getattr(info, "commit_url", info))


def add_push_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", type=Path, help="an export folder (the --out of `draftsmith export`)")
    p.add_argument("--repo-id", required=True, help="ORG/NAME of the model repo (created if missing)")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--revision", default=None, help="branch to commit to (created if missing; default main)")
    p.add_argument("--dry-run", action="store_true", help="list the files that would be uploaded; no network")


def run_push(args: argparse.Namespace) -> int:
    try:
        plan = plan_push(args.folder, args.repo_id)
    except PushError as e:
        print(f"draftsmith push: error: {e}", file=sys.stderr)
        return 2
    for warning in plan.warnings:
        print(f"draftsmith push: warning: {warning}", file=sys.stderr)
    where = f"{plan.repo_id}@{args.revision or 'main'}"
    total = sum(size for _, _, size in plan.files)
    print(f"{'would upload' if args.dry_run else 'uploading'} {len(plan.files)} files ({human_size(total)}) to "
          f"{where}{' (private)' if args.private else ''}, commit message {plan.commit_message!r}:")
    for name, src, size in plan.files:
        note = "  (model card re-rendered for the repo)" if isinstance(src, bytes) else ""
        print(f"  {name:<28} {human_size(size):>10}{note}")
    if args.dry_run:
        print(f"dry run: nothing uploaded; Hugging Face token {'found' if find_token() else 'NOT found'}")
        return 0
    try:
        url = push(plan, private=args.private, revision=args.revision)
    except PushError as e:
        print(f"draftsmith push: error: {e}", file=sys.stderr)
        return 2
    print(f"pushed: {url}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="draftsmith push", description=__doc__.splitlines()[0])
    add_push_args(parser)
    return run_push(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
