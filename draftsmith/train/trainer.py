"""The training loop: one function, top to bottom, for every drafter method.

Online capture: each micro-batch runs the frozen target once (`TargetModel.capture`) and the drafter's loss on
those states. accelerate supplies DDP (and FSDP / DeepSpeed through its launcher config), bf16 autocast over fp32
master weights, gradient accumulation and the trackers.

Resume is exact: a checkpoint is taken only at an optimizer-step boundary and records the epoch and the number
of micro-batches already consumed in it; the data order of an epoch is a pure function of (seed, epoch), so a
resumed run sees exactly the batches an uninterrupted run would have seen. A run resumes only a checkpoint of the
same recipe: model, data and the method's section, and the training keys the optimizer state, the schedule and
the resume position were made with (SAME_RUN_TRAINING); the others, such as max_steps, may change. Resuming never
unpickles anything from the run folder (state.py).

Health (health.py): a NaN or inf in the loss, the gradient norm or the target's features stops the run with one
line naming the step (and sample), found at the next sync the loop makes anyway and always before a checkpoint is
written; a run whose gradient norm is 0 or whose loss does not move is warned about, and stopped once it has not
learned for training.stop_when_stuck_steps steps (periodic checkpoints are skipped while it is stuck).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from draftsmith import device as dev
from draftsmith.config import (
    Recipe,
    RecipeError,
    check_recipe_against_target,
    load_recipe,
    recipe_to_dict,
    save_recipe,
)
from draftsmith.models import registry
from draftsmith.models.spec import TrainingMethod, resolve
from draftsmith.train.flops import describe as describe_flops
from draftsmith.train.health import FeatureCheck, FiniteWatch, StuckWatch
from draftsmith.train.optim import (
    MEASURE_SKIP,
    SchedulePlan,
    build_optimizers,
    fixed_plan,
    plan_for_budget,
    probe_plan,
    replan,
)
from draftsmith.train.state import (
    STATE_DIR,
    check_run_folder,
    load_training_state,
    read_json_object,
    save_training_state,
)

LATEST = "latest"
WEIGHTS_FILE = "model.safetensors"
RECIPE_FILE = "recipe.yaml"
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


class TrainingError(ValueError):
    """A run that cannot start as configured."""


def method_class(name: str) -> type[TrainingMethod]:
    """The class the trainer drives for model.method: its spec's `training` entry point (models/registry.py)."""
    return resolve(registry.get(name).training)


def target_config_dict(target: str) -> dict:
    """The target's config as a dict (its text part for multimodal targets), read from its config.json alone, for
    the method's rules that depend on the target; one TrainingError line when it cannot be read."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(target)
    except (OSError, ValueError, KeyError) as e:
        raise TrainingError(f"model.target {target}: cannot read its config.json: {str(e).splitlines()[0]}") from None
    return config.get_text_config().to_dict()


SORT_WINDOW = 64  # token budgets: samples are length-sorted within windows of this many budgets' worth


def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int, rank: int, world: int,
                  tokens_per_step: int | None = None, packing: bool = False) -> list[list[int]]:
    """Sample indices of this process's micro-batches for one epoch: shuffled by (seed, epoch), then dealt
    round-robin over processes. Every process gets the same number of batches (the tail that does not fill a
    round is dropped) so collective ops stay in step.

    With `tokens_per_step`, a micro-batch is as many samples as fit in that many padded tokens (rows x longest
    row): the shuffled order is cut into windows, each sorted by length and cut into such batches, whose order is
    then shuffled again, so a step computes little padding and the batches still come in random order. With
    `packing`, a micro-batch is samples whose lengths add up to at most `tokens_per_step` (one packed row), each
    window's samples placed longest first into the first row with room."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=generator).tolist()
    if tokens_per_step is None:
        batches = [order[i:i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]
    else:
        mean = max(1, sum(lengths) // max(1, len(lengths)))
        window = max(1, SORT_WINDOW * tokens_per_step // mean)
        batches = []
        for start in range(0, len(order), window):
            if packing:
                batches.extend(_pack_first_fit(order[start:start + window], lengths, tokens_per_step))
                continue
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


def _pack_first_fit(indices: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(indices, key=lambda j: -lengths[j]):
        for r, left in enumerate(room):
            if lengths[i] <= left:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(budget - lengths[i])
    return rows


def collate_packed(samples, device, every_token: bool = False) -> dict[str, torch.Tensor]:
    """One packed (1, T) row of the samples, T = their total length: input_ids, loss_mask, position_ids (restarting
    at 0 in every sample: the target's attention, from transformers' packed-sequence masks, and the drafter's
    both stay inside a sample) and doc_ids (which sample each position belongs to); no attention_mask.
    every_token (training.loss_on all): the loss mask is 1 on every token, not only the answers'."""
    ids = _concatenated(samples, "input_ids")
    mask = torch.ones_like(ids) if every_token else _concatenated(samples, "loss_mask")
    positions = torch.cat([torch.arange(len(s.input_ids)) for s in samples])
    docs = torch.cat([torch.full((len(s.input_ids),), i) for i, s in enumerate(samples)])
    return {"input_ids": ids[None].to(device), "attention_mask": None, "loss_mask": mask[None].to(device),
            "position_ids": positions[None].to(device), "doc_ids": docs[None].to(device)}


def collate(samples, pad_id: int, device, every_token: bool = False) -> dict[str, torch.Tensor]:
    """Right-padded (B, S) tensors: input_ids, attention_mask, loss_mask (every_token: 1 on every real token)."""
    lengths = torch.tensor([len(s.input_ids) for s in samples])
    real = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]  # (B, S): the samples' own positions
    ids = torch.full(real.shape, pad_id, dtype=torch.long)
    ids[real] = _concatenated(samples, "input_ids")  # row-major, as the samples follow one another
    if every_token:
        mask = real.long()
    else:
        mask = torch.zeros(real.shape, dtype=torch.long)
        mask[real] = _concatenated(samples, "loss_mask")
    return {"input_ids": ids.to(device), "attention_mask": real.long().to(device), "loss_mask": mask.to(device)}


def _concatenated(samples, field: str) -> torch.Tensor:
    """The samples' `field` lists end to end as one int64 tensor. Through numpy: a step's 32k tokens convert in
    about a quarter of the time `torch.tensor` takes over Python lists (1.8 against 7.7 ms on a 2-core CPU), and the
    host sets a small drafter's pace."""
    return torch.from_numpy(np.concatenate([np.asarray(getattr(s, field), dtype=np.int64) for s in samples]))


def latest_checkpoint(output_dir: Path) -> Path | None:
    pointer = output_dir / LATEST
    if pointer.is_file():
        path = output_dir / pointer.read_text().strip()
        if path.is_dir():
            return path
    found = sorted((p for p in output_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
                   key=lambda p: int(p.name.split("-")[-1]))
    return found[-1] if found else None


def _checkpoint_before(output_dir: Path, step: int) -> Path | None:
    """The newest checkpoint-N of output_dir with N < step."""
    steps = [int(p.name.split("-")[-1]) for p in output_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()]
    earlier = [n for n in steps if n < step]
    return output_dir / f"checkpoint-{max(earlier)}" if earlier else None


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(accelerator, drafter, method, recipe: Recipe, output_dir: Path, state: dict,
                    optimizers) -> Path:
    """Write checkpoint-<step>/ through a temporary folder and a rename, then point `latest` at it.

    The drafter's weights are written once, as model.safetensors; training_state/ holds the optimizer and RNG
    states in safetensors and JSON (state.py; under FSDP or DeepSpeed, accelerate's save_state, whose hooks `train`
    sets to leave the model out). A failed write (a full disk) removes the partial folder and stops the run with
    one line; the last complete checkpoint stays."""
    from draftsmith.models.checkpoint import is_disk_full, save_safetensors_atomic, write_json_atomic

    name = f"checkpoint-{state['step']}"
    final = output_dir / name
    tmp = output_dir / f".{name}.tmp"
    previous = latest_checkpoint(output_dir)
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    try:
        if accelerator.is_main_process:
            model = accelerator.unwrap_model(drafter)
            tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()
                       if not k.startswith("rotary_emb.")}
            save_safetensors_atomic(tensors, tmp / WEIGHTS_FILE)
        if _delegated(accelerator):
            accelerator.save_state(str(tmp / STATE_DIR))  # FSDP / DeepSpeed shard the optimizer themselves
        else:  # optimizer and RNG states (every process its RNG's), no pickles
            save_training_state(tmp / STATE_DIR, optimizers, accelerator.process_index, accelerator.num_processes,
                                accelerator.is_main_process)
        accelerator.wait_for_everyone()  # every process's RNG file is in before the folder is renamed
        if accelerator.is_main_process:
            write_json_atomic(method.config.to_dict(), tmp / "config.json")
            write_json_atomic(state, tmp / "trainer_state.json")
            save_recipe(recipe, tmp / RECIPE_FILE)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _write_text_atomic(output_dir / LATEST, name + "\n")
            kept = sorted((p for p in output_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
                          key=lambda p: int(p.name.split("-")[-1]))
            for old in kept[: -recipe.training.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
    except (OSError, RuntimeError) as e:
        full = is_disk_full(e) or (isinstance(e, RuntimeError) and _nearly_full(output_dir))
        if not (full or isinstance(e, OSError)):
            raise
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        where = final
        filename = getattr(e, "filename", None)
        if filename and Path(filename).is_relative_to(tmp):
            where = final / Path(filename).relative_to(tmp)
        reason = "disk full (no space left on device)" if full else f"cannot write: {e.strerror or e}"
        resume = f"resume from {previous.name}" if previous is not None else "start again"
        raise TrainingError(f"{where}: {reason}; removed the partial {tmp.name}: free space (or set output_dir on "
                            f"another disk) and rerun to {resume}") from None
    accelerator.wait_for_everyone()
    return final


def _nearly_full(path: Path) -> bool:
    try:
        return shutil.disk_usage(path).free < NEARLY_FULL_BYTES
    except OSError:
        return False


def _delegated(accelerator) -> bool:
    """FSDP or DeepSpeed: they shard the optimizer state, which only accelerate's save_state and load_state
    (pickles) handle."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED,
                                            DistributedType.MEGATRON_LM)


def _state_without_model(models, weights, output_dir) -> None:
    """accelerate's save_state pre-hook: the checkpoint's model.safetensors already holds the drafter's weights,
    so training_state/ keeps only the optimizer and RNG states (FSDP and DeepSpeed, which shard the
    model themselves, never put it in `weights`)."""
    weights.clear()


def _model_from_checkpoint(accelerator):
    """accelerate's load_state pre-hook: load the drafter from the checkpoint's model.safetensors (its one copy,
    fp32 master weights, so a resume stays bit-exact) and tell accelerate not to look for its own."""

    def hook(models, input_dir) -> None:
        if not models:
            return
        for model in models:
            load_drafter_weights(accelerator, model, Path(input_dir).parent)
        models.clear()

    return hook


def load_drafter_weights(accelerator, drafter, checkpoint: Path) -> None:
    """The drafter's weights from the checkpoint's model.safetensors (its one copy, fp32 master weights, so a
    resume stays bit-exact)."""
    from draftsmith.models.checkpoint import load_checkpoint

    _, tensors = load_checkpoint(checkpoint)
    missing, unexpected = accelerator.unwrap_model(drafter).load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not k.startswith("rotary_emb.")]
    if missing or unexpected:
        raise TrainingError(f"{checkpoint / WEIGHTS_FILE}: does not fit this drafter (tensors "
                            f"{(missing + unexpected)[:5]} differ): set output_dir to a new folder")


def _schedule_at(schedulers, step: int) -> None:
    """Put the rebuilt schedulers of a resumed run at `step`: the rate is a pure function of the step and the plan
    (trainer_state.json), so no scheduler state is saved. step() recomputes each group's rate from its
    initial_lr, which the loaded optimizer state holds."""
    for scheduler in schedulers:
        scheduler.last_epoch = step - 1
        with warnings.catch_warnings():  # no optimizer step has run in this process yet: torch's order warning
            warnings.filterwarnings("ignore", message="Detected call of")
            scheduler.step()


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

    def change(key: str, before, now) -> str:
        return f"{key} {json.dumps(before)} there, {json.dumps(now)} now"

    differ = []
    for section in (*SAME_RUN_SECTIONS, recipe.model.method):
        before, now = old.get(section) or {}, new.get(section) or {}
        for key in sorted(set(before) | set(now)):
            if f"{section}.{key}" not in SAME_RUN_IGNORED and before.get(key) != now.get(key):
                differ.append(change(f"{section}.{key}", before.get(key), now.get(key)))
    before, now = old.get("training") or {}, new["training"]
    differ += [change(f"training.{key}", before.get(key), now[key]) for key in SAME_RUN_TRAINING
               if key in before and before[key] != now[key]]  # a key the old recipe lacks had its default
    saved = _read_trainer_state(checkpoint)
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
    return [f"{change(f'training.{key}', before[key], now[key])}: the resumed run keeps its checkpoint's schedule, "
            f"which ends at step {plan.get('total')}" for key in ("max_steps", "epochs")
            if key in before and before[key] != now[key] and not plan.get("hold")]


def _read_trainer_state(checkpoint: Path) -> dict:
    return read_json_object(checkpoint / "trainer_state.json")


def drop_replayed_rows(metrics_path: Path, step: int) -> None:
    """Keep the rows of steps up to the resumed checkpoint's: the later ones are logged again as the resumed run
    replays those steps. A line cut short by a kill is dropped too."""
    from draftsmith.models.checkpoint import write_text_atomic

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


def check_target_weights(target, source: str) -> None:
    """Refuse a target holding a NaN or inf weight (one pass and one sync, at load): it yields NaN features, or, in
    its lm_head, NaN teacher rows that EAGLE-3's draft-vocabulary mask would drop without a word."""
    params = [(name, p) for name, p in target.model.named_parameters() if p.is_floating_point() and not p.is_meta]
    finite = torch.stack([torch.isfinite(p).all() for _, p in params]).cpu().tolist()
    bad = [name for (name, _), ok in zip(params, finite) if not ok]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise TrainingError(f"{source}: the target's weight {bad[0]}{more} holds NaN or inf values: its checkpoint "
                            "is corrupt; download it again")


TOKENIZER_PADDING = 1024  # embedding rows past the tokenizer that models pad with (Qwen3: 267), not a mismatch


def check_tokenizer_fits(tokenizer_size: int, vocab_size: int, target: str) -> None:
    """A tokenizer with ids past the target's vocabulary cannot work (refused); one much smaller than it is
    probably another model's (warned): its ids still index the embedding, so training would run on wrong text."""
    if tokenizer_size > vocab_size:
        raise TrainingError(f"{target}: the tokenizer has {tokenizer_size} tokens, more than the target's "
                            f"vocabulary of {vocab_size}: use the target's own tokenizer")
    if vocab_size - tokenizer_size > max(TOKENIZER_PADDING, vocab_size // 100):
        warnings.warn(f"{target}: the tokenizer has {tokenizer_size} tokens, the target's vocabulary "
                      f"{vocab_size}: is it the target's own tokenizer?", stacklevel=2)


def _load_tokenizer(target: str):
    """The tokenizer of model.target; a bad target is one TrainingError line (models/target.py)."""
    from draftsmith.models.target import load_target_tokenizer

    return load_target_tokenizer(target, "model.target", TrainingError)


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
def evaluate(method, drafter, samples, batch_size, pad_id, device, features: FeatureCheck | None = None,
             before_batch=None) -> dict[str, float]:
    """Held-out loss, per-step top-1 accuracy and simulated acceptance length, weighted by valid positions.
    With `features` (the target's checked capture), a non-finite feature of an eval sample stops the run;
    `before_batch(start, end)` is told which eval samples each batch holds (a hidden-state store reads them)."""
    if not samples:
        return {}
    drafter.eval()
    sums: dict[str, float] = {}
    weight_total = 0.0
    for i in range(0, len(samples), batch_size):
        batch = collate(samples[i:i + batch_size], pad_id, device)
        if before_batch is not None:
            before_batch(i, min(i + batch_size, len(samples)))
        loss, metrics = method.loss(drafter, batch)
        rows_ok = features.take() if features is not None else None
        if rows_ok is not None and not bool(rows_ok.all()):  # evaluation syncs per batch anyway
            bad = i + int((~rows_ok).nonzero()[0, 0])
            raise TrainingError(f"evaluation: the target's hidden states for eval sample {bad} are not finite (NaN "
                                "or inf): the target's weights hold a NaN, or it overflows in half precision (try "
                                "model.dtype=float32)")
        weight = float(metrics["count_0"])
        weight_total += weight
        for key in ["sim_accept_len", *[k for k in metrics if k.startswith(("acc_", "loss_"))]]:
            sums[key] = sums.get(key, 0.0) + float(metrics[key]) * weight
        sums["loss"] = sums.get("loss", 0.0) + float(loss) * weight
    drafter.train()
    return {f"eval/{k}": v / max(weight_total, 1.0) for k, v in sums.items()}


def train(recipe: Recipe, log=print) -> Path:
    """Train the drafter a recipe describes; returns the final checkpoint folder. A run that fails before it
    writes anything leaves no output_dir behind (when it created it); a full disk is one line."""
    from draftsmith.models.checkpoint import is_disk_full, write_failure

    output_dir = Path(recipe.output_dir)
    created = not output_dir.exists()
    try:
        with contextlib.ExitStack() as closing:  # the progress bar is closed before an error is printed
            return _train(recipe, output_dir, log, closing)
    except OSError as e:
        if not is_disk_full(e):
            raise
        raise TrainingError(f"{write_failure(e, output_dir)}: free space and rerun (the run resumes from its last "
                            "checkpoint)") from None
    finally:
        if created and output_dir.is_dir() and not any(output_dir.iterdir()):
            with contextlib.suppress(OSError):  # another process of the run may have removed it first
                output_dir.rmdir()


def _train(recipe: Recipe, output_dir: Path, log, closing: contextlib.ExitStack) -> Path:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from draftsmith.data import prepare_dataset
    from draftsmith.data.vocab import load_or_build_draft_vocab
    from draftsmith.models.target import TargetModel

    cfg = recipe.training
    mixed = cfg.mixed_precision
    if mixed == "auto":
        mixed = dev.mixed_precision_for(dev.get_device())
    elif mixed == "bf16":
        dev.warn_if_emulated_bf16(dev.get_device(), "set training.mixed_precision=no (or auto) and "
                                                    "model.dtype=float32")
    accelerator = Accelerator(
        mixed_precision=mixed,
        gradient_accumulation_steps=cfg.grad_accum_steps,
        log_with=None if cfg.report_to == "none" else cfg.report_to,
        project_dir=str(output_dir),
    )
    log = log if accelerator.is_main_process else (lambda *a, **k: None)
    set_seed(cfg.seed)
    output_dir.mkdir(parents=True, exist_ok=True)
    resume_from = latest_checkpoint(output_dir)
    own_state = True  # training_state/ in draftsmith's files (state.py), else accelerate's
    if resume_from is not None:  # before anything slow: a rerun of another recipe is refused at once
        for note in check_same_run(resume_from, recipe, output_dir, accelerator.num_processes):
            log(note)
        own_state = check_run_folder(resume_from, cfg.trust_run_folder, _delegated(accelerator))
    if accelerator.is_main_process:
        for stale in output_dir.glob(".checkpoint-*.tmp"):  # a save killed halfway (kill -9); this run saves later
            shutil.rmtree(stale, ignore_errors=True)

    spec = registry.get(recipe.model.method)
    closing.enter_context(dev.sdpa_without_cudnn())  # batches change shape every step (device.py)
    tokenizer = _load_tokenizer(recipe.model.target)
    check_recipe_against_target(recipe, target_config_dict(recipe.model.target), str(output_dir / RECIPE_FILE))
    with accelerator.main_process_first():
        data = prepare_dataset(recipe.data, tokenizer, log=log)
    if not data.train:
        raise TrainingError(f"{recipe.data.path}: no training samples left after filtering")
    target_dtype = recipe.model.dtype if recipe.model.dtype != "auto" else (
        "bfloat16" if mixed == "bf16" else "float32")
    store_dir = recipe.data.hidden_states_path or _complete_cache(recipe.data.hidden_states_cache)
    if store_dir:  # the store holds what the layers would compute: load only what it needs
        target = TargetModel.head_and_embeddings(recipe.model.target, dtype=target_dtype, device=accelerator.device)
    else:
        target = TargetModel.from_pretrained(recipe.model.target, dtype=target_dtype, device=accelerator.device,
                                             attn_implementation=recipe.model.attn_implementation)
    check_target_weights(target, recipe.model.target)
    check_tokenizer_fits(len(tokenizer), target.vocab_size, recipe.model.target)
    method = method_class(recipe.model.method)(recipe, target)
    # the method's draft vocabulary (EAGLE-3's default fits the target; None: the target's whole vocabulary)
    vocab_size = method.draft_vocab_size or target.vocab_size
    for note in method.notes:
        log(note)
    if accelerator.num_processes > 1:
        method.count_mean = _mean_over_processes  # normalise by the global batch's tokens, not each process's
    stored = _open_store(store_dir, recipe, tokenizer, target, method, data, log) if store_dir else None
    caching = None
    if stored is None and recipe.data.hidden_states_cache:  # the hybrid's first epoch: capture and write
        caching = _start_cache(recipe, tokenizer, target, method, data, accelerator.process_index, log)
        stored = caching  # selects samples like a store
    if stored is not None:
        target.capture = stored  # the methods' capture now reads (or, first epoch of a cache, writes) the store
    features = FeatureCheck(target.capture)
    target.capture = features  # the methods capture inside their loss; this records which rows came out finite
    with accelerator.main_process_first():
        d2t, t2d, vocab_path = load_or_build_draft_vocab(
            recipe.data.cache_path(), tokenizer, data.train, target.vocab_size, vocab_size)
    if spec.draft_vocab:
        log(f"draft vocab: {vocab_size} of {target.vocab_size} tokens ({vocab_path})")
    elif recipe.model.draft_vocab_size is not None:
        log(f"model.draft_vocab_size is not used by {recipe.model.method}: it reads out with the target's head")
    drafter = method.build_drafter(d2t, t2d)
    if recipe.model.init_from:
        load_initial_weights(drafter, recipe.model.init_from, recipe.model.method)
        log(f"initialised the drafter from {recipe.model.init_from}")
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    optimizers = build_optimizers(drafter, cfg)

    world, rank = accelerator.num_processes, accelerator.process_index
    lengths = [len(sample.input_ids) for sample in data.train]
    batch_label = f"{cfg.tokens_per_step} tokens" if cfg.tokens_per_step else f"{cfg.batch_size} samples"
    if cfg.packing:
        batch_label = f"{cfg.tokens_per_step} tokens packed into one row"
    batches_per_epoch = len(epoch_batches(lengths, cfg.batch_size, cfg.seed, 0, rank, world, cfg.tokens_per_step,
                                          cfg.packing))
    if batches_per_epoch < cfg.grad_accum_steps:
        raise TrainingError(f"{len(data.train)} samples make no full optimizer step of {cfg.grad_accum_steps} x "
                            f"{batch_label} on {world} processes: lower training.batch_size (or "
                            "training.tokens_per_step) or training.grad_accum_steps, or add data")
    steps_per_epoch = max(1, batches_per_epoch // cfg.grad_accum_steps)
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    if cfg.max_minutes is not None:  # the probe's plan; replaced once the step time is known
        plan = probe_plan(cfg.time_probe_steps, total_steps, cfg.lr_schedule, cfg.lr_decay_ratio)
    else:
        plan = fixed_plan(total_steps, cfg.warmup_ratio, cfg.lr_schedule, cfg.lr_decay_ratio)
    planned = {"plan": plan}  # the schedulers read the current plan through this box
    # not registered with accelerate (it would pickle them): rebuilt from the plan on resume (_schedule_at)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lambda step: planned["plan"].factor(step))
                  for opt in optimizers]
    drafter, *optimizers = accelerator.prepare(drafter, *optimizers)
    # accelerate's save_state and load_state (FSDP, DeepSpeed, a trusted folder of accelerate's state)
    accelerator.register_save_state_pre_hook(_state_without_model)  # the weights live in model.safetensors
    accelerator.register_load_state_pre_hook(_model_from_checkpoint(accelerator))

    state = {"step": 0, "epoch": 0, "micro_batches_done": 0, "tokens_seen": 0, "train_seconds": 0.0}
    metrics_path = output_dir / "metrics.jsonl"
    if resume_from is not None:
        if own_state:
            load_drafter_weights(accelerator, drafter, resume_from)
            if not load_training_state(resume_from / STATE_DIR, optimizers, rank):
                log(f"{resume_from / STATE_DIR}: no RNG state for process {rank}: its generators start from the "
                    "seed")
        else:
            accelerator.load_state(str(resume_from / STATE_DIR))
        state = {**state, **_read_trainer_state(resume_from)}
        if "plan" in state:
            planned["plan"] = SchedulePlan.from_dict(state["plan"])
        _schedule_at(schedulers, state["step"])
        if accelerator.is_main_process:
            drop_replayed_rows(metrics_path, state["step"])
        log(f"resuming from {resume_from} at step {state['step']}")
    state["plan"] = planned["plan"].to_dict()
    state["processes"] = world  # a resume must keep batch_size x processes (check_same_run)
    log(f"optimizer: {' + '.join(type(o.optimizer).__name__ for o in optimizers)}, lr {cfg.lr}"
        + (f" (Muon {cfg.muon_lr or cfg.lr})" if cfg.optimizer == "muon" else "")
        + f", {cfg.lr_schedule} schedule, micro-batches of {batch_label}")
    if accelerator.is_main_process:
        save_recipe(recipe, output_dir / "recipe.yaml")
    if cfg.report_to != "none":
        accelerator.init_trackers(cfg.run_name or output_dir.name, config=_flat(recipe_to_dict(recipe)))

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    # share of positions whose next token is trained (loss masks hold 0 and 1): DFlash anchors only there, MTP
    # reads its head only there, so their FLOPs per token follow the data
    every_token = cfg.loss_on == "all"
    loss_share = 1.0 if every_token else (
        sum(sum(sample.loss_mask[1:]) for sample in data.train) / max(1, sum(n - 1 for n in lengths)))
    flops_at, peak_tflops = _flop_counter(method, lengths, cfg, accelerator.device, log,
                                          target_runs=store_dir is None, loss_share=loss_share)
    watch = FiniteWatch(describe=lambda i: _describe(tokenizer, data.train, i))
    rate = f"training.lr={cfg.lr:g}" + (f", training.muon_lr={cfg.muon_lr:g}" if cfg.optimizer == "muon" and
                                          cfg.muon_lr else "")
    stuck = StuckWatch(rate, cfg.stop_when_stuck_steps)

    def check_health() -> None:
        """Stop on the first NaN/inf since the last call; called where the loop syncs anyway (health.py)."""
        _raise_if_unhealthy(watch, accelerator)

    started = time.time() - state["train_seconds"]  # a resumed run keeps the budget it has spent
    probe_times: dict[int, float] = {}  # probe (and re-plan) step -> wall time at its end (device synchronised)
    eval_seconds, eval_spent = 0.0, 0.0  # one evaluation's cost, and the time evaluations took since the probe
    window_tokens, window_start = 0, time.time()
    window_loss, window_micro = 0.0, 0  # mean micro-batch loss since the last log line
    window_flops = 0.0  # model FLOPs of the tokens since the last log line (train/flops.py)
    progress = closing.enter_context(tqdm(total=planned["plan"].total, initial=state["step"], desc="train",
                                          disable=not accelerator.is_main_process))
    drafter.train()
    last_saved = state["step"] if resume_from else -1
    stop = state["step"] >= planned["plan"].total
    while not stop:
        batches = epoch_batches(lengths, cfg.batch_size, cfg.seed, state["epoch"], rank, world, cfg.tokens_per_step,
                                cfg.packing)
        # whole accumulation cycles only, so every epoch (and every checkpoint) ends on an optimizer step
        batches = batches[: len(batches) // cfg.grad_accum_steps * cfg.grad_accum_steps]
        for micro in range(state["micro_batches_done"], len(batches)):
            samples = [data.train[i] for i in batches[micro]]
            batch = (collate_packed(samples, accelerator.device, every_token) if cfg.packing
                     else collate(samples, pad_id, accelerator.device, every_token))
            if stored is not None:
                stored.select(batches[micro], [s.input_ids for s in samples])
            with accelerator.accumulate(drafter):
                loss, metrics = method.loss(drafter, batch)
                watch.observe_micro_batch(state["step"] + 1, batches[micro], features.take(), loss)  # no sync
                accelerator.backward(loss)
                window_loss = window_loss + loss.detach()
                window_micro += 1
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(trainable, cfg.max_grad_norm)
                    watch.observe_step(state["step"] + 1, grad_norm)
                for optimizer in optimizers:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            state["micro_batches_done"] = micro + 1
            n_tokens = sum(len(sample.input_ids) for sample in samples) * world  # from the host: no sync
            state["tokens_seen"] += n_tokens
            window_tokens += n_tokens
            if flops_at is not None:  # a packed row's attention spans its samples, not the row
                seq = n_tokens // world // len(samples) if cfg.packing else batch["input_ids"].shape[1]
                window_flops += flops_at(seq) * n_tokens
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
                    check_health()
                    planned["plan"], eval_seconds = _plan_the_budget(cfg, probe_times, started, total_steps, method,
                                                                     drafter, data.eval, pad_id, accelerator,
                                                                     metrics_path, log, _eval_selector(stored, data))
                    probe_times[step] = time.time()  # the steady steps are timed from after that evaluation
                    eval_spent = 0.0
                elif step == plan.replan_step and len(probe_times) > 1:
                    since = max(s for s in probe_times if s < step)  # the last timing point
                    steady = (probe_times[step] - probe_times[since] - eval_spent) / (step - since)
                    planned["plan"] = replan(plan, step, steady, cfg.max_minutes * 60 - (time.time() - started),
                                             total_steps, cfg.eval_every, eval_seconds)
                    eval_spent = 0.0
                    new = planned["plan"]
                    log(f"time budget: re-planned at step {step}: {steady * 1000:.1f} ms/step, {new.shape} schedule "
                        f"to step {new.total}")
                if planned["plan"] is not plan:
                    state["plan"] = planned["plan"].to_dict()
                    progress.total = planned["plan"].total
                    progress.refresh()
            state["train_seconds"] = time.time() - started
            elapsed_min = state["train_seconds"] / 60
            out_of_time = cfg.max_minutes is not None and elapsed_min >= cfg.max_minutes
            stop = step >= planned["plan"].total or out_of_time
            if step % cfg.log_every == 0 or stop:
                check_health()  # its one transfer is the sync this log line makes anyway
                now = time.time()
                seconds = max(now - window_start, 1e-9)
                if world > 1:  # every process logs at the same steps: the mean loss of the global batch
                    window_loss = accelerator.reduce(torch.as_tensor(window_loss, device=accelerator.device).clone(),
                                                     reduction="mean")
                row = {"step": step, "epoch": state["epoch"], "lr": schedulers[0].get_last_lr()[0],
                       "loss": float(window_loss) / window_micro, "grad_norm": float(grad_norm),
                       "tokens_per_s": window_tokens / seconds,
                       **_utilisation(window_flops / seconds, flops_at, peak_tflops, accelerator.device, world),
                       **{f"train/{k}": float(v) for k, v in metrics.items() if not k.startswith("count_")}}
                window_tokens, window_start, window_flops = 0, now, 0.0
                window_loss, window_micro = 0.0, 0
                postfix = dict(loss=f"{row['loss']:.3f}", acc0=f"{row.get('train/acc_0', 0):.2f}",
                               tau=f"{row['train/sim_accept_len']:.2f}")
                if "peak_memory_gib" in row:
                    postfix["mem"] = f"{row['peak_memory_gib']:.1f}G"
                if "mfu" in row:
                    postfix["mfu"] = f"{row['mfu']:.0%}"
                progress.set_postfix(**postfix)
                _log_row(accelerator, metrics_path, row)
                for warning in stuck.observe(step, row["loss"], row["grad_norm"]):
                    log(f"warning: {warning}")
                stuck_stop = stuck.stop_message(step)
                if stuck_stop is not None:  # no checkpoint of the stuck weights: the last good one stays
                    good = _checkpoint_before(output_dir, stuck.stuck_since)
                    raise TrainingError(stuck_stop + (f" (model.init_from={good} starts from its last checkpoint "
                                                      "before that)" if good is not None else ""))
            if step % cfg.eval_every == 0 or stop:
                check_health()  # evaluation syncs on every batch anyway
                if stop and data.eval:  # the bar sits at its end meanwhile: say what the wait is for
                    log(f"step {step}: evaluating on the {len(data.eval)} held-out samples")
                eval_started = time.time()
                row = {"step": step, **evaluate(method, drafter, data.eval, cfg.batch_size, pad_id,
                                                accelerator.device, features, _eval_selector(stored, data))}
                eval_spent += time.time() - eval_started
                if len(row) > 1:
                    log(f"step {step}: eval loss {row['eval/loss']:.4f} acc_0 {row['eval/acc_0']:.3f} "
                        f"simulated acceptance length {row['eval/sim_accept_len']:.2f}")
                    _log_row(accelerator, metrics_path, row)
            if step % cfg.save_every == 0 and not stop and stuck.stopping_soon():
                log(f"step {step}: no checkpoint: the run is stuck since step {stuck.stuck_since} (the last one "
                    "stays)")
            elif step % cfg.save_every == 0 or stop:
                check_health()  # a checkpoint never holds a NaN
                save_checkpoint(accelerator, drafter, method, recipe, output_dir, state, optimizers)
                last_saved = step
            if stop:
                if out_of_time:
                    log(f"stopping: training.max_minutes={cfg.max_minutes} reached at step {step}")
                break
        else:
            if caching is not None:  # the first epoch is over: complete the cache, then read it
                caching.finish(accelerator.device, method.aux_layer_ids, world, recipe.collect.batch_tokens,
                               accelerator.wait_for_everyone)
                stored = _open_store(recipe.data.hidden_states_cache, recipe, tokenizer, target, method, data, log)
                features.replace(stored)
                caching = None
            state["epoch"] += 1
            state["micro_batches_done"] = 0
            stop = cfg.max_steps is None and state["epoch"] >= cfg.epochs
    progress.close()
    if last_saved != state["step"]:
        check_health()
        save_checkpoint(accelerator, drafter, method, recipe, output_dir, state, optimizers)
    accelerator.end_training()
    final = latest_checkpoint(output_dir)
    log(f"done: {state['step']} steps, {state['tokens_seen']} tokens in {(time.time() - started) / 60:.1f} min; "
        f"checkpoint {final}")
    return final


def _mean_over_processes(count: torch.Tensor) -> torch.Tensor:
    """A per-process count's mean over the data-parallel processes (one all-reduce, no host sync)."""
    import torch.distributed as dist

    total = count.detach().float().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def _complete_cache(folder: str | None) -> str | None:
    from draftsmith.data.store import INDEX

    return folder if folder and (Path(folder).expanduser() / INDEX).is_file() else None


def recipe_store_header(recipe, tokenizer, target, method, data, dtype: str) -> dict:
    """What a hidden-state store for this recipe records (data/store.py): its samples are the training samples,
    then the held-out ones, with the method's aux layers. `collect` writes it, training checks it."""
    from draftsmith.data.store import store_header

    return store_header(recipe.model.target, tokenizer, method.aux_layer_ids, target.config.hidden_size,
                        [*data.train, *data.eval], len(data.train), dtype)


def _start_cache(recipe, tokenizer, target, method, data, rank: int, log):
    """data.hidden_states_cache, not complete yet: the capture that also writes the first epoch's states."""
    from draftsmith.data.store import CachingCapture

    header = recipe_store_header(recipe, tokenizer, target, method, data, recipe.collect.dtype)
    folder = Path(recipe.data.hidden_states_cache).expanduser()
    cache = CachingCapture(target.capture, folder, header, [*data.train, *data.eval], rank, recipe.collect.dtype,
                           recipe.collect.max_shard_bytes)
    log(f"hidden states: the first epoch also writes them to {folder}"
        + (f" (resuming: {len(cache.writer.done)} samples there)" if cache.writer.done else "")
        + "; later epochs read them")
    return cache


def _open_store(folder, recipe, tokenizer, target, method, data, log):
    """The store in `folder`, checked against this recipe; the capture that reads it."""
    from accelerate import PartialState

    from draftsmith.data.store import HiddenStateStore, StoredCapture, human_bytes

    store = HiddenStateStore(Path(folder).expanduser())
    store.check_matches(recipe_store_header(recipe, tokenizer, target, method, data, store.index.get("dtype")))
    if recipe.data.verify_store:  # every shard's checksum before the first step, each process its share
        store.verify(PartialState().process_index, PartialState().num_processes)
    log(f"hidden states: read from {store.folder} ({store.index['num_samples']} samples, "
        f"{human_bytes(store.index['bytes'])}, {store.index['dtype']}); the target's layers are not run")
    return StoredCapture(store, target.device, target.dtype, method.aux_layer_ids)


def _eval_selector(stored, data):
    """evaluate()'s `before_batch` for a store: eval sample j is store sample len(train) + j."""
    if stored is None:
        return None
    n = len(data.train)
    return lambda start, end: stored.select(list(range(n + start, n + end)),
                                            [s.input_ids for s in data.eval[start:end]])


def _flop_counter(method, lengths: list[int], cfg, device, log, target_runs: bool = True, loss_share: float = 1.0):
    """(`flops_at(seq_len)`: model FLOP per trained token, cached per length, the matrix rate in TFLOP/s that MFU is
    measured against or None); logs the count at the median sample length, term by term, and the rate."""
    def count(seq_len: int) -> dict[str, float]:
        terms = dict(method.flops_per_token(seq_len, loss_share))
        if not target_runs:  # read from a hidden-state store: the target's layers do not run
            terms.pop("target_forward")
            terms["total"] = sum(v for k, v in terms.items() if k != "total")
        return terms

    cache: dict[int, float] = {}

    def flops_at(seq_len: int) -> float:
        if seq_len not in cache:
            cache[seq_len] = count(seq_len)["total"]
        return cache[seq_len]

    typical = sorted(lengths)[len(lengths) // 2]
    peak = cfg.peak_tflops or dev.peak_matrix_tflops(device)
    source = "training.peak_tflops" if cfg.peak_tflops else f"the datasheet of {dev.device_name(device)}"
    log(f"model FLOPs at {typical} tokens: {describe_flops(count(typical))}; MFU against "
        + (f"{peak:g} TFLOP/s ({source})" if peak else "no known matrix rate (set training.peak_tflops)"))
    return flops_at, peak


def _utilisation(flops_per_s: float, flops_at, peak_tflops: float | None, device, world: int) -> dict:
    """The log row's TFLOP/s, MFU (per device, against the peak) and peak allocated memory of this device."""
    row = {}
    if flops_at is not None:
        row["tflops_per_s"] = flops_per_s / 1e12
        if peak_tflops:
            row["mfu"] = flops_per_s / 1e12 / world / peak_tflops
    peak_bytes = dev.max_memory_allocated(device)
    if peak_bytes:
        row["peak_memory_gib"] = peak_bytes / 2**30
    return row


def _plan_the_budget(cfg, probe_times, started, max_steps, method, drafter, eval_samples, pad_id, accelerator,
                     metrics_path, log, before_batch=None) -> tuple[SchedulePlan, float]:
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
        row = {"step": hold, **evaluate(method, drafter, eval_samples, cfg.batch_size, pad_id, accelerator.device,
                                        before_batch=before_batch)}
        eval_seconds = time.time() - t0
        _log_row(accelerator, metrics_path, row)
    seconds_left = cfg.max_minutes * 60 - (time.time() - started)
    plan = plan_for_budget(hold, step_seconds, seconds_left, cfg.warmup_ratio, cfg.lr_schedule,
                           max_steps=max_steps, eval_every=cfg.eval_every, eval_seconds=eval_seconds,
                           decay_ratio=cfg.lr_decay_ratio)
    log(f"time budget {cfg.max_minutes} min: {plan.note}; warmup {plan.warmup}, {plan.shape} schedule to step "
        f"{plan.total}" + (f", re-planned at step {plan.replan_step}" if plan.replan_step else ""))
    return plan, eval_seconds


def _raise_if_unhealthy(watch: FiniteWatch, accelerator) -> None:
    problem = watch.first_problem()
    if accelerator.num_processes > 1:  # all processes stop together, or the others wait forever in a collective
        found = accelerator.reduce(torch.tensor([float(problem is not None)], device=accelerator.device), "sum")
        if problem is None and float(found) > 0:
            problem = "another process found NaN or inf values (its message names the step and sample)"
    if problem is not None:
        raise TrainingError(problem)


def _describe(tokenizer, samples, i: int) -> str:
    """A training sample as a message names it: its index in the training set and its first words."""
    text = " ".join(tokenizer.decode(samples[i].input_ids[:48], skip_special_tokens=True).split())
    return f"training sample {i} ({text[:60]!r})"


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
