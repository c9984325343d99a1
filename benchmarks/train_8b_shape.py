"""Online drafter training for a Llama-3.1-8B-shaped target (random bf16 weights, built from config: no download):
tokens/s, peak memory, model FLOPs per token by term and MFU, against the target's forward-only throughput at the
same batch, all in one process.

    python -m benchmarks.train_8b_shape --out train_8b_shape.json \
        --runs "eagle3+reference:2048x16 eagle3+flex:2048x16 eagle3+reference:8192x4 eagle3+flex:8192x4 \
                eagle3:32768x1 dflash:2048x16"

A run is METHOD[+FLAG...][/reference]:SEQxBATCH. `eagle3` is the training step `draftsmith train` runs with the
recipe defaults (Eagle3Method.loss: target capture, teacher, TTT attention, fused chunked loss, under bf16 autocast
with fp32 master weights and AdamW, as accelerate's bf16 mixed precision does), its TTT attention kernel, query block
and loss chunk chosen as the trainer chooses them (recorded in each run's `ttt_attention`, `query_block`,
`loss_chunk_rows`); `+flex` and `+reference` force training.ttt_attention (FlexAttention, or the plain-torch blocked
reference); `+ckpt` adds training.checkpoint_ttt_steps, `+compile` forces training.compile_drafter and `+eager`
turns it off (its default, auto, compiles on a GPU since 2026-12-03; results before that date ran eager unless
they say +compile; compilations, the FlexAttention kernel's too, fall in the untimed warm-up steps); `+fusedloss`
(every method) sets training.loss_kernel=fused, the head losses' Triton kernel (each run records its
`loss_kernel`). `eagle3/reference` is the path training took before blocked attention (S x S scores and whole-step
logits kept for the backward pass).
`dflash` runs DflashMethod.loss, `dflash+ckpt` with dflash.checkpoint_layers, `dflash+flex` / `dflash+reference` with
training.block_attention (default: auto, as the recipes; each run records its kernel in `block_attention`); `dspark`
DsparkMethod.loss with the recipe defaults (the whole vocabulary), the same flags as dflash; `mtp` MtpMethod.loss
(one new module, mtp.num_depths from the recipe default); `eagle` EagleMethod.loss (EAGLE-1: one decoder layer,
smooth-L1 to the next state + soft CE through the target's whole head). Each run trains a fresh drafter for --steps
optimizer steps, the first --warmup untimed; a run that runs out of memory or fails is recorded as such and the next
one starts. MFU is counted with train/flops.py against the bf16 matrix rate measured in the same process (a large
matmul) and against 790 TFLOP/s (the H200 figure the issue measured). `--profile DIR` runs one more step after each
run's timed ones (outside its figures) under torch.profiler: DIR/profile_<run>.txt, its key_averages table by self
device time, and the row's `profile_top`, the top 12 kernels by self device time (CPU: self CPU time) with their
shares. Random weights and tokens make the losses meaningless but not the timing or the memory."""

from __future__ import annotations

import argparse
import gc
import re
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import write_json
from benchmarks.runinfo import run_info
from benchmarks.shapes import FIXTURE, LLAMA_31_8B, TINY, random_target
from draftsmith import device as dev
from draftsmith.config import recipe_from_dict
from draftsmith.models.eagle3.loss import teacher_targets, ttt_loss
from draftsmith.models.target import TargetModel


ISSUE_PEAK_TFLOPS = 790.0


def matmul_tflops(device, n: int = 8192) -> float | None:
    """The bf16 matrix rate of this device, measured on random data (None on CPU)."""
    if device.type == "cpu":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = dev.time_ms(lambda: a @ b, device, repeat=20)
    return 2 * n**3 / (ms / 1e3) / 1e12


FLAGS = {"ckpt": ("checkpoint_ttt_steps", True), "compile": ("compile_drafter", True),  # eagle3+FLAG: training.KEY
         "eager": ("compile_drafter", False),  # compile_drafter is auto (compiled on a GPU) since 2026-12-03
         "flex": ("ttt_attention", "flex"), "reference": ("ttt_attention", "reference"),
         "fusedloss": ("loss_kernel", "fused")}  # every method: the head losses' Triton kernel


def parse_run(text: str) -> tuple[str, bool, list[str], int, int]:
    """METHOD[+FLAG...][/reference]:SEQxBATCH -> (method, reference, flags, seq, batch)."""
    head, shape = text.split(":")
    seq, batch = (int(x) for x in shape.lower().split("x"))
    head, _, variant = head.partition("/")
    method, *flags = head.split("+")
    if (method not in ("eagle3", "eagle", "dflash", "dspark", "mtp") or variant not in ("", "reference")
            or (variant and method != "eagle3") or any(f not in FLAGS for f in flags)
            or (method in ("dflash", "dspark") and set(flags) - {"ckpt", "flex", "reference", "fusedloss"})
            or (method in ("mtp", "eagle") and set(flags) - {"fusedloss"})
            or {"flex", "reference"} <= set(flags) or (variant and {"flex", "reference"} & set(flags))):
        raise SystemExit(f"--runs: {text!r} is not eagle3[+ckpt][+compile][+flex|+reference][+fusedloss][/reference]"
                         ":SEQxBATCH (/reference: the dense path, its own attention and loss), "
                         "dflash|dspark[+ckpt][+flex|+reference][+fusedloss]:SEQxBATCH or "
                         "mtp|eagle[+fusedloss]:SEQxBATCH")
    return method, variant == "reference", flags, seq, batch


def training_keys(name: str, flags) -> dict:
    """The training.KEY values a run's flags set: FLAGS for eagle3; for dflash and dspark +flex/+reference set
    training.block_attention (their +ckpt is dflash/dspark.checkpoint_layers)."""
    if name == "eagle3":
        return dict(FLAGS[f] for f in flags)
    fused = dict([FLAGS["fusedloss"]]) if "fusedloss" in flags else {}  # every method: the head losses' kernel
    return {**fused, **({"block_attention": f for f in flags if f in ("flex", "reference")}
                        if name in ("dflash", "dspark") else {})}


def build_method(name: str, target: TargetModel, args, flags=()):
    from draftsmith.train.setup import method_class

    recipe = recipe_from_dict({
        "model": {"target": target.name_or_path, "method": name,
                  **({"draft_vocab_size": args.draft_vocab} if name == "eagle3" else {})},
        "data": {"path": "unused.jsonl", "max_length": 32768},
        "training": {"ttt_steps": args.ttt_steps, "ttt_query_block": args.query_block,
                     "loss_chunk_size": args.loss_chunk,
                     **training_keys(name, flags)},
        "output_dir": "unused",
        **({name: {"mask_token_id": target.vocab_size - 1,  # no tokenizer
                   "checkpoint_layers": "ckpt" in flags}} if name in ("dflash", "dspark") else {}),
    })
    method = method_class(name)(recipe, target)
    vocab = target.vocab_size
    d2t = torch.zeros(args.draft_vocab, dtype=torch.long)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[: args.draft_vocab] = True
    drafter = method.build_drafter(d2t, t2d)
    method.apply_training_options(drafter)  # as the trainer does
    return method, drafter


def reference_loss(method, drafter, batch):
    """The EAGLE-3 training step before blocked attention and the fused loss: whole S x S scores and logits."""
    from draftsmith.models.eagle3.model import PlainTTTKernels

    drafter.ttt_kernels = PlainTTTKernels()  # the plain-torch reference, whole S x S scores
    captured = method.target.capture(batch["input_ids"], batch["attention_mask"], method.aux_layer_ids)
    teacher, in_draft = teacher_targets(captured.last_hidden, method.target.lm_head, drafter.t2d)
    with torch.no_grad():
        embeds = method.target.embed_tokens(batch["input_ids"])
    logits = drafter.forward_ttt(captured.aux_hidden, embeds, method.ttt_steps, query_block=embeds.shape[1])
    options = {k: v for k, v in method.loss_options.items() if k not in ("chunk_size", "loss_grad")}  # whole logits
    return ttt_loss(logits, teacher, in_draft, batch["loss_mask"], **options)


def chosen_kernels(method, drafter, dense: bool, seq: int, batch: int, args) -> dict:
    """What the run computes with: EAGLE-3's TTT attention kernel and (for the reference) its query block, and the
    loss chunk's rows, as the trainer chooses them from the recipe keys (None: by size)."""
    from draftsmith.kernels.chunked_loss import loss_chunk_rows
    from draftsmith.kernels.ttt_attention import query_block_for

    loss_kernel = {"loss_kernel": getattr(method, "loss_kernel", None) or method.loss_options["loss_kernel"]}
    if method.name in ("dflash", "dspark"):
        return {"block_attention": drafter.block_kernels.options.attention, **loss_kernel}
    if method.name != "eagle3":
        return loss_kernel
    if dense:
        return {"ttt_attention": "dense", "query_block": seq, "loss_kernel": "reference",
                "loss_chunk_rows": None}  # the whole S x S scores, whole-step logits
    config = drafter.config
    options = drafter.ttt_kernels.options
    block = (None if options.attention == "flex"
             else query_block_for(batch, config.num_attention_heads, seq, method.ttt_steps, options.query_block))
    return {"ttt_attention": options.attention, "query_block": block, **loss_kernel,
            "loss_chunk_rows": loss_chunk_rows(config.draft_vocab_size, method.loss_options["chunk_size"])}


def forward_only(target: TargetModel, batch, aux_layer_ids, device, repeat: int) -> float:
    """Tokens/s of the target's capture alone (no logits, no grad) at this batch."""
    with torch.no_grad():
        for _ in range(2):
            target.capture(batch["input_ids"], batch["attention_mask"], aux_layer_ids)
        dev.synchronize(device)
        start = time.perf_counter()
        for _ in range(repeat):
            target.capture(batch["input_ids"], batch["attention_mask"], aux_layer_ids)
        dev.synchronize(device)
    return repeat * batch["input_ids"].numel() / (time.perf_counter() - start)


def _time_attr(event, *names) -> float:
    """The first of these time attributes the profiler's event has (names differ across torch versions), in us."""
    for name in names:
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def profile_step(train_step, text: str, device, folder: Path, result: dict) -> None:
    """One more training step under torch.profiler: DIR/profile_<run>.txt (key_averages sorted by self device
    time, self CPU time on CPU) and result["profile_top"], the top 12 events by that time (on an accelerator its
    kernels: the events that ran on the device, as the table's Self CUDA % counts them). A failure is recorded
    in result["profile_error"], the run's figures kept."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        accelerator = {"cuda": "CUDA", "xpu": "XPU"}.get(device.type)
        activities = [ProfilerActivity.CPU]
        if accelerator and hasattr(ProfilerActivity, accelerator):
            activities.append(getattr(ProfilerActivity, accelerator))
        on_device = len(activities) > 1
        with profile(activities=activities, record_shapes=False, with_stack=False) as prof:
            loss = train_step()
        del loss
        events = prof.key_averages()
        if on_device:
            names = ("self_device_time_total", "self_cuda_time_total")  # torch >= 2.4, before
            sort_by = next((n for n in names if events and hasattr(events[0], n)), names[0])
            ranked = [e for e in events if getattr(e, "device_type", None) != DeviceType.CPU
                      and not getattr(e, "is_user_annotation", False)]  # the kernels (and copies) themselves
        else:
            names, sort_by, ranked = ("self_cpu_time_total",), "self_cpu_time_total", list(events)
        folder.mkdir(parents=True, exist_ok=True)
        # '+' as '-' (the device tool's file transfer refuses '+'), other separators as '_': eagle3+reference and
        # eagle3/reference stay apart
        path = folder / f"profile_{re.sub(r'[^A-Za-z0-9.-]+', '_', text.replace('+', '-'))}.txt"
        path.write_text(f"{text}: one training step, sorted by {sort_by}\n"
                        + events.table(sort_by=sort_by, row_limit=30, max_name_column_width=120) + "\n")
        self_us = [(e, _time_attr(e, *names)) for e in ranked]
        total = sum(us for _, us in self_us)
        top = sorted(self_us, key=lambda pair: pair[1], reverse=True)[:12]
        result["profile_table"] = str(path)
        result["profile_top"] = [{"name": e.key[:120], "self_ms": round(us / 1e3, 3),
                                  "share": round(us / total, 3) if total else None, "calls": e.count}
                                 for e, us in top]
        for entry in result["profile_top"][:5]:
            print(f"  {text} profile: {entry['self_ms']:9.3f} ms {entry['share'] or 0:6.1%} "
                  f"x{entry['calls']:<5} {entry['name'][:80]}", flush=True)
    except Exception as e:  # noqa: BLE001 - the profile is extra: the run's figures stand without it
        message = str(e).splitlines()[0][:300] if str(e) else ""
        result["profile_error"] = f"{type(e).__name__}: {message}"
        print(f"  {text} profile failed: {result['profile_error']}", flush=True)


def one_run(target, text, args, device, measured_peak) -> dict:
    name, reference, flags, seq, batch_size = parse_run(text)
    result = {"run": text, "method": name, "path": "reference" if reference else "trainer",
              "training_keys": {**training_keys(name, flags), **({f"{name}.checkpoint_layers": True}
                                                                  if name in ("dflash", "dspark") and "ckpt" in flags
                                                                  else {})},
              "seq": seq, "batch": batch_size}
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, target.vocab_size, (batch_size, seq), generator=g).to(device),
             "attention_mask": torch.ones(batch_size, seq, dtype=torch.long, device=device),
             "loss_mask": torch.ones(batch_size, seq, dtype=torch.long, device=device)}
    method = drafter = optimizer = None
    dev.empty_cache(device)
    dev.reset_peak_memory_stats(device)
    try:
        torch.manual_seed(0)
        method, drafter = build_method(name, target, args, flags)
        result.update(chosen_kernels(method, drafter, reference, seq, batch_size, args))
        optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4, fused=None)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type != "cpu")

        def train_step():
            with autocast:
                loss, _ = reference_loss(method, drafter, batch) if reference else method.loss(drafter, batch,
                                                                                               method.target.capture)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            dev.synchronize(device)
            return loss

        times = []
        for step in range(args.steps):
            start = time.perf_counter()
            loss = train_step()
            times.append(time.perf_counter() - start)
            print(f"  {text} step {step}: {times[-1]:.3f} s, loss {float(loss):.3f}", flush=True)
        timed = times[args.warmup:]
        tokens_per_s = batch_size * seq * len(timed) / sum(timed)
        result.update(tokens_per_s=tokens_per_s, step_seconds=sum(timed) / len(timed),
                      peak_memory_gib=dev.max_memory_allocated(device) / 2**30)
        del loss
        if args.profile:  # one more step, after the figures above are measured
            profile_step(train_step, text, device, Path(args.profile), result)
            drafter.zero_grad(set_to_none=True)  # a step that failed part way leaves no gradients behind
        optimizer = None
        gc.collect()
        dev.empty_cache(device)
        result["target_forward_only_tokens_per_s"] = forward_only(target, batch, method.aux_layer_ids, device,
                                                                  max(2, len(timed)))
        result["ratio_to_forward_only"] = tokens_per_s / result["target_forward_only_tokens_per_s"]
        # the benchmark's samples are all under the loss (DFlash: min(anchors, S - 1) blocks a sequence)
        terms = method.flops_per_token(seq)
        result["gflop_per_token"] = {k: v / 1e9 for k, v in terms.items()}
        achieved = terms["total"] * tokens_per_s / 1e12
        result["tflops_per_s"] = achieved
        result["mfu_vs_790"] = achieved / ISSUE_PEAK_TFLOPS
        if measured_peak:
            result["mfu_vs_measured_matmul"] = achieved / measured_peak
        # the bound the FLOP count allows: training tokens/s over forward-only if both ran at one rate
        result["flop_bound_ratio_to_forward_only"] = (terms["target_forward"] / terms["total"])
    except torch.OutOfMemoryError as e:
        result.update(error="out of memory", message=str(e).splitlines()[0][:300],
                      peak_memory_gib=dev.max_memory_allocated(device) / 2**30)
    except Exception as e:  # noqa: BLE001 - a kernel that fails to compile here must not cost the other runs
        result.update(error=type(e).__name__, message=str(e)[:2000],
                      peak_memory_gib=dev.max_memory_allocated(device) / 2**30)
        print(f"  {text} failed: {type(e).__name__}: {str(e)[:2000]}", flush=True)
    finally:
        method = drafter = optimizer = None
        gc.collect()
        dev.empty_cache(device)
    return result


@dev.sdpa_without_cudnn()  # as `draftsmith train`: no cuDNN attention (device.py), forward-only too
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default="eagle3/reference:2048x4 eagle3:2048x4 eagle3/reference:2048x16 eagle3:2048x16 "
                                     "eagle3:8192x4 eagle3:32768x1 dflash:2048x16")
    p.add_argument("--layers", type=int, default=None, help="target decoder layers (default: the shape's own)")
    p.add_argument("--tiny", action="store_true", help="a tiny shape for a CPU smoke run")
    p.add_argument("--fixture-shape", action="store_true",
                   help="the fixture target's shape (sharegpt-llama-19m: hidden 384, 8 layers, vocabulary 16,000)")
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--query-block", type=int, default=None,
                   help="training.ttt_query_block (default: the trainer's choice by size)")
    p.add_argument("--loss-chunk", type=int, default=None,
                   help="training.loss_chunk_size (default: the trainer's choice by size)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--profile", metavar="DIR", default=None,
                   help="after each run's timed steps, one more step under torch.profiler: DIR/profile_<run>.txt "
                        "and the run's profile_top (its top 12 kernels by self device time)")
    args = p.parse_args(argv)
    device = dev.get_device()
    shape = TINY if args.tiny else FIXTURE if args.fixture_shape else LLAMA_31_8B
    if args.tiny or args.fixture_shape:
        args.draft_vocab = min(args.draft_vocab, shape["vocab_size"] // 2)
    layers = args.layers or shape["num_hidden_layers"]
    dtype = torch.bfloat16 if device.type != "cpu" else torch.float32
    name = "fixture-shape" if args.fixture_shape else "llama-3.1-8b-shape"
    target = random_target({**shape, "num_hidden_layers": layers}, dtype, device, f"random-{name}-{layers}-layers")
    measured_peak = matmul_tflops(device)
    report = {**run_info(target), "target_shape": {**shape, "num_hidden_layers": layers},
              "ttt_steps": args.ttt_steps, "draft_vocab_size": args.draft_vocab, "query_block": args.query_block,
              "loss_chunk_size": args.loss_chunk, "steps": args.steps, "warmup_steps": args.warmup,
              "measured_matmul_tflops": measured_peak, "issue_peak_tflops": ISSUE_PEAK_TFLOPS, "runs": []}
    out = Path(args.out)

    def save():
        write_json(report, out)

    for text in args.runs.split():
        report["runs"].append(one_run(target, text, args, device, measured_peak))
        save()  # a run cut short keeps what finished
    print(f"matmul {measured_peak or 0:.0f} TFLOP/s")
    print(f"{'run':28} {'attention':>10} {'tok/s':>9} {'peak GiB':>9} {'fwd tok/s':>10} {'ratio':>6} {'MFU790':>7}")
    for r in report["runs"]:
        attention = r.get("ttt_attention", r.get("block_attention", "-"))
        if "error" in r:
            print(f"{r['run']:28} {attention:>10} {r['error']} (peak {r['peak_memory_gib']:.1f} GiB)")
        else:
            print(f"{r['run']:28} {attention:>10} {r['tokens_per_s']:9.0f} {r['peak_memory_gib']:9.1f} "
                  f"{r['target_forward_only_tokens_per_s']:10.0f} {r['ratio_to_forward_only']:6.2f} "
                  f"{r.get('mfu_vs_790', float('nan')):7.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
