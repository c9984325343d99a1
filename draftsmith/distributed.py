"""Spreading the drafter (and the frozen target) over the processes of a run: which sharding a run asked for, and
the torch calls that do it. draftsmith shards with FSDP2 (`torch.distributed.fsdp.fully_shard`); it writes no
sharding of its own.

    ddp    every process holds the whole drafter and its optimizer state (accelerate's DistributedDataParallel)
    fsdp2  the drafter's parameters, gradients and optimizer state are DTensors sharded over the processes (one
           FSDP2 unit: shard_drafter says why)

A run asks for sharding with `training.sharding`, or, left at `auto`, with accelerate's launcher config (`accelerate
launch --config_file recipes/accelerate/fsdp.yaml`, which sets ACCELERATE_USE_FSDP and FSDP_VERSION). draftsmith
calls `fully_shard` itself on every device, so the CPU (gloo) runs of the tests are the very code a GPU run takes:
accelerate's multi-CPU mode has no FSDP, and would otherwise train plain DDP without a word. accelerate still
launches the processes, owns the process group, autocast and gradient accumulation. DeepSpeed ZeRO is accelerate's
own path (GPUs only, not run by draftsmith's tests; its checkpoints are accelerate's pickles).

The frozen target can be sharded too (`training.shard_target`): FSDP2 over its decoder layers alone, forward only;
its embeddings, final norm and head stay whole on every process, since the losses read them outside the forward
(models/target.py `TargetModel.sharded`).

Checkpoints of a sharded drafter hold gathered full tensors in draftsmith's files (safetensors and JSON), written
by the main process: the same files as a DDP or one-process run, so any of them resumes under any world size.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import nn


def launcher_sharding(environ=os.environ) -> tuple[str, str]:
    """(the sharding accelerate's launcher config asks for, where it says so): ("fsdp2", ...), ("fsdp1", ...),
    ("deepspeed", ...) or ("ddp", "")."""
    if environ.get("ACCELERATE_USE_FSDP", "").lower() in ("true", "1"):
        version = environ.get("FSDP_VERSION", "1")
        return ("fsdp2" if version == "2" else "fsdp1"), f"the accelerate launcher config (fsdp_version: {version})"
    if environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("true", "1"):
        stage = environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "?")
        return "deepspeed", f"the accelerate launcher config (DeepSpeed zero_stage: {stage})"
    return "ddp", ""


def requested_sharding(setting: str, environ=os.environ) -> tuple[str, str]:
    """(the sharding a run asks for, where it asks): training.sharding, or at `auto` the launcher's."""
    if setting != "auto":
        return setting, f"training.sharding={setting}"
    kind, source = launcher_sharding(environ)
    return kind, source or "training.sharding=auto"


@contextlib.contextmanager
def launcher_fsdp_hidden(environ=os.environ) -> Iterator[None]:
    """accelerate's Accelerator built without the launcher's FSDP switch: draftsmith shards with fully_shard itself
    (on every device alike), so accelerate runs its plain multi-process mode and must not wrap the drafter again."""
    saved = environ.pop("ACCELERATE_USE_FSDP", None)
    try:
        yield
    finally:
        if saved is not None:
            environ["ACCELERATE_USE_FSDP"] = saved


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
    """This process's part of a DTensor (a sharded parameter), else the tensor."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def all_processes(flags: torch.Tensor) -> torch.Tensor:
    """Per-process bool flags, true where they hold on every process (one all-reduce)."""
    import torch.distributed as dist

    agreed = flags.to(torch.int32)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return agreed.bool()


def local_bytes(module: nn.Module) -> int:
    """Bytes of `module`'s parameters this process holds (a DTensor's local shard, a plain tensor whole)."""
    return sum(local(p).nbytes for p in module.parameters())


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


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict (the caller moves it to the CPU). Under FSDP2 every process calls it (a gather, onto
    the CPU) and only the main process gets the tensors (the others an empty dict)."""
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
