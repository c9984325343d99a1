"""The training loop: one function, top to bottom, for every drafter method.

Online capture: each micro-batch runs the frozen target once (`TargetModel.capture`) and the drafter's loss on
those states. accelerate supplies DDP (and FSDP / DeepSpeed through its launcher config), bf16 autocast over fp32
master weights, gradient accumulation and the trackers.

Resume is exact: a checkpoint is taken only at an optimizer-step boundary and records the epoch and the number
of micro-batches already consumed in it; the data order of an epoch is a pure function of (seed, epoch), so a
resumed run sees exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith import device as dev
from draftsmith.config import Recipe, recipe_to_dict, save_recipe
from draftsmith.train.optim import (
    MEASURE_SKIP,
    SchedulePlan,
    build_optimizers,
    fixed_plan,
    plan_for_budget,
    probe_plan,
    replan,
)

# method name -> trainer-facing class ("module:Class"); adding a drafter adds a line here and a folder.
METHODS = {
    "eagle3": "draftsmith.models.eagle3.training:Eagle3Method",
    "dflash": "draftsmith.models.dflash.training:DflashMethod",
    "mtp": "draftsmith.models.mtp.training:MtpMethod",
}
LATEST = "latest"
STATE_DIR = "training_state"


class TrainingError(ValueError):
    """A run that cannot start as configured."""


def _method_class(name: str):
    if name not in METHODS:
        raise TrainingError(f"model.method '{name}' cannot be trained yet; available: {sorted(METHODS)}")
    module, cls = METHODS[name].split(":")
    return getattr(importlib.import_module(module), cls)


SORT_WINDOW = 64  # token budgets: samples are length-sorted within windows of this many budgets' worth


def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int, rank: int, world: int,
                  tokens_per_step: int | None = None) -> list[list[int]]:
    """Sample indices of this process's micro-batches for one epoch: shuffled by (seed, epoch), then dealt
    round-robin over processes. Every process gets the same number of batches (the tail that does not fill a
    round is dropped) so collective ops stay in step.

    With `tokens_per_step`, a micro-batch is as many samples as fit in that many padded tokens (rows x longest
    row): the shuffled order is cut into windows, each sorted by length and cut into such batches, whose order is
    then shuffled again, so a step computes little padding and the batches still come in random order."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=generator).tolist()
    if tokens_per_step is None:
        batches = [order[i:i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]
    else:
        mean = max(1, sum(lengths) // max(1, len(lengths)))
        window = max(1, SORT_WINDOW * tokens_per_step // mean)
        batches = []
        for start in range(0, len(order), window):
            current, longest = [], 0
            for i in sorted(order[start:start + window], key=lambda j: -lengths[j]):
                longest = max(longest, lengths[i])
                if current and longest * (len(current) + 1) > tokens_per_step:
                    batches.append(current)
                    current, longest = [], lengths[i]
                current.append(i)
            if current:
                batches.append(current)
        batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
    per_rank = len(batches) // world
    return batches[rank:per_rank * world:world]


def collate(samples, pad_id: int, device) -> dict[str, torch.Tensor]:
    """Right-padded (B, S) tensors: input_ids, attention_mask, loss_mask."""
    length = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
    attn = torch.zeros((len(samples), length), dtype=torch.long)
    mask = torch.zeros((len(samples), length), dtype=torch.long)
    for row, s in enumerate(samples):
        n = len(s.input_ids)
        ids[row, :n] = torch.tensor(s.input_ids)
        attn[row, :n] = 1
        mask[row, :n] = torch.tensor(s.loss_mask)
    return {"input_ids": ids.to(device), "attention_mask": attn.to(device), "loss_mask": mask.to(device)}


def latest_checkpoint(output_dir: Path) -> Path | None:
    pointer = output_dir / LATEST
    if pointer.is_file():
        path = output_dir / pointer.read_text().strip()
        if path.is_dir():
            return path
    found = sorted((p for p in output_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
                   key=lambda p: int(p.name.split("-")[-1]))
    return found[-1] if found else None


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(accelerator, drafter, method, recipe: Recipe, output_dir: Path, state: dict) -> Path:
    """Write checkpoint-<step>/ through a temporary folder and a rename, then point `latest` at it."""
    from draftsmith.models.checkpoint import save_safetensors_atomic, write_json_atomic

    name = f"checkpoint-{state['step']}"
    final = output_dir / name
    tmp = output_dir / f".{name}.tmp"
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp / STATE_DIR))  # optimizer, scheduler, RNG states, model (all processes)
    if accelerator.is_main_process:
        model = accelerator.unwrap_model(drafter)
        tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()
                   if not k.startswith("rotary_emb.")}
        save_safetensors_atomic(tensors, tmp / "model.safetensors")
        write_json_atomic(method.config.to_dict(), tmp / "config.json")
        write_json_atomic(state, tmp / "trainer_state.json")
        save_recipe(recipe, tmp / "recipe.yaml")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_text_atomic(output_dir / LATEST, name + "\n")
        kept = sorted((p for p in output_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
                      key=lambda p: int(p.name.split("-")[-1]))
        for old in kept[: -recipe.training.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_initial_weights(drafter, path: str, method: str) -> None:
    """Copy a checkpoint's weights (and draft vocabulary) into a freshly built drafter of the same shape."""
    from draftsmith.models.checkpoint import load_checkpoint, resolve_checkpoint

    config, state = load_checkpoint(resolve_checkpoint(path))
    if config.get("method") != method:
        raise TrainingError(f"model.init_from: {path} holds a {config.get('method')!r} drafter, the recipe trains "
                            f"{method!r}")
    own = {k: v for k, v in drafter.state_dict().items() if not k.startswith("rotary_emb.")}
    problems = [k for k in own if k not in state or state[k].shape != own[k].shape]
    problems += [k for k in state if k not in own]
    if problems:
        raise TrainingError(f"model.init_from: {path} does not fit this target and recipe (tensors "
                            f"{problems[:5]} differ): train a fresh drafter or match model.draft_vocab_size")
    drafter.load_state_dict(state, strict=False)


@torch.no_grad()
def evaluate(method, drafter, samples, batch_size, pad_id, device) -> dict[str, float]:
    """Held-out loss, per-step top-1 accuracy and simulated acceptance length, weighted by valid positions."""
    if not samples:
        return {}
    drafter.eval()
    sums: dict[str, float] = {}
    weight_total = 0.0
    for i in range(0, len(samples), batch_size):
        batch = collate(samples[i:i + batch_size], pad_id, device)
        loss, metrics = method.loss(drafter, batch)
        weight = float(metrics["count_0"])
        weight_total += weight
        for key in ["sim_accept_len", *[k for k in metrics if k.startswith(("acc_", "loss_"))]]:
            sums[key] = sums.get(key, 0.0) + float(metrics[key]) * weight
        sums["loss"] = sums.get("loss", 0.0) + float(loss) * weight
    drafter.train()
    return {f"eval/{k}": v / max(weight_total, 1.0) for k, v in sums.items()}


def train(recipe: Recipe, log=print) -> Path:
    """Train the drafter a recipe describes; returns the final checkpoint folder."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import AutoTokenizer

    from draftsmith.data import prepare_dataset
    from draftsmith.data.vocab import load_or_build_draft_vocab
    from draftsmith.models.target import TargetModel

    cfg = recipe.training
    output_dir = Path(recipe.output_dir)
    mixed = cfg.mixed_precision
    if mixed == "auto":
        mixed = dev.mixed_precision_for(dev.get_device())
    accelerator = Accelerator(
        mixed_precision=mixed,
        gradient_accumulation_steps=cfg.grad_accum_steps,
        log_with=None if cfg.report_to == "none" else cfg.report_to,
        project_dir=str(output_dir),
    )
    log = log if accelerator.is_main_process else (lambda *a, **k: None)
    set_seed(cfg.seed)
    output_dir.mkdir(parents=True, exist_ok=True)

    method_cls = _method_class(recipe.model.method)
    tokenizer = AutoTokenizer.from_pretrained(recipe.model.target)
    with accelerator.main_process_first():
        data = prepare_dataset(recipe.data, tokenizer, log=log)
    if not data.train:
        raise TrainingError(f"{recipe.data.path}: no training samples left after filtering")
    target_dtype = recipe.model.dtype if recipe.model.dtype != "auto" else (
        "bfloat16" if mixed == "bf16" else "float32")
    target = TargetModel.from_pretrained(recipe.model.target, dtype=target_dtype, device=accelerator.device,
                                         attn_implementation=recipe.model.attn_implementation)
    if recipe.model.draft_vocab_size > target.vocab_size:
        raise TrainingError(
            f"model.draft_vocab_size ({recipe.model.draft_vocab_size}) exceeds the target vocabulary "
            f"({target.vocab_size}): set model.draft_vocab_size <= {target.vocab_size}"
        )
    method = method_cls(recipe, target)
    with accelerator.main_process_first():
        d2t, t2d, vocab_path = load_or_build_draft_vocab(
            recipe.data.cache_path(), tokenizer, data.train, target.vocab_size, recipe.model.draft_vocab_size)
    log(f"draft vocab: {recipe.model.draft_vocab_size} of {target.vocab_size} tokens ({vocab_path})")
    drafter = method.build_drafter(d2t, t2d)
    if recipe.model.init_from:
        load_initial_weights(drafter, recipe.model.init_from, recipe.model.method)
        log(f"initialised the drafter from {recipe.model.init_from}")
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    optimizers = build_optimizers(drafter, cfg)

    world, rank = accelerator.num_processes, accelerator.process_index
    lengths = [len(sample.input_ids) for sample in data.train]
    batch_label = f"{cfg.tokens_per_step} tokens" if cfg.tokens_per_step else f"{cfg.batch_size} samples"
    batches_per_epoch = len(epoch_batches(lengths, cfg.batch_size, cfg.seed, 0, rank, world, cfg.tokens_per_step))
    if batches_per_epoch < cfg.grad_accum_steps:
        raise TrainingError(f"{len(data.train)} samples make no full optimizer step of {cfg.grad_accum_steps} x "
                            f"{batch_label} on {world} processes: lower training.batch_size (or "
                            "training.tokens_per_step) or training.grad_accum_steps, or add data")
    steps_per_epoch = max(1, batches_per_epoch // cfg.grad_accum_steps)
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    if cfg.max_minutes is not None:  # the probe's plan; replaced once the step time is known
        plan = probe_plan(cfg.time_probe_steps, total_steps, cfg.lr_schedule)
    else:
        plan = fixed_plan(total_steps, cfg.warmup_ratio, cfg.lr_schedule)
    planned = {"plan": plan}  # the schedulers read the current plan through this box
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lambda step: planned["plan"].factor(step))
                  for opt in optimizers]
    drafter, *optimizers = accelerator.prepare(drafter, *optimizers)
    for scheduler in schedulers:
        accelerator.register_for_checkpointing(scheduler)

    state = {"step": 0, "epoch": 0, "micro_batches_done": 0, "tokens_seen": 0, "train_seconds": 0.0}
    resume_from = latest_checkpoint(output_dir)
    if resume_from is not None:
        accelerator.load_state(str(resume_from / STATE_DIR))
        state = {**state, **json.loads((resume_from / "trainer_state.json").read_text())}
        if "plan" in state:
            planned["plan"] = SchedulePlan.from_dict(state["plan"])
        log(f"resuming from {resume_from} at step {state['step']}")
    state["plan"] = planned["plan"].to_dict()
    log(f"optimizer: {' + '.join(type(o.optimizer).__name__ for o in optimizers)}, lr {cfg.lr}"
        + (f" (Muon {cfg.muon_lr or cfg.lr})" if cfg.optimizer == "muon" else "")
        + f", {cfg.lr_schedule} schedule, micro-batches of {batch_label}")
    if accelerator.is_main_process:
        save_recipe(recipe, output_dir / "recipe.yaml")
    if cfg.report_to != "none":
        accelerator.init_trackers(cfg.run_name or output_dir.name, config=_flat(recipe_to_dict(recipe)))

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    metrics_path = output_dir / "metrics.jsonl"
    started = time.time() - state["train_seconds"]  # a resumed run keeps the budget it has spent
    probe_times: dict[int, float] = {}  # probe (and re-plan) step -> wall time at its end (device synchronised)
    eval_seconds, eval_spent = 0.0, 0.0  # one evaluation's cost, and the time evaluations took since the probe
    window_tokens, window_start = 0, time.time()
    window_loss, window_micro = 0.0, 0  # mean micro-batch loss since the last log line
    progress = tqdm(total=planned["plan"].total, initial=state["step"], desc="train",
                    disable=not accelerator.is_main_process)
    drafter.train()
    last_saved = state["step"] if resume_from else -1
    stop = state["step"] >= planned["plan"].total
    while not stop:
        batches = epoch_batches(lengths, cfg.batch_size, cfg.seed, state["epoch"], rank, world, cfg.tokens_per_step)
        # whole accumulation cycles only, so every epoch (and every checkpoint) ends on an optimizer step
        batches = batches[: len(batches) // cfg.grad_accum_steps * cfg.grad_accum_steps]
        for micro in range(state["micro_batches_done"], len(batches)):
            samples = [data.train[i] for i in batches[micro]]
            batch = collate(samples, pad_id, accelerator.device)
            with accelerator.accumulate(drafter):
                loss, metrics = method.loss(drafter, batch)
                accelerator.backward(loss)
                window_loss = window_loss + loss.detach()
                window_micro += 1
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(trainable, cfg.max_grad_norm)
                for optimizer in optimizers:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            state["micro_batches_done"] = micro + 1
            n_tokens = sum(len(sample.input_ids) for sample in samples) * world  # from the host: no sync
            state["tokens_seen"] += n_tokens
            window_tokens += n_tokens
            if not accelerator.sync_gradients:
                continue
            for scheduler in schedulers:
                scheduler.step()
            state["step"] += 1
            progress.update(1)
            step = state["step"]
            plan = planned["plan"]
            if plan.probing or step in (plan.hold, plan.replan_step):
                dev.synchronize(accelerator.device)
                probe_times[step] = time.time()
                if plan.probing and step == plan.hold:
                    planned["plan"], eval_seconds = _plan_the_budget(cfg, probe_times, started, total_steps, method,
                                                                     drafter, data.eval, pad_id, accelerator,
                                                                     metrics_path, log)
                    probe_times[step] = time.time()  # the steady steps are timed from after that evaluation
                    eval_spent = 0.0
                elif step == plan.replan_step and len(probe_times) > 1:
                    since = max(s for s in probe_times if s < step)  # the last timing point
                    steady = (probe_times[step] - probe_times[since] - eval_spent) / (step - since)
                    planned["plan"] = replan(plan, step, steady, cfg.max_minutes * 60 - (time.time() - started),
                                             total_steps, cfg.eval_every, eval_seconds)
                    eval_spent = 0.0
                    log(f"time budget: re-planned at step {step}: {steady * 1000:.1f} ms/step, decay to 0 at step "
                        f"{planned['plan'].total}")
                if planned["plan"] is not plan:
                    state["plan"] = planned["plan"].to_dict()
                    progress.total = planned["plan"].total
                    progress.refresh()
            state["train_seconds"] = time.time() - started
            elapsed_min = state["train_seconds"] / 60
            out_of_time = cfg.max_minutes is not None and elapsed_min >= cfg.max_minutes
            stop = step >= planned["plan"].total or out_of_time
            if step % cfg.log_every == 0 or stop:
                now = time.time()
                row = {"step": step, "epoch": state["epoch"], "lr": schedulers[0].get_last_lr()[0],
                       "loss": float(window_loss) / window_micro, "grad_norm": float(grad_norm),
                       "tokens_per_s": window_tokens / max(now - window_start, 1e-9),
                       **{f"train/{k}": float(v) for k, v in metrics.items() if not k.startswith("count_")}}
                window_tokens, window_start = 0, now
                window_loss, window_micro = 0.0, 0
                progress.set_postfix(loss=f"{row['loss']:.3f}", acc0=f"{row.get('train/acc_0', 0):.2f}",
                                     tau=f"{row['train/sim_accept_len']:.2f}")
                _log_row(accelerator, metrics_path, row)
            if step % cfg.eval_every == 0 or stop:
                eval_started = time.time()
                row = {"step": step, **evaluate(method, drafter, data.eval, cfg.batch_size, pad_id,
                                                accelerator.device)}
                eval_spent += time.time() - eval_started
                if len(row) > 1:
                    log(f"step {step}: eval loss {row['eval/loss']:.4f} acc_0 {row['eval/acc_0']:.3f} "
                        f"simulated acceptance length {row['eval/sim_accept_len']:.2f}")
                    _log_row(accelerator, metrics_path, row)
            if step % cfg.save_every == 0 or stop:
                save_checkpoint(accelerator, drafter, method, recipe, output_dir, state)
                last_saved = step
            if stop:
                if out_of_time:
                    log(f"stopping: training.max_minutes={cfg.max_minutes} reached at step {step}")
                break
        else:
            state["epoch"] += 1
            state["micro_batches_done"] = 0
            stop = cfg.max_steps is None and state["epoch"] >= cfg.epochs
    progress.close()
    if last_saved != state["step"]:
        save_checkpoint(accelerator, drafter, method, recipe, output_dir, state)
    accelerator.end_training()
    final = latest_checkpoint(output_dir)
    log(f"done: {state['step']} steps, {state['tokens_seen']} tokens in {(time.time() - started) / 60:.1f} min; "
        f"checkpoint {final}")
    return final


def _plan_the_budget(cfg, probe_times, started, max_steps, method, drafter, eval_samples, pad_id, accelerator,
                     metrics_path, log) -> tuple[SchedulePlan, float]:
    """(the schedule for the steps that fit in what is left of `training.max_minutes`, one evaluation's seconds),
    from the probe's step time and one timed evaluation (whose row is logged like any other)."""
    hold = cfg.time_probe_steps
    timed = sorted((step, t) for step, t in probe_times.items() if step >= MEASURE_SKIP)  # a resume may lose some
    if len(timed) >= 2:
        step_seconds = (timed[-1][1] - timed[0][1]) / (timed[-1][0] - timed[0][0])
    else:
        step_seconds = (time.time() - started) / hold
    eval_seconds = 0.0
    if eval_samples:
        t0 = time.time()
        row = {"step": hold, **evaluate(method, drafter, eval_samples, cfg.batch_size, pad_id, accelerator.device)}
        eval_seconds = time.time() - t0
        _log_row(accelerator, metrics_path, row)
    seconds_left = cfg.max_minutes * 60 - (time.time() - started)
    plan = plan_for_budget(hold, step_seconds, seconds_left, cfg.warmup_ratio, cfg.lr_schedule,
                           max_steps=max_steps, eval_every=cfg.eval_every, eval_seconds=eval_seconds)
    log(f"time budget {cfg.max_minutes} min: {plan.note}; warmup {plan.warmup}, {plan.shape} decay to 0 at step "
        f"{plan.total}" + (f", re-planned at step {plan.replan_step}" if plan.replan_step else ""))
    return plan, eval_seconds


def _log_row(accelerator, path: Path, row: dict) -> None:
    accelerator.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])
    if accelerator.is_main_process:
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out
