"""The run folder's checkpoints: writing one, finding the latest, checking that a rerun is the same run, resuming.

    output_dir/checkpoint-<step>/  model.safetensors (the drafter's weights, once: fp32 master weights), config.json,
                                   recipe.yaml, trainer_state.json, training_state/ (state.py: optimizer and RNG
                                   states in safetensors and JSON)
    output_dir/latest              the newest checkpoint's name (models/checkpoint.py resolve_checkpoint reads it)
    output_dir/metrics.jsonl       one row per logged step and per evaluation

Resume is exact: a checkpoint is taken only at an optimizer-step boundary and records the epoch and the number of
micro-batches already consumed in it; the data order of an epoch is a pure function of (seed, epoch) (batching.py),
so a resumed run sees exactly the batches an uninterrupted run would have seen. A run resumes only a checkpoint of
the same recipe: model, data and the method's section, and the training keys the optimizer state, the schedule and
the resume position were made with (SAME_RUN_TRAINING); the others, such as max_steps, may change. Resuming never
unpickles anything from the run folder (state.py). The file writers and the latest-checkpoint resolver are
models/checkpoint.py's, shared with export and import.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from draftsmith import distributed
from draftsmith.config import Recipe, RecipeError, load_recipe, recipe_to_dict, save_recipe
from draftsmith.models.checkpoint import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    LATEST_FILE,
    RECIPE_FILE,
    TRAINER_STATE_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    is_disk_full,
    load_checkpoint,
    resolve_checkpoint,
    save_safetensors_atomic,
    write_json_atomic,
    write_text_atomic,
)
from draftsmith.train.errors import TrainingError
from draftsmith.train.state import (
    STATE_DIR,
    check_run_folder,
    load_training_state,
    raw_optimizer,
    read_json_object,
    save_training_state,
)

# Sections of the recipe a resumed run must share with its checkpoint (plus the method's own section): they decide
# what the drafter is and what it learns from. data.cache_dir only says where cached files live.
SAME_RUN_SECTIONS = ("model", "data")
SAME_RUN_IGNORED = {"data.cache_dir"}
# Training keys a resumed run must share with its checkpoint: loading the optimizer state brings back the values it
# was made with (another optimizer does not load at all), the schedule is the checkpoint's plan, and the resume
# position counts the checkpoint's micro-batches in the order the seed gives. batch_size may change with the number
# of processes as long as their product (the micro-batch of all processes) stays. The rest may change: when to stop
# (max_steps, epochs, max_minutes; the schedule stays the checkpoint's), logging, saving, memory and speed knobs.
SAME_RUN_TRAINING = ("optimizer", "lr", "muon_lr", "adam_betas", "weight_decay", "lr_schedule", "warmup_ratio",
                     "lr_decay_ratio", "train_draft_head",
                     "time_probe_steps", "seed", "grad_accum_steps", "tokens_per_step", "packing")
NEARLY_FULL_BYTES = 64 * 2**20  # torch.save reports a full disk as a RuntimeError without errno: this little left


# ---- finding checkpoints -------------------------------------------------------------------------------------
def checkpoint_folders(output_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every checkpoint-<step> folder in output_dir, oldest first."""
    found = [(int(m.group(1)), p) for p in output_dir.glob("checkpoint-*") if (m := CHECKPOINT_DIR.fullmatch(p.name))]
    return sorted(found, key=lambda found_step: found_step[0])


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The checkpoint a rerun in output_dir resumes (models/checkpoint.py resolve_checkpoint: `latest`, else the
    highest step), None when there is none yet."""
    if not (output_dir / LATEST_FILE).exists() and not checkpoint_folders(output_dir):
        return None
    try:
        return resolve_checkpoint(output_dir)
    except CheckpointError as e:
        raise TrainingError(f"{e}; or set output_dir to a new folder") from None


def checkpoint_before(output_dir: Path, step: int) -> Path | None:
    """The newest checkpoint-N of output_dir with N < step."""
    earlier = [folder for n, folder in checkpoint_folders(output_dir) if n < step]
    return earlier[-1] if earlier else None


def discard_checkpoints_from(output_dir: Path, step: int) -> str:
    """Remove checkpoint-N for N >= step (weights that no longer learn), point `latest` at the newest one left;
    returns what a message says of it."""
    dropped = [folder for n, folder in checkpoint_folders(output_dir) if n >= step]
    for folder in dropped:
        shutil.rmtree(folder, ignore_errors=True)
    good = checkpoint_before(output_dir, step)
    if good is not None:
        write_text_atomic(good.name + "\n", output_dir / LATEST_FILE)
    elif (output_dir / LATEST_FILE).exists():
        (output_dir / LATEST_FILE).unlink()
    removed = f"removed {', '.join(f.name for f in dropped)}, which held those weights; " if dropped else ""
    return removed + (f"the last good checkpoint is {good} (model.init_from={good} starts from it)" if good
                      else "no checkpoint before it")


def read_trainer_state(checkpoint: Path) -> dict:
    return read_json_object(checkpoint / TRAINER_STATE_FILE)


# ---- before anything slow: is a rerun the same run? -------------------------------------------------------------
def find_resume(output_dir: Path, recipe: Recipe, accelerator, log) -> tuple[Path | None, bool]:
    """(the checkpoint to resume or None, whether its training state is draftsmith's own files), checked before
    anything slow: a rerun of another recipe, or a folder holding pickles, is refused at once. Removes the
    temporary folder of a save killed halfway (this run saves later)."""
    resume_from = latest_checkpoint(output_dir)
    own_state = True
    if resume_from is not None:
        for note in check_same_run(resume_from, recipe, output_dir, accelerator.num_processes):
            log(note)
        own_state = check_run_folder(resume_from, recipe.training.trust_run_folder)
    if accelerator.is_main_process:
        for stale in output_dir.glob(".checkpoint-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
    return resume_from, own_state


def check_same_run(checkpoint: Path, recipe: Recipe, output_dir: Path, processes: int = 1) -> list[str]:
    """Refuse to resume a checkpoint trained with other model, data or method keys than `recipe`'s, or other
    SAME_RUN_TRAINING keys, or another micro-batch of all `processes` (reads only the checkpoint's recipe and
    trainer_state.json: it runs before anything slow). Returns notes on the keys that may change but do not
    change the schedule."""
    fresh = f"set output_dir to a new folder, or delete {output_dir} to start fresh"
    try:
        old = recipe_to_dict(load_recipe(checkpoint / RECIPE_FILE))
    except RecipeError as e:
        raise TrainingError(f"{output_dir} holds {checkpoint.name}, whose recipe cannot be compared with this one "
                            f"({e}): {fresh}") from None
    new = recipe_to_dict(recipe)
    differ = _sections_that_differ(old, new, recipe.model.method)
    before, now = old.get("training") or {}, new["training"]
    differ += [_change(f"training.{key}", before.get(key), now[key]) for key in SAME_RUN_TRAINING
               if key in before and before[key] != now[key]]  # a key the old recipe lacks had its default
    saved = read_trainer_state(checkpoint)
    old_processes = saved.get("processes")
    if isinstance(old_processes, int) and now["tokens_per_step"] is None and \
            before.get("batch_size", now["batch_size"]) * old_processes != now["batch_size"] * processes:
        differ.append(f"training.batch_size {before.get('batch_size')} x {old_processes} processes there, "
                      f"{now['batch_size']} x {processes} now")
    if differ:
        more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
        raise TrainingError(f"{output_dir} holds {checkpoint.name} of another recipe ({'; '.join(differ[:3])}{more})"
                            f": it resumes only with the same model, data and {recipe.model.method} keys and the "
                            f"training keys its optimizer state, schedule and batches were made with; {fresh}")
    plan = saved.get("plan") if isinstance(saved.get("plan"), dict) else {}
    return [f"{_change(f'training.{key}', before[key], now[key])}: the resumed run keeps its checkpoint's schedule, "
            f"which ends at step {plan.get('total')}" for key in ("max_steps", "epochs")
            if key in before and before[key] != now[key] and not plan.get("hold")]


def _change(key: str, before, now) -> str:
    return f"{key} {json.dumps(before)} there, {json.dumps(now)} now"


def _sections_that_differ(old: dict, new: dict, method: str) -> list[str]:
    differ = []
    for section in (*SAME_RUN_SECTIONS, method):
        before, now = old.get(section) or {}, new.get(section) or {}
        for key in sorted(set(before) | set(now)):
            if f"{section}.{key}" not in SAME_RUN_IGNORED and before.get(key) != now.get(key):
                differ.append(_change(f"{section}.{key}", before.get(key), now.get(key)))
    return differ


# ---- writing -------------------------------------------------------------------------------------------------------
def save_checkpoint(accelerator, drafter, method, recipe: Recipe, output_dir: Path, state: dict,
                    optimizers) -> Path:
    """Write checkpoint-<step>/ through a temporary folder and a rename, then point `latest` at it.

    The drafter's weights are written once, as model.safetensors; training_state/ holds the optimizer and RNG
    states in safetensors and JSON (state.py), under every sharding. A failed write (a full disk) removes the
    partial folder and stops the run with one line; the last complete checkpoint stays."""
    name = f"checkpoint-{state['step']}"
    final, tmp = output_dir / name, output_dir / f".{name}.tmp"
    previous = latest_checkpoint(output_dir)
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    try:
        _write_checkpoint(accelerator, drafter, optimizers, tmp)
        if accelerator.is_main_process:
            write_json_atomic(method.config.to_dict(), tmp / CONFIG_FILE)
            write_json_atomic(state, tmp / TRAINER_STATE_FILE)
            save_recipe(recipe, tmp / RECIPE_FILE)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            write_text_atomic(name + "\n", output_dir / LATEST_FILE)
            for _, old in checkpoint_folders(output_dir)[: -recipe.training.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
    except (OSError, RuntimeError) as e:
        raise _write_failed(e, accelerator, tmp, final, previous) from None
    accelerator.wait_for_everyone()
    return final


def _write_checkpoint(accelerator, drafter, optimizers, tmp: Path) -> None:
    """The weights (main process) and the training state (every process its RNG's) into `tmp`, no pickles. Under
    FSDP2 and DeepSpeed ZeRO every process takes part in gathering the weights and optimizer states whole
    (distributed.py): the files are those of a one-process run."""
    model = accelerator.unwrap_model(drafter)
    gathers = distributed.gathers(model)  # every process takes part; otherwise the main one's copy is it
    states = []
    if gathers or accelerator.is_main_process:
        weights = _weights(distributed.full_weights(model))
        states = [distributed.optimizer_state(model, raw_optimizer(o)) for o in optimizers]
    if accelerator.is_main_process:
        save_safetensors_atomic(weights, tmp / WEIGHTS_FILE)
    save_training_state(tmp / STATE_DIR, states, accelerator.process_index, accelerator.num_processes,
                        accelerator.is_main_process)
    accelerator.wait_for_everyone()  # every process's RNG file is in before the folder is renamed


def _weights(state: dict) -> dict:
    """A drafter's state dict as model.safetensors holds it: CPU tensors, no rotary tables (rebuilt from config)."""
    return {k: v.detach().cpu().contiguous() for k, v in state.items() if not k.startswith("rotary_emb.")}


def _write_failed(e: OSError | RuntimeError, accelerator, tmp: Path, final: Path, previous: Path | None) -> Exception:
    """The one-line TrainingError for a checkpoint write that failed (the partial folder removed); anything that
    is not a failed write is raised as it is."""
    full = is_disk_full(e) or (isinstance(e, RuntimeError) and _nearly_full(final.parent))
    if not (full or isinstance(e, OSError)):
        raise e
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    where = final
    filename = getattr(e, "filename", None)
    if filename and Path(filename).is_relative_to(tmp):
        where = final / Path(filename).relative_to(tmp)
    reason = "disk full (no space left on device)" if full else f"cannot write: {e.strerror or e}"
    resume = f"resume from {previous.name}" if previous is not None else "start again"
    return TrainingError(f"{where}: {reason}; removed the partial {tmp.name}: free space (or set output_dir on "
                         f"another disk) and rerun to {resume}")


def _nearly_full(path: Path) -> bool:
    try:
        return shutil.disk_usage(path).free < NEARLY_FULL_BYTES
    except OSError:
        return False


# ---- reading and resuming ------------------------------------------------------------------------------------------
def register_state_hooks(accelerator) -> None:
    """accelerate's load_state (a trusted folder of accelerate's state) leaves the drafter to model.safetensors: its
    one copy, fp32 master weights, so a resume stays bit-exact."""

    def state_without_model(models, weights, output_dir) -> None:
        weights.clear()

    def model_from_checkpoint(models, input_dir) -> None:
        for model in models:
            load_drafter_weights(accelerator, model, Path(input_dir).parent)
        models.clear()  # accelerate does not look for its own copy

    accelerator.register_save_state_pre_hook(state_without_model)
    accelerator.register_load_state_pre_hook(model_from_checkpoint)


def load_drafter_weights(accelerator, drafter, checkpoint: Path) -> None:
    """The drafter's weights from the checkpoint's model.safetensors (its one copy, fp32 master weights, so a
    resume stays bit-exact)."""
    _, tensors = load_checkpoint(checkpoint)
    missing, unexpected = distributed.load_full_weights(accelerator.unwrap_model(drafter), tensors)
    missing = [k for k in missing if not k.startswith("rotary_emb.")]
    if missing or unexpected:
        raise TrainingError(f"{checkpoint / WEIGHTS_FILE}: does not fit this drafter (tensors "
                            f"{(missing + unexpected)[:5]} differ): set output_dir to a new folder")


def resume(accelerator, drafter, optimizers, paths, log) -> dict:
    """Load `paths.resume_from` into the prepared drafter and optimizers (this process's RNG states too);
    returns its trainer_state.json. The metrics rows of the steps after it are dropped: the run logs them again."""
    checkpoint, rank = paths.resume_from, accelerator.process_index
    if paths.own_state:
        load_drafter_weights(accelerator, drafter, checkpoint)
        model = accelerator.unwrap_model(drafter)

        def load(optimizer, state):
            distributed.load_optimizer_state(model, raw_optimizer(optimizer), state)

        if not load_training_state(checkpoint / STATE_DIR, optimizers, rank, load):
            log(f"{checkpoint / STATE_DIR}: no RNG state for process {rank}: its generators start from the seed")
    else:
        accelerator.load_state(str(checkpoint / STATE_DIR))
    state = read_trainer_state(checkpoint)
    if accelerator.is_main_process:
        drop_replayed_rows(paths.metrics, state["step"])
    log(f"resuming from {checkpoint} at step {state['step']}")
    return state


def drop_replayed_rows(metrics_path: Path, step: int) -> None:
    """Keep the rows of steps up to the resumed checkpoint's: the later ones are logged again as the resumed run
    replays those steps. A line cut short by a kill is dropped too."""
    if not metrics_path.is_file():
        return
    kept = []
    for line in metrics_path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and row.get("step", 0) <= step:
            kept.append(line + "\n")
    write_text_atomic("".join(kept), metrics_path)


def load_initial_weights(drafter, path: str, method: str) -> None:
    """model.init_from: copy a checkpoint's weights (and draft vocabulary) into a freshly built drafter of the same
    shape."""
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
