"""A checkpoint's training_state/: the optimizer and RNG states, in safetensors and JSON only, so resuming a run
folder (shared, downloaded, or written by someone else) can never run code from it.

accelerate's `save_state` writes pickles (optimizer.bin, random_states_<rank>.pkl, and custom_checkpoint_<i>.pkl,
which `load_state` reads with torch.load(weights_only=False): a crafted one runs whatever it likes). draftsmith
writes its own files instead:

    training_state/state.json                 {"format": FORMAT, "optimizers": n, "processes": world}
    training_state/optimizer_<i>.safetensors  optimizer i's tensors ("<param index>.<name>"); its param_groups and
                                              other values as JSON in the file's metadata
    training_state/rng_<rank>.safetensors     each process's torch (and accelerator) generator states; Python's
                                              and numpy's generator states as JSON in the metadata

The learning-rate schedulers are not saved: the rate is a pure function of the step and the plan that
trainer_state.json holds, so the trainer rebuilds them. A drafter sharded with FSDP2 or DeepSpeed ZeRO
(draftsmith/distributed.py) has its optimizer states gathered whole into the same files, so one format serves every
world size and sharding. `check_run_folder` resumes accelerate's pickles (folders written before this format) only
with training.trust_run_folder=true. Before anything is read, a
checkpoint holding a pickle draftsmith did not write is refused in one line naming the file.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from draftsmith import device as dev
from draftsmith.models.checkpoint import save_safetensors_atomic, write_json_atomic

STATE_DIR = "training_state"  # in each checkpoint folder
FORMAT = "draftsmith-training-state-1"
FORMAT_FILE = "state.json"
META_KEY = "draftsmith"  # the safetensors metadata entry holding a file's JSON part
# torch.save / pickle files by name, and by their first bytes: pickle protocol 2-5 (0x80 then the protocol) or
# torch.save's zip container
PICKLE_SUFFIXES = {".pkl", ".pickle", ".bin", ".pt", ".pth", ".ckpt", ".pck"}
PICKLE_MAGIC = tuple(bytes([0x80, protocol]) for protocol in range(2, 6)) + (b"PK\x03\x04",)
TRUST = "training.trust_run_folder=true"


class TrainingStateError(ValueError):
    """A checkpoint's training state that is refused or cannot be read (one line naming the file)."""


def optimizer_file(i: int) -> str:
    return f"optimizer_{i}.safetensors"


def rng_file(rank: int) -> str:
    return f"rng_{rank}.safetensors"


def raw_optimizer(optimizer):
    """The torch optimizer inside accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def save_training_state(folder: Path, optimizer_states: list[dict], rank: int, world: int, is_main: bool) -> None:
    """Every process writes its RNG states; the main process the optimizers' states (torch's state_dict layout,
    whole tensors: identical on every process under DDP, gathered under FSDP2) and state.json, last."""
    folder.mkdir(parents=True, exist_ok=True)
    _save_rng(folder / rng_file(rank))
    if not is_main:
        return
    for i, state in enumerate(optimizer_states):
        tensors, values = {}, {}
        for index, entries in state["state"].items():
            for name, value in entries.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{index}.{name}"] = value
                else:
                    values.setdefault(str(index), {})[name] = value
        meta = json.dumps({"param_groups": state["param_groups"], "values": values})
        save_safetensors_atomic(tensors, folder / optimizer_file(i), metadata={META_KEY: meta})
    write_json_atomic({"format": FORMAT, "optimizers": len(optimizer_states), "processes": world},
                      folder / FORMAT_FILE)


def load_training_state(folder: Path, optimizers, rank: int, load=None) -> bool:
    """Load the optimizers' states and this process's RNG states from draftsmith's files (safetensors and JSON:
    nothing is unpickled); `load(optimizer, state_dict)` puts a state into an optimizer (default: its
    load_state_dict; a sharded drafter's shards it). False when there is no RNG file for this process (a run
    resumed on more processes than wrote it): its generators keep the recipe's seed."""
    saved = read_json_object(folder / FORMAT_FILE)
    if saved.get("optimizers") != len(optimizers):
        raise TrainingStateError(f"{folder / FORMAT_FILE}: holds {saved.get('optimizers')} optimizer states, this "
                                 f"run has {len(optimizers)}: set output_dir to a new folder")
    for i, optimizer in enumerate(optimizers):
        path = folder / optimizer_file(i)
        tensors, meta = _read_safetensors(path)
        raw = raw_optimizer(optimizer)
        try:
            state: dict[int, dict] = {}
            for key, tensor in tensors.items():
                index, name = key.split(".", 1)
                state.setdefault(int(index), {})[name] = tensor
            for index, entries in meta["values"].items():
                state.setdefault(int(index), {}).update(entries)
            groups = meta["param_groups"]
            for live, group in zip(raw.param_groups, groups):  # JSON made the tuples (betas, ...) lists
                for name, value in group.items():
                    if isinstance(live.get(name), tuple) and isinstance(value, list):
                        group[name] = tuple(value)
            if load is None:
                raw.load_state_dict({"state": state, "param_groups": groups})
            else:
                load(optimizer, {"state": state, "param_groups": groups})
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            raise TrainingStateError(f"{path}: does not fit this run's optimizer ({type(e).__name__}: "
                                     f"{str(e).splitlines()[0] if str(e) else ''}): set output_dir to a new "
                                     "folder") from None
    path = folder / rng_file(rank)
    if not path.is_file():
        return False
    tensors, meta = _read_safetensors(path)
    try:
        version, state, gauss = meta["python"]
        random.setstate((version, tuple(state), gauss))
        name, keys, pos, has_gauss, cached = meta["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(tensors["torch"])
        kinds = {name.split(".")[0] for name in tensors if name != "torch"}
        dev.set_accelerator_rng_states({kind: [tensors[k] for k in sorted(
            (k for k in tensors if k.startswith(f"{kind}.")), key=lambda k: int(k.split(".")[1]))] for kind in kinds})
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise TrainingStateError(f"{path}: not an RNG state draftsmith wrote ({type(e).__name__}: {e}): set "
                                 "output_dir to a new folder") from None
    return True


def _save_rng(path: Path) -> None:
    tensors = {"torch": torch.get_rng_state()}
    for kind, per_device in dev.accelerator_rng_states().items():
        for device, state in enumerate(per_device):
            tensors[f"{kind}.{device}"] = state
    version, state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    meta = {"python": [version, list(state), gauss],
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    save_safetensors_atomic(tensors, path, metadata={META_KEY: json.dumps(meta)})


def read_json_object(path: Path) -> dict:
    """A run folder's JSON file as a dict; one line naming it otherwise."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TrainingStateError(f"{path}: cannot read it ({e}): set output_dir to a new folder") from None
    if not isinstance(data, dict):
        raise TrainingStateError(f"{path}: expected a JSON object: set output_dir to a new folder")
    return data


def _read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors on the CPU, the JSON of the file's metadata entry META_KEY)."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = json.loads((f.metadata() or {})[META_KEY])
            return {key: f.get_tensor(key) for key in f.keys()}, meta
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as e:
        raise TrainingStateError(f"{path}: cannot read it ({type(e).__name__}: {e}): set output_dir to a new "
                                 "folder") from None


def looks_pickled(path: Path) -> bool:
    """A pickle or torch.save file, by its name or its first bytes (a safetensors file, whose first 8 bytes are its
    header's length and may start like a pickle, opens its JSON header at byte 8)."""
    if path.suffix.lower() in PICKLE_SUFFIXES:
        return True
    try:
        with path.open("rb") as f:
            head = f.read(9)
    except OSError:
        return False
    if head[8:9] == b"{" and int.from_bytes(head[:8], "little") < path.stat().st_size:
        return False
    return head.startswith(PICKLE_MAGIC)


def check_run_folder(checkpoint: Path, trusted: bool) -> bool:
    """Whether `checkpoint`'s training state is draftsmith's own (True) or accelerate's (False: a folder written
    before this format), read before anything is loaded from it. Refused in one line naming the file, unless
    `trusted`: any pickle in a checkpoint of draftsmith's format (it writes none), and accelerate's state, whose
    loaders unpickle."""
    state_dir = checkpoint / STATE_DIR
    own = (state_dir / FORMAT_FILE).is_file()
    pickles = sorted(p for p in checkpoint.rglob("*") if p.is_file() and looks_pickled(p))
    if own:
        if pickles and not trusted:
            raise TrainingStateError(f"{pickles[0]}: a pickle draftsmith did not write (its checkpoints hold "
                                     "safetensors and JSON only); loading it could run code, so the run folder is "
                                     "not resumed: delete the file, or set output_dir to a new folder")
        return True
    if trusted:
        return False
    named = pickles[0] if pickles else state_dir
    raise TrainingStateError(f"{named}: training state in accelerate's pickles (written before draftsmith kept its "
                             "own in safetensors), which can run code when loaded: set output_dir to a new folder "
                             f"and model.init_from={checkpoint} to start from its weights (or, for a folder you "
                             f"trust, {TRUST})")
