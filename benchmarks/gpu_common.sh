# Sourced by benchmarks/run_gpu.sh and benchmarks/serve/run.sh: the repository root as working directory,
# the Python to use ($PYTHON, else .venv/bin/python, else python3), unbuffered output with the repository
# importable, $KBIT_COMMIT (the commit the benchmarks record; git's HEAD unless set), and
# ensure_extension, which builds the CUDA extension in place when it is missing.
set -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHON PYTHONUNBUFFERED=1 PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${KBIT_COMMIT:-}" ]; then
  KBIT_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  if [ "$KBIT_COMMIT" != unknown ] && ! git diff --quiet HEAD -- csrc vllm_kbit 2>/dev/null; then
    KBIT_COMMIT="$KBIT_COMMIT+changes"  # uncommitted changes to the code being measured
  fi
fi
export KBIT_COMMIT

# Builds vllm_kbit/_C*.so with nvcc (setup.py; TORCH_CUDA_ARCH_LIST defaults to 9.0a) unless it exists.
ensure_extension() {
  if ls vllm_kbit/_C*.so >/dev/null 2>&1; then return 0; fi
  local log
  log=$(mktemp /tmp/vllm_kbit_build.XXXXXX.log)
  echo "building the CUDA extension (python setup.py build_ext --inplace; log: $log)"
  MAX_JOBS=${MAX_JOBS:-$(nproc 2>/dev/null || echo 4)} "$PYTHON" setup.py build_ext --inplace >"$log" 2>&1 ||
    { tail -40 "$log"; echo "the CUDA extension did not build (log: $log)" >&2; return 1; }
  ls vllm_kbit/_C*.so >/dev/null 2>&1 || { echo "setup.py built no vllm_kbit/_C*.so (no nvcc or no CUDA build of torch?)" >&2; return 1; }
}

# Whether this checkout's vllm_kbit is what $PYTHON imports, with the vllm.general_plugins entry point vLLM finds
# the `kbit` method through (PYTHONPATH alone gives engines that reject --quantization kbit).
plugin_ok() {
  "$PYTHON" - "$PWD" <<'PY'
import importlib.metadata as md, os, sys
import vllm_kbit
here = os.path.realpath(vllm_kbit.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep)
eps = [e.value for e in md.entry_points(group="vllm.general_plugins") if e.name == "kbit"]
print(f"vllm_kbit from {os.path.dirname(vllm_kbit.__file__)}, CUDA kernels: {vllm_kbit.HAS_CUDA_KERNELS}, plugin entry point: {eps}")
sys.exit(0 if here and eps else 1)
PY
}

# Installs this checkout editable into $PYTHON unless plugin_ok (shown no CUDA toolkit, so it compiles nothing:
# ensure_extension builds the kernels), then fails if a CUDA GPU has no kbit CUDA kernels to run.
ensure_plugin() {
  if ! plugin_ok 2>/dev/null; then
    echo "== installing vllm-kbit (editable) into $PYTHON"
    local log
    log=$(mktemp /tmp/vllm_kbit_install.XXXXXX.log)
    CUDA_HOME=/nonexistent "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . >"$log" 2>&1 ||
      { tail -30 "$log"; return 1; }
    rm -f "$log"
    plugin_ok || return 1
  fi
  "$PYTHON" -c "import sys, torch, vllm_kbit; sys.exit(torch.cuda.is_available() and not vllm_kbit.HAS_CUDA_KERNELS)" ||
    { echo "a CUDA GPU but no kbit CUDA kernels (vllm_kbit/_C*.so missing or not loadable)"; return 1; }
}

# The GPU's name as the result files spell it (spaces to underscores), e.g. NVIDIA_H100_80GB_HBM3.
gpu_name() {
  nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 | tr ' ' '_'
}
