"""draftsmith checkpoint folders on disk: finding and reading ours, writing any folder atomically.

A checkpoint folder, as the trainer writes it:

    <output_dir>/checkpoint-<step>/
        config.json          the drafter config (`to_dict()`, with "method")
        model.safetensors    draft weights in draftsmith's names, metadata {"format": "pt"}
        recipe.yaml          the recipe it was trained with (optional)
        trainer_state.json   {"step": int, ...} (optional)
        eval.json            latest `draftsmith eval` result for this drafter (optional)
    <output_dir>/latest      text file naming the newest checkpoint folder

Every write goes to a temporary name in the destination's directory and is moved into place with `os.replace`,
so a crash or a full disk leaves the old file (or nothing), never half a file that a later run would trust. A
temporary folder's name carries the writer's pid (`<out>.tmp-<pid>-<hex>`), so the next write to the same place
can tell a stale one (its writer is gone) from one being written right now, and remove it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path, PureWindowsPath
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
RECIPE_FILE = "recipe.yaml"
TRAINER_STATE_FILE = "trainer_state.json"
EVAL_FILE = "eval.json"
LATEST_FILE = "latest"
IMPORT_FILE = "import.json"  # what `draftsmith import` records next to an imported checkpoint
INDEX_FILE = "model.safetensors.index.json"
# Written into every folder `draftsmith export` writes (each format's, and the `--format all` folder around them):
# `--overwrite` replaces only a folder that holds it, never a folder of someone else's files. Hidden, so push leaves
# it out and engines never see it.
EXPORT_MARKER = ".draftsmith-export.json"
CHECKPOINT_DIR = re.compile(r"checkpoint-(\d+)")
# transformers refuses safetensors files whose "format" is not one of pt/tf/flax/mlx; some versions crash without it.
SAFETENSORS_METADATA = {"format": "pt"}


class CheckpointError(ValueError):
    """A checkpoint folder (or output_dir) that cannot be found or read."""


class ExportError(ValueError):
    """An export refused: a checkpoint that fails the target format's contract, or an occupied output folder."""


class FormatNotApplicable(ExportError):
    """The checkpoint is sound, but this format's consumer cannot run it (`--format all` skips the format)."""


class CheckpointImportError(ValueError):
    """A source folder that cannot be imported; the message names the file and the reason."""


@dataclass
class ImportedCheckpoint:
    """What a format's reader (`ExportFormat.read`) hands back: a draftsmith config (with "method") and tensors in
    draftsmith's names; `draftsmith import` writes them as a checkpoint."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    notes: list[str] = field(default_factory=list)  # what had to be assumed; shown to the user, kept in import.json
    step: int | None = None
    num_speculative_tokens: int | None = None  # the source's proposal length, if it recorded one


@dataclass
class ExportResult:
    """What an exporter wrote, for the command line to report."""

    out_dir: Path
    files: list[Path]
    warnings: list[str] = field(default_factory=list)
    serve_commands: dict[str, str] = field(default_factory=dict)  # engine -> shell command


def draftsmith_version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("draftsmith")
    except PackageNotFoundError:  # running from a source tree that is not installed
        import draftsmith

        return getattr(draftsmith, "__version__", "0+unknown")


def human_size(n: int) -> str:
    """A byte count as people read it: 512 B, 3.2 KiB, 1.5 GiB."""
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def is_checkpoint_dir(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file()


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint folder itself, or an output_dir meaning its newest checkpoint (`latest`, else highest N)."""
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"{root}: no such checkpoint folder or output directory")
    if not root.is_dir():
        raise CheckpointError(f"{root}: is a file; give a checkpoint folder or the training output_dir")
    if is_checkpoint_dir(root):
        return root

    latest = root / LATEST_FILE
    if latest.is_dir() and is_checkpoint_dir(latest):  # a symlink to the folder also works
        return latest
    if latest.is_file():
        name = latest.read_text(encoding="utf-8").strip()
        named = Path(name) if Path(name).is_absolute() else root / name
        if not name or not is_checkpoint_dir(named):
            raise CheckpointError(
                f"{latest}: names {name!r}, which is not a checkpoint folder ({CONFIG_FILE} + {WEIGHTS_FILE}); "
                f"point at a checkpoint-N folder directly"
            )
        return named

    steps = [
        (int(m.group(1)), child)
        for child in root.iterdir()
        if (m := CHECKPOINT_DIR.fullmatch(child.name)) and is_checkpoint_dir(child)
    ]
    if not steps:
        raise CheckpointError(
            f"{root}: not a checkpoint folder (no {CONFIG_FILE} + {WEIGHTS_FILE}) and no `{LATEST_FILE}` file "
            f"or complete checkpoint-N folder inside"
        )
    return max(steps, key=lambda s: s[0])[1]


SHOWN_CHARS = 200  # how much of a file's value an error quotes: a hostile file must not make a long error line


def inside(folder: Path, name: Any, where: str, error: type[Exception] = CheckpointImportError) -> Path:
    """`folder / name` for a file name that a file (a safetensors index's weight_map, a store's index) gives,
    refused in one line unless it stays inside `folder`: `where` names the file and the entry ("<index>:
    weight_map['x']"), `error` is the caller's error type. Every name a file hands draftsmith to read or write goes
    through here.

    The name is checked as written (relative, no `..` part, either slash), not by resolving links: a Hugging Face
    cache snapshot's files are links into the cache's blobs/ folder, so resolving would refuse every downloaded
    model, while a link inside the folder is the folder's own content."""
    shown = repr(name) if len(repr(name)) <= SHOWN_CHARS else repr(name)[:SHOWN_CHARS] + "..."
    if not isinstance(name, str) or not name or "\0" in name:
        raise error(f"{where} is {shown}: not a file name")
    if PureWindowsPath(name).anchor or ".." in name.replace("\\", "/").split("/"):  # "/x", "C:x", "\\\\host\\x"
        raise error(f"{where} is {shown}, a path outside {folder} (absolute or through '..'): only files inside "
                    "the folder are read")
    return Path(folder) / name


def read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None


def read_optional_json(path: Path) -> Any | None:
    return read_json(path) if path.is_file() else None


@dataclass
class CardInputs:
    """What a checkpoint folder says about itself for an export's model card."""

    step: int | None  # training step (trainer_state.json), None when unknown
    eval_result: dict[str, Any] | None  # eval.json (`draftsmith eval` leaves its rows there), when readable
    recipe_text: str | None  # recipe.yaml as saved with the checkpoint
    warnings: list[str] = field(default_factory=list)  # what could not be read (the export still goes ahead)


def read_card_inputs(ckpt: Path) -> CardInputs:
    trainer_state = read_optional_json(ckpt / TRAINER_STATE_FILE) or {}
    step = trainer_state.get("step") if isinstance(trainer_state, dict) else None
    warnings = []
    try:
        eval_result = read_optional_json(ckpt / EVAL_FILE)
    except CheckpointError as e:
        eval_result = None
        warnings.append(f"eval result not shown in the model card: {e}")
    recipe_path = ckpt / RECIPE_FILE
    recipe_text = recipe_path.read_text(encoding="utf-8", errors="replace") if recipe_path.is_file() else None
    return CardInputs(step=step, eval_result=eval_result if isinstance(eval_result, dict) else None,
                      recipe_text=recipe_text, warnings=warnings)


def load_checkpoint(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config dict, state dict) of a checkpoint folder or of an output_dir's newest checkpoint, on CPU."""
    ckpt = resolve_checkpoint(path)
    config = read_json(ckpt / CONFIG_FILE)
    if not isinstance(config, dict):
        raise CheckpointError(f"{ckpt / CONFIG_FILE}: expected a JSON object, got {type(config).__name__}")
    if "method" not in config:
        raise CheckpointError(f"{ckpt / CONFIG_FILE}: no \"method\" key; not a draftsmith checkpoint config")
    try:
        tensors = load_file(ckpt / WEIGHTS_FILE, device="cpu")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{ckpt / WEIGHTS_FILE}: cannot load: {e}") from None
    check_finite(tensors, ckpt / WEIGHTS_FILE, CheckpointError)
    return config, tensors


def load_folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a published folder's `model.safetensors`, or of the shards its index names."""
    try:
        if (folder / INDEX_FILE).is_file():
            index = json.loads((folder / INDEX_FILE).read_text(encoding="utf-8"))
            shards = {inside(folder, file, f"{folder / INDEX_FILE}: weight_map[{key!r}]")
                      for key, file in index["weight_map"].items()}
            tensors: dict[str, torch.Tensor] = {}
            for shard in sorted(shards):
                shard_tensors = load_file(str(shard), device="cpu")
                check_finite(shard_tensors, shard, CheckpointImportError)
                tensors.update(shard_tensors)
            return tensors
        if (folder / WEIGHTS_FILE).is_file():
            tensors = load_file(str(folder / WEIGHTS_FILE), device="cpu")
            check_finite(tensors, folder / WEIGHTS_FILE, CheckpointImportError)
            return tensors
    except (SafetensorError, OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointImportError(f"{folder}: cannot load its safetensors weights: {e}") from None
    raise CheckpointImportError(f"{folder}: no {WEIGHTS_FILE} or {INDEX_FILE}")


def provenance_step(public: dict[str, Any]) -> int | None:
    """The training step an export recorded under its "draftsmith" key, if any."""
    prov = public.get("draftsmith") if isinstance(public.get("draftsmith"), dict) else {}
    step = prov.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def replace_atomically(path: Path, write) -> None:
    """Call `write(tmp)`, fsync it, then move it over `path`; the temporary file never outlives a failure. An
    OSError names `path` (the file meant), not the temporary name, so callers can report it as it is."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(path)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # safetensors creates files 0600; shared checkpoints should be readable
        os.replace(tmp, path)
    except OSError as e:
        e.filename = str(path)
        raise
    finally:
        tmp.unlink(missing_ok=True)


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def write_failure(e: OSError, where: Path | str) -> str:
    """One line for a failed write: a full disk said as such, else the OS's reason."""
    target = e.filename or where
    if is_disk_full(e):
        return f"{target}: disk full (no space left on device)"
    return f"{target}: cannot write: {e.strerror or e}"


def check_tensors(expected: Mapping[str, tuple[tuple[int, ...], str]], tensors: Mapping[str, torch.Tensor],
                  dtypes: Mapping[str, torch.dtype] | None = None) -> list[str]:
    """Names, shapes and dtypes of `tensors` against a contract `expected` (name -> (shape, why the shape)): one
    line per kind of problem. A tensor is a floating-point weight unless `dtypes` names its dtype. Every format's
    contract check and every importer run their tensors through here."""
    problems: list[str] = []
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors (engines would ignore them silently): {', '.join(unexpected)}")
    for name in sorted(set(expected) & set(tensors)):
        shape, why = expected[name]
        t = tensors[name]
        if tuple(t.shape) != tuple(shape):
            problems.append(f"{name}: shape {tuple(t.shape)}, expected {tuple(shape)} = {why}")
        want = (dtypes or {}).get(name)
        if want is not None and t.dtype != want:
            problems.append(f"{name}: dtype {t.dtype}, expected {want}")
        elif want is None and not t.is_floating_point():
            problems.append(f"{name}: dtype {t.dtype}, expected a floating-point weight")
    return problems


def module_shapes(module: torch.nn.Module, why: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """A freshly built drafter's state dict as a contract for `check_tensors` (RoPE's buffers left out)."""
    return {name: (tuple(t.shape), why) for name, t in module.state_dict().items() if not name.startswith("rotary_emb.")}


def meta_shapes(build: Callable[[], torch.nn.Module],
                why: str = "from the config") -> dict[str, tuple[tuple[int, ...], str]]:
    """`module_shapes` of the drafter `build()` makes, built on the meta device: shapes only, no memory, whatever
    sizes its config asks for."""
    with torch.device("meta"):
        return module_shapes(build(), why)


def weights_file(folder: Path) -> Path:
    """The file a folder's weights are read from, as messages name it: its safetensors index, else the single file."""
    return folder / INDEX_FILE if (folder / INDEX_FILE).is_file() else folder / WEIGHTS_FILE


def _int_keys(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, int]]:
    """(dotted key, value) of every integer in a config.json, nested objects included."""
    for key, value in config.items():
        if isinstance(value, Mapping):
            yield from _int_keys(value, f"{prefix}{key}.")
        elif isinstance(value, int) and not isinstance(value, bool):
            yield f"{prefix}{key}", value


def size_mismatch(expected: Mapping[str, tuple[tuple[int, ...], str]], tensors: Mapping[str, torch.Tensor],
                  config: Mapping[str, Any], config_file: Path | str, weights: Path | str) -> str | None:
    """Whether a drafter config's sizes are those of the weights that came with it, asked before the drafter is
    built: a config.json claiming hidden_size 65536 would otherwise allocate hundreds of GB before anything failed.

    `expected` is the contract of the drafter the config builds (`meta_shapes`), `tensors` the weights as read (their
    shapes are the safetensors header's), `config` the config.json as written, to name the key behind a size. None
    when every tensor the config asks for is there with its shape; else one line naming the config file, the first
    tensor that differs, the config key and both shapes (or the tensors the weights lack)."""
    named = []  # (name, shape in the weights, shape from the config, the config keys behind the difference)
    for name in sorted(set(expected) & set(tensors)):
        want, have = tuple(expected[name][0]), tuple(tensors[name].shape)
        if want != have:
            differ = [w for w, h in zip(want, have) if w != h] if len(want) == len(have) else list(want)
            keys = [f"{key} = {value}" for key, value in _int_keys(config) if value in differ]
            named.append((name, have, want, keys))
    if named:  # a tensor whose size a config key gives outright (hidden_size), else the first (hidden_size + rank)
        name, have, want, keys = next((m for m in named if m[3]), named[0])
        what = f"{', '.join(keys[:3])} does not" if keys else "its sizes do not"
        return (f"{config_file}: {what} fit the weights: {weights} holds {name} as {have}, the config makes it "
                f"{want}; use the config.json published with these weights")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        return f"{weights}: no {missing[0]}{more}, which {config_file} asks for; the config is not these weights'"
    return None


def check_finite(tensors: Mapping[str, torch.Tensor], where: Path | str,
                 error: type[Exception] = ExportError) -> None:
    """Refuse weights holding NaN or inf, wherever draftsmith reads or writes a drafter (import, every load of
    generate, eval and export, an export's files): a drafter with one drafts nothing, silently (acceptance 0), and
    an engine would serve garbage drafts without a word. One line naming the tensors and the file."""
    bad = [name for name, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        named = ", ".join(bad[:3]) + (", ..." if len(bad) > 3 else "")
        raise error(f"{where}: {len(bad)} tensor(s) hold NaN or inf values ({named}): the checkpoint is damaged or "
                    "was saved from a diverged run (take an earlier checkpoint-N of it, or retrain with a lower "
                    "training.lr); draftsmith neither imports, exports nor runs it")


# safetensors reports a failed write as SafetensorError("Error while serializing: I/O error: No space left on device
# (os error 28)"), Rust's io::Error text; its "(os error N)" is the only trace of the errno that tells a full disk.
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def _save_file(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """safetensors' save_file, with a failed write raised as the OSError it was (so is_disk_full sees ENOSPC)."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        found = _RUST_OS_ERROR.search(str(e))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None


def save_safetensors_atomic(
    tensors: Mapping[str, torch.Tensor], path: str | os.PathLike, metadata: Mapping[str, str] | None = None
) -> None:
    """Save with {"format": "pt"} metadata (plus `metadata`, str -> str); tensors are made contiguous on CPU. A
    failed write is an OSError naming `path`."""
    meta = {**SAFETENSORS_METADATA, **(metadata or {})}
    flat = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    replace_atomically(Path(path), lambda tmp: _save_file(flat, tmp, meta))


def write_text_atomic(text: str, path: str | os.PathLike) -> None:
    replace_atomically(Path(path), lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json_atomic(obj: Any, path: str | os.PathLike) -> None:
    write_text_atomic(json.dumps(obj, indent=2) + "\n", path)


def write_export_marker(folder: Path) -> None:
    """Mark `folder` as written by `draftsmith export` (EXPORT_MARKER), so that a later --overwrite may replace it."""
    write_json_atomic({"written_by": "draftsmith export", "version": draftsmith_version()}, folder / EXPORT_MARKER)


def is_export_folder(folder: Path) -> bool:
    """True when `folder` holds the marker as a regular file (a link named like it could vouch for anything)."""
    marker = folder / EXPORT_MARKER
    return marker.is_file() and not marker.is_symlink()


def _shown(name: str, limit: int = 60) -> str:
    """A file name as a one-line message can quote it: a newline or other control character shown escaped."""
    name = name if len(name) <= limit else name[:limit] + "..."
    return name if name.isprintable() else repr(name)


def folder_listing(folder: Path, limit: int = 5) -> str:
    """The first `limit` entries of `folder`, sorted, folders ending in '/', then '...' if there are more."""
    names = sorted(p.name + ("/" if p.is_dir() and not p.is_symlink() else "") for p in folder.iterdir())
    return ", ".join(_shown(n) for n in names[:limit]) + (" ..." if len(names) > limit else "")


def check_output_dir(out_dir: Path, overwrite: bool, keep: tuple[Path, ...] = (), *,
                     exports_only: bool = False) -> None:
    """Refuse an occupied destination unless `overwrite`, and never one that holds a folder in `keep`. With
    `exports_only` (every export), an occupied folder must be an earlier export (its EXPORT_MARKER): --overwrite
    deletes the old folder, and someone's unrelated files are not draftsmith's to delete."""
    out = out_dir.resolve()
    for kept in keep:
        kept = kept.resolve()
        if out == kept or out in kept.parents:
            raise ExportError(f"{out_dir}: would replace {kept}, the checkpoint being exported; choose another --out")
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"{out_dir}: exists and is not a folder")
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    if exports_only and not is_export_folder(out_dir):
        raise ExportError(f"refusing to {'overwrite' if overwrite else 'write into'} {out_dir}: it holds files that "
                          f"are not a draftsmith export ({folder_listing(out_dir)}); remove them or choose another "
                          "--out")
    if not overwrite:
        raise ExportError(f"{out_dir}: exists and is not empty; pass --overwrite to replace it")


TEMP_DIR = re.compile(r"(?P<name>.+)\.(?P<kind>tmp|old)-(?:(?P<pid>\d+)-)?[0-9a-f]{8}")  # ours: <out>.tmp-<pid>-<hex>
RUN_STARTED = time.time()  # a pid-less (older draftsmith) temporary folder from before this process is stale
# While set, atomic_output_dir() under (final root) writes into (staging root) instead: see staged_output_dir.
_STAGING: ContextVar[tuple[Path, Path] | None] = ContextVar("draftsmith_export_staging", default=None)


def _alive_since(pid: int) -> float | None:
    """When process `pid` started (epoch seconds; 0.0 when alive but unknown), None when there is no such process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, another user's
        pass
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return 0.0


def _is_stale(path: Path, pid: str | None) -> bool:
    """A temporary folder whose writer is gone: its pid is not running, or that pid now belongs to a process that
    started after the folder was last written (pid reuse); pid-less (older) names when older than this run."""
    try:
        mtime = path.lstat().st_mtime
    except OSError:
        return False
    if pid is None:
        return mtime < RUN_STARTED
    if int(pid) == os.getpid():
        return False  # this process cleans up its own (atomic_output_dir's finally)
    started = _alive_since(int(pid))
    return started is None or mtime < started


def remove_stale_temporaries(out_dir: Path) -> list[Path]:
    """Remove `<out_dir>.tmp-*` siblings a killed export left behind, and settle `<out_dir>.old-*` ones (a kill
    between the two renames of a replace): deleted when `out_dir` exists, else moved back as `out_dir`."""
    removed = []
    if not out_dir.parent.is_dir():
        return removed
    for sibling in sorted(out_dir.parent.iterdir()):
        m = TEMP_DIR.fullmatch(sibling.name)
        if not m or m["name"] != out_dir.name or not sibling.is_dir() or not _is_stale(sibling, m["pid"]):
            continue
        if m["kind"] == "old" and not out_dir.exists():
            os.replace(sibling, out_dir)  # the previous export, whose replacement never landed
            continue
        shutil.rmtree(sibling, ignore_errors=True)
        removed.append(sibling)
    return removed


def _staged(out_dir: Path) -> Path:
    """Where `out_dir` is written physically: itself, or its place inside the active staging folder."""
    staging = _STAGING.get()
    if staging is None:
        return out_dir
    root, tmp_root = staging
    try:
        return tmp_root / out_dir.resolve().relative_to(root)
    except ValueError:
        return out_dir


@contextlib.contextmanager
def atomic_output_dir(
    out_dir: str | os.PathLike, overwrite: bool = False, keep: tuple[Path, ...] = (), *, exports_only: bool = False
) -> Iterator[Path]:
    """Yield a fresh sibling folder `<out_dir>.tmp-<pid>-<hex>` to fill; on success it becomes `out_dir`, else it
    is removed. Stale temporary siblings of earlier, killed runs are removed first.

    With `overwrite`, an existing `out_dir` is moved aside first and deleted only once the new one is in place
    (with `exports_only`, only when it is an earlier export: check_output_dir). A failed write (a full disk) is an
    ExportError naming the file; nothing is left behind.
    """
    final = Path(out_dir)
    check_output_dir(final, overwrite, keep, exports_only=exports_only)
    out_dir = _staged(final)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out_dir)
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    tmp.mkdir()
    try:
        try:
            yield tmp
        except OSError as e:
            if e.filename and str(e.filename).startswith(str(tmp)):
                e.filename = str(final) + str(e.filename)[len(str(tmp)):]  # the file meant, not its temporary
            fix = "free space and rerun" if is_disk_full(e) else "check the folder's permissions"
            raise ExportError(f"{write_failure(e, final)}; nothing was written: {fix}") from None
        check_output_dir(out_dir, overwrite, keep, exports_only=exports_only)  # something may have appeared meanwhile
        old = None
        if out_dir.exists():
            old = out_dir.with_name(f"{out_dir.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
            os.replace(out_dir, old)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if old is not None:
                os.replace(old, out_dir)
            raise
        if old is not None:
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


@contextlib.contextmanager
def staged_output_dir(
    out_dir: str | os.PathLike, overwrite: bool = False, keep: tuple[Path, ...] = (), *, exports_only: bool = False
) -> Iterator[Path]:
    """`out_dir` written as a whole: every atomic_output_dir(`out_dir/...`) inside this block writes into one
    temporary sibling of `out_dir`, which becomes `out_dir` when the block succeeds (`export --format all`). The
    exporters keep naming their final folders (model cards print them), and a kill leaves no partial `out_dir`."""
    out_dir = Path(out_dir)
    with atomic_output_dir(out_dir, overwrite=overwrite, keep=keep, exports_only=exports_only) as tmp:
        token = _STAGING.set((out_dir.resolve(), tmp))
        try:
            yield tmp
        finally:
            _STAGING.reset(token)


def absolute_target(target: str) -> str:
    """The target as an export records it: a relative path to a local folder (the recipe's model.target as typed)
    made absolute, so the serve commands, the model card and the config that name it work from any directory; a
    Hub id, an absolute path, or a path not found from here (nothing to resolve it against) as it is."""
    if not target or Path(target).is_absolute() or not Path(target).exists():
        return target
    return os.path.abspath(target)


def config_for_export(ckpt: Path, raw: dict[str, Any], config_cls, method: str, format_name: str):
    """The drafter config (`config_cls.from_dict`) of a checkpoint being exported as `format_name`, its target
    through `absolute_target`; an ExportError naming its config.json when the checkpoint is of another method or
    its config does not parse."""
    where = ckpt / CONFIG_FILE
    if raw.get("method") != method:
        raise ExportError(f"{where}: method {raw.get('method')!r} cannot be exported as {format_name} "
                          f"(needs {method!r})")
    try:
        config = config_cls.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise ExportError(f"{where}: {e}") from None
    config.target_name_or_path = absolute_target(config.target_name_or_path)  # every exporter takes it from here
    return config


def write_export(out_dir: Path, ckpt: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], card: str, *,
                 overwrite: bool, warnings: list[str], serve_commands: dict[str, str],
                 extra_files: Mapping[str, Callable[[Path], None]] | None = None) -> ExportResult:
    """Write config.json, model.safetensors, README.md and `extra_files` (name -> writer of that path) into
    `out_dir`, all or nothing (atomic_output_dir), and describe the result. Every format's weights pass here, so
    this is where non-finite ones are refused, the export marker written, and an --overwrite of a folder that is
    not an export refused."""
    names = [CONFIG_FILE, WEIGHTS_FILE, "README.md", *(extra_files or {})]
    check_finite(tensors, ckpt / WEIGHTS_FILE)
    with atomic_output_dir(out_dir, overwrite=overwrite, keep=(ckpt,), exports_only=True) as tmp:
        write_export_marker(tmp)
        write_json_atomic(config, tmp / CONFIG_FILE)
        save_safetensors_atomic(tensors, tmp / WEIGHTS_FILE)
        write_text_atomic(card, tmp / "README.md")
        for name, write in (extra_files or {}).items():
            write(tmp / name)
    return ExportResult(out_dir=out_dir, files=[out_dir / n for n in names], warnings=warnings,
                        serve_commands=serve_commands)
