"""`setup(recipe)`: everything a training run needs, built once, in a fixed order, into one `Run`: a small
dataclass (torchtune's recipe state as one object, not a trainer class) that the loop (loop.py) steps.

    1. accelerate (DDP; bf16 autocast over fp32 master weights, gradient accumulation, the trackers), the
       sharding the run asks for checked (distributed.py: FSDP2 and DeepSpeed ZeRO are draftsmith's own
       fully_shard and deepspeed.initialize calls, on every device), and the run folder: a rerun of another
       recipe is refused before anything slow (checkpoint.py find_resume)
    2. tokenizer, the recipe checked against the target's config.json, the data
    3. the target (only its head and embeddings when a store holds what its layers would compute; its decoder
       layers sharded over the processes with training.shard_target), the method
       (models/registry.py), the feature source (features.py)
    4. the draft vocabulary, the drafter (its method's training options applied once, from outside:
       `method.apply_training_options`), model.init_from
    5. the drafter sharded (FSDP2) or left to accelerate's prepare (DDP); batching, the time budget and its plan,
       optimizers and schedulers; then a resume loads the checkpoint into them (checkpoint.py resume); under
       DeepSpeed ZeRO the drafter and its (resumed) optimizer are handed to DeepSpeed last

The order is the run's random stream: the target's and drafter's initialisations draw from the seed in this order,
so a change of order is a change of behaviour (tests/test_pinned_losses.py).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from draftsmith import device as dev
from draftsmith import distributed
from draftsmith.config import Recipe, check_recipe_against_target, recipe_to_dict, save_recipe
from draftsmith.models import registry
from draftsmith.models.checkpoint import RECIPE_FILE
from draftsmith.models.spec import TrainingMethod, resolve
from draftsmith.train.batching import Batching, epoch_batches
from draftsmith.train.budget import TimeBudget
from draftsmith.train.checkpoint import find_resume, load_initial_weights, register_state_hooks, resume
from draftsmith.train.errors import TrainingError
from draftsmith.train.features import FeatureSource, open_features, store_folder
from draftsmith.train.metrics import flat
from draftsmith.train.optim import build_optimizers, build_schedulers, schedule_at
from draftsmith.train.state import raw_optimizer

if TYPE_CHECKING:  # annotations only: the target's module loads transformers
    from draftsmith.models.target import TargetModel

METRICS_FILE = "metrics.jsonl"
SHARDING_NAMES = {"fsdp2": "FSDP2", "zero1": "DeepSpeed ZeRO-1", "zero2": "DeepSpeed ZeRO-2",
                  "zero3": "DeepSpeed ZeRO-3"}
TOKENIZER_PADDING = 1024  # embedding rows past the tokenizer that models pad with (Qwen3: 267), not a mismatch


@dataclass
class RunPaths:
    """The run folder (output_dir) and what this run found in it."""

    output_dir: Path
    metrics: Path  # metrics.jsonl: one JSON row per logged step and per evaluation
    resume_from: Path | None  # the checkpoint this run continues, None for a fresh run
    own_state: bool  # its training_state/ in draftsmith's files (state.py), else accelerate's


@dataclass
class Run:
    """Everything the loop steps, built once by `setup`. `state` is what trainer_state.json saves: step,
    epoch, micro_batches_done, tokens_seen, train_seconds, plan (the schedule's), processes."""

    recipe: Recipe
    accelerator: Any  # accelerate.Accelerator
    tokenizer: Any
    data: Any  # data.PreparedData: .train and .eval samples
    batching: Batching
    target: TargetModel
    features: FeatureSource  # handed to the method's loss: online capture, a store or the first epoch's cache
    method: TrainingMethod
    drafter: torch.nn.Module  # FSDP2-sharded or a DeepSpeed engine (distributed.py), or as accelerate prepared it
    optimizers: list
    schedulers: list  # LambdaLR over budget.factor: the schedule is a pure function of the step and the plan
    budget: TimeBudget
    paths: RunPaths
    state: dict
    log: Callable[..., None]  # print on the main process, silent on the others
    trainable: list  # the drafter's parameters with requires_grad, as built (clip_grad_norm_ reads them)
    sharding: str = "ddp"  # "fsdp2" (fully_shard), "zero1" / "zero2" (DeepSpeed) or "ddp" (one process too)


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


def load_tokenizer(target: str):
    """The tokenizer of model.target; a bad target is one TrainingError line (models/target.py)."""
    from draftsmith.models.target import load_target_tokenizer

    return load_target_tokenizer(target, "model.target", TrainingError)


def check_target_weights(target, source: str) -> None:
    """Refuse a target holding a NaN or inf weight (one pass and one sync, at load): it yields NaN features, or, in
    its lm_head, NaN teacher rows that EAGLE-3's draft-vocabulary mask would drop without a word."""
    params = [(name, p) for name, p in target.model.named_parameters() if p.is_floating_point() and not p.is_meta]
    finite = torch.stack([torch.isfinite(distributed.local(p)).all() for _, p in params])
    if any(distributed.is_sharded(m) for m in target.model.modules()):  # each process checked its own shards
        finite = distributed.all_processes(finite)
    finite = finite.cpu().tolist()
    bad = [name for (name, _), ok in zip(params, finite) if not ok]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise TrainingError(f"{source}: the target's weight {bad[0]}{more} holds NaN or inf values: its checkpoint "
                            "is corrupt; download it again")


def check_tokenizer_fits(tokenizer_size: int, vocab_size: int, target: str) -> None:
    """A tokenizer with ids past the target's vocabulary cannot work (refused); one much smaller than it is
    probably another model's (warned): its ids still index the embedding, so training would run on wrong text."""
    if tokenizer_size > vocab_size:
        raise TrainingError(f"{target}: the tokenizer has {tokenizer_size} tokens, more than the target's "
                            f"vocabulary of {vocab_size}: use the target's own tokenizer")
    if vocab_size - tokenizer_size > max(TOKENIZER_PADDING, vocab_size // 100):
        warnings.warn(f"{target}: the tokenizer has {tokenizer_size} tokens, the target's vocabulary "
                      f"{vocab_size}: is it the target's own tokenizer?", stacklevel=2)


def mean_over_processes(count: torch.Tensor) -> torch.Tensor:
    """A per-process count's mean over the data-parallel processes (one all-reduce, no host sync)."""
    import torch.distributed as dist

    total = count.detach().float().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def _silent(*args, **kwargs) -> None:
    pass


def setup(recipe: Recipe, log=print, closing: contextlib.ExitStack | None = None) -> Run:
    """Build the run a recipe describes (see the module's steps); `closing` keeps what must be undone when the run
    ends (the cuDNN attention switch)."""
    from accelerate.utils import set_seed

    cfg = recipe.training
    accelerator, mixed, sharding = _accelerator(recipe, log)
    log = log if accelerator.is_main_process else _silent
    set_seed(cfg.seed)
    output_dir = Path(recipe.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = RunPaths(output_dir, output_dir / METRICS_FILE, *find_resume(output_dir, recipe, accelerator, log))
    if closing is not None:
        closing.enter_context(dev.sdpa_without_cudnn())  # batches change shape every step (device.py)
    tokenizer, data = _tokenizer_and_data(recipe, accelerator, output_dir, log)
    target = _load_target(recipe, tokenizer, mixed, accelerator, log)
    method = method_class(recipe.model.method)(recipe, target)
    for note in method.notes:
        log(note)
    if accelerator.num_processes > 1:
        method.count_mean = mean_over_processes  # normalise by the global batch's tokens, not each process's
    features = open_features(recipe, tokenizer, target, method, data, accelerator, log)
    drafter = _build_drafter(recipe, tokenizer, target, method, data, accelerator, log)
    if sharding == "fsdp2":
        drafter = _shard_drafter(drafter, accelerator, log)
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    optimizers = build_optimizers(drafter, cfg)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batching = Batching(data.train, cfg, pad_id, accelerator.process_index, accelerator.num_processes,
                        accelerator.device)
    budget = TimeBudget(cfg, _total_steps(batching))
    schedulers = build_schedulers(optimizers, budget.factor)
    if sharding == "fsdp2":  # accelerate wraps only the optimizers (it skips their step inside an accumulation)
        prepared = accelerator.prepare(*optimizers)
        optimizers = list(prepared) if isinstance(prepared, (tuple, list)) else [prepared]
    elif sharding == "ddp":  # under ZeRO they are handed to DeepSpeed after a resume loaded them (below)
        drafter, *optimizers = accelerator.prepare(drafter, *optimizers)
    register_state_hooks(accelerator)  # the weights live in model.safetensors, not in accelerate's state
    state = {"step": 0, "epoch": 0, "micro_batches_done": 0, "tokens_seen": 0, "train_seconds": 0.0}
    if paths.resume_from is not None:
        state = {**state, **resume(accelerator, drafter, optimizers, paths, log)}
        if "plan" in state:
            budget.resume(state["plan"])
        schedule_at(schedulers, state["step"])
    if sharding in distributed.ZERO_STAGES:
        drafter = _zero_drafter(drafter, optimizers[0], sharding, accelerator, cfg, log)
    state["plan"] = budget.plan.to_dict()
    state["processes"] = accelerator.num_processes  # a resume must keep batch_size x processes (check_same_run)
    run = Run(recipe, accelerator, tokenizer, data, batching, target, features, method, drafter, optimizers,
              schedulers, budget, paths, state, log, trainable, sharding)
    _start_logging(run)
    return run


def _accelerator(recipe: Recipe, log):
    """(accelerate's Accelerator for the recipe's training section, the mixed precision it runs, the sharding:
    "fsdp2", "zero1" / "zero2" / "zero3" or "ddp"). A sharding the run cannot do is one line here, before the target
    loads."""
    from accelerate import Accelerator

    cfg, output_dir = recipe.training, Path(recipe.output_dir)
    kind, source = distributed.requested_sharding(cfg.sharding)
    check_sharding(recipe, kind, source)
    dev.compile_dynamic()  # a bad DRAFTSMITH_COMPILE_DYNAMIC is one line now, not when the drafter first compiles
    mixed = cfg.mixed_precision
    if mixed == "auto":
        mixed = dev.mixed_precision_for(dev.get_device())
    elif mixed == "bf16":
        dev.warn_if_emulated_bf16(dev.get_device(), "set training.mixed_precision=no (or auto) and "
                                                    "model.dtype=float32")
    # a launcher config made for GPUs (accelerate launch without --cpu) on a host without any: accelerate would make
    # each process a run of its own; its multi-CPU mode joins them (gloo)
    on_cpu_processes = dev.accelerator_type() == "cpu" and launched_processes() > 1
    with distributed.launcher_sharding_hidden():  # draftsmith shards itself (distributed.py)
        accelerator = Accelerator(cpu=on_cpu_processes, mixed_precision=mixed,
                                  gradient_accumulation_steps=cfg.grad_accum_steps,
                                  log_with=None if cfg.report_to == "none" else cfg.report_to,
                                  project_dir=str(output_dir))
    check_processes(recipe, kind, source, accelerator)
    log = log if accelerator.is_main_process else _silent
    if kind != "ddp" and accelerator.num_processes == 1:  # nothing to shard: the drafter trains whole, and
        log(f"sharding: {SHARDING_NAMES[kind]} asked for, but one process holds the whole drafter")
        kind = "ddp"  # the checkpoint is the one a sharded run writes (either resumes the other)
    elif kind == "ddp" and accelerator.num_processes > 1:  # said aloud: accelerate's CPU launcher passes no
        note = (" (accelerate's CPU launcher passes no FSDP config on: set training.sharding=fsdp2 to shard)"
                if accelerator.device.type == "cpu" and cfg.sharding == "auto" else "")  # launcher config on
        log(f"sharding: DDP over {accelerator.num_processes} processes, the whole drafter on each{note}")
    return accelerator, mixed, kind


def check_sharding(recipe: Recipe, kind: str, source: str, environ=os.environ) -> None:
    """Refuse, in one line, a sharding that draftsmith cannot do for this recipe on this device (before anything
    loads): a recipe that asks for sharding never trains plain DDP without a word."""
    cfg = recipe.training
    if kind == "fsdp1":
        raise TrainingError(f"{source}: FSDP1 is not supported: set fsdp_version: 2 in the launcher config "
                            "(recipes/accelerate/fsdp.yaml), or training.sharding=fsdp2")
    if kind == "fsdp2" and cfg.optimizer == "muon":
        raise TrainingError(f"{source}: training.optimizer=muon orthogonalises whole matrices, which FSDP2 shards: "
                            "use training.optimizer=adamw, or training.sharding=ddp")
    if kind == "deepspeed":
        raise TrainingError(f"{source}: draftsmith runs DeepSpeed ZeRO stages 1, 2 and 3: set zero_stage to one "
                            "of them (recipes/accelerate/deepspeed_zero2.yaml, deepspeed_zero3.yaml)")
    if kind in distributed.ZERO_STAGES:
        check_deepspeed(recipe, kind, source, environ)
    store = store_folder(recipe) if cfg.shard_target else None
    if store:
        raise TrainingError("training.shard_target: the target's layers do not run when training reads the store "
                            f"{store}: set training.shard_target=false")


def check_deepspeed(recipe: Recipe, kind: str, source: str, environ=os.environ) -> None:
    """What draftsmith's DeepSpeed ZeRO (distributed.deepspeed_engine) cannot do, refused in one line."""
    cfg = recipe.training
    if importlib.util.find_spec("deepspeed") is None:
        raise TrainingError(f"{source}: DeepSpeed is not installed: pip install 'draftsmith[deepspeed]', or launch "
                            "with recipes/accelerate/fsdp.yaml")
    if cfg.optimizer == "muon":
        raise TrainingError(f"{source}: training.optimizer=muon is two optimizers, and DeepSpeed takes one: use "
                            "training.optimizer=adamw")
    if cfg.shard_target:
        raise TrainingError(f"training.shard_target with {source}: the target is sharded with FSDP2, next to a "
                            "drafter under FSDP2 or DDP: use recipes/accelerate/fsdp.yaml")
    for setting in ("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"):
        if environ.get(setting, "none").lower() not in ("none", ""):
            raise TrainingError(f"{source}: {setting.lower().removeprefix('accelerate_deepspeed_')}: "
                                f"{environ[setting]} is not supported (a drafter's optimizer state fits the "
                                "devices once partitioned): set it to none")


def launched_processes(environ=os.environ) -> int:
    """How many processes the launcher started (torchrun's WORLD_SIZE; 1 for a plain `python -m`)."""
    try:
        return int(environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def check_processes(recipe: Recipe, kind: str, source: str, accelerator) -> None:
    """What the launched processes allow: they are one run (not each its own, writing the same folder), and a
    sharded target needs more than one process."""
    if accelerator.num_processes != launched_processes():
        raise TrainingError(f"the launcher started {launched_processes()} processes, but accelerate made each its "
                            f"own run of {accelerator.num_processes} ({accelerator.distributed_type}): check the "
                            "launcher config's distributed_type for this host")
    if recipe.training.shard_target and accelerator.num_processes < 2:
        raise TrainingError("training.shard_target: one process has nothing to share the target with: launch "
                            "several (accelerate launch --num_processes N), or set training.shard_target=false")


def _shard_drafter(drafter: torch.nn.Module, accelerator, log) -> torch.nn.Module:
    """The drafter under FSDP2 (distributed.py), its forward under accelerate's autocast (bf16 compute over fp32
    master weights, as accelerate runs a DDP drafter: one numerics whatever the sharding)."""
    drafter = distributed.shard_drafter(drafter, distributed.device_mesh(accelerator.device))
    _under_autocast(drafter, accelerator)
    log(f"sharding: FSDP2 over {accelerator.num_processes} processes; this "
        f"process holds {distributed.local_bytes(drafter) / 2**20:.1f} MiB of the drafter's parameters")
    return drafter


def _zero_drafter(drafter: torch.nn.Module, optimizer, sharding: str, accelerator, cfg, log):
    """The drafter and its optimizer handed to DeepSpeed ZeRO (distributed.py), the forward under accelerate's
    autocast over fp32 weights (as DDP and FSDP2 run it: one numerics whatever the sharding)."""
    _under_autocast(drafter, accelerator)
    engine = distributed.deepspeed_engine(drafter, optimizer, distributed.ZERO_STAGES[sharding], cfg.grad_accum_steps,
                                          cfg.max_grad_norm)
    partitions = sum(flat.nbytes for flat in distributed.zero_partitions(engine))
    log(f"sharding: {SHARDING_NAMES[sharding]} over {accelerator.num_processes} processes; this process holds "
        f"{distributed.local_bytes(drafter) / 2**20:.1f} MiB of the drafter's parameters and steps "
        f"{partitions / 2**20:.1f} MiB of them")
    return engine


def _under_autocast(drafter: torch.nn.Module, accelerator) -> None:
    """The drafter's forward under accelerate's autocast (bf16 compute over fp32 master weights), for the shardings
    accelerate does not prepare."""
    import functools

    forward = drafter.forward

    @functools.wraps(forward)
    def under_autocast(*args, **kwargs):
        with accelerator.autocast():
            return forward(*args, **kwargs)

    drafter.forward = under_autocast


def _tokenizer_and_data(recipe: Recipe, accelerator, output_dir: Path, log):
    """(the target's tokenizer, the prepared samples), the recipe checked against the target's config.json first."""
    from draftsmith.data import prepare_dataset

    tokenizer = load_tokenizer(recipe.model.target)
    check_recipe_against_target(recipe, target_config_dict(recipe.model.target), str(output_dir / RECIPE_FILE))
    with accelerator.main_process_first():
        data = prepare_dataset(recipe.data, tokenizer, log=log)
    if not data.train:
        raise TrainingError(f"{recipe.data.path}: no training samples left after filtering")
    return tokenizer, data


def _load_target(recipe: Recipe, tokenizer, mixed: str, accelerator, log):
    """The frozen target, checked; only its head and embeddings when a store holds what its layers compute; its
    decoder layers sharded over the processes with training.shard_target."""
    from draftsmith.models.target import TargetModel

    model, device = recipe.model, accelerator.device
    dtype = model.dtype if model.dtype != "auto" else ("bfloat16" if mixed == "bf16" else "float32")
    if store_folder(recipe):
        target = TargetModel.head_and_embeddings(model.target, dtype=dtype, device=device)
    elif recipe.training.shard_target:
        target = TargetModel.sharded(model.target, distributed.device_mesh(device), dtype=dtype, device=device,
                                     attn_implementation=model.attn_implementation)
        log(f"target: decoder layers sharded over {accelerator.num_processes} processes; this process holds "
            f"{distributed.local_bytes(target.model) / 2**20:.1f} MiB of its "
            f"{sum(p.nbytes for p in target.model.parameters()) / 2**20:.1f} MiB of weights")
    else:
        target = TargetModel.from_pretrained(model.target, dtype=dtype, device=device,
                                             attn_implementation=model.attn_implementation)
    check_target_weights(target, model.target)
    check_tokenizer_fits(len(tokenizer), target.vocab_size, model.target)
    return target


def _build_drafter(recipe: Recipe, tokenizer, target, method, data, accelerator, log) -> torch.nn.Module:
    """The drafter over the method's draft vocabulary, its training options applied, model.init_from loaded."""
    from draftsmith.data.vocab import load_or_build_draft_vocab

    # the method's draft vocabulary (EAGLE-3's default fits the target; None: the target's whole vocabulary)
    vocab_size = method.draft_vocab_size or target.vocab_size
    with accelerator.main_process_first():
        d2t, t2d, vocab_path = load_or_build_draft_vocab(
            recipe.data.cache_path(), tokenizer, data.train, target.vocab_size, vocab_size)
    if registry.get(recipe.model.method).draft_vocab:
        log(f"draft vocab: {vocab_size} of {target.vocab_size} tokens ({vocab_path})")
    elif recipe.model.draft_vocab_size is not None:
        log(f"model.draft_vocab_size is not used by {recipe.model.method}: it reads out with the target's head")
    drafter = method.build_drafter(d2t, t2d)
    method.apply_training_options(drafter)  # attention kernels, recomputation, compilation: from outside, once
    if recipe.model.init_from:
        load_initial_weights(drafter, recipe.model.init_from, recipe.model.method)
        log(f"initialised the drafter from {recipe.model.init_from}")
    return drafter


def _total_steps(batching: Batching) -> int:
    """training.max_steps, or the epochs' optimizer steps; refused when the data make no full step."""
    cfg = batching.cfg
    batches_per_epoch = len(epoch_batches(batching.lengths, cfg.batch_size, cfg.seed, 0, batching.rank,
                                          batching.world, cfg.tokens_per_step, cfg.packing))
    if batches_per_epoch < cfg.grad_accum_steps:
        raise TrainingError(f"{len(batching.samples)} samples make no full optimizer step of {cfg.grad_accum_steps} "
                            f"x {batching.label} on {batching.world} processes: lower training.batch_size (or "
                            "training.tokens_per_step) or training.grad_accum_steps, or add data")
    steps_per_epoch = max(1, batches_per_epoch // cfg.grad_accum_steps)
    return cfg.max_steps or cfg.epochs * steps_per_epoch


def _start_logging(run: Run) -> None:
    """The optimizer's line, the recipe in the run folder, the trackers."""
    cfg, accelerator = run.recipe.training, run.accelerator
    run.log(f"optimizer: {' + '.join(type(raw_optimizer(o)).__name__ for o in run.optimizers)}, lr {cfg.lr}"
            + (f" (Muon {cfg.muon_lr or cfg.lr})" if cfg.optimizer == "muon" else "")
            + f", {cfg.lr_schedule} schedule, micro-batches of {run.batching.label}")
    if accelerator.is_main_process:
        save_recipe(run.recipe, run.paths.output_dir / RECIPE_FILE)
    if cfg.report_to != "none":
        accelerator.init_trackers(cfg.run_name or run.paths.output_dir.name, config=flat(recipe_to_dict(run.recipe)))
