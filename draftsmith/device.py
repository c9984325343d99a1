"""Accelerator detection and the few device-specific calls draftsmith makes.

This is the only module that touches ``torch.cuda`` or ``torch_npu``: everything
else asks it for a ``torch.device``, a dtype or a distributed backend, so model
and training code stay written for one device and run unchanged on

* NVIDIA and AMD GPUs -- ROCm builds of torch use the ``cuda`` device string,
  so "cuda" covers both (``is_rocm()`` tells them apart);
* Ascend NPUs -- ``torch_npu`` registers ``torch.npu`` and the ``npu`` device;
  it is imported lazily (through importlib, so tests can stand a fake module in
  ``sys.modules``) and only when no CUDA device is present;
* CPU -- the fallback, always float32 by default.

bf16 policy: ``supports_bf16`` answers "can tensors of this dtype be computed
here at all" (True on CPU: torch implements bf16 kernels there, so an explicit
``bfloat16`` request is honoured), while ``default_dtype`` answers "what should
draftsmith pick when asked for auto": bf16 on accelerators with native bf16,
float32 otherwise, and float32 on CPU where bf16 matmuls are slow on most
processors and the tests want exact, reproducible arithmetic. A CPU without
AVX512-BF16, AMX or Arm's BF16 extension emulates bf16, 30-50x slower than
float32 for a training step: an explicit bf16 there warns (`native_bf16`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import sys
import warnings
from collections.abc import Callable
from types import ModuleType

import torch

ACCELERATOR_TYPES = ("cuda", "npu", "cpu")
DTYPE_NAMES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
_BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}  # ROCm ships RCCL under the "nccl" name


class DeviceError(ValueError):
    """A device or dtype request that cannot be met on this machine."""


def _torch_npu() -> ModuleType | None:
    """Import torch_npu if installed; it registers ``torch.npu`` as a side effect.

    Any failure (not installed, CANN libraries missing) means "no NPU": an
    Ascend toolchain that cannot load must not stop CPU work.
    """
    try:
        return importlib.import_module("torch_npu")
    except Exception:  # noqa: BLE001 - torch_npu raises RuntimeError/OSError when CANN is absent
        return None


def _npu_available() -> bool:
    if _torch_npu() is None:
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def accelerator_type() -> str:
    """``"cuda"`` (NVIDIA or ROCm), ``"npu"`` (Ascend) or ``"cpu"``."""
    if torch.cuda.is_available():
        return "cuda"
    if _npu_available():
        return "npu"
    return "cpu"


def is_rocm() -> bool:
    """True for a ROCm (HIP) build of torch, whose GPUs answer to "cuda"."""
    return getattr(torch.version, "hip", None) is not None


def _device_type(device: torch.device | str) -> str:
    # Parsed by hand: torch.device("npu") only works once torch_npu has renamed the PrivateUse1 backend.
    return device.type if isinstance(device, torch.device) else str(device).split(":", 1)[0]


def get_device(prefer: str | None = None) -> torch.device:
    """The device to run on: ``prefer`` when given ("cpu", "cuda", "cuda:1", "npu", "auto"), else the best one found.

    Asking for an accelerator that is not there is an error rather than a
    silent CPU fallback: a run that expected a GPU should not crawl on CPU.
    """
    if prefer is None or prefer == "auto":
        return torch.device(accelerator_type())
    usage = "use one of 'auto', 'cpu', 'cuda', 'cuda:N', 'npu', 'npu:N'"
    kind = _device_type(prefer)
    if kind not in ACCELERATOR_TYPES:
        raise DeviceError(f"invalid device {prefer!r}: {usage}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"device {prefer!r} requested but no CUDA/ROCm GPU is available; use 'cpu' or 'auto'")
    if kind == "npu" and not _npu_available():
        raise DeviceError(f"device {prefer!r} requested but no Ascend NPU (torch_npu) is available; "
                          "use 'cpu' or 'auto'")
    try:
        return torch.device(prefer)
    except (RuntimeError, TypeError):
        raise DeviceError(f"invalid device {prefer!r}: {usage}") from None


def supports_bf16(device: torch.device | str) -> bool:
    """Whether bf16 tensors compute natively on ``device`` (see the module docstring for CPU)."""
    kind = _device_type(device)
    if kind == "cuda":
        try:  # emulated bf16 (pre-Ampere NVIDIA) is too slow to count as support
            return bool(torch.cuda.is_bf16_supported(including_emulation=False))
        except TypeError:  # older signature without the keyword
            return bool(torch.cuda.is_bf16_supported())
    if kind in ("npu", "cpu"):
        return True
    raise DeviceError(f"unsupported device type {kind!r}")


CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # /proc/cpuinfo flags of native bf16 arithmetic (x86, Arm)
_said: set[str] = set()  # one-time notes already printed


def _note_once(key: str, message: str) -> None:
    if key not in _said:
        _said.add(key)
        print(f"draftsmith: {message}", file=sys.stderr)


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.split(":")[0].strip() in ("flags", "Features"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def native_bf16(device: torch.device | str) -> bool:
    """Whether bf16 arithmetic runs at hardware speed on ``device`` (on a CPU: one of CPU_BF16_FLAGS)."""
    if _device_type(device) == "cpu":
        return bool(cpu_flags() & set(CPU_BF16_FLAGS))
    return supports_bf16(device)


def warn_if_emulated_bf16(device: torch.device | str, fix: str) -> None:
    """One warning when bf16 was asked for on a CPU that only emulates it; `fix` says how to ask for float32."""
    if _device_type(device) == "cpu" and not native_bf16(device):
        warnings.warn(f"bfloat16 on this CPU ({platform.processor() or platform.machine()}, no AVX512-BF16, AMX or "
                      f"BF16 flag) is emulated and runs 30-50x slower than float32: {fix}", stacklevel=3)


def default_dtype(device: torch.device | str) -> torch.dtype:
    """dtype picked for ``auto``: bf16 on accelerators with native bf16, else float32 (always float32 on CPU)."""
    kind = _device_type(device)
    if kind == "cpu":
        _note_once("cpu-auto-dtype", "dtype auto on the CPU is float32 (exact, and fast on every CPU)")
        return torch.float32
    return torch.bfloat16 if supports_bf16(device) else torch.float32


def resolve_dtype(name: str | torch.dtype, device: torch.device | str) -> torch.dtype:
    """Turn a recipe dtype name ("auto" | "bfloat16" | "float16" | "float32") into a dtype usable on ``device``.

    bf16 asked for where it is not native falls back to float32 with a warning
    rather than failing, so one recipe runs on a V100 as on an H100.
    """
    if isinstance(name, torch.dtype):
        dtype = name
    elif name == "auto":
        return default_dtype(device)
    elif name in DTYPE_NAMES:
        dtype = DTYPE_NAMES[name]
    else:
        raise DeviceError(f"unknown dtype {name!r}: use one of 'auto', {', '.join(repr(n) for n in DTYPE_NAMES)}")
    if dtype == torch.bfloat16 and not supports_bf16(device):
        warnings.warn(
            f"bfloat16 is not supported natively on {device_name(device)}; using float32 instead",
            stacklevel=2,
        )
        return torch.float32
    if dtype == torch.bfloat16:
        warn_if_emulated_bf16(device, "ask for float32 (--dtype float32; in a recipe model.dtype=float32 "
                                      "training.mixed_precision=no) or auto")
    return dtype


def mixed_precision_for(device: torch.device | str) -> str:
    """accelerate's ``mixed_precision`` for ``device``: "bf16" on accelerators with native bf16, else "no"."""
    return "bf16" if _device_type(device) != "cpu" and supports_bf16(device) else "no"


def distributed_backend(device_type: torch.device | str) -> str:
    """torch.distributed backend for a device type: nccl (CUDA and ROCm), hccl (NPU), gloo (CPU)."""
    kind = _device_type(device_type)
    try:
        return _BACKENDS[kind]
    except KeyError:
        raise DeviceError(f"no distributed backend for device type {kind!r}") from None


def _accel_module(device: torch.device | str) -> ModuleType | None:
    """``torch.cuda`` or ``torch.npu`` for an accelerator device, None for CPU."""
    kind = _device_type(device)
    if kind == "cuda":
        return torch.cuda
    if kind == "npu":
        if _torch_npu() is None or not hasattr(torch, "npu"):
            raise DeviceError("an 'npu' device needs torch_npu: pip install 'draftsmith[npu]'")
        return torch.npu  # type: ignore[attr-defined]
    if kind == "cpu":
        return None
    raise DeviceError(f"unsupported device type {kind!r}")


def synchronize(device: torch.device | str) -> None:
    """Wait for queued kernels; timings are meaningless without it on accelerators."""
    mod = _accel_module(device)
    if mod is not None:
        mod.synchronize(device)


def empty_cache(device: torch.device | str) -> None:
    mod = _accel_module(device)
    if mod is not None:
        mod.empty_cache()


def max_memory_allocated(device: torch.device | str) -> int:
    """Peak bytes allocated by tensors on ``device`` (0 on CPU, where torch does not track it)."""
    mod = _accel_module(device)
    return int(mod.max_memory_allocated(device)) if mod is not None else 0


def reset_peak_memory_stats(device: torch.device | str) -> None:
    mod = _accel_module(device)
    if mod is not None:
        mod.reset_peak_memory_stats(device)


ACCELERATOR_RNG_KINDS = ("cuda", "xpu", "npu")  # torch modules whose per-device generators a checkpoint keeps


def _rng_module(kind: str) -> ModuleType | None:
    module = getattr(torch, kind, None)
    if module is None or not hasattr(module, "get_rng_state_all") or not module.is_available():
        return None
    return module


def accelerator_rng_states() -> dict[str, list[torch.Tensor]]:
    """Every available accelerator's per-device generator states, by kind ("cuda": [state of device 0, ...])."""
    return {kind: list(module.get_rng_state_all()) for kind in ACCELERATOR_RNG_KINDS
            if (module := _rng_module(kind)) is not None}


def set_accelerator_rng_states(states: dict[str, list[torch.Tensor]]) -> None:
    """Restore what `accelerator_rng_states` returned; kinds not available here are skipped."""
    for kind, per_device in states.items():
        module = _rng_module(kind)
        if module is not None and per_device:
            module.set_rng_state_all(per_device)


def device_name(device: torch.device | str) -> str:
    """Human-readable hardware name for logs and benchmark JSON."""
    mod = _accel_module(device)
    if mod is not None:
        return str(mod.get_device_name(device))
    return platform.processor() or platform.machine() or "cpu"


# Dense bf16 matrix rates from the vendors' datasheets, TFLOP/s per device (without sparsity). Leads, not
# measurements: benchmarks measure their own ceiling; `training.peak_tflops` overrides this for MFU.
_PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "GH200": 989.0, "B200": 2250.0, "A100": 312.0,
                     "A800": 312.0, "L40S": 362.0, "MI300X": 1307.0, "MI325X": 1307.0, "MI355X": 2500.0}


def peak_matrix_tflops(device: torch.device | str) -> float | None:
    """The datasheet bf16 dense matrix rate of `device` in TFLOP/s, or None where draftsmith does not know it."""
    if _accel_module(device) is None:
        return None
    name = device_name(device).upper().replace("-", " ")
    for key in sorted(_PEAK_BF16_TFLOPS, key=len, reverse=True):  # GH200 before H200
        if key in name.split() or f" {key}" in f" {name}":
            return _PEAK_BF16_TFLOPS[key]
    return None


def graphs_supported(device: torch.device | str) -> bool:
    """Whether fixed-shape steps may be replayed as CUDA graphs (CUDA and ROCm; off with DRAFTSMITH_CUDA_GRAPHS=0)."""
    return _device_type(device) == "cuda" and os.environ.get("DRAFTSMITH_CUDA_GRAPHS", "1") != "0"


def compiled_flex_attention(device: torch.device | str) -> bool:
    """Whether training may run FlexAttention compiled to Triton kernels on `device`: CUDA and ROCm with Triton
    importable, unless DRAFTSMITH_FLEX_ATTENTION=0 (kernels/ttt_attention.resolve_backend reads it). NPU and CPU
    have no compiled FlexAttention with a backward pass; they take the plain-torch reference."""
    return _triton_kernels(device, "DRAFTSMITH_FLEX_ATTENTION")


def compiled_drafter(device: torch.device | str) -> bool:
    """Whether `training.compile_drafter: auto` compiles the drafter's step on `device`: CUDA and ROCm with Triton
    importable (inductor's GPU backend), unless DRAFTSMITH_COMPILE_DRAFTER=0."""
    return _triton_kernels(device, "DRAFTSMITH_COMPILE_DRAFTER")


def compile_dynamic() -> bool | None:
    """torch.compile's `dynamic` for the drafter's compiled training parts (EAGLE-3's step halves, FlexAttention and
    its block masks): True by default, shapes dynamic from the first compilation, so batches of new lengths reuse it
    (on one H100, cold caches, EAGLE-3's first steady step came 41 s after the first step began against 52 s with
    torch's default, DFlash's 32 s against 76 s, at no slower a step: benchmarks/results/time_to_steady_h100).
    DRAFTSMITH_COMPILE_DYNAMIC=0: static, one compilation per batch shape; =auto: torch's default (static until a
    shape changes, then recompiled dynamic)."""
    choice = os.environ.get("DRAFTSMITH_COMPILE_DYNAMIC", "1")
    if choice not in ("1", "0", "auto"):
        raise ValueError(f"DRAFTSMITH_COMPILE_DYNAMIC={choice[:40]!r}: expected 1 (dynamic), 0 (static) or auto")
    return {"1": True, "0": False}.get(choice)


def fused_loss_kernel(device: torch.device | str) -> bool:
    """Whether the head losses' Triton kernel (kernels/fused_head_loss.py) may run on `device`: CUDA and ROCm with
    Triton importable, unless DRAFTSMITH_FUSED_LOSS=0 (kernels/fused_head_loss.resolve_backend reads it). NPU and
    CPU take the plain-torch chunked loss."""
    return _triton_kernels(device, "DRAFTSMITH_FUSED_LOSS")


def _triton_kernels(device: torch.device | str, switch: str) -> bool:
    """The rule the `auto` kernel choices share: CUDA or ROCm, Triton importable, and the environment variable
    `switch` not set to 0."""
    if _device_type(device) != "cuda" or os.environ.get(switch, "1") == "0":
        return False
    return importlib.util.find_spec("triton") is not None


def host_to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` (on the CPU) on `device` without waiting for the device's queue.

    A plain `.to(device)` from pageable host memory blocks until every queued kernel has run, a host sync that
    stalls the decode loop. On CUDA and ROCm the copy goes through pinned memory and is queued instead (the
    caching host allocator keeps the pinned block until the copy has run). Elsewhere: a plain copy."""
    if tensor.device.type != "cpu" or _device_type(device) != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def device_to_host_async(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """Host copies of device `tensors`, queued behind the device's work instead of waiting for it, and a `wait()`
    that returns once they have landed (read them only after it).

    A plain `.to("cpu")` waits for every queued kernel and then copies from the device while nothing else is
    queued, so the device idles for the copy and for whatever the host does next. On CUDA and ROCm the copies go
    into pinned host memory (from torch's caching host allocator) behind one event; elsewhere they are plain
    copies and `wait` returns at once. Pinned blocks are reused once released; a new one is an allocation that
    waits for the device, so callers should not hold many (the store's writer copies out of them on landing).
    Measured on the H200 with torch 2.11, the call still returned only after the queued kernels had run
    (tests/test_gpu.py, marked xfail): the values are right, the overlap is not there. A version on a side copy
    stream into two reused pinned buffers (commit d43ee9c) did return at once, yet collected no faster on the H200
    (benchmarks/results/collect_store_h200/, 2026-12-04), so this one stays."""
    if not tensors or tensors[0].device.type != "cuda":
        return [t.to("cpu") for t in tensors], lambda: None
    hosts = []
    for t in tensors:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        hosts.append(host)
    event = torch.cuda.Event()
    event.record()
    return hosts, event.synchronize


def time_ms(fn, device: torch.device | str, repeat: int = 50) -> float:
    """Mean milliseconds of `fn()` over `repeat` runs after one untimed run, synchronized around the loop: queued
    kernels count, launch gaps included, as decoding sees them (benchmarks only)."""
    import time

    fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / repeat * 1e3


def sdpa_without_cudnn():
    """Context for scaled-dot-product attention without the cuDNN backend, for training, collection and decoding.

    cuDNN's attention builds an execution plan for every new shape: 7 to 12 ms of host time a call on an H200
    (torch 2.11, `benchmarks/results/profile_train_h200/`). Training batches change length every step and decoding
    changes the key length every eager step, so with cuDNN each step pays a plan build per attention call;
    flash, memory-efficient and math kernels have no per-shape setup. A no-op where cuDNN attention does not exist
    (CPU, NPU, older torch). DRAFTSMITH_CUDNN_ATTENTION=1 leaves torch's own choice (for side-by-side timing)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    if os.environ.get("DRAFTSMITH_CUDNN_ATTENTION") == "1":
        backends.append(SDPBackend.CUDNN_ATTENTION)
    return sdpa_kernel(backends)  # also a decorator


def capture_graph(fn, warmup: int = 2):
    """Record `fn()` (fixed shapes, no host syncs) into a CUDA graph after `warmup` runs on a side stream, as
    PyTorch's CUDA-graph notes require. Returns (replay, outputs): call `replay()` to rerun fn on whatever is now
    in the input buffers it read; `outputs` are the tensors it wrote, overwritten by each replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph.replay, outputs


class GraphPool:
    """CUDA graphs of fixed-shape steps, one per key, each replayed on copies of its inputs.

    The key must pin everything the recorded kernels depend on besides the input values: shapes, and the
    identity of any buffer the step reads or writes (a KV cache). Outputs are overwritten by the next replay
    of the same key."""

    def __init__(self):
        self._entries: dict = {}

    def run(self, key, fn, *inputs):
        entry = self._entries.get(key)
        if entry is None:
            buffers = [x.clone() for x in inputs]
            replay, outputs = capture_graph(lambda: fn(*buffers))  # its warm-up runs compute this very call
            entry = self._entries[key] = (buffers, replay, outputs)
        buffers, replay, outputs = entry
        for buffer, x in zip(buffers, inputs):
            buffer.copy_(x)
        replay()
        return outputs

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
