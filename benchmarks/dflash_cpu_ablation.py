"""DFlash optimizer, learning rate and loss, one change at a time, on the CPU: held-out slot accuracy after a fixed number
of steps on the fixture target's own answers.

Why on the CPU: the fixture target is small enough that its features for a few hundred samples are captured once
and each variant trains the same batches in the same order, so variants differ only in what they change. It is a
learning-speed probe (short blocks, few anchors, 256-token samples), not a quality figure: the GPU runs of
`benchmarks/gpu_drafter_quality.sh` measure acceptance.

    python -m benchmarks.dflash_cpu_ablation --out benchmarks/results/dflash_6min_h200/cpu_ablation.json \
        --variant adamw_1e-3:optimizer=adamw,lr=1e-3 --variant muon_1e-3:optimizer=muon,lr=1e-3 ...
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from benchmarks.common import write_json
from benchmarks.runinfo import run_info
from draftsmith.data import load_conversations
from draftsmith.data.tokenize import tokenize_conversations
from draftsmith.models.dflash.config import DflashDrafterConfig
from draftsmith.models.dflash.loss import block_labels, dflash_loss, sample_anchors, teacher_argmax, teacher_rows
from draftsmith.models.dflash.model import DflashDrafter, init_drafter
from draftsmith.models.target import TargetModel, load_target_tokenizer
from draftsmith.train.optim import muon_groups
from draftsmith.train.batching import collate


def captured(target, config, samples, batch_size, pad_id):
    """(input_ids, loss_mask, aux_hidden, teacher argmax, last hidden) per batch of the trainer's padded batches,
    captured once."""
    out = []
    for i in range(0, len(samples), batch_size):
        batch = collate(samples[i:i + batch_size], pad_id, "cpu")
        with torch.no_grad():
            cap = target.capture(batch["input_ids"], batch["attention_mask"], config.aux_layer_ids)
            out.append((batch["input_ids"], batch["loss_mask"], cap.aux_hidden,
                        teacher_argmax(cap.last_hidden, target.lm_head), cap.last_hidden))
    return out


def slot_accuracy(drafter, target, batches, config, anchors):
    """Held-out accuracy per slot, anchors drawn with a fixed seed."""
    g = torch.Generator().manual_seed(1)
    correct = torch.zeros(config.block_size - 1)
    count = torch.zeros(config.block_size - 1)
    with torch.no_grad():
        for ids, loss_mask, aux, teacher, _ in batches:
            pos, valid_blocks = sample_anchors(loss_mask, anchors, g)
            hidden = drafter(aux, target.embed_tokens(ids.gather(1, pos)), pos)
            labels, valid = block_labels(teacher, loss_mask, pos, valid_blocks, config.block_size)
            _, m = dflash_loss(hidden, target.lm_head.weight, labels, valid, 7.0)
            for i in range(config.block_size - 1):
                correct[i] += m[f"acc_{i}"] * m[f"count_{i}"]
                count[i] += m[f"count_{i}"]
    return (correct / count.clamp(min=1)).tolist()


def init_layers_from_target(drafter, target) -> None:
    """init=target: start each draft layer as one of the target's top layers (the names and shapes a DFlash layer
    shares with a Llama layer; q_norm/k_norm stay at one). Measured worse than the random start (README of
    results/drafters_6min_h200), so it lives here and not in the model."""
    top = target.layers[len(target.layers) - len(drafter.layers):]
    with torch.no_grad():
        for layer, source in zip(drafter.layers, top):
            theirs = dict(source.named_parameters())
            for name, param in layer.named_parameters():
                if name in theirs:
                    param.copy_(theirs[name].to(param.dtype))


def run_variant(target, config, train, held_out, settings, args):
    torch.manual_seed(0)
    drafter = DflashDrafter(config)
    init_drafter(drafter, target.embed_tokens.weight)
    if settings.get("init", "random") == "target":
        init_layers_from_target(drafter, target)
    lr = float(settings.get("lr", 1e-3))
    gamma = float(settings.get("gamma", 7.0))
    if settings.get("optimizer", "adamw") == "muon":
        matrices, rest = muon_groups(drafter)
        optimizers = [torch.optim.Muon(matrices, lr=lr, adjust_lr_fn="match_rms_adamw"),
                      torch.optim.AdamW(rest, lr=lr, weight_decay=0.0)]
    else:
        optimizers = [torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.0)]
    start = time.perf_counter()
    for step in range(args.steps):
        ids, loss_mask, aux, teacher, last_hidden = train[step % len(train)]
        pos, valid_blocks = sample_anchors(loss_mask, args.anchors)
        with torch.no_grad():
            anchor_embeds = target.embed_tokens(ids.gather(1, pos))
        labels, valid = block_labels(teacher, loss_mask, pos, valid_blocks, config.block_size)
        soft = (teacher_rows(last_hidden, pos, valid, config.block_size)
                if settings.get("loss", "ce") == "soft_ce" else None)
        loss, _ = dflash_loss(drafter(aux, anchor_embeds, pos), target.lm_head.weight, labels, valid, gamma, soft)
        for o in optimizers:
            o.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        factor = min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / args.steps))  # warmup, cosine
        for o in optimizers:
            for group in o.param_groups:
                group["lr"] = lr * factor
            o.step()
    acc = slot_accuracy(drafter, target, held_out, config, args.anchors)
    return {"settings": settings, "held_out_slot_accuracy": [round(a, 4) for a in acc],
            "train_seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=".fixture/sharegpt-llama-19m")
    p.add_argument("--data", default=".devdata/regenerated/regenerated.jsonl")
    p.add_argument("--samples", type=int, default=700, help="records read; the first --eval-samples are held out")
    p.add_argument("--eval-samples", type=int, default=96)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--anchors", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--variant", action="append", required=True, metavar="NAME:key=value,...",
                   help="optimizer=adamw|muon, lr=..., loss=ce|soft_ce, gamma=..., init=random|target; repeat for each variant")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    variants = {}
    for text in args.variant:
        name, _, body = text.partition(":")
        variants[name] = dict(item.split("=", 1) for item in body.split(",") if item)

    target = TargetModel.from_pretrained(args.target, dtype="float32", device="cpu")
    tokenizer = load_target_tokenizer(args.target, "--target")
    convs, _ = load_conversations(args.data, on_malformed="skip", max_samples=args.samples)
    samples, _ = tokenize_conversations(tokenizer, convs, args.max_length, "truncate", progress=False)
    config = DflashDrafterConfig.from_target(target.config, num_layers=args.layers, block_size=args.block_size,
                                             learned_mask=True)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    held_out = captured(target, config, samples[:args.eval_samples], args.batch_size, pad_id)
    train = captured(target, config, samples[args.eval_samples:], args.batch_size, pad_id)
    results = {}
    for name, settings in variants.items():
        results[name] = run_variant(target, config, train, held_out, settings, args)
        print(name, results[name]["held_out_slot_accuracy"], flush=True)
    report = {
        **run_info(device="cpu"), "threads": torch.get_num_threads(),
        "setup": {"train_samples": len(samples) - args.eval_samples, "held_out_samples": args.eval_samples,
                  "max_length": args.max_length, "batch_size": args.batch_size, "steps": args.steps,
                  "block_size": args.block_size, "anchors": args.anchors, "layers": args.layers,
                  "schedule": "20 warmup steps, cosine to 0", "max_grad_norm": 1.0},
        "variants": results,
    }
    write_json(report, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
