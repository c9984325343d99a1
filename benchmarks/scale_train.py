"""Sharded training across the GPUs of one host: `draftsmith train` launched as users launch it (accelerate launch
with recipes/accelerate/ddp.yaml, fsdp.yaml, deepspeed_zero2.yaml or deepspeed_zero3.yaml), EAGLE-3 online on random-weight targets
built from config and saved once (no download): tokens/s per GPU, peak memory of every process, and scaling
efficiency, in one JSON.

    python -m benchmarks.scale_train --gpus 1,2,4,8 --out scale_train.json \
        --runs "8b:ddp 8b:fsdp2 8b:zero2 8b:zero3 70bL16:ddp 70bL16:fsdp2+shard_target 70b:fsdp2+shard_target"

A run is SHAPE:SHARDING[+shard_target], measured at every world size of --gpus that this host has (the others are
recorded as not run, so the first machine with more GPUs measures them with this same command):

    SHAPE     8b (Llama-3.1-8B), 70b (Llama-3.1-70B: 140 GB of bf16 weights, larger than one H200), 70bL<N> (the
              70B shape cut to its first N decoder layers, to fit one GPU as the baseline), fixture (the shape of
              the 19M fixture target: the CPU smoke run)
    SHARDING  ddp (the whole drafter on each process), fsdp2, zero2 or zero3 (DeepSpeed ZeRO-2 / ZeRO-3; all
              draftsmith/distributed.py); +shard_target (fsdp2) also
              shards the target's decoder layers (training.shard_target; needs 2 processes or more)

Each run trains --warmup + --steps optimizer steps of --batch sequences of --seq tokens per process (global batch:
batch x processes); the figures are the medians over the steps after the warm-up (compilation and allocator
growth fall there). tokens/s per GPU is the trainer's logged global rate over the processes; scaling efficiency is
a run's tokens/s per GPU over that of the same SHAPE at one process (its ddp run where there is one). Peak memory
is torch's peak allocation of each process (metrics.jsonl `peak_memory_gib_per_process`). A run that fails or runs
out of memory is recorded with its last error line and the next starts.

The drafter trains eager (training.compile_drafter=false) under every sharding, so the runs compare sharding alone.
The target's tokenizer (for the synthetic conversations and the chat template) is the fixture's (--tokenizer)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.common import write_json
from benchmarks.runinfo import ROOT, run_info
from benchmarks.shapes import FIXTURE, LLAMA_31_8B

LLAMA_31_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                    tie_word_embeddings=False)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
DEFAULT_TOKENIZER = next((p for p in (ROOT / ".fixture" / "sharegpt-llama-19m",
                                      ROOT.parent / "shared" / "fixtures" / "targets" / "sharegpt-llama-19m")
                          if p.is_dir()), ROOT / ".fixture" / "sharegpt-llama-19m")
RUN = re.compile(r"^(8b|70b|70bL\d+|fixture):(ddp|fsdp2|zero2|zero3)(\+shard_target)?$")


def shape_of(name: str) -> dict:
    if name == "8b":
        return dict(LLAMA_31_8B)
    if name == "fixture":
        return dict(FIXTURE)
    layers = int(name[4:]) if name.startswith("70bL") else 80
    return {**LLAMA_31_70B, "num_hidden_layers": layers}


def parse_runs(text: str) -> list[tuple[str, str, bool]]:
    runs = []
    for item in text.split():
        match = RUN.match(item)
        if not match:
            raise SystemExit(f"--runs: {item!r} is not SHAPE:SHARDING[+shard_target] with SHAPE 8b, 70b, 70bL<N> or "
                             "fixture and SHARDING ddp, fsdp2, zero2 or zero3")
        runs.append((match[1], match[2], bool(match[3])))
    return runs


def write_random_target(shape: dict, folder: Path, tokenizer: Path, device: torch.device) -> Path:
    """A Llama of `shape` with random bf16 weights as a Hugging Face folder, one safetensors file per decoder layer
    (built on the meta device and filled a layer at a time: a 70B target never sits in memory whole), with the
    tokenizer's files. Kept: a folder whose config matches is reused."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**shape, torch_dtype="bfloat16")
    if (folder / "model.safetensors.index.json").is_file() and json.loads(
            (folder / "config.json").read_text()).get("num_hidden_layers") == shape["num_hidden_layers"]:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    groups: dict[str, list[tuple[str, torch.Size]]] = {}
    for name, param in model.state_dict().items():
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        groups.setdefault(f"layer-{int(layer[1]):05d}" if layer else "rest", []).append((name, param.shape))
    generator = torch.Generator(device).manual_seed(0)
    weight_map, total = {}, 0
    for group, entries in groups.items():
        tensors = {}
        for name, size in entries:
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(size, dtype=torch.bfloat16)
            else:
                tensors[name] = (torch.randn(size, generator=generator, device=device) * 0.02).to(
                    torch.bfloat16).cpu()
            total += tensors[name].nbytes
            weight_map[name] = f"model-{group}.safetensors"
        save_file(tensors, str(folder / f"model-{group}.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, folder / name)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return folder


def write_conversations(path: Path, tokenizer_dir: Path, count: int, tokens: int) -> Path:
    """`count` chats whose answer is `tokens` random tokens of the tokenizer (data.on_long: truncate cuts each
    sample to --seq): the content does not matter to the speed."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    generator = torch.Generator().manual_seed(0)
    top = min(len(tokenizer), 16000)
    with path.open("w") as f:
        for i in range(count):
            ids = torch.randint(100, top, (tokens,), generator=generator).tolist()
            f.write(json.dumps({"conversations": [{"from": "human", "value": f"Question {i}"},
                                                  {"from": "gpt", "value": tokenizer.decode(ids)}]}) + "\n")
    return path


def recipe_for(target: Path, data: Path, out: Path, cache: Path, sharding: str, shard_target: bool, args,
               on_cpu: bool) -> dict:
    return {
        "model": {"target": str(target), "method": "eagle3", "draft_vocab_size": args.draft_vocab,
                  "dtype": "float32" if on_cpu else "bfloat16"},
        "data": {"path": str(data), "max_length": args.seq, "on_long": "truncate", "eval_samples": 0,
                 "cache_dir": str(cache)},
        "training": {"max_steps": args.warmup + args.steps, "batch_size": args.batch, "grad_accum_steps": 1,
                     "lr": 1e-4, "log_every": 1, "eval_every": 10**6, "save_every": 10**6,
                     "compile_drafter": False, "shard_target": shard_target,
                     # on a CPU accelerate's launcher passes no FSDP config on: the recipe asks itself
                     "sharding": sharding if on_cpu else "auto"},
        "output_dir": str(out),
    }


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(world: int, sharding: str, recipe: Path, on_cpu: bool) -> tuple[list[str], dict]:
    """The command a user types: accelerate launch with the repository's launcher config (torchrun with
    ACCELERATE_USE_CPU on a CPU, as tests/test_multiprocess.py runs accelerate's multi-CPU mode)."""
    env = dict(os.environ)
    if on_cpu:
        env.update(ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
        return ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_addr",
                 "127.0.0.1", "--master_port", str(free_port()), "-m", "draftsmith.train", str(recipe)], env)
    configs = {"fsdp2": "fsdp.yaml", "zero2": "deepspeed_zero2.yaml", "zero3": "deepspeed_zero3.yaml"}
    config = ROOT / "recipes" / "accelerate" / configs.get(sharding, "ddp.yaml")
    return ([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes",
             str(world), "-m", "draftsmith.train", str(recipe)], env)


def measure(rows: list[dict], warmup: int, world: int) -> dict:
    steady = [r for r in rows if r["step"] > warmup]
    if not steady:
        return {"error": "no step after the warm-up was logged"}
    rate = statistics.median(r["tokens_per_s"] for r in steady)
    result = {"steps_measured": len(steady), "tokens_per_s": round(rate, 1),
              "tokens_per_s_per_gpu": round(rate / world, 1)}
    per_process = [r.get("peak_memory_gib_per_process") or ([r["peak_memory_gib"]] if "peak_memory_gib" in r else [])
                   for r in steady]
    if per_process and per_process[-1]:
        result["peak_memory_gib_per_process"] = [max(col) for col in zip(*per_process)]
    return result


def run_one(shape: str, sharding: str, shard_target: bool, world: int, args, workdir: Path, on_cpu: bool) -> dict:
    from draftsmith.config import recipe_from_dict, save_recipe

    name = f"{shape}:{sharding}{'+shard_target' if shard_target else ''}@{world}"
    row = {"run": name, "shape": shape, "sharding": sharding, "shard_target": shard_target, "processes": world,
           "seq": args.seq, "batch_per_process": args.batch}
    if shard_target and world < 2:
        return {**row, "not_run": "training.shard_target needs 2 processes or more"}
    device = torch.device("cpu" if on_cpu else "cuda")
    target = write_random_target(shape_of(shape), workdir / f"target-{shape}", args.tokenizer, device)
    count = max(args.batch * world * (args.warmup + args.steps) + 8, 16)
    data = write_conversations(workdir / f"chats-{count}-{args.seq}.jsonl", args.tokenizer, count, args.seq + 64)
    out = workdir / "runs" / re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    recipe_path = out / "recipe.yaml"
    save_recipe(recipe_from_dict(recipe_for(target, data, out / "run", workdir / "cache", sharding, shard_target,
                                            args, on_cpu)), recipe_path)
    command, env = launch_command(world, sharding, recipe_path, on_cpu)
    row["command"] = " ".join(command)
    print(f"{name}: {row['command']}", flush=True)
    with (out / "train.log").open("w") as log:
        try:
            done = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
            code = done.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    for checkpoint in (out / "run").glob("checkpoint-*"):  # the drafter's weights and AdamW state: GBs a run
        shutil.rmtree(checkpoint, ignore_errors=True)
    lines = (out / "train.log").read_text(errors="replace").splitlines()
    sharded_lines = [line for line in lines if line.startswith(("sharding:", "target: decoder layers"))]
    row["trainer_says"] = sharded_lines[:2]
    metrics = out / "run" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    rows = [r for r in rows if "tokens_per_s" in r]
    if code != 0:
        errors = [line for line in lines if "Error" in line or "error:" in line]
        return {**row, "error": (errors[-1] if errors else f"exit {code}")[:400]}
    return {**row, **measure(rows, args.warmup, world)}


def with_efficiency(results: list[dict]) -> list[dict]:
    """Each run's tokens/s per GPU over its shape's at one process (the ddp run where there is one)."""
    base = {}
    for r in sorted(results, key=lambda r: r["sharding"] != "ddp"):
        if r["processes"] == 1 and "tokens_per_s_per_gpu" in r:
            base.setdefault(r["shape"], r["tokens_per_s_per_gpu"])
    for r in results:
        if "tokens_per_s_per_gpu" in r and r["shape"] in base:
            r["scaling_efficiency"] = round(r["tokens_per_s_per_gpu"] / base[r["shape"]], 3)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="8b:ddp 8b:fsdp2 70bL16:ddp 70bL16:fsdp2+shard_target",
                        help="SHAPE:SHARDING[+shard_target] ... (the module docstring)")
    parser.add_argument("--gpus", default="1,2,4,8", help="world sizes; those above this host's GPUs are not run")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4, help="sequences per process and step")
    parser.add_argument("--steps", type=int, default=10, help="measured steps, after --warmup")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/scale_train"))
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per run")
    parser.add_argument("--keep-targets", action="store_true", help="keep each shape's target folder for a rerun")
    parser.add_argument("--cpu", action="store_true", help="CPU processes over gloo (the smoke test)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not (args.tokenizer / "tokenizer_config.json").is_file():
        raise SystemExit(f"--tokenizer {args.tokenizer}: no tokenizer there (python -m benchmarks.prepare_fixture_data "
                         "copies the fixture's to .fixture/)")
    runs = parse_runs(args.runs)
    worlds = [int(w) for w in args.gpus.split(",")]
    info = run_info()
    available = (os.cpu_count() or 1) if args.cpu else info["gpu_count"]
    args.workdir.mkdir(parents=True, exist_ok=True)
    report = {**info, "settings": {k: str(v) for k, v in vars(args).items()}, "gpus_on_this_host": available,
              "runs": []}
    shapes = list(dict.fromkeys(shape for shape, _, _ in runs))
    for shape in shapes:  # one target on disk at a time (a 70B one is 140 GB)
        for world in worlds:
            for _, sharding, shard_target in [r for r in runs if r[0] == shape]:
                if world > available:
                    report["runs"].append({"run": f"{shape}:{sharding}{'+shard_target' if shard_target else ''}"
                                                  f"@{world}", "processes": world,
                                           "not_run": f"this host has {available} devices"})
                    continue
                report["runs"].append(run_one(shape, sharding, shard_target, world, args, args.workdir, args.cpu))
                with_efficiency([r for r in report["runs"] if "shape" in r])
                write_json(report, args.out)  # after every run: a cut-short call keeps what it measured
                print(json.dumps(report["runs"][-1]), flush=True)
        if not args.keep_targets:
            shutil.rmtree(args.workdir / f"target-{shape}", ignore_errors=True)
    write_json(report, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
