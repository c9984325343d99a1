"""Spreading the drafter (and the frozen target) over the processes of a run: which sharding a run asked for, and
the library calls that do it. draftsmith shards with FSDP2 (`torch.distributed.fsdp.fully_shard`) or DeepSpeed
ZeRO (`deepspeed.initialize`); it writes no sharding of its own.

    ddp    every process holds the whole drafter and its optimizer state (accelerate's DistributedDataParallel)
    fsdp2  the drafter's parameters, gradients and optimizer state are DTensors sharded over the processes (one
           FSDP2 unit: shard_drafter says why)
    zero1  DeepSpeed ZeRO stage 1 / 2 / 3: the optimizer state / and the gradients / and the parameters
    zero2  partitioned over the processes (deepspeed_engine); ZeRO-3 gathers each module's parameters around its
    zero3  forward and backward by DeepSpeed's hooks

A run asks for sharding with `training.sharding`, or, left at `auto`, with accelerate's launcher config (`accelerate
launch --config_file recipes/accelerate/fsdp.yaml`, which sets ACCELERATE_USE_FSDP and FSDP_VERSION;
deepspeed_zero2.yaml / deepspeed_zero3.yaml, which set ACCELERATE_USE_DEEPSPEED and the stage). draftsmith calls
`fully_shard` and `deepspeed.initialize` itself on every device, so the CPU (gloo) runs of the tests are the very
code a GPU run takes: accelerate's multi-CPU mode has no FSDP, and its DeepSpeed on a CPU gives every process a world
of one; both would train something else without a word. accelerate still launches the processes, owns the process
group, autocast and the accumulation count.

The frozen target can be sharded too (`training.shard_target`): FSDP2 over its decoder layers alone, forward only;
its embeddings, final norm and head stay whole on every process, since the losses read them outside the forward
(models/target.py `TargetModel.sharded`).

Checkpoints of a sharded drafter hold gathered full tensors in draftsmith's files (safetensors and JSON), written
by the main process: the same files as a DDP or one-process run, so any of them resumes under any world size and
any sharding.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterator

import torch
from torch import nn


def launcher_sharding(environ=os.environ) -> tuple[str, str]:
    """(the sharding accelerate's launcher config asks for, where it says so): ("fsdp2", ...), ("fsdp1", ...),
    ("zero1" / "zero2" / "zero3", ...), ("deepspeed", ...) for another ZeRO stage, or ("ddp", "")."""
    if environ.get("ACCELERATE_USE_FSDP", "").lower() in ("true", "1"):
        version = environ.get("FSDP_VERSION", "1")
        return ("fsdp2" if version == "2" else "fsdp1"), f"the accelerate launcher config (fsdp_version: {version})"
    if environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("true", "1"):
        stage = environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "?")
        kind = f"zero{stage}" if stage in ("1", "2", "3") else "deepspeed"  # "deepspeed": a stage it cannot run
        return kind, f"the accelerate launcher config (DeepSpeed zero_stage: {stage})"
    return "ddp", ""


def requested_sharding(setting: str, environ=os.environ) -> tuple[str, str]:
    """(the sharding a run asks for, where it asks): training.sharding, or at `auto` the launcher's."""
    if setting != "auto":
        return setting, f"training.sharding={setting}"
    kind, source = launcher_sharding(environ)
    return kind, source or "training.sharding=auto"


ZERO_STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}  # what deepspeed_engine runs
LAUNCHER_SWITCHES = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED")


@contextlib.contextmanager
def launcher_sharding_hidden(environ=os.environ) -> Iterator[None]:
    """accelerate's Accelerator built without the launcher's FSDP and DeepSpeed switches: draftsmith shards with
    fully_shard or deepspeed.initialize itself (on every device alike), so accelerate runs its plain multi-process
    mode and must not wrap the drafter again."""
    saved = {name: environ.pop(name) for name in LAUNCHER_SWITCHES if name in environ}
    try:
        yield
    finally:
        environ.update(saved)


def device_mesh(device: torch.device):
    """The one-dimensional mesh of all processes on this device type (gloo on the CPU, nccl / hccl elsewhere)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),))


def shard_drafter(drafter: nn.Module, mesh) -> nn.Module:
    """FSDP2 over a built drafter, as one unit: its parameters, gradients and optimizer state sharded at rest,
    gathered whole for the drafter's forward and backward. One unit, not one per layer, because every method calls
    its layers' parts piecewise (EAGLE-3's TTT step halves, DFlash's context K/V, Gemma 4's attention by hand),
    outside the layer's own forward where FSDP2's per-unit hooks would gather them; a drafter is 1-5 layers, its
    gathered weights small next to the optimizer state that stays sharded. Every process takes its own chunk of the
    main process's values (broadcast first, as DDP does at wrap time). The parameters become DTensors: build the
    optimizers after this."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    with torch.no_grad():
        for tensor in [*drafter.parameters(), *drafter.buffers()]:
            dist.broadcast(tensor.data, src=0)
    fully_shard(drafter, mesh=mesh)
    return drafter


def shard_frozen_layers(model: nn.Module, layers: nn.ModuleList, base: nn.Module, keep_whole: list[torch.Tensor],
                        mesh) -> None:
    """FSDP2 over a frozen target built on the meta device: each decoder layer its own unit (resharded after each
    forward, so a process holds one layer whole at a time), `base` (the decoder stack) the root with `keep_whole`
    (embeddings, final norm, head) left out: they stay plain tensors that the losses read outside the forward."""
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(base, mesh=mesh, ignored_params=set(keep_whole))


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


@contextlib.contextmanager
def gathered(module: nn.Module) -> Iterator[nn.Module]:
    """A frozen FSDP2 unit's parameters whole for code that calls its parts outside its forward (Gemma 4 MTP
    recomputes a target layer's K/V from its captured input), resharded after; a plain module as it is."""
    if not is_sharded(module):
        yield module
        return
    module.unshard()
    try:
        yield module
    finally:
        module.reshard()


def module_class(module: nn.Module) -> type[nn.Module]:
    """The class a module was built as: fully_shard swaps it for a subclass (FSDPLlamaDecoderLayer) that code
    looking up its family by name must see through."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def plain(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's whole value (a gradient norm clip_grad_norm_ returns over sharded gradients), else the tensor."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a DTensor (a sharded parameter) or of a ZeRO-3 parameter, else the tensor."""
    from torch.distributed.tensor import DTensor

    if hasattr(tensor, "ds_tensor"):  # ZeRO-3: the parameter's own data is empty outside its module's forward
        return tensor.ds_tensor
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def all_processes(flags: torch.Tensor) -> torch.Tensor:
    """Per-process bool flags, true where they hold on every process (one all-reduce)."""
    import torch.distributed as dist

    agreed = flags.to(torch.int32)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return agreed.bool()


def local_bytes(module: nn.Module) -> int:
    """Bytes of `module`'s parameters this process holds (a DTensor's local shard, a ZeRO-3 partition, a plain
    tensor whole)."""
    return sum(local(p).nbytes for p in module.parameters())


def whole_bytes(module: nn.Module) -> int:
    """Bytes of `module`'s parameters whole, however they are spread (a ZeRO-3 parameter's own size is 0)."""
    return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in module.parameters())


@contextlib.contextmanager
def gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """FSDP2 reduce-scatters gradients only on the micro-batch that ends an accumulation cycle (DDP's no_sync)."""
    if not is_sharded(model) or sync:
        yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def gathers(model: nn.Module) -> bool:
    """Whether saving `model` takes every process (its weights, or under ZeRO its optimizer state, are spread over
    them)."""
    return is_sharded(model) or is_zero(model)


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict (the caller moves it to the CPU). Under FSDP2 every process calls it (a gather, onto
    the CPU) and only the main process gets the tensors (the others an empty dict). ZeRO-1/2 keep the parameters
    whole on every process: fp32 (draftsmith gives DeepSpeed no bf16 config), each step's partitions gathered back
    into them, so they are the master weights. Under ZeRO-3 every process calls it: each fp32 master weight is
    gathered from the partitions (every process gets it)."""
    if is_zero3(model):
        from deepspeed.utils import safe_get_full_fp32_param

        params = dict(model.named_parameters())
        return {name: safe_get_full_fp32_param(params[name]) if name in params else tensor
                for name, tensor in model.state_dict().items()}
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_weights(model: nn.Module, tensors: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Whole tensors into a (sharded or plain) model; (missing, unexpected) keys as load_state_dict returns them."""
    if not is_sharded(model):
        result = model.load_state_dict(tensors, strict=False)
        return list(result.missing_keys), list(result.unexpected_keys)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    own = set(model.state_dict())
    missing, unexpected = sorted(own - set(tensors)), sorted(set(tensors) - own)
    set_model_state_dict(model, {k: v for k, v in tensors.items() if k in own},
                         options=StateDictOptions(full_state_dict=True, strict=False))
    return missing, unexpected


def _names_in_group_order(model: nn.Module, optimizer) -> list[str]:
    """The optimizer's parameters by their names in `model`, in the order torch's plain layout numbers them."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def optimizer_state(model: nn.Module, optimizer) -> dict:
    """The optimizer's state in torch's plain layout (parameters numbered in group order), whole tensors: the same
    under FSDP2 (gathered: every process calls it, the main process gets it, the others an empty dict) as under
    DDP or one process, so one checkpoint resumes under either."""
    if is_zero(model):
        return _zero_optimizer_state(model, optimizer)
    if not is_sharded(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    by_name = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                   cpu_offload=True))
    if not by_name:  # gathered to the main process only
        return {}
    number = {name: i for i, name in enumerate(_names_in_group_order(model, optimizer))}
    groups, start = [], 0
    for live, saved in zip(optimizer.param_groups, by_name["param_groups"]):
        groups.append({**{k: v for k, v in saved.items() if k != "params"},
                       "params": list(range(start, start + len(live["params"])))})
        start += len(live["params"])
    return {"state": {number[name]: entries for name, entries in by_name["state"].items()}, "param_groups": groups}


def load_optimizer_state(model: nn.Module, optimizer, state: dict) -> None:
    """A plain-layout optimizer state (optimizer_state's) into the live optimizer, sharded under FSDP2."""
    if not is_sharded(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = _names_in_group_order(model, optimizer)
    by_name = {"state": {names[int(i)]: entries for i, entries in state["state"].items()},
               "param_groups": [{**group, "params": [names[int(i)] for i in group["params"]]}
                                for group in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


# ---- DeepSpeed ZeRO --------------------------------------------------------------------------------------------------
# The parameter names of each group of an optimizer handed to DeepSpeed, in order: ZeRO swaps a group's parameters
# for one flat partition, and the checkpoint numbers them as torch's plain layout does (optimizer_state).
_ZERO_GROUP_NAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def is_zero(model: nn.Module) -> bool:
    """Whether `model` (the drafter inside a DeepSpeed engine) is partitioned by ZeRO: its parameters carry
    DeepSpeed's map to their fragment of the fp32 partitions (stages 1 and 2), or are ZeRO-3 parameters."""
    return any(hasattr(p, "_hp_mapping") or hasattr(p, "ds_id") for p in model.parameters())


def is_zero3(model: nn.Module) -> bool:
    """Whether `model`'s parameters are partitioned by ZeRO-3 (whole only inside their module's forward)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def deepspeed_engine(drafter: nn.Module, optimizer: torch.optim.Optimizer, stage: int, grad_accum: int,
                     max_grad_norm: float):
    """`drafter` and its (built, maybe resumed) optimizer handed to DeepSpeed ZeRO stage 1, 2 or 3; returns the
    engine, which the loop calls, backpropagates through and steps (`zero_step`). Called after a resume: the plain
    optimizer's per-parameter state is carried into ZeRO's partitions, so a checkpoint of any sharding resumes.

    ZeRO-3 gathers each module's parameters around its forward and backward by hooks, per module as DeepSpeed
    traces them (not the whole drafter as one leaf module: DeepSpeed 0.19.8 then partitioned a weight again before
    its gradient was taken, even for two Linear layers whose loss is computed inside the forward). Every parameter
    is partitioned (persistence threshold 0: a drafter's small parameters, its norms, are few, and so each process
    holds 1/N of it); the losses that read a head outside its module's forward take their plain-torch path there
    (kernels/chunked_loss.py). The drafter's step is not compiled under any sharding (eagle3/training.py)."""
    import logging

    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)  # its INFO lines are a page per process
    deepspeed.init_distributed(dist_backend=dist.get_backend())  # the process group accelerate made
    with torch.no_grad():
        for tensor in [*drafter.parameters(), *drafter.buffers()]:
            dist.broadcast(tensor.data, src=0)
    name_of = {id(p): name for name, p in drafter.named_parameters()}
    group_names = [[name_of[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    carried = {name_of[id(p)]: dict(entries) for p, entries in optimizer.state.items()}
    optimizer.state.clear()  # ZeRO keeps the state of its flat partitions, built below
    zero = {"stage": stage}
    if stage == 3:  # every parameter partitioned; torch's F.linear left as it is (DeepSpeed's "memory efficient
        # linear" replaces it for the whole process, the frozen target's compiled layers included)
        zero.update(stage3_param_persistence_threshold=0, memory_efficient_linear=False)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": grad_accum,
              "gradient_clipping": max_grad_norm, "zero_optimization": zero,
              "zero_allow_untested_optimizer": True, "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=drafter, optimizer=optimizer, config=config)
    _ZERO_GROUP_NAMES[optimizer] = group_names
    if carried:
        _load_zero_optimizer_state(drafter, optimizer, engine.optimizer, carried)
    return engine


def zero_partitions(engine) -> list[torch.Tensor]:
    """The flat fp32 partitions this process's optimizer steps under ZeRO (what DeepSpeed's own checkpoints save
    as its fp32 groups)."""
    return list(_flat_partitions(engine.optimizer))


def _flat_partitions(zero_optimizer) -> list[torch.Tensor]:
    if hasattr(zero_optimizer, "fp32_partitioned_groups_flat"):  # stage 3
        return zero_optimizer.fp32_partitioned_groups_flat
    return zero_optimizer.single_partition_of_fp32_groups


def accumulation_model(model: nn.Module) -> nn.Module:
    """The model accelerate's `accumulate` may call no_sync on: a DeepSpeed engine accumulates and reduces its
    gradients itself (zero_step), so accelerate gets the drafter inside it."""
    return model.module if _is_engine(model) else model


def zero_step(engine, loss: torch.Tensor, sync: bool) -> torch.Tensor | None:
    """Backward and, where the accumulation cycle ends (`sync`, accelerate's count), DeepSpeed's step: clipping to
    its gradient_clipping, the optimizer step, the gradients zeroed. Returns the step's gradient norm before
    clipping (as clip_grad_norm_ does), None inside a cycle. The loss is divided by the accumulation steps by
    DeepSpeed, as accelerate's backward does."""
    engine.set_gradient_accumulation_boundary(sync)
    engine.backward(loss)
    engine.step()
    if not sync:
        return None
    norm = engine.get_global_grad_norm()
    return torch.as_tensor(norm, dtype=torch.float32, device=loss.device)


def _is_engine(model) -> bool:
    return type(model).__name__ == "DeepSpeedEngine" and hasattr(model, "module")


def _zero_optimizer_state(model: nn.Module, optimizer) -> dict:
    """ZeRO's partitioned optimizer state gathered whole (every process calls it) in torch's plain layout."""
    from deepspeed.utils import safe_get_full_optimizer_state

    params = dict(model.named_parameters())
    flat_states = list(optimizer.state.values())  # one per flat partition, once a step has run
    keys = [k for k, v in flat_states[0].items() if torch.is_tensor(v) and v.dim() > 0] if flat_states else []
    state, groups, index = {}, [], 0
    for group, names in zip(optimizer.param_groups, _ZERO_GROUP_NAMES[optimizer]):
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": list(range(index, index + len(names)))})
        for name in names:
            if flat_states:
                state[index] = {"step": torch.as_tensor(flat_states[0]["step"]).clone().cpu(),
                                **{key: safe_get_full_optimizer_state(params[name], key).cpu() for key in keys}}
            index += 1
    return {"state": state, "param_groups": groups}


def _load_zero_optimizer_state(model: nn.Module, optimizer, zero_optimizer, carried: dict[str, dict]) -> None:
    """A plain optimizer's per-parameter state (loaded from a checkpoint before DeepSpeed took it) into ZeRO's
    partitions: each flat partition's state made as torch's first step would, linked to its parameters' fragments
    (as DeepSpeed does after its first step; ZeRO-3 finds them by its own index), then filled from the whole
    tensors."""
    from deepspeed.utils import lazy_init_hp_params_optimizer_state, safe_set_full_optimizer_state

    first = next(iter(carried.values()))
    keys = [k for k, v in first.items() if torch.is_tensor(v) and v.dim() > 0]
    stage3 = hasattr(zero_optimizer, "fp32_partitioned_groups_flat")
    groups = zero_optimizer.fp16_groups if stage3 else zero_optimizer.bit16_groups
    for params, flat in zip(groups, _flat_partitions(zero_optimizer)):
        optimizer.state[flat] = {"step": torch.as_tensor(first["step"]).clone(),
                                 **{key: torch.zeros_like(flat) for key in keys}}
        if not stage3:
            lazy_init_hp_params_optimizer_state(params, flat, optimizer.state)
    params = dict(model.named_parameters())
    for name, entries in carried.items():
        for key in keys:
            safe_set_full_optimizer_state(params[name], entries[key].to(params[name].device), key)
