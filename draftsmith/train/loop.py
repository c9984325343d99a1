"""The training loop: `train(recipe)` builds the run (setup.py) and steps it, top to bottom, for every drafter
method. The loop only steps, logs, evaluates and saves; what it steps is the `Run` setup built, where the features
come from is the run's FeatureSource (features.py), the schedule is the TimeBudget's plan (budget.py), and the run
folder is checkpoint.py's.

Health (health.py): a NaN or inf in the loss, the gradient norm or the target's features stops the run with one
line naming the step (and sample), found at the next sync the loop makes anyway and always before a checkpoint is
written. So does a saturated drafter (a gradient norm of exactly 0 while the loss is not: its weights after the
step before will never learn again), and the checkpoints holding those weights are removed, `latest` pointing at
the last good one. A run whose loss does not move is warned about, and stopped once it has not learned for
training.stop_when_stuck_steps steps (periodic checkpoints are skipped while it is stuck).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from tqdm.auto import tqdm

from draftsmith import distributed
from draftsmith.config import Recipe
from draftsmith.train.checkpoint import (
    checkpoint_before,
    discard_checkpoints_from,
    latest_checkpoint,
    save_checkpoint,
)
from draftsmith.train.health import Health, describe_sample
from draftsmith.train.metrics import FlopCounter, LogWindow, evaluate, log_row, progress_postfix
from draftsmith.train.errors import SaturatedError, TrainingError
from draftsmith.train.setup import Run, setup


def train(recipe: Recipe, log=print) -> Path:
    """Train the drafter a recipe describes; returns the final checkpoint folder. A run that fails before it
    writes anything leaves no output_dir behind (when it created it); a full disk is one line."""
    from draftsmith.models.checkpoint import is_disk_full, write_failure

    output_dir = Path(recipe.output_dir)
    created = not output_dir.exists()
    try:
        with contextlib.ExitStack() as closing:  # the progress bar is closed before an error is printed
            return train_run(setup(recipe, log, closing), closing)
    except OSError as e:
        if not is_disk_full(e):
            raise
        raise TrainingError(f"{write_failure(e, output_dir)}: free space and rerun (the run resumes from its last "
                            "checkpoint)") from None
    finally:
        if created and output_dir.is_dir() and not any(output_dir.iterdir()):
            with contextlib.suppress(OSError):  # another process of the run may have removed it first
                output_dir.rmdir()


def train_run(run: Run, closing: contextlib.ExitStack) -> Path:
    """Step the run until its plan's last step, training.max_minutes or the last epoch; returns the final
    checkpoint. Every `log_every` steps a metrics row, every `eval_every` an evaluation, every `save_every` a
    checkpoint, and all three at the end."""
    cfg, state, acc, budget = run.recipe.training, run.state, run.accelerator, run.budget
    health = Health(acc, lambda i: describe_sample(run.tokenizer, run.data.train, i), _rate(cfg),
                    cfg.stop_when_stuck_steps)
    flops = FlopCounter(run.method, cfg, acc.device, run.features.target_runs, run.batching.loss_share)
    run.log(flops.describe(run.batching.lengths))
    window = LogWindow(flops, acc, cfg.packing)
    progress = closing.enter_context(tqdm(total=budget.plan.total, initial=state["step"], desc="train",
                                          disable=not acc.is_main_process))
    run.drafter.train()
    last_saved = state["step"] if run.paths.resume_from else -1
    budget.start(state["train_seconds"])
    try:
        last_saved = _steps(run, health, window, progress, last_saved)
    except SaturatedError as e:  # the weights after the step before it gave no gradient: no checkpoint keeps them
        acc.wait_for_everyone()
        kept = discard_checkpoints_from(run.paths.output_dir, e.step - 1) if acc.is_main_process else ""
        raise TrainingError(f"{e} ({kept})" if kept else str(e)) from None
    progress.close()
    return _finish(run, health, last_saved)


def _steps(run: Run, health: Health, window: LogWindow, progress, last_saved: int) -> int:
    """train_run's steps, to its plan's end, its time budget or a stop; returns the step last saved."""
    cfg, state, acc, budget = run.recipe.training, run.state, run.accelerator, run.budget
    stop = state["step"] >= budget.plan.total
    while not stop:
        batches = run.batching.epoch(state["epoch"])
        for micro in range(state["micro_batches_done"], len(batches)):
            metrics, grad_norm = _micro_step(run, batches[micro], window, health)
            state["micro_batches_done"] = micro + 1
            if not acc.sync_gradients:
                continue
            for scheduler in run.schedulers:
                scheduler.step()
            state["step"] += 1
            progress.update(1)
            step = state["step"]
            if budget.after_step(step, acc.device, lambda: _timed_evaluation(run, health), run.log):
                state["plan"] = budget.plan.to_dict()
                progress.total = budget.plan.total
                progress.refresh()
            state["train_seconds"] = budget.seconds
            out_of_time = budget.out_of_time(state["train_seconds"])
            stop = step >= budget.plan.total or out_of_time
            if step % cfg.log_every == 0 or stop:
                _log_step(run, health, window, progress, grad_norm, metrics)
            if step % cfg.eval_every == 0 or stop:
                _evaluate_step(run, health, stop)
            if step % cfg.save_every == 0 and not stop and health.stuck.stopping_soon():
                run.log(f"step {step}: no checkpoint: the run is stuck since step {health.stuck.stuck_since} (the "
                        "last one stays)")
            elif step % cfg.save_every == 0 or stop:
                health.check()  # a checkpoint never holds a NaN
                save_checkpoint(acc, run.drafter, run.method, run.recipe, run.paths.output_dir, state, run.optimizers)
                last_saved = step
            if stop:
                if out_of_time:
                    run.log(f"stopping: training.max_minutes={cfg.max_minutes} reached at step {step}")
                break
        else:
            run.features.end_epoch()  # the first epoch of a cache completes it: later ones read it
            state["epoch"] += 1
            state["micro_batches_done"] = 0
            stop = cfg.max_steps is None and state["epoch"] >= cfg.epochs
    return last_saved


def _micro_step(run: Run, indices: list[int], window: LogWindow, health: Health):
    """Forward, backward and (at the end of an accumulation cycle) the optimizer step of one micro-batch; returns
    (its metrics, the gradient norm of the step or None). No host sync: the health flags stay on the device."""
    acc, state, features = run.accelerator, run.state, run.features
    batch, samples = run.batching.collate(indices)
    features.select(indices, samples)
    grad_norm = None
    with (acc.accumulate(distributed.accumulation_model(run.drafter)),
          distributed.gradient_sync(run.drafter, acc.sync_gradients)):
        loss, metrics = run.method.loss(run.drafter, batch, features)
        health.finite.observe_micro_batch(state["step"] + 1, indices, features.take(), loss)
        if run.sharding in distributed.ZERO_STAGES:  # DeepSpeed's engine backpropagates, clips and steps
            grad_norm = distributed.zero_step(run.drafter, loss, acc.sync_gradients)
        else:
            acc.backward(loss)
            if acc.sync_gradients:  # over FSDP2's sharded gradients the norm is a DTensor: its whole value
                grad_norm = distributed.plain(acc.clip_grad_norm_(run.trainable, run.recipe.training.max_grad_norm))
            for optimizer in run.optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        if grad_norm is not None:
            health.finite.observe_step(state["step"] + 1, grad_norm)
    state["tokens_seen"] += window.observe(batch, samples, loss)
    return metrics, grad_norm


def _log_step(run: Run, health: Health, window: LogWindow, progress, grad_norm, metrics) -> None:
    """The window's metrics row; a run stuck for training.stop_when_stuck_steps stops here."""
    health.check()  # its one transfer is the sync this log line makes anyway
    state = run.state
    row = window.row(state["step"], state["epoch"], run.schedulers[0].get_last_lr()[0], grad_norm, metrics)
    progress.set_postfix(**progress_postfix(row))
    log_row(run.accelerator, run.paths.metrics, row)
    for warning in health.stuck.observe(row["step"], row["loss"], row["grad_norm"]):
        run.log(f"warning: {warning}")
    stuck_stop = health.stuck.stop_message(row["step"])
    if stuck_stop is not None:  # no checkpoint of the stuck weights: the last good one stays
        good = checkpoint_before(run.paths.output_dir, health.stuck.stuck_since)
        raise TrainingError(stuck_stop + (f" (model.init_from={good} starts from its last checkpoint before that)"
                                          if good is not None else ""))


def _evaluate(run: Run) -> dict[str, float]:
    cfg = run.recipe.training
    return evaluate(run.method, run.drafter, run.data.eval, cfg.batch_size, run.batching.pad_id,
                    run.accelerator.device, run.features)


def _evaluate_step(run: Run, health: Health, last: bool) -> None:
    """The held-out evaluation, logged; its time is not step time (budget.py)."""
    health.check()  # evaluation syncs on every batch anyway
    step = run.state["step"]
    if last and run.data.eval:  # the bar sits at its end meanwhile: say what the wait is for
        run.log(f"step {step}: evaluating on the {len(run.data.eval)} held-out samples")
    started = time.time()
    row = {"step": step, **_evaluate(run)}
    run.budget.evaluated(time.time() - started)
    if len(row) > 1:
        run.log(f"step {step}: eval loss {row['eval/loss']:.4f} acc_0 {row['eval/acc_0']:.3f} "
                f"simulated acceptance length {row['eval/sim_accept_len']:.2f}")
        log_row(run.accelerator, run.paths.metrics, row)


def _timed_evaluation(run: Run, health: Health) -> float:
    """The evaluation a time budget's plan accounts for, at the end of its probe: logged, its seconds returned."""
    health.check()
    if not run.data.eval:
        return 0.0
    started = time.time()
    row = {"step": run.state["step"], **_evaluate(run)}
    seconds = time.time() - started
    log_row(run.accelerator, run.paths.metrics, row)
    return seconds


def _finish(run: Run, health: Health, last_saved: int) -> Path:
    """The last checkpoint (unless the last step saved one), the trackers closed; returns it."""
    state = run.state
    if last_saved != state["step"]:
        health.check()
        save_checkpoint(run.accelerator, run.drafter, run.method, run.recipe, run.paths.output_dir, state,
                        run.optimizers)
    run.accelerator.end_training()
    final = latest_checkpoint(run.paths.output_dir)
    run.log(f"done: {state['step']} steps, {state['tokens_seen']} tokens in {run.budget.seconds / 60:.1f} min; "
            f"checkpoint {final}")
    return final


def _rate(cfg) -> str:
    """The recipe's learning rate(s), as the stuck watch's messages name them."""
    return f"training.lr={cfg.lr:g}" + (f", training.muon_lr={cfg.muon_lr:g}" if cfg.optimizer == "muon" and
                                        cfg.muon_lr else "")
