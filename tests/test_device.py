"""Device selection logic, exercised on CPU with monkeypatched CUDA / stand-in torch_npu."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
import warnings

import pytest
import torch

from draftsmith import device as dev


@pytest.fixture
def no_accelerator(monkeypatch):
    """A machine with neither CUDA nor torch_npu (a None entry makes `import torch_npu` fail)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "torch_npu", None)


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "torch_npu", None)


class FakeNpu:
    """Stand-in for the `torch.npu` namespace that torch_npu registers."""

    def __init__(self):
        self.synced = 0

    def is_available(self):
        return True

    def synchronize(self, device=None):
        self.synced += 1

    def empty_cache(self):
        pass

    def max_memory_allocated(self, device=None):
        return 12345

    def get_device_name(self, device=None):
        return "Ascend910B"


@pytest.fixture
def fake_npu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    npu = FakeNpu()
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    return npu


def test_cpu_fallback(no_accelerator):
    assert dev.accelerator_type() == "cpu"
    assert dev.get_device() == torch.device("cpu")
    assert dev.get_device("auto") == torch.device("cpu")
    assert dev.distributed_backend("cpu") == "gloo"
    assert dev.default_dtype("cpu") == torch.float32
    assert dev.mixed_precision_for(torch.device("cpu")) == "no"
    assert dev.max_memory_allocated("cpu") == 0
    dev.synchronize("cpu")  # no-ops, must not touch torch.cuda
    dev.empty_cache("cpu")
    assert dev.device_name("cpu")


def test_missing_accelerator_is_an_error_not_a_silent_fallback(no_accelerator):
    with pytest.raises(dev.DeviceError, match="no CUDA/ROCm GPU"):
        dev.get_device("cuda")
    with pytest.raises(dev.DeviceError, match="no Ascend NPU"):
        dev.get_device("npu:0")


@pytest.mark.parametrize("bad", ["gpu", "mps", "cuda:x", "cpu:first"])
def test_invalid_prefer(fake_cuda, bad):
    with pytest.raises(dev.DeviceError, match=f"invalid device '{bad}'"):
        dev.get_device(bad)


def test_cuda_selected_and_prefer_cpu_forces_cpu(fake_cuda):
    assert dev.accelerator_type() == "cuda"
    assert dev.get_device() == torch.device("cuda")
    assert dev.get_device("cuda:1") == torch.device("cuda", 1)
    assert dev.get_device("cpu") == torch.device("cpu")
    assert dev.distributed_backend(dev.accelerator_type()) == "nccl"
    assert dev.distributed_backend(torch.device("cuda", 3)) == "nccl"


def test_cuda_dtype_follows_native_bf16(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert dev.default_dtype("cuda") == torch.bfloat16
    assert dev.resolve_dtype("auto", "cuda") == torch.bfloat16
    assert dev.mixed_precision_for("cuda") == "bf16"

    # Pre-Ampere GPU: bf16 only emulated -> auto picks fp32, explicit bf16 falls back with a warning.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    assert not dev.supports_bf16("cuda")
    assert dev.default_dtype("cuda") == torch.float32
    assert dev.mixed_precision_for("cuda") == "no"
    with pytest.warns(UserWarning, match="bfloat16 is not supported natively on Tesla V100"):
        assert dev.resolve_dtype("bfloat16", "cuda") == torch.float32
    assert dev.resolve_dtype("float16", "cuda") == torch.float16


def test_rocm_detection(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    assert dev.is_rocm()
    monkeypatch.setattr(torch.version, "hip", None)
    assert not dev.is_rocm()


def test_rocm_gpu_is_cuda_with_nccl(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    assert dev.accelerator_type() == "cuda"
    assert dev.distributed_backend(dev.get_device()) == "nccl"  # RCCL answers to "nccl"


def test_stand_in_torch_npu_selects_npu(fake_npu):
    assert dev.accelerator_type() == "npu"
    assert dev.distributed_backend(dev.accelerator_type()) == "hccl"
    assert dev.supports_bf16("npu")
    assert dev.default_dtype("npu") == torch.bfloat16
    assert dev.mixed_precision_for("npu:0") == "bf16"
    assert dev.max_memory_allocated("npu") == 12345
    assert dev.device_name("npu:0") == "Ascend910B"
    dev.synchronize("npu")
    assert fake_npu.synced == 1


def test_cuda_wins_over_npu(fake_npu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert dev.accelerator_type() == "cuda"


def test_broken_torch_npu_means_no_npu(monkeypatch):
    """torch_npu installed without its CANN libraries raises on import; that must read as "no NPU"."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def broken_import(name, *args, **kwargs):
        if name == "torch_npu":
            raise RuntimeError("libascendcl.so: cannot open shared object file")
        return real_import(name, *args, **kwargs)

    real_import = dev.importlib.import_module
    monkeypatch.setattr(dev.importlib, "import_module", broken_import)
    assert dev.accelerator_type() == "cpu"


def test_get_device_npu_through_lazy_import(tmp_path):
    """End to end with a stand-in torch_npu *file*, which (like the real one) renames PrivateUse1 to "npu".

    The rename is irreversible for a process, hence the subprocess.
    """
    (tmp_path / "torch_npu.py").write_text(
        textwrap.dedent(
            """
            import types, torch
            torch.utils.rename_privateuse1_backend("npu")
            torch.npu = types.SimpleNamespace(is_available=lambda: True)
            """
        )
    )
    code = textwrap.dedent(
        """
        import sys, torch
        torch.cuda.is_available = lambda: False
        assert "torch_npu" not in sys.modules
        from draftsmith.device import get_device, distributed_backend
        d = get_device()
        print(d, get_device("npu:1"), distributed_backend(d))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["npu", "npu:1", "hccl"]


@pytest.mark.parametrize(
    "name, expected",
    [("auto", torch.float32), ("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)],
)
def test_resolve_dtype_on_cpu(name, expected):
    # Explicit bf16 is honoured on CPU (torch has bf16 kernels); only "auto" chooses float32.
    assert dev.resolve_dtype(name, "cpu") == expected


def test_resolve_dtype_rejects_unknown_name():
    with pytest.raises(dev.DeviceError, match="unknown dtype 'fp8'"):
        dev.resolve_dtype("fp8", "cpu")


def test_distributed_backend_rejects_unknown_type():
    with pytest.raises(dev.DeviceError, match="no distributed backend"):
        dev.distributed_backend("mps")


def test_time_ms_runs_once_untimed_then_repeat_times(monkeypatch):
    calls, synced = [], []
    monkeypatch.setattr(dev, "synchronize", lambda device: synced.append(len(calls)))
    ms = dev.time_ms(lambda: calls.append(1), "cpu", repeat=7)
    assert len(calls) == 8 and synced == [1, 8]  # warm-up, sync, 7 timed runs, sync
    assert ms >= 0.0


@pytest.mark.parametrize("flags, emulated", [({"avx2", "fma"}, True), ({"avx512f", "avx512_bf16"}, False),
                                             ({"amx_bf16", "amx_tile"}, False), ({"asimd", "bf16"}, False)])
def test_bf16_on_a_cpu_without_native_bf16_warns_that_it_is_emulated(monkeypatch, flags, emulated):
    """An AVX2-only CPU ran a bf16 training step 30-50x slower than float32, silently (issue 16, item 3)."""
    monkeypatch.setattr(dev, "cpu_flags", lambda: set(flags))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert dev.resolve_dtype("bfloat16", "cpu") == torch.bfloat16  # honoured, as asked
        assert dev.resolve_dtype("float32", "cpu") == torch.float32
    messages = [str(w.message) for w in caught]
    assert any("emulated and runs 30-50x slower" in m and "--dtype float32" in m for m in messages) == emulated
    assert dev.native_bf16("cpu") == (not emulated)


def test_auto_on_the_cpu_is_float32_and_says_so_once(monkeypatch, capsys):
    monkeypatch.setattr(dev, "_said", set())
    assert dev.resolve_dtype("auto", "cpu") == torch.float32
    assert dev.resolve_dtype("auto", "cpu") == torch.float32
    assert capsys.readouterr().err.count("dtype auto on the CPU is float32") == 1


def test_sdpa_without_cudnn_turns_off_cudnn_attention_alone(monkeypatch):
    """Training, collection and decoding run attention inside it: cuDNN's backend off, flash, memory-efficient and
    math on, torch's settings back afterwards; DRAFTSMITH_CUDNN_ATTENTION=1 leaves cuDNN on (side-by-side timing)."""
    flags = lambda: (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),  # noqa: E731
                     torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())
    before = flags()
    with dev.sdpa_without_cudnn():
        assert flags() == (False, True, True, True)
    assert flags() == before
    monkeypatch.setenv("DRAFTSMITH_CUDNN_ATTENTION", "1")
    with dev.sdpa_without_cudnn():
        assert flags() == (True, True, True, True)
    assert flags() == before


def test_compile_drafter_auto_compiles_on_gpus_only(fake_cuda, monkeypatch):
    """training.compile_drafter: auto compiles EAGLE-3's TTT steps on CUDA and ROCm with Triton, never on the CPU or
    an NPU nor under FSDP or DeepSpeed, and DRAFTSMITH_COMPILE_DRAFTER=0 turns it off."""
    from draftsmith.models.eagle3.training import auto_compile  # before find_spec is replaced: transformers uses it

    monkeypatch.setattr(dev.importlib.util, "find_spec", lambda name: object() if name == "triton" else None)
    assert dev.compiled_drafter("cuda")
    assert not dev.compiled_drafter("cpu") and not dev.compiled_drafter("npu")
    assert auto_compile("cuda") and not auto_compile("cpu")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # `accelerate launch` with an FSDP config: not measured there
    assert not auto_compile("cuda")
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    monkeypatch.setenv("DRAFTSMITH_COMPILE_DRAFTER", "0")
    assert not dev.compiled_drafter("cuda") and not auto_compile("cuda")


@pytest.mark.parametrize("value, expected", [(None, True), ("1", True), ("0", False), ("auto", None)])
def test_compile_dynamic_defaults_to_dynamic_shapes(monkeypatch, value, expected):
    """The drafter's compiled parts take dynamic shapes unless DRAFTSMITH_COMPILE_DYNAMIC says static (0) or torch's
    own default (auto, passed to torch.compile as None)."""
    if value is None:
        monkeypatch.delenv("DRAFTSMITH_COMPILE_DYNAMIC", raising=False)
    else:
        monkeypatch.setenv("DRAFTSMITH_COMPILE_DYNAMIC", value)
    assert dev.compile_dynamic() is expected


def test_compile_dynamic_rejects_other_values_in_one_line(monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_COMPILE_DYNAMIC", "yes")
    with pytest.raises(ValueError, match="DRAFTSMITH_COMPILE_DYNAMIC='yes': expected 1"):
        dev.compile_dynamic()
