#!/usr/bin/env bash
# The serving benchmark of issue 6 in one command (on the lent GPU: one device call; see benchmarks/NOTES.md):
# install this package into the interpreter (so vLLM sees the `kbit` plugin entry point), optionally run
# the GPU e2e tests, run bench_serve.py with the given arguments, optionally profile decode steps.
#   bash benchmarks/serve/run.sh [bench_serve.py args, e.g. --methods kbit-4,bf16 --settings 1024/256 --concurrency 1,16,64,128]
# With vLLM staged per /work/shared/gpu/README.md, wrap it: bash .vllm/scripts/stage.sh bash benchmarks/serve/run.sh ...
# Environment:
#   PYTHON     interpreter (default python3)
#   DEADLINE   seconds for the whole call: steps that would not fit are skipped (default none; the device
#              tool's calls stop at 600 s, so there use 575 and one method per call)
#   TESTS=1    first run `pytest -m gpu tests/vllm`, each test in its own process, TESTS_PARALLEL (4) at a time
#              (log: $OUT/tests.log; each test at most TESTS_TIMEOUT s, default 420)
#   BENCH=0    skip the benchmark                     PROFILE   methods to profile after it, e.g. kbit-4,bf16
#   PROFILE_ARGS  extra profile_decode.py args (e.g. "--batches 1,16 --eager")
#   KBIT_COMMIT   commit named in the results (the device's copy of the tree has no .git)
# Outputs in $OUT (default /tmp/kbit_out; at most 8 files come back from the device): run.log, tests.log,
# serve_<gpu>_<date>.{jsonl,md,png}, serve_<gpu>_<date>_servers.log, profile_<gpu>_<date>.md.
# The extension comes from benchmarks/gpu_env.sh (already built, carried as .device/_C.abi3.so.xz, or built
# there); the editable install then only adds the package metadata and entry point (setup.py is shown no
# CUDA toolkit, so it compiles nothing).
source "$(dirname "$0")/../gpu_env.sh"
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-/tmp/vllm_cache}  # torch.compile cache kept while the machine is warm
PY=${PYTHON:-python3}
DEADLINE=${DEADLINE:-86400}  # default: no practical limit
left() { echo $((DEADLINE - SECONDS)); }

plugin_ok() {  # this checkout's vllm_kbit is what the interpreter imports, with the vllm.general_plugins entry point
  "$PY" - "$PWD" <<'PY'
import importlib.metadata as md, os, sys
import vllm_kbit
here = os.path.realpath(vllm_kbit.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep)
eps = [e.value for e in md.entry_points(group="vllm.general_plugins") if e.name == "kbit"]
print(f"vllm_kbit from {os.path.dirname(vllm_kbit.__file__)}, CUDA kernels: {vllm_kbit.HAS_CUDA_KERNELS}, plugin entry point: {eps}")
sys.exit(0 if here and eps else 1)
PY
}

# Each GPU e2e test in its own pytest process (own compile cache, so parallel engines never share one),
# TESTS_PARALLEL at a time: with CUDA graphs and torch.compile an engine of the tiny models starts in
# ~60 s on an H100, and a test needs two. tests.log gets every test's result lines; a failing test adds
# its traceback (the last 40 lines of its output).
TESTS_PARALLEL=${TESTS_PARALLEL:-4}
gpu_tests() {
  local dir="$OUT/tests.d" i=0 id rc=0
  mkdir -p "$dir"
  for id in $("$PY" -m pytest -m gpu tests/vllm --collect-only -q -p no:cacheprovider 2>/dev/null | grep "::"); do
    i=$((i + 1))
    ( VLLM_CACHE_ROOT="$VLLM_CACHE_ROOT/t$i" timeout "${TESTS_TIMEOUT:-420}" "$PY" -m pytest "$id" -q -s -p no:cacheprovider \
        --tb=short >"$dir/$i.log" 2>&1; echo "exit $? $id" >>"$dir/$i.log" ) &
    if [ $((i % TESTS_PARALLEL)) = 0 ]; then wait; fi
  done
  wait
  : >"$OUT/tests.log"
  for f in "$dir"/*.log; do
    grep -E "^GPU |^exit " "$f" >>"$OUT/tests.log"
    grep -q "^exit 0 " "$f" || { rc=1; grep -vE "^(INFO|WARNING|DEBUG)|^\(EngineCore" "$f" | tail -40 >>"$OUT/tests.log"; }
  done
  rm -rf "$dir"
  return $rc
}

main() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  if ! plugin_ok 2>/dev/null; then
    echo "== installing vllm-kbit (editable) into $PY"
    CUDA_HOME=/nonexistent "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 ||
      { tail -30 "$OUT/install.log"; return 1; }
    rm -f "$OUT/install.log"
    plugin_ok || return 1
  fi
  "$PY" -c "import sys, torch, vllm_kbit; sys.exit(torch.cuda.is_available() and not vllm_kbit.HAS_CUDA_KERNELS)" ||
    { echo "a CUDA GPU but no kbit CUDA kernels (vllm_kbit/_C.abi3.so missing or not loadable)"; return 1; }

  local status=0
  if [ "${TESTS:-0}" = 1 ]; then
    echo "== pytest -m gpu tests/vllm, one process per test, $TESTS_PARALLEL at a time ($(left) s left)"
    gpu_tests || status=1
    cat "$OUT/tests.log"
  fi
  if [ "${BENCH:-1}" = 1 ]; then
    echo "== bench_serve.py $* ($(left) s left)"
    "$PY" benchmarks/serve/bench_serve.py --deadline "$(( $(left) - 10 ))" "$@" || status=1
  fi
  for m in ${PROFILE//,/ }; do
    echo "== profile_decode.py --method $m ($(left) s left)"
    [ "$(left)" -gt 150 ] || { echo "skipped: too little time left"; continue; }
    # shellcheck disable=SC2086
    timeout "$(( $(left) - 10 ))" "$PY" benchmarks/serve/profile_decode.py --method "$m" $PROFILE_ARGS || status=1
  done
  return $status
}

main "$@" 2>&1 | tee -a "$OUT/run.log"
