"""`draftsmith import-data PEER_DIR RECIPE`: the hidden-state store of a recipe's data, taken from a peer's offline
hidden-state dataset instead of running the target.

speculators 0.9.0's offline layout (`speculators generate-offline-data`) is a folder of `hs_{i}.safetensors`, each
one request's file as vLLM's hidden-states KV connector wrote it (data/vllm_capture.py):

    hidden_states         (S, n_ids, H)  the model dtype; or float8_e4m3fn in hs-connectors' FP8 variant, with
    hidden_states_scales  (S, 1, 1)      float32, one scale per token (dequantized: fp8 * scale)
    token_ids             (S,)           int64, the prompt's token ids

`i` is the row of speculators' own preprocessed data, not draftsmith's sample order, so each sample takes the file
whose `token_ids` equal its input ids. The n_ids slots are vLLM's capture ids, sorted and each once, the last of them
N (the target's layers): the state before the final norm. vLLM ids are draftsmith's capture ids (DESIGN.md section 2),
so a file is what `VllmCapture` reads from vLLM, and `PeerCapture` hands it to the same store writer as `draftsmith
collect` (the same header, shards, index, checksums, FP8 option and resume). Only safetensors is read: the folder's
`token_freq.pt` (a pickle) and any other file are never opened.
"""

from __future__ import annotations

import argparse
import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.data.store import StoreError
from draftsmith.data.vllm_capture import RequestFailed, VllmCapture, VllmLayers, read_states

PEER_FILE = re.compile(r"hs_(\d+)\.safetensors")
SPECULATORS_SUBFOLDER = "hidden_states"  # generate-offline-data's default: {preprocessed data}/hidden_states
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3"}  # safetensors' names; F8_E4M3 with its scales only


def tokens_key(ids: Sequence[int] | torch.Tensor) -> bytes:
    """sha256 of the ids as little-endian int64: a file's identity in the index, 32 bytes however long it is."""
    return hashlib.sha256(torch.as_tensor(ids, dtype=torch.int64).numpy().astype("<i8").tobytes()).digest()


@dataclass(frozen=True)
class PeerFile:
    """One peer file, as its header describes it (no state read yet)."""

    path: Path
    shape: tuple[int, ...]  # hidden_states: (S, n_ids, H)
    dtype: str  # safetensors' name: BF16, F32, F8_E4M3, ...
    scaled: bool  # holds hidden_states_scales (the FP8 variant)
    num_tokens: int  # len(token_ids)

    def problem(self, num_ids: int, hidden_size: int, ids_given: str) -> str | None:
        """Why this file cannot give a sample's states, in one line; None when it can."""
        if len(self.shape) != 3 or self.shape[0] != self.num_tokens:
            return (f"{self.path}: hidden_states is {self.shape} for {self.num_tokens} token ids, not (tokens, layer "
                    "ids, hidden size): not a speculators hidden-state file")
        if self.shape[1] != num_ids:
            return (f"{self.path}: holds {self.shape[1]} layer slots, not one per id of {ids_given} ({num_ids}): "
                    "pass --layer-ids with the ids the peer captured (its vLLM eagle_aux_hidden_state_layer_ids, "
                    "with N)")
        if self.shape[2] != hidden_size:
            return (f"{self.path}: states of width {self.shape[2]}, the recipe's target has hidden size {hidden_size}: "
                    "the peer captured another model")
        if self.dtype not in FLOAT_DTYPES:
            return f"{self.path}: hidden_states is {self.dtype}, not a float type the connectors write"
        if self.dtype == "F8_E4M3" and not self.scaled:
            return (f"{self.path}: hidden_states is float8_e4m3fn without hidden_states_scales: the FP8 connector "
                    "writes one scale per token, and without it the states cannot be restored")
        return None


class PeerFolder:
    """A peer's `hs_{i}.safetensors` files by their tokens. Indexing opens each file's header and reads only its
    `token_ids` tensor; a file safetensors cannot open is left out and counted (speculators can leave one cut short)."""

    def __init__(self, folder: str | Path, log: Callable[[str], None] = print):
        from safetensors import safe_open
        from tqdm.auto import tqdm

        folder = Path(folder).expanduser()
        if not folder.is_dir():
            raise StoreError(f"{folder}: no such folder (the peer's hs_{{i}}.safetensors files)")
        names = self._names(folder)
        if not names and self._names(folder / SPECULATORS_SUBFOLDER):
            folder = folder / SPECULATORS_SUBFOLDER
            names = self._names(folder)
        if not names:
            raise StoreError(f"{folder}: no hs_{{i}}.safetensors files: give the folder speculators "
                             "generate-offline-data wrote them to (its output's hidden_states/)")
        self.folder = folder
        self.files: dict[bytes, PeerFile] = {}
        self.unreadable: list[tuple[Path, str]] = []
        for name in tqdm(names, unit="file", desc="index peer files", disable=len(names) < 1000):
            path = folder / name
            try:
                with safe_open(str(path), framework="pt") as f:
                    keys = set(f.keys())
                    if not {"hidden_states", "token_ids"} <= keys:
                        raise ValueError(f"holds {sorted(keys)}, not hidden_states and token_ids")
                    tokens = f.get_tensor("token_ids")
                    states = f.get_slice("hidden_states")
                    entry = PeerFile(path, tuple(states.get_shape()), states.get_dtype(),
                                     "hidden_states_scales" in keys, tokens.numel())
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types and OSError alike
                self.unreadable.append((path, str(e).splitlines()[0] if str(e) else type(e).__name__))
                continue
            self.files.setdefault(tokens_key(tokens.flatten()), entry)  # the same tokens twice: the same states
        if self.unreadable:
            path, why = self.unreadable[0]
            log(f"import-data: {len(self.unreadable)} of {len(names)} peer files cannot be read and are left out "
                f"(first: {path.name}: {why})")

    @staticmethod
    def _names(folder: Path) -> list[str]:
        if not folder.is_dir():
            return []
        found = [(int(m.group(1)), p.name) for p in folder.iterdir()
                 if (m := PEER_FILE.fullmatch(p.name)) and p.is_file()]
        return [name for _, name in sorted(found)]

    def match(self, samples, num_ids: int, hidden_size: int, ids_given: str) -> list[PeerFile]:
        """Each sample's file, checked (layer slots, width, dtype) before anything is written; one line naming the
        first sample without a file, or the first file that cannot give its sample's states."""
        found = [self.files.get(tokens_key(s.input_ids)) for s in samples]
        missing = [i for i, f in enumerate(found) if f is None]
        if missing:
            first = samples[missing[0]].input_ids
            lost = (f"; {len(self.unreadable)} peer files could not be read (first: {self.unreadable[0][0].name})"
                    if self.unreadable else "")
            raise StoreError(
                f"{len(missing)} of {len(samples)} samples have no file in {self.folder} with their "
                f"token ids (first: sample {missing[0]}, {len(first)} tokens starting {first[:8]}){lost}: the peer "
                "captured other data or another tokenization; set data.* (path, max_length, chat template) to the "
                "peer's data, or capture these samples with draftsmith collect")
        for f in found:
            if (why := f.problem(num_ids, hidden_size, ids_given)) is not None:
                raise StoreError(why)
        return found


def peer_layer_ids(layer_ids: Sequence[int] | None, layers: VllmLayers) -> list[int]:
    """The ids the peer captured, in its files' slot order (vLLM sorts them and keeps each once); default: what
    draftsmith collect asks vLLM for (the method's aux ids and N). They must hold every aux id and N."""
    if layer_ids is None:
        return layers.requested
    ids = sorted(set(layer_ids))
    n = layers.num_layers
    if bad := [i for i in ids if not 0 <= i <= n]:
        raise StoreError(f"--layer-ids {bad} are outside 0..{n} for this {n}-layer target (vLLM's capture ids: id k "
                         "the residual stream entering layer k, id N the state before the final norm)")
    if lacking := [i for i in layers.requested if i not in ids]:
        raise StoreError(f"--layer-ids {ids} lack {lacking}: the store needs the method's aux layer ids "
                         f"{list(layers.aux_layer_ids)} and N={n} (the last state): this peer data cannot train this "
                         "method; capture with draftsmith collect, or set model.aux_layer_ids to ids the peer holds")
    return ids


class PeerCapture(VllmCapture):
    """`VllmCapture` reading a peer's files instead of asking an engine: the same signature for `collect_rank`
    (`capture`, `device`) and the same assembly (slots back to the recipe's order, id N through the target's final
    norm), only `states` differs. A subclass because the assembly is VllmCapture's to keep; its `states` would
    retry requests and delete each file once read, and a peer's files are neither retried nor removed.

    files:    each sample's file, by its tokens (PeerFolder)
    captured: the ids the peer's files hold, sorted (their slots); may hold more than the recipe's
    """

    def __init__(self, files: dict[bytes, PeerFile], captured: Sequence[int], layers: VllmLayers,
                 final_norm: torch.nn.Module, hidden_size: int):
        super().__init__(engine=None, layers=layers, final_norm=final_norm, hidden_size=hidden_size, retries=0)
        self.files, self.captured = files, list(captured)
        self.slots = [self.captured.index(k) for k in layers.requested]  # the recipe's ids among the peer's

    def states(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """(S, len(layers.requested), H) per prompt, read (and dequantized) from its file."""
        out = []
        for prompt in prompts:
            peer = self.files.get(tokens_key(prompt))
            if peer is None:  # `PeerFolder.match` found every sample's file before anything was written
                raise StoreError(f"no peer file holds a prompt of {len(prompt)} tokens")
            try:
                states = read_states(str(peer.path), prompt, len(self.captured), self.hidden_size)
            except RequestFailed as e:
                raise StoreError(f"{e}; nothing of this batch was stored (run import-data again to resume once "
                                 "the file is fixed)") from None
            out.append(states[:, self.slots])  # (S, n_requested, H)
        return out


def import_data(recipe, peer_dir: str | Path, layer_ids: Sequence[int] | None = None,
                log: Callable[[str], None] = print) -> Path:
    """Write the store `data.hidden_states_path` names for the recipe's prepared data from the peer's files: what
    `draftsmith collect` writes (train/collect.py), the target's layers never run (only its final norm, on the
    CPU). A complete store for the recipe: nothing to do; a partial one: resumed."""
    from draftsmith.config import RecipeError, check_recipe_against_target
    from draftsmith.data import prepare_dataset
    from draftsmith.data.store import (
        INDEX,
        HiddenStateStore,
        bytes_per_token,
        check_disk,
        collect_rank,
        human_bytes,
        write_index,
    )
    from draftsmith.models.target import TargetModel
    from draftsmith.train.collect import tokens_done
    from draftsmith.train.features import recipe_store_header
    from draftsmith.train.setup import load_tokenizer, method_class, target_config_dict

    if not recipe.data.hidden_states_path:
        raise RecipeError("import-data needs data.hidden_states_path: the folder to write the hidden-state store into")
    folder = Path(recipe.data.hidden_states_path).expanduser()
    tokenizer = load_tokenizer(recipe.model.target)
    check_recipe_against_target(recipe, target_config_dict(recipe.model.target))
    data = prepare_dataset(recipe.data, tokenizer, log=log)
    samples = [*data.train, *data.eval]
    target = TargetModel.head_and_embeddings(recipe.model.target, dtype=recipe.model.dtype, device="cpu")
    method = method_class(recipe.model.method)(recipe, target)
    layers = VllmLayers(tuple(method.aux_layer_ids), target.num_layers)
    captured = peer_layer_ids(layer_ids, layers)
    header = recipe_store_header(recipe, tokenizer, target, method, data, recipe.collect.dtype)
    if (folder / INDEX).is_file():
        HiddenStateStore(folder).check_matches(header)
        log(f"import-data: {folder} already holds the complete store for this recipe: nothing to do")
        return folder
    peer = PeerFolder(peer_dir, log)
    given = (f"--layer-ids {captured}" if layer_ids is not None else
             f"the default layer ids {captured} (the method's aux ids and N)")
    files = peer.match(samples, len(captured), target.hidden_size, given)
    per_token = bytes_per_token(target.hidden_size, len(method.aux_layer_ids), recipe.collect.dtype)
    tokens = sum(len(s.input_ids) for s in samples)
    log(f"import-data: {len(samples)} samples, {tokens} tokens from {len({f.path for f in files})} of "
        f"{len(peer.files)} files in {peer.folder} (layer ids {captured}, aux {method.aux_layer_ids} + N) = about "
        f"{human_bytes(tokens * per_token)} of {recipe.collect.dtype} into {folder}")
    check_disk(folder, (tokens - tokens_done(folder, 0)) * per_token)
    capture = PeerCapture(peer.files, captured, layers, target.final_norm, target.hidden_size)
    collect_rank(capture, method.aux_layer_ids, samples, folder, header, max_shard_bytes=recipe.collect.max_shard_bytes,
                 dtype=recipe.collect.dtype, batch_tokens=recipe.collect.batch_tokens, log=log)
    index = write_index(folder, header, len(samples), 1)
    log(f"import-data: wrote {index['num_samples']} samples, {index['num_tokens']} tokens, "
        f"{human_bytes(index['bytes'])} in {len(index['shards'])} shards to {folder}")
    return folder


# --------------------------------------------------------------------------- the command


def _layer_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers, e.g. 2,4,5,8") from None


def add_import_data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("peer_dir", metavar="PEER_DIR",
                   help="the peer's hs_{i}.safetensors folder (speculators generate-offline-data's hidden_states/)")
    p.add_argument("recipe", help="recipe YAML whose data.hidden_states_path receives the store")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. collect.dtype=bfloat16")
    p.add_argument("--layer-ids", type=_layer_ids, default=None, metavar="IDS",
                   help="the layer ids the peer captured, comma-separated, in vLLM's convention (id k the residual "
                        "stream entering layer k, id N the state before the final norm; sorted, each once, as "
                        "vLLM keeps them); default: the method's aux layer ids and N")


def run_import_data(args: argparse.Namespace) -> int:
    from draftsmith.config import load_recipe

    import_data(load_recipe(args.recipe, args.overrides), args.peer_dir, args.layer_ids)
    return 0
