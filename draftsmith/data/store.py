"""The hidden-state store: what `draftsmith collect` writes once, and training reads instead of running the target.

A store is a folder:

    index.json                           written last, atomically: a store is complete exactly when it exists
    shard-r{rank}-{n:05d}.safetensors    many samples each, closed at a batch boundary once it holds about
                                         `collect.max_shard_bytes` (an eighth of it over a collection's last
                                         shard's worth: `ShardWriter`); for sample i: "{i}.aux" (L, n_aux*H) and
                                         "{i}.last" (L, H) in the store dtype, "{i}.input_ids" (L,) int32,
                                         "{i}.loss_mask" (L,) int8
    progress-r{rank}.json                the shards rank r finished, with their checksums (removed once the index
                                         is written); a killed collection resumes from it

`aux` is what `TargetModel.capture` returns for the method's aux layer ids (the residual stream entering each
layer, DESIGN.md's capture ids) and `last` the final-normed last hidden state, from which training recomputes the
teacher with the target's frozen head (the logits are never stored). Sample ids are the prepared data's order:
the training samples, then the held-out ones. index.json records what the states belong to (target fingerprint, aux
layer ids, tokenizer and chat template, a hash of the tokenized data), the dtype and sizes, every shard's checksum
(`shard_checksum`: sha256 over the sha256 of each 64 MiB piece) and, per sample, [shard, byte offset of its aux
tensor, length]. The target fingerprint includes sampled bytes of every weight file (`sampled_weights`), so weights
changed in place are seen without reading them all.
Training checks all of it before its first step (every shard's checksum too, unless data.verify_store is false): a
store that does not belong to the recipe, a shard that fails its checksum, or a non-finite state is a one-line
error naming the key, shard or sample.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from draftsmith import device as dev

STORE_FORMAT = "draftsmith-hidden-states/2"
# format 1 recorded each shard's plain sha256 ("sha256"); format 2 its tree checksum ("sha256_tree"); both are read
READABLE_FORMATS = ("draftsmith-hidden-states/1", STORE_FORMAT)
INDEX = "index.json"
AUX_CONVENTION = ("capture id k = the residual stream entering decoder layer k (output_hidden_states[k]); "
                  "id L = the input of the final norm")
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float8_e4m3fn": torch.float8_e4m3fn}
FP8_MAX = 448.0  # the largest float8_e4m3fn value: each row is scaled so its largest magnitude lands there


def quantize_rows(x: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """A sample's (L, D) states as stored: cast, or for float8_e4m3fn the fp8 values plus a float32 scale per row
    (per token: one outlier token does not flatten the rest)."""
    if dtype != "float8_e4m3fn":
        return {"": x.to(_DTYPES[dtype])}
    x = x.float()
    scale = (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)  # (L, 1)
    return {"": (x / scale).to(torch.float8_e4m3fn), "_scale": scale}


def dequantize_rows(values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return values if scale is None else values.float() * scale


class StoreError(ValueError):
    """A store that cannot be written or used; the message is one line naming the folder, file, key or sample."""


# --------------------------------------------------------------------------- fingerprints


def data_fingerprint(samples) -> str:
    """sha256 of the tokenized samples (ids and loss masks, in order): the store holds states of exactly these."""
    h = hashlib.sha256()
    for s in samples:
        h.update(struct.pack(f"<{len(s.input_ids)}i", *s.input_ids))
        h.update(bytes(s.loss_mask))
        h.update(b"\n")
    return h.hexdigest()


def _safetensors_headers_sha256(folder: Path) -> str | None:
    """sha256 of every weight file's safetensors header (names, shapes, dtypes, offsets): cheap, and changes with
    any re-save or re-shard of the weights; it does not read the weights themselves."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            h.update(f.name.encode() + fh.read(n))
    return h.hexdigest()


# What `sampled_weights` reads of each weight file besides its header: every tensor's first, middle and last bytes (a
# fine-tune, a merged adapter or an edited row range changes whole tensors, so one changed tensor is seen) and
# evenly spaced chunks over the whole file. About 3.5 MB of an 8B target's 16 GB: cheap on a network file system.
TENSOR_SAMPLE_BYTES = 4096
FILE_SAMPLES, FILE_SAMPLE_BYTES = 16, 1 << 16


def _sampled_ranges(header: dict, data_start: int, size: int) -> list[tuple[int, int]]:
    """The [start, end) byte ranges of a safetensors file that `sampled_weights` hashes, sorted and merged."""
    ranges = [(0, data_start)]  # the header: names, shapes, dtypes, offsets
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = (data_start + offset for offset in info["data_offsets"])
        middle = (start + end - TENSOR_SAMPLE_BYTES) // 2
        for a in (start, middle, end - TENSOR_SAMPLE_BYTES):
            ranges.append((max(start, a), min(end, a + TENSOR_SAMPLE_BYTES)))
    for k in range(FILE_SAMPLES + 1):  # k = 0 and k = FILE_SAMPLES: the file's first and last bytes
        a = max(0, size - FILE_SAMPLE_BYTES) * k // FILE_SAMPLES
        ranges.append((a, min(size, a + FILE_SAMPLE_BYTES)))
    merged: list[tuple[int, int]] = []
    for a, b in sorted(r for r in ranges if r[0] < r[1]):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def sampled_weights(folder: Path) -> dict[str, dict[str, Any]] | None:
    """{weight file: its size and the sha256 of its sampled byte ranges} for every safetensors file of a local
    target: sees weights changed in place with the same layout (which the header hash does not), without reading
    them all (`_sampled_ranges`). None when the folder holds no safetensors files."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    sampled = {}
    for f in files:
        h = hashlib.sha256()
        with f.open("rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            (n,) = struct.unpack("<Q", fh.read(8))
            for a, b in _sampled_ranges(json.loads(fh.read(n)), 8 + n, size):
                fh.seek(a)
                h.update(fh.read(b - a))
        sampled[f.name] = {"bytes": size, "sampled_sha256": h.hexdigest()}
    return sampled


def target_fingerprint(target: str) -> dict[str, Any]:
    """What identifies the target's weights: its name, the Hub revision when it came from the Hub cache, and hashes
    of its config.json, weight headers and sampled weight bytes (`sampled_weights`) when its files are local (a Hub
    snapshot's files are local too, once in the cache)."""
    folder = Path(target)
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(target, local_files_only=True))
        except Exception:  # noqa: BLE001 - not in the local cache: the name is all we can record
            return {"target": target}
    revision = folder.name if folder.parent.name == "snapshots" else None
    config = folder / "config.json"
    return {"target": target, "revision": revision,
            "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None,
            "weights_header_sha256": _safetensors_headers_sha256(folder), "weights_sampled": sampled_weights(folder)}


def tokenizer_fingerprints(tokenizer) -> dict[str, str | None]:
    from draftsmith.data.vocab import tokenizer_vocab_fingerprint

    template = getattr(tokenizer, "chat_template", None)
    return {"tokenizer_sha256": tokenizer_vocab_fingerprint(tokenizer),
            "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if isinstance(template, str)
            else None}


def store_header(target_name: str, tokenizer, aux_layer_ids: list[int], hidden_size: int, samples, num_train: int,
                 dtype: str) -> dict[str, Any]:
    """What index.json says the states belong to; `collect` writes it and training checks it (`check_matches`)."""
    return {"format": STORE_FORMAT, **target_fingerprint(target_name), "aux_layer_ids": list(aux_layer_ids),
            "aux_convention": AUX_CONVENTION, "hidden_size": hidden_size, "num_aux": len(aux_layer_ids),
            "dtype": dtype, **tokenizer_fingerprints(tokenizer), "data_sha256": data_fingerprint(samples),
            "num_train": num_train, "num_eval": len(samples) - num_train}


def bytes_per_token(hidden_size: int, num_aux: int, dtype: str) -> int:
    scales = 2 * 4 if dtype == "float8_e4m3fn" else 0  # a float32 scale per row of aux and of last
    return (num_aux + 1) * hidden_size * _DTYPES[dtype].itemsize + scales + 4 + 1  # + int32 id, int8 mask


def _sha256_file(path: Path, progress: Callable[[int], Any] | None = None) -> str:
    """The file's sha256, read in 16 MiB blocks; `progress` is told each block's size (format 1 shards)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)  # releases the GIL: threads hash several files at once
            if progress is not None:
                progress(len(block))
    return h.hexdigest()


# A shard's checksum is a two-level sha256: the sha256 of the concatenated sha256 digests of its CHECKSUM_LEAF_BYTES
# pieces (the last one shorter). Why not the file's plain sha256: one sha256 stream ran at 1.3 GB/s on the H200's
# host, little more than the 1 GB/s an 8B target's bf16 collection writes, so the checksum thread held collection
# back (benchmarks/results/collect_store_h200); pieces hash on several threads at once (hashlib releases the GIL).
CHECKSUM_LEAF_BYTES = 64 << 20
_LEAF_HASHERS = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)),
                                   thread_name_prefix="draftsmith-sha256")


def _leaf_digest(pieces: list[memoryview]) -> bytes:
    h = hashlib.sha256()
    for piece in pieces:
        h.update(piece)
    return h.digest()


def _leaves(parts, leaf_bytes: int):
    """The byte stream of `parts` cut every `leaf_bytes`: each leaf as the list of slices (no copies) it spans."""
    leaf, filled = [], 0
    for part in parts:
        view, start = memoryview(part), 0
        while start < len(view):
            take = min(leaf_bytes - filled, len(view) - start)
            leaf.append(view[start:start + take])
            filled, start = filled + take, start + take
            if filled == leaf_bytes:
                yield leaf
                leaf, filled = [], 0
    if leaf:
        yield leaf


def _checksum_file(path: Path, leaf_bytes: int = CHECKSUM_LEAF_BYTES,
                   progress: Callable[[int], Any] | None = None) -> str:
    """A file's tree checksum (as `shard_checksum` takes it from memory), read in 16 MiB blocks; `progress` is told
    each block's size."""
    leaves, leaf, filled = [], hashlib.sha256(), 0
    with path.open("rb") as f:
        while block := f.read(min(1 << 24, leaf_bytes - filled)):
            leaf.update(block)  # releases the GIL: threads check several files at once
            filled += len(block)
            if filled == leaf_bytes:
                leaves.append(leaf.digest())
                leaf, filled = hashlib.sha256(), 0
            if progress is not None:
                progress(len(block))
    if filled:
        leaves.append(leaf.digest())
    return hashlib.sha256(b"".join(leaves)).hexdigest()


# safetensors' names of the dtypes a store holds
_SAFETENSORS_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
                      torch.float8_e4m3fn: "F8_E4M3", torch.int64: "I64", torch.int32: "I32", torch.int8: "I8"}


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """A host tensor's memory as bytes, no copy (numpy has no bfloat16 or float8, bytes it has)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def shard_layout(tensors: dict[str, torch.Tensor]) -> tuple[list[str], bytes, dict[str, int]]:
    """The safetensors layout of `tensors`: their order in the file (wider elements first, so every tensor starts at
    a multiple of its element size), the file's first bytes (header length, then the JSON header padded to 8 bytes)
    and each tensor's byte offset in the file."""
    from draftsmith.models.checkpoint import SAFETENSORS_METADATA

    order = sorted(tensors, key=lambda name: -tensors[name].element_size())  # stable: insertion order within a width
    header: dict[str, Any] = {"__metadata__": SAFETENSORS_METADATA}
    start = 0
    for name in order:
        t = tensors[name]
        end = start + t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": [start, end]}
        start = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    offsets = {name: len(prefix) + header[name]["data_offsets"][0] for name in order}
    return order, prefix, offsets


# Bytes written before the kernel is asked to start putting them on disk (None: leave it to the page cache, as
# DRAFTSMITH_SHARD_WRITEBACK=0 does, for side-by-side timing)
WRITEBACK_CHUNK: int | None = 64 << 20


def write_shard(tensors: dict[str, torch.Tensor], order: list[str], prefix: bytes, path: Path) -> None:
    """Write host `tensors` as one safetensors file (`shard_layout`'s), straight from their memory, atomically.

    Why not safetensors' `save_file`: it first copies every tensor into one serialised buffer, a second pass over
    gigabytes per shard on the collector's host path; the format is a header and the raw bytes, and safetensors'
    own reader (`safe_open`) checks what is written here whenever a shard is read.

    Why the writeback: left alone, the kernel keeps a shard's gigabytes dirty in the page cache (below
    `vm.dirty_background_ratio` of the memory) and the disk idles until the closing fsync writes them all, so
    copying and writing take turns. Every WRITEBACK_CHUNK bytes, `posix_fadvise(DONTNEED)` starts the
    disk writing what was just copied (on Linux it starts writeback of the range, without waiting, and drops
    it from the cache once clean), so the disk writes while the next chunk is copied
    (benchmarks/shard_write.py)."""
    from draftsmith.models.checkpoint import replace_atomically

    def write(tmp: Path) -> None:
        with tmp.open("wb") as f:
            writeback = _Writeback(f)
            for part in _shard_bytes(tensors, order, prefix):
                step = writeback.chunk or len(part) or 1
                for start in range(0, len(part), step):
                    piece = part[start:start + step]  # a memoryview's slice: no copy
                    f.write(piece)
                    writeback.wrote()

    replace_atomically(path, write)


class _Writeback:
    """Asks the kernel to write a file's bytes out as they come, WRITEBACK_CHUNK at a time (Linux; where os has no
    posix_fadvise, or with DRAFTSMITH_SHARD_WRITEBACK=0, nothing changes)."""

    def __init__(self, f):
        self.f = f
        off = not hasattr(os, "posix_fadvise") or os.environ.get("DRAFTSMITH_SHARD_WRITEBACK") == "0"
        self.chunk = None if off else WRITEBACK_CHUNK
        self.done = 0  # bytes handed to the kernel for writeback

    def wrote(self) -> None:
        """Call after each write: past a chunk since the last advice, flush and advise the range in between."""
        if not self.chunk:
            return
        written = self.f.tell()
        if written - self.done >= self.chunk:
            self.f.flush()
            try:
                os.posix_fadvise(self.f.fileno(), self.done, written - self.done, os.POSIX_FADV_DONTNEED)
            except OSError:  # a file system that takes no advice: the closing fsync writes it all, as before
                self.chunk = None
            self.done = written


def shard_checksum(tensors: dict[str, torch.Tensor], order: list[str], prefix: bytes,
                   leaf_bytes: int = CHECKSUM_LEAF_BYTES) -> str:
    """The tree checksum of the file `write_shard` writes (`_checksum_file`'s), from the tensors in memory (no
    re-reading of the file), its pieces hashed on several threads."""
    pieces = [_LEAF_HASHERS.submit(_leaf_digest, leaf)
              for leaf in _leaves(_shard_bytes(tensors, order, prefix), leaf_bytes)]
    return hashlib.sha256(b"".join(piece.result() for piece in pieces)).hexdigest()


def _shard_bytes(tensors: dict[str, torch.Tensor], order: list[str], prefix: bytes):
    """A shard file's bytes in order, without a copy: what `write_shard` writes and `shard_sha256` hashes."""
    yield prefix
    for name in order:
        yield _raw_bytes(tensors[name])


# --------------------------------------------------------------------------- writing


def plan_batches(ids: list[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Sample ids grouped for the target: longest first, each group at most `batch_tokens` padded tokens, so the
    target runs full batches with little padding. Deterministic: a resumed collection redoes the same batches."""
    batches, current = [], []
    for i in sorted(ids, key=lambda j: (-lengths[j], j)):
        if current and lengths[current[0]] * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


# Two stages, one thread each: one writes a shard while the other checksums it from memory, then records it once it
# is on disk; each stage keeps submission order, so shards go on record in order (a resumed run names and groups
# them as before).
_SAVER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draftsmith-shard-save")
_RECORDER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draftsmith-shard-record")


def _progress_path(folder: Path, rank: int) -> Path:
    return folder / f"progress-r{rank}.json"


def _recorded_shards(folder: Path, progress_file: Path, shards: list) -> list:
    """The shards a progress file records, each name checked to be a file of the store's folder (a resumed writer
    keeps them and the index names them)."""
    from draftsmith.models.checkpoint import inside

    for k, shard in enumerate(shards):
        inside(folder, shard.get("name") if isinstance(shard, dict) else None, f"{progress_file}: shards[{k}].name",
               StoreError)
    return shards


class ShardWriter:
    """One rank's shards and progress record: samples are added a batch at a time, a shard is written (atomically)
    once a batch leaves it past `max_shard_bytes`, and only then recorded in progress-r{rank}.json. Reopening
    the folder with the same `plan` resumes: shards on record are kept, anything after them is redone.

    Nothing here waits for the target. A batch's states are packed, checked and cast (or quantized) on the device
    and copied to the host behind the device's queue (pinned memory on CUDA and ROCm); the batch lands in the open
    shard at the next `add_batch`, while the target computes the next batch. A full shard is written in the
    background: one thread writes it straight from memory (`write_shard`), another checksums the same memory and
    records the shard once it is on disk (at most one shard being written and one waiting for its record, so
    memory stays bounded). `flush()` lands the last batch, writes what is open and waits until everything is on
    disk and on record.

    A collection's end waits for what is still open to be written. So a caller that knows how many tokens follow
    a batch (`tokens_after`) gets smaller shards (an eighth of `max_shard_bytes`) once less than a shard's worth
    is left: the writer keeps writing during the last forward passes instead of idling while a full shard fills,
    and the final flush writes about one batch, not up to a whole shard (on an 8B-shaped target, 1.9 s of a
    16 s bf16 collection over 450k tokens before this rule). Shard boundaries still follow from the plan alone,
    so a resumed collection groups its shards as the first run did."""

    TAIL_SHARD_FRACTION = 8

    def __init__(self, folder: Path, rank: int, plan: dict, dtype: str, max_shard_bytes: int, what: str):
        self.folder, self.rank, self.dtype, self.max_shard_bytes = folder, rank, dtype, max_shard_bytes
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob(f".shard-r{rank}-*.tmp-*"):  # a shard a killed run was writing
            stale.unlink(missing_ok=True)
        digest = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()
        self.progress_file = _progress_path(folder, rank)
        self.progress = {"format": STORE_FORMAT, "plan_sha256": digest, "rank": rank, "shards": []}
        if self.progress_file.is_file():
            previous = json.loads(self.progress_file.read_text())
            if previous.get("format") != STORE_FORMAT:
                raise StoreError(f"{self.progress_file}: {what} by another draftsmith version (format "
                                 f"{previous.get('format')!r}, this one writes {STORE_FORMAT!r}) was started in this "
                                 "folder: give it a new folder")
            if previous.get("plan_sha256") != digest:
                raise StoreError(f"{self.progress_file}: {what} with another target, data, layers or collect "
                                 "settings was started in this folder: give it a new folder")
            recorded = _recorded_shards(folder, self.progress_file, previous["shards"])
            self.progress["shards"] = [s for s in recorded if (folder / s["name"]).is_file()
                                       and (folder / s["name"]).stat().st_size == s["bytes"]]
        self.done = {i for shard in self.progress["shards"] for i, _, _ in shard["samples"]}
        self._next_shard = len(self.progress["shards"])
        self._saving: Future | None = None
        self._recording: list[Future] = []
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_ids: list[tuple[int, int]] = []  # (sample id, length)
        self._pending_bytes = 0
        self._in_flight: tuple | None = None  # the batch whose host copies are under way

    def add_batch(self, items, tokens_after: int | None = None) -> None:
        """Samples of one batch, `items` = [(i, aux (L, n*H), last (L, H), input_ids, loss_mask)], the states on the
        target's device. Lands the batch before (into the open shard, closing it when full), then queues this one.
        `tokens_after`: how many tokens the caller will add after this batch, when it knows (see the class)."""
        self._land()
        if not items:
            return
        aux = torch.cat([a for _, a, _, _, _ in items])  # (T, n*H): every sample's rows, one after the other
        last = torch.cat([h for _, _, h, _, _ in items])  # (T, H)
        finite = torch.isfinite(aux).all(-1) & torch.isfinite(last).all(-1)  # (T,), checked once it lands
        stored = {f"{kind}{suffix}": tensor for kind, value in (("aux", aux), ("last", last))
                  for suffix, tensor in quantize_rows(value, self.dtype).items()}
        hosts, wait = dev.device_to_host_async([finite, *stored.values()])
        meta = [(i, a.shape[0], ids, mask) for i, a, _, ids, mask in items]
        per_token = bytes_per_token(last.shape[-1], aux.shape[-1] // last.shape[-1], self.dtype)
        in_tail = tokens_after is not None and tokens_after * per_token < self.max_shard_bytes
        limit = max(1, self.max_shard_bytes // self.TAIL_SHARD_FRACTION) if in_tail else self.max_shard_bytes
        self._in_flight = (meta, list(stored), hosts, wait, per_token, limit)
        self.done.update(i for i, *_ in meta)

    def _land(self) -> None:
        """The batch in flight into the open shard (each sample's tensors are views of the batch's host copy), then
        the shard to the writer threads if it is full."""
        if self._in_flight is None:
            return
        meta, names, hosts, wait, per_token, limit = self._in_flight
        self._in_flight = None
        wait()
        # out of the pinned staging copies at once, so the pinned pool stays two batches deep: a new pinned block
        # is a host allocation that waits for the device, the very stall the queued copies avoid
        hosts = [h.clone() if h.is_pinned() else h for h in hosts]
        lengths = [n for _, n, _, _ in meta]
        finite = hosts[0].split(lengths)
        parts = [h.split(lengths) for h in hosts[1:]]
        for j, (i, n, input_ids, loss_mask) in enumerate(meta):
            if not bool(finite[j].all()):
                raise StoreError(f"collect: the target's hidden states for sample {i} are not finite (NaN or inf): "
                                 "its weights hold a NaN, or it overflows (try model.dtype=float32)")
            for name, part in zip(names, parts):
                self._pending[f"{i}.{name}"] = part[j]
            self._pending[f"{i}.input_ids"] = torch.tensor(input_ids, dtype=torch.int32)
            self._pending[f"{i}.loss_mask"] = torch.tensor(loss_mask, dtype=torch.int8)
            self._pending_ids.append((i, n))
            self._pending_bytes += n * per_token
        if self._pending_bytes >= limit:
            self._submit()

    def flush(self) -> None:
        """Land the batch in flight, write the open shard and wait until every shard is on disk and on record."""
        self._land()
        self._submit()
        self._wait()

    def _wait(self) -> None:
        pending, self._recording, self._saving = self._recording, [], None
        for future in pending:
            future.result()  # a failed write raises here, in the caller's thread

    def _submit(self) -> None:
        if not self._pending_ids:
            return
        if self._saving is not None:
            self._saving.result()  # one shard being written at most
        while len(self._recording) > 1 or (self._recording and self._recording[0].done()):
            self._recording.pop(0).result()  # a failed record raises here; one shard waits for its checksum at most
        name = f"shard-r{self.rank}-{self._next_shard:05d}.safetensors"
        self._next_shard += 1
        tensors, ids = self._pending, self._pending_ids
        self._pending, self._pending_ids, self._pending_bytes = {}, [], 0
        order, prefix, offsets = shard_layout(tensors)
        self._saving = _SAVER.submit(write_shard, tensors, order, prefix, self.folder / name)
        self._recording.append(_RECORDER.submit(self._record, self._saving, name, ids, tensors, order, prefix,
                                                offsets))

    def _record(self, saved: Future, name: str, ids: list[tuple[int, int]], tensors, order, prefix, offsets) -> None:
        from draftsmith.models.checkpoint import write_json_atomic

        digest = shard_checksum(tensors, order, prefix)  # while the other thread writes the same bytes
        saved.result()
        path = self.folder / name
        self.progress["shards"].append({"name": name, "sha256_tree": digest, "bytes": path.stat().st_size,
                                        "samples": [[i, offsets[f"{i}.aux"], n] for i, n in ids]})
        write_json_atomic(self.progress, self.progress_file)  # the shard counts as done only from here


def capture_samples(capture, device, aux_layer_ids: list[int], samples, batches: list[list[int]],
                    writer: ShardWriter, desc: str = "collect") -> None:
    """Run the target's `capture` over `batches` of sample ids (right-padded) and add every sample to `writer`."""
    from tqdm.auto import tqdm

    lengths = {i: len(samples[i].input_ids) for batch in batches for i in batch}
    tokens_after = sum(lengths.values())
    with torch.no_grad(), tqdm(total=tokens_after, unit="tok", desc=desc, disable=not batches) as bar:
        for batch in batches:
            in_batch = sum(lengths[i] for i in batch)
            tokens_after -= in_batch
            width = max(lengths[i] for i in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, :lengths[i]] = torch.tensor(samples[i].input_ids)
                mask[row, :lengths[i]] = 1
            # queued, not waited for: the device may still be computing the batch before
            states = capture(dev.host_to_device(ids, device), dev.host_to_device(mask, device), aux_layer_ids)
            aux, last = states.aux_hidden, states.last_hidden  # left on the device: the writer copies what it keeps
            writer.add_batch([(i, aux[row, :lengths[i]], last[row, :lengths[i]], samples[i].input_ids,
                               samples[i].loss_mask) for row, i in enumerate(batch)], tokens_after)
            bar.update(in_batch)
    writer.flush()


def collect_rank(target, aux_layer_ids: list[int], samples, folder: Path, header: dict, *, rank: int = 0,
                 world: int = 1, max_shard_bytes: int, dtype: str, batch_tokens: int,
                 log: Callable[[str], None] = print) -> None:
    """Write this rank's share of the store (samples rank, rank + world, ...) as shards, resuming its progress."""
    lengths = [len(s.input_ids) for s in samples]
    batches = plan_batches(list(range(rank, len(samples), world)), lengths, batch_tokens)
    plan = {"header": header, "rank": rank, "world": world, "max_shard_bytes": max_shard_bytes, "dtype": dtype,
            "batches": batches}
    writer = ShardWriter(folder, rank, plan, dtype, max_shard_bytes, "a collection")
    if writer.done:
        log(f"collect: resuming rank {rank} after {len(writer.progress['shards'])} shards ({len(writer.done)} "
            "samples)")
    todo = [b for b in batches if b[0] not in writer.done]  # shards end at batch boundaries: all done or not
    capture_samples(target.capture, target.device, aux_layer_ids, samples, todo, writer, desc=f"collect r{rank}")


def write_index(folder: Path, header: dict, num_samples: int, world: int) -> dict:
    """Merge every rank's progress into index.json (atomically), check each sample is there once, and remove the
    progress files. Returns the index."""
    from draftsmith.models.checkpoint import write_json_atomic

    shards, samples = {}, [None] * num_samples
    for rank in range(world):
        path = _progress_path(folder, rank)
        if not path.is_file():
            raise StoreError(f"{path}: missing: rank {rank} has not finished its part of the collection")
        for shard in _recorded_shards(folder, path, json.loads(path.read_text())["shards"]):
            shards[shard["name"]] = {"sha256_tree": shard["sha256_tree"], "bytes": shard["bytes"],
                                     "samples": len(shard["samples"])}
            for i, offset, length in shard["samples"]:
                if samples[i] is not None:
                    raise StoreError(f"{folder}: sample {i} is in two shards ({samples[i][0]}, {shard['name']})")
                samples[i] = [shard["name"], offset, length]
    missing = [i for i, s in enumerate(samples) if s is None]
    if missing:
        raise StoreError(f"{folder}: {len(missing)} samples were not collected (first: {missing[0]}); run collect "
                         "again to finish")
    index = {**header, "checksum_leaf_bytes": CHECKSUM_LEAF_BYTES, "num_samples": num_samples,
             "num_tokens": sum(s[2] for s in samples),
             "bytes": sum(s["bytes"] for s in shards.values()), "shards": shards, "samples": samples}
    write_json_atomic(index, folder / INDEX)
    for rank in range(world):
        _progress_path(folder, rank).unlink(missing_ok=True)
    return index


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def check_disk(folder: Path, needed: int) -> None:
    probe = folder if folder.exists() else next(p for p in folder.parents if p.exists())
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise StoreError(f"{folder}: the store needs about {human_bytes(needed)} and the disk has "
                         f"{human_bytes(free)} free: free space or set data.hidden_states_path elsewhere")


# --------------------------------------------------------------------------- reading


VERIFY_BAR_BYTES = 1 << 30  # `verify` shows a progress bar from a store this large


def _weights_change(recorded: dict | None, current: dict | None) -> str:
    """What differs between two `sampled_weights` records, in words (the first weight file that differs)."""
    recorded, current = recorded or {}, current or {}
    for name in sorted(recorded.keys() | current.keys()):
        if name not in current:
            return f"{name} is gone"
        if name not in recorded:
            return f"{name} is new"
        was, now = recorded[name], current[name]
        if was["bytes"] != now["bytes"]:
            return f"{name} is {now['bytes']} bytes, {was['bytes']} at collection"
        if was["sampled_sha256"] != now["sampled_sha256"]:
            return f"{name} holds other values at the same size"
    return "no weight file differs"


DIGEST_KEYS = {"draftsmith-hidden-states/1": "sha256", STORE_FORMAT: "sha256_tree"}  # what each format checksums


def _check_checksums(index: dict, path: Path) -> str:
    """The key of the shards' checksums in a store `index` (read from `path`), fixed by its format: every shard
    must record that checksum, each shard's name must be a file of the store's folder, and a format 2 index may
    only record the piece size the writer uses. The index cannot choose how it is checked: pieces of 0 bytes
    would make every file's checksum the same, so a damaged shard would pass. One line naming the key."""
    from draftsmith.models.checkpoint import inside

    key = DIGEST_KEYS[index["format"]]
    leaf = index.get("checksum_leaf_bytes", CHECKSUM_LEAF_BYTES)
    if key == "sha256_tree" and (type(leaf) is not int or leaf != CHECKSUM_LEAF_BYTES):
        shown = repr(leaf)[:80]
        raise StoreError(f"{path}: checksum_leaf_bytes is {shown}, but a {index['format']} store is checksummed in "
                         f"pieces of {CHECKSUM_LEAF_BYTES} bytes: the index was changed after collection; collect "
                         "the store again")
    shards = index.get("shards")
    if not isinstance(shards, dict):
        raise StoreError(f"{path}: shards is not a mapping of shard names to their records: collect the store again")
    for name, recorded in shards.items():
        inside(path.parent, name, f"{path}: shard name", StoreError)
        digest = recorded.get(key) if isinstance(recorded, dict) else None
        if not (isinstance(digest, str) and len(digest) == 64) or not isinstance(recorded.get("bytes"), int):
            raise StoreError(f"{path}: shard {name!r} records no {key} checksum (64 hex digits) and byte size, as "
                             f"{index['format']} stores do: the index was changed or damaged; collect the store "
                             "again")
    return key


class HiddenStateStore:
    """A complete store, opened for training: checked against what the recipe expects (`check_matches`), every
    shard checksummed before the first step (`verify`, unless data.verify_store is false), read a batch at a time
    (memory-mapped shards: only the requested samples' bytes are read). A shard is checksummed again at its first
    read unless `verify` saw it and its size and modification time are unchanged since: a second line of defence
    that costs nothing after `verify`."""

    CHECKED = ("target", "revision", "config_sha256", "weights_header_sha256", "weights_sampled",
               "aux_layer_ids", "tokenizer_sha256", "chat_template_sha256", "data_sha256", "num_train", "hidden_size")

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        path = self.folder / INDEX
        if not path.is_file():
            raise StoreError(f"{self.folder}: no {INDEX}: not a complete hidden-state store (run draftsmith collect "
                             "with this data.hidden_states_path, or let it finish)")
        try:
            self.index = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise StoreError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
        if not isinstance(self.index, dict) or self.index.get("format") not in READABLE_FORMATS:
            shown = self.index.get("format") if isinstance(self.index, dict) else type(self.index).__name__
            raise StoreError(f"{path}: format {shown!r} is not one this draftsmith reads "
                             f"({', '.join(READABLE_FORMATS)})")
        self._digest_key = _check_checksums(self.index, path)
        self._open: dict[str, Any] = {}
        self._verified: dict[str, tuple[int, int]] = {}  # shard: (size, mtime in ns) when `verify` saw it

    def check_matches(self, expected: dict) -> None:
        """One line naming the first key whose recorded value differs from the recipe's.

        A store written before the index recorded sampled weight bytes (`weights_sampled`) is refused when the
        recipe's target is local: nothing in it could show it still belongs to the target's current weights, and a
        stale store trains a drafter for other weights without any error."""
        path = self.folder / INDEX
        for key in self.CHECKED:
            if key not in expected or self.index.get(key) == expected[key]:
                continue
            if key == "weights_sampled" and key not in self.index:
                raise StoreError(f"{path}: written by an older draftsmith without a fingerprint of the target's "
                                 f"weights, so it cannot show it belongs to {expected.get('target')}'s current "
                                 "weights: run draftsmith collect again into a new or emptied folder")
            if key == "weights_sampled":
                raise StoreError(f"{path}: the target {expected.get('target')} changed since this store was "
                                 f"collected ({_weights_change(self.index[key], expected[key])}): its states belong "
                                 "to other weights; run draftsmith collect again into a new or emptied folder")
            raise StoreError(f"{path}: {key} is {self.index.get(key)!r} but the recipe gives {expected[key]!r}: "
                             "these states belong to another target, layers, tokenizer or data; collect a store for "
                             "this recipe")

    def verify(self, rank: int = 0, world: int = 1) -> None:
        """Checksum every shard now, several at once (threads: hashlib releases the GIL), so a damaged one stops
        the run before its first step rather than hours in. With `world` processes each checksums its share
        (shards rank, rank + world, ...) and takes the others' on trust: a process that finds damage ends the
        launch. One line naming the first damaged or missing shard."""
        from tqdm.auto import tqdm

        names, seen = sorted(self.index["shards"]), {}
        for name in names:
            path, recorded = self.folder / name, self.index["shards"][name]
            if not path.is_file():
                raise StoreError(f"{path}: missing from the store")
            st = path.stat()
            if st.st_size != recorded["bytes"]:
                raise StoreError(f"{path}: {st.st_size} bytes where the index records {recorded['bytes']}: the file "
                                 "is damaged or was changed after collection; collect the store again")
            seen[name] = (st.st_size, st.st_mtime_ns)
        mine = names[rank::world]
        total = sum(self.index["shards"][name]["bytes"] for name in mine)
        with tqdm(total=total, unit="B", unit_scale=True, desc="verify store",
                  disable=rank != 0 or total < VERIFY_BAR_BYTES) as bar, \
                ThreadPoolExecutor(thread_name_prefix="draftsmith-verify") as pool:  # shut down before the bar
            digests = [pool.submit(self._checksum_matches, name, bar.update) for name in mine]
            for name, digest in zip(mine, digests):  # in name order: the first damaged shard is named
                if not digest.result():
                    for pending in digests:
                        pending.cancel()  # the shards not started yet are not read
                    raise StoreError(f"{self.folder / name}: fails its checksum: the file is damaged or was changed "
                                     "after collection; collect the store again")
        self._verified = seen

    def _checksum_matches(self, name: str, progress: Callable[[int], Any] | None = None) -> bool:
        """Whether shard `name` still matches the checksum the index records (a format 1 store: its plain sha256)."""
        recorded, path = self.index["shards"][name], self.folder / name
        if self._digest_key == "sha256_tree":  # pieces of the size the writer uses, never one the index gives
            return _checksum_file(path, CHECKSUM_LEAF_BYTES, progress) == recorded["sha256_tree"]
        return _sha256_file(path, progress) == recorded["sha256"]

    def _shard(self, name: str):
        if name not in self._open:
            from safetensors import safe_open

            path = self.folder / name
            recorded = self.index["shards"].get(name)
            if recorded is None or not path.is_file():
                raise StoreError(f"{path}: missing from the store")
            st = path.stat()
            seen = self._verified.get(name) == (st.st_size, st.st_mtime_ns)  # by `verify`, untouched since
            if not seen and not self._checksum_matches(name):
                raise StoreError(f"{path}: fails its checksum: the file is damaged or was changed after collection; "
                                 "collect the store again")
            self._open[name] = safe_open(str(path), framework="pt")
        return self._open[name]

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(aux (L, n*H), last (L, H), input ids) of sample i, on the CPU, checked finite."""
        if not 0 <= i < self.index["num_samples"]:
            raise StoreError(f"{self.folder / INDEX}: no sample {i} (the store holds {self.index['num_samples']})")
        name = self.index["samples"][i][0]
        shard = self._shard(name)
        fp8 = self.index.get("dtype") == "float8_e4m3fn"
        aux, last = (dequantize_rows(shard.get_tensor(f"{i}.{kind}"),
                                     shard.get_tensor(f"{i}.{kind}_scale") if fp8 else None) for kind in ("aux", "last"))
        if not (torch.isfinite(aux).all() and torch.isfinite(last).all()):
            raise StoreError(f"{self.folder / name}: sample {i} holds a non-finite (NaN or inf) hidden state")
        return aux, last, shard.get_tensor(f"{i}.input_ids").tolist()

    def batch(self, ids: list[int], input_ids: list[list[int]], device, dtype, packed: bool = False):
        """CapturedStates of these samples, right-padded (B, S, .) like the trainer's collate, or concatenated into
        one packed row. `input_ids` are the samples' ids as the recipe tokenized them: they must be the stored ones."""
        from draftsmith.models.target import CapturedStates

        rows = []
        for i, want in zip(ids, input_ids):
            aux, last, stored = self.sample(i)
            if stored != list(want):
                raise StoreError(f"{self.folder / self.index['samples'][i][0]}: sample {i} holds other tokens than "
                                 "the recipe's data gives it: collect a store for this data")
            rows.append((aux, last))
        if packed:
            aux = torch.cat([a for a, _ in rows])[None]
            last = torch.cat([h for _, h in rows])[None]
        else:
            width = max(a.shape[0] for a, _ in rows)
            aux = torch.zeros(len(rows), width, rows[0][0].shape[-1], dtype=rows[0][0].dtype)
            last = torch.zeros(len(rows), width, rows[0][1].shape[-1], dtype=rows[0][1].dtype)
            for r, (a, h) in enumerate(rows):
                aux[r, :a.shape[0]] = a
                last[r, :h.shape[0]] = h
        return CapturedStates(aux_hidden=aux.to(device, dtype), last_hidden=last.to(device, dtype))


class StoredCapture:
    """Stands in for `target.capture` when training reads a store: the trainer names the micro-batch's sample ids
    (`select`) before the method's loss runs, and capture returns their stored states instead of running the
    target. Shapes are checked against the batch the method passes."""

    def __init__(self, store: HiddenStateStore, device, dtype, aux_layer_ids: list[int]):
        self.store, self.device, self.dtype = store, device, dtype
        self.aux_layer_ids = list(aux_layer_ids)
        self._selected: tuple[list[int], list[list[int]]] | None = None

    def select(self, store_ids: list[int], input_ids: list[list[int]]) -> None:
        self._selected = (list(store_ids), input_ids)

    def __call__(self, input_ids, attention_mask=None, aux_layer_ids=None, position_ids=None):
        if self._selected is None:
            raise RuntimeError("StoredCapture: no samples selected for this batch")
        if aux_layer_ids is not None and list(aux_layer_ids) != self.aux_layer_ids:
            raise StoreError(f"{self.store.folder / INDEX}: holds aux layers {self.aux_layer_ids}, asked for "
                             f"{list(aux_layer_ids)}")
        ids, tokens = self._selected
        self._selected = None
        packed = position_ids is not None and attention_mask is None
        states = self.store.batch(ids, tokens, self.device, self.dtype, packed=packed)
        if tuple(states.aux_hidden.shape[:2]) != tuple(input_ids.shape):
            raise RuntimeError(f"StoredCapture: stored states {tuple(states.aux_hidden.shape[:2])} do not fit the "
                               f"batch {tuple(input_ids.shape)}")
        return states


class CachingCapture:
    """`data.hidden_states_cache` in the first epoch: the target's capture, and the states of the samples the trainer
    selects also go into the cache's shards (each sample once, also across a resumed run). `finish` completes the
    store at the end of the epoch; later epochs read it (StoredCapture)."""

    def __init__(self, capture, folder: Path, header: dict, samples, rank: int, dtype: str, max_shard_bytes: int):
        plan = {"header": header, "rank": rank, "cache": True, "dtype": dtype, "max_shard_bytes": max_shard_bytes}
        self.writer = ShardWriter(folder, rank, plan, dtype, max_shard_bytes, "a hidden-state cache")
        self.folder, self.header, self.samples, self.rank = folder, header, samples, rank
        self._capture = capture
        self._selected: list[int] | None = None

    def select(self, store_ids, input_ids=None) -> None:
        self._selected = list(store_ids)

    def __call__(self, input_ids, attention_mask=None, aux_layer_ids=None, position_ids=None):
        states = self._capture(input_ids, attention_mask, aux_layer_ids, position_ids=position_ids)
        ids, self._selected = self._selected, None
        if ids is None:
            return states
        packed = position_ids is not None and attention_mask is None
        aux, last = states.aux_hidden.detach(), states.last_hidden.detach()
        start, items = 0, []
        for row, i in enumerate(ids):
            sample = self.samples[i]
            n = len(sample.input_ids)
            a, h = (aux[0, start:start + n], last[0, start:start + n]) if packed else (aux[row, :n], last[row, :n])
            start += n
            if i not in self.writer.done:
                items.append((i, a, h, sample.input_ids, sample.loss_mask))
        self.writer.add_batch(items)
        return states

    def finish(self, device, aux_layer_ids: list[int], world: int, batch_tokens: int, barrier) -> None:
        """Flush, capture what no micro-batch brought (held-out samples, the tail of the epoch, batches lost to a
        kill) split over the ranks, then (rank 0) the index."""
        self.writer.flush()
        barrier()
        seen = set()
        for path in self.folder.glob("progress-r*.json"):
            seen |= {i for shard in json.loads(path.read_text())["shards"] for i, _, _ in shard["samples"]}
        missing = [i for i in range(len(self.samples)) if i not in seen][self.rank::world]
        lengths = [len(s.input_ids) for s in self.samples]
        capture_samples(self._capture, device, aux_layer_ids, self.samples,
                        plan_batches(missing, lengths, batch_tokens), self.writer, desc="cache")
        barrier()
        if self.rank == 0:
            write_index(self.folder, self.header, len(self.samples), world)
        barrier()
