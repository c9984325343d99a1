"""Hidden-state collection at scale, side by side in one process: collection against the target's forward-only
rate, bytes per token against the theory, and training from the store (bf16, FP8) against online training.

    python -m benchmarks.collect_store --recipe recipes/eagle3_fixture.yaml --out collect_store.json \
        --work /tmp/collect --answers .devdata/mtbench_greedy_fp32.json data.path=.devdata/regenerated.jsonl

For the fixture target of the recipe, and (unless --no-8b) a Llama-3.1-8B-shaped target with random bf16 weights
built from config (no download) over the first --shape-tokens tokens of the same samples:

- forward only: `target.capture` over the batches `collect` plans (collect.batch_tokens padded tokens, longest
  first), states left on the device, nothing written; timed on a second pass (the first pays first-use costs);
- collection: the same batches through `collect_rank` and `write_index`, the code `draftsmith collect` runs once
  its target is loaded (device-to-host copies, safetensors shards written in the background, checksums, index);
  also its rate without the final flush, which a long collection pays once;
- bytes per token: the store's shard bytes over its tokens, against (n_aux + 1) * H * itemsize (what the issue
  calls theoretical) and against draftsmith's own count (+ int32 token id, int8 loss mask, FP8 scales);
- training (fixture only, --train-minutes each, time-budgeted): online, from the bf16 store and from the FP8
  store, with tokens/s and the simulated greedy acceptance over --answers (benchmarks/acceptance.py).

Every part is saved to --out as it finishes. --tiny runs a tiny random shape instead of the 8B one (a CPU smoke);
--shape-dtypes picks the 8B shape's store dtypes and --shape-writers its writers (`shard_writer`: draftsmith's,
the safetensors library's, none), --no-fixture skips the fixture's collections and the training.
`--host-path GB` measures only the host side (ShardWriter against sequential writes) on synthetic states.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import write_json
from benchmarks.runinfo import run_info
from benchmarks.shapes import LLAMA_31_8B, TINY, random_target
from draftsmith import device as dev
from draftsmith.data.store import collect_rank, plan_batches, store_header, write_index
from draftsmith.models.eagle3.section import default_aux_layer_ids




def forward_only(target, aux_ids, samples, batches) -> tuple[float, float]:
    """Seconds for the target's capture over `batches`, built as capture_samples builds them, nothing kept: a
    second pass (warm), and the first."""
    device = target.device

    def run(batch):
        width = max(len(samples[i].input_ids) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):
            n = len(samples[i].input_ids)
            ids[row, :n] = torch.tensor(samples[i].input_ids)
            mask[row, :n] = 1
        target.capture(ids.to(device), mask.to(device), aux_ids)

    def timed_pass() -> float:
        dev.synchronize(device)
        start = time.perf_counter()
        for batch in batches:
            run(batch)
        dev.synchronize(device)
        return time.perf_counter() - start

    # The first pass over the batches pays first-use costs of every batch width (allocator growth, kernel
    # choices): on the 8B shape it ran at about half the rate of the second (16k against 30k tok/s, H200). The rate
    # collection is held to is the warm one; the first pass is reported beside it.
    with torch.no_grad():
        first = timed_pass()
        return timed_pass(), first


@contextlib.contextmanager
def shard_writer(kind: str):
    """The writer a collection runs with: `product` (draftsmith's: safetensors written from memory, checksummed
    from memory in a second thread, 64 MiB pieces at once), `sha256` (the same with one sha256 stream a shard, as
    before the tree checksum), `library` (what it was before: safetensors' save_file, then the file read
    back for its checksum) or `no-save` (shards neither written nor checksummed: the device and main-thread path
    alone, the bound a writer can reach). Also times the final flush (landing the last batch, waiting for the last
    shard), a cost a long collection pays once."""
    import draftsmith.data.store as store
    from draftsmith.models.checkpoint import save_safetensors_atomic

    saved = {name: getattr(store, name) for name in ("write_shard", "shard_checksum")}
    flush, timing = store.ShardWriter.flush, {"final_flush_seconds": 0.0}
    if kind == "library":
        pending = {}

        def write_shard(tensors, order, prefix, path):
            save_safetensors_atomic({n: tensors[n] for n in order}, path)
            pending[id(tensors)] = path

        def shard_checksum(tensors, order, prefix):  # runs beside write_shard: read the file back once it is there
            while id(tensors) not in pending:
                time.sleep(0.005)
            return store._checksum_file(pending.pop(id(tensors)))
    elif kind == "sha256":
        def shard_checksum(tensors, order, prefix):  # one sha256 stream over the whole shard, from memory
            return store._leaf_digest(list(store._shard_bytes(tensors, order, prefix))).hex()
    elif kind == "no-save":
        def write_shard(tensors, order, prefix, path):
            path.touch()

        def shard_checksum(tensors, order, prefix):
            return ""
    elif kind != "product":
        raise ValueError(f"writer {kind!r}: product, sha256, library or no-save")

    def timed_flush(self):
        start = time.perf_counter()
        flush(self)
        timing["final_flush_seconds"] += time.perf_counter() - start

    try:
        if kind == "sha256":
            store.shard_checksum = shard_checksum
        elif kind != "product":
            store.write_shard, store.shard_checksum = write_shard, shard_checksum
        store.ShardWriter.flush = timed_flush
        yield timing
    finally:
        for name, fn in saved.items():
            setattr(store, name, fn)
        store.ShardWriter.flush = flush


def measure_collection(name, target, aux_ids, tokenizer, samples, num_train, folder: Path, dtype, batch_tokens,
                       max_shard_bytes, target_name, writer: str = "product") -> dict:
    lengths = [len(s.input_ids) for s in samples]
    tokens = sum(lengths)
    batches = plan_batches(list(range(len(samples))), lengths, batch_tokens)
    forward_s, first_pass_s = forward_only(target, aux_ids, samples, batches)
    shutil.rmtree(folder, ignore_errors=True)
    header = store_header(target_name, tokenizer, aux_ids, target.config.hidden_size, samples, num_train, dtype)
    dev.synchronize(target.device)
    with shard_writer(writer) as timing:
        start = time.perf_counter()
        collect_rank(target, aux_ids, samples, folder, header, max_shard_bytes=max_shard_bytes, dtype=dtype,
                     batch_tokens=batch_tokens, log=lambda *a: None)
        index = write_index(folder, header, len(samples), 1)
        collect_s = time.perf_counter() - start
    before_flush_s = collect_s - timing["final_flush_seconds"]
    hidden = target.config.hidden_size
    theory = (len(aux_ids) + 1) * hidden * getattr(torch, dtype).itemsize
    row = {"target": name, "dtype": dtype, "writer": writer, "samples": len(samples), "tokens": tokens,
           "batches": len(batches),
           "batch_tokens": batch_tokens, "aux_layer_ids": list(aux_ids), "hidden_size": hidden,
           "forward_only_seconds": round(forward_s, 3), "forward_only_tokens_per_s": round(tokens / forward_s),
           "forward_only_first_pass_tokens_per_s": round(tokens / first_pass_s),
           "collect_seconds": round(collect_s, 3), "collect_tokens_per_s": round(tokens / collect_s),
           "collect_over_forward_only": round(forward_s / collect_s, 3),
           "final_flush_seconds": round(timing["final_flush_seconds"], 3),
           # the rate a long collection approaches: the final flush (the last shard written and checksummed after
           # the last forward) is paid once, and is a large share of a short measurement
           "collect_tokens_per_s_without_final_flush": round(tokens / before_flush_s),
           "collect_without_final_flush_over_forward_only": round(forward_s / before_flush_s, 3),
           "store_bytes": index["bytes"], "shards": len(index["shards"]),
           "bytes_per_token": round(index["bytes"] / tokens, 2), "theoretical_bytes_per_token": theory,
           "store_over_theoretical": round(index["bytes"] / (tokens * theory), 4)}
    print(f"{name} {dtype} ({writer} writer): forward {row['forward_only_tokens_per_s']:,} tok/s, "
          f"collect {row['collect_tokens_per_s']:,} tok/s ({row['collect_over_forward_only']:.2f}x), "
          f"{row['bytes_per_token']} B/token vs {theory} ({row['store_over_theoretical']:.3f}x), final flush "
          f"{row['final_flush_seconds']:.1f} s (without it {row['collect_tokens_per_s_without_final_flush']:,} tok/s, "
          f"{row['collect_without_final_flush_over_forward_only']:.2f}x)", flush=True)
    return row


def host_path(folder: Path, gigabytes: float, hidden: int = 4096, num_aux: int = 3, length: int = 512) -> dict:
    """The collector's host side alone, on synthetic bf16 states of an 8B-shaped target: ShardWriter (shards
    written in one thread, checksummed and recorded in another, while the caller goes on) with draftsmith's
    writer and with safetensors' (`shard_writer`), against the same shards written and checksummed one after the
    other in the caller, as collection did first."""
    from draftsmith.data.store import ShardWriter, _checksum_file
    from draftsmith.models.checkpoint import save_safetensors_atomic

    count = int(gigabytes * 1e9 / (length * (num_aux + 1) * hidden * 2))
    aux = torch.randn(length, num_aux * hidden).to(torch.bfloat16)
    last = torch.randn(length, hidden).to(torch.bfloat16)
    ids, mask = list(range(length)), [1] * length
    shard_bytes = 500_000_000
    shutil.rmtree(folder, ignore_errors=True)
    seconds = {}
    for kind in ("library", "product"):
        with shard_writer(kind):
            start = time.perf_counter()
            writer = ShardWriter(folder / kind, 0, {"bench": 1}, "bfloat16", shard_bytes, "a benchmark")
            for i in range(count):
                writer.add_batch([(i, aux, last, ids, mask)])
            writer.flush()
            seconds[kind] = time.perf_counter() - start
        shutil.rmtree(folder / kind, ignore_errors=True)
    threaded = seconds["product"]
    start = time.perf_counter()
    pending, size, n = {}, 0, 0
    for i in range(count):
        pending.update({f"{i}.aux": aux.clone(), f"{i}.last": last.clone(),
                        f"{i}.input_ids": torch.tensor(ids, dtype=torch.int32),
                        f"{i}.loss_mask": torch.tensor(mask, dtype=torch.int8)})
        size += length * ((num_aux + 1) * hidden * 2 + 5)
        if size >= shard_bytes or i == count - 1:
            path = folder / "sequential" / f"shard-{n:05d}.safetensors"
            path.parent.mkdir(parents=True, exist_ok=True)
            save_safetensors_atomic(pending, path)
            _checksum_file(path)
            pending, size, n = {}, 0, n + 1
    sequential = time.perf_counter() - start
    total = count * length * ((num_aux + 1) * hidden * 2 + 5)
    shutil.rmtree(folder, ignore_errors=True)
    row = {"bytes": total, "samples": count, "sample_tokens": length, "hidden_size": hidden, "num_aux": num_aux,
           "max_shard_bytes": shard_bytes, "shard_writer_mb_per_s": round(total / threaded / 1e6),
           "shard_writer_library_mb_per_s": round(total / seconds["library"] / 1e6),
           "sequential_mb_per_s": round(total / sequential / 1e6), "ratio": round(sequential / threaded, 3),
           "product_over_library": round(seconds["library"] / threaded, 3)}
    print(f"host path: ShardWriter {row['shard_writer_mb_per_s']} MB/s (with safetensors' save_file "
          f"{row['shard_writer_library_mb_per_s']} MB/s), sequential {row['sequential_mb_per_s']} MB/s "
          f"({row['ratio']:.2f}x)", flush=True)
    return row


def train_run(name, recipe_path, overrides, minutes, answers, target32) -> dict:
    import gc

    from benchmarks.ablate_eagle3 import train_for_minutes
    from benchmarks.acceptance import simulate

    _, checkpoint, run = train_for_minutes(recipe_path, overrides, minutes)
    state = run.pop("state")
    row = {"name": name, "overrides": overrides, **run,
           "tokens_per_s": round(state["tokens_seen"] / state["train_seconds"])}
    if answers is not None:
        row["tau"] = simulate(target32, str(checkpoint), answers)["tau"]
    print(f"train {name}: {row['steps']} steps, {row['tokens_per_s']:,} tok/s"
          + (f", tau k5 {row['tau']['5']:.3f}" if "tau" in row else ""), flush=True)
    gc.collect()
    dev.empty_cache(dev.get_device())
    return row


@dev.sdpa_without_cudnn()  # as `draftsmith collect`: no cuDNN attention (device.py), forward-only too
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, required=True, help="folder for the stores and the training runs")
    p.add_argument("--answers", type=Path, default=None, help="the target's float32 greedy answers (acceptance.py)")
    p.add_argument("--train-minutes", type=float, default=0.75)
    p.add_argument("--shape-tokens", type=int, default=150_000, help="tokens collected with the 8B shape")
    p.add_argument("--no-8b", action="store_true")
    p.add_argument("--shape-dtypes", default="bfloat16", help="store dtypes collected with the 8B shape, comma-joined")
    p.add_argument("--shape-writers", default="product",
                   help="writers the 8B shape's first dtype collects with, comma-joined: product, sha256, library, "
                        "no-save (shard_writer); further dtypes collect with the product's")
    p.add_argument("--shape-repeats", type=int, default=1, help="measure the first dtype's combinations this often")
    p.add_argument("--no-fixture", action="store_true", help="skip the fixture's collections (and the training)")
    p.add_argument("--no-train", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a tiny random shape instead of the 8B one (CPU smoke)")
    p.add_argument("--deadline-seconds", type=float, default=None, help="start no part after this much wall time")
    p.add_argument("--host-path", type=float, default=None, metavar="GB",
                   help="only measure the host side of collection on GB of synthetic 8B-shaped states")
    p.add_argument("overrides", nargs="*", help="recipe overrides (data.path, data.max_samples, ...)")
    args = p.parse_args(argv)
    if args.host_path is not None:
        write_json({**run_info(), "host_path": host_path(args.work, args.host_path)}, args.out)
        return 0

    from draftsmith.config import load_recipe
    from draftsmith.data import prepare_dataset
    from draftsmith.models.target import TargetModel, load_target_tokenizer
    from draftsmith.train.setup import method_class

    began = time.time()
    recipe = load_recipe(args.recipe, args.overrides)
    tokenizer = load_target_tokenizer(recipe.model.target, "model.target", ValueError)
    data = prepare_dataset(recipe.data, tokenizer, log=lambda *a: None)
    samples = [*data.train, *data.eval]
    target = TargetModel.from_pretrained(recipe.model.target, dtype="bfloat16" if dev.get_device().type != "cpu"
                                         else "float32")
    aux_ids = method_class(recipe.model.method)(recipe, target).aux_layer_ids
    report = {**run_info(target), "recipe": args.recipe, "overrides": args.overrides, "collection": [], "training": []}

    def save():
        write_json(report, args.out)

    def time_left() -> bool:
        return args.deadline_seconds is None or time.time() - began < args.deadline_seconds

    stores = {}
    for dtype in ("bfloat16", "float8_e4m3fn") if not args.no_fixture else ():
        stores[dtype] = args.work / f"store-{dtype}"
        report["collection"].append(measure_collection(
            "fixture", target, aux_ids, tokenizer, samples, len(data.train), stores[dtype], dtype,
            recipe.collect.batch_tokens, recipe.collect.max_shard_bytes, recipe.model.target))
        save()

    if not args.no_8b and time_left():
        shape = {**TINY, "vocab_size": target.vocab_size} if args.tiny else LLAMA_31_8B  # the fixture's tokens
        device = dev.get_device()
        big = random_target(shape, target.dtype, device, "random-llama-3.1-8b-shape")
        big_aux = default_aux_layer_ids(big.num_layers)  # EAGLE-3's (vLLM's) capture ids
        chosen, total = [], 0
        for s in samples:
            if total >= args.shape_tokens:
                break
            chosen.append(s)
            total += len(s.input_ids)
        runs = [(dtype, writer) for n, dtype in enumerate(args.shape_dtypes.split(","))
                for _ in range(args.shape_repeats if n == 0 else 1)
                for writer in (args.shape_writers.split(",") if n == 0 else ["product"])]
        for dtype, writer in runs:
            if not time_left():
                print(f"skipping the 8B shape {dtype} {writer}: past the deadline", flush=True)
                continue
            report["collection"].append(measure_collection(
                "llama-3.1-8b-shape" if not args.tiny else "tiny-shape", big, big_aux, tokenizer, chosen,
                len(chosen), args.work / "store-8b", dtype, recipe.collect.batch_tokens,
                recipe.collect.max_shard_bytes, "random-llama-3.1-8b-shape", writer))
            save()
            shutil.rmtree(args.work / "store-8b", ignore_errors=True)
        del big
        dev.empty_cache(device)

    if not args.no_train and not args.no_fixture:
        from benchmarks.acceptance import load_answers

        answers = load_answers(args.answers) if args.answers else None
        target32 = TargetModel.from_pretrained(recipe.model.target, dtype="float32") if answers else None
        runs = [("online", []), ("store_bfloat16", [f"data.hidden_states_path={stores['bfloat16']}"]),
                ("store_float8_e4m3fn", [f"data.hidden_states_path={stores['float8_e4m3fn']}"])]
        for name, extra in runs:
            if not time_left():
                print(f"skipping training {name}: past the deadline", flush=True)
                continue
            report["training"].append(train_run(name, args.recipe, [*args.overrides, *extra,
                                                                   f"output_dir={args.work / ('run-' + name)}"],
                                                args.train_minutes, answers, target32))
            save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
