#!/usr/bin/env bash
# The serving benchmark in one command: install this package into the interpreter (so vLLM finds the
# `kbit` plugin entry point), optionally run the GPU end-to-end tests, run bench_serve.py with the given
# arguments, optionally profile decode steps.
#   bash benchmarks/serve/run.sh [--out DIR] [bench_serve.py args, e.g. --methods kbit-4,bf16 --settings 1024/256]
# --out DIR: where results go (default benchmarks/results): serve_<gpu>_<date>.{jsonl,md,png} and
# serve_<gpu>_<date>_servers.log from bench_serve.py, profile_<gpu>_<date>.md, e2e_gpu_<gpu>_<date>_tests.log.
# Environment:
#   PYTHON     interpreter (default .venv/bin/python, else python3); it needs vLLM
#   DEADLINE   seconds for the whole run: steps that would not fit are skipped (default: no limit)
#   TESTS=1    first run `pytest -m gpu tests/vllm`, each test in its own process, TESTS_PARALLEL (4) at a time
#              (each test at most TESTS_TIMEOUT s, default 420); TESTS_K: only the tests pytest -k selects
#   BENCH=0    skip the benchmark                     PROFILE   methods to profile after it, e.g. kbit-4,bf16
#   PROFILE_ARGS  extra profile_decode.py args (e.g. "--batches 1,16 --eager")
#   KBIT_COMMIT   commit named in the results (default: git's HEAD)
# On a GPU the CUDA extension is built first if it is missing (benchmarks/gpu_common.sh); the editable
# install then only adds the package metadata and entry point (it is shown no CUDA toolkit, so it compiles
# nothing). Without a GPU (vLLM's CPU build) the PyTorch reference ops serve kbit: a check of the harness.
source "$(dirname "$0")/../gpu_common.sh"
RESULTS_DIR=benchmarks/results
args=()
while [ $# -gt 0 ]; do
  case $1 in
    --out) RESULTS_DIR=${2:?--out needs a folder}; shift 2 ;;
    --out=*) RESULTS_DIR=${1#--out=}; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
mkdir -p "$RESULTS_DIR"
# vLLM's torch.compile cache (vLLM's default place unless set); each GPU test gets a folder of its own in it.
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm}
PY=$PYTHON
DEADLINE=${DEADLINE:-86400}  # default: no practical limit
left() { echo $((DEADLINE - SECONDS)); }
GPU=$(gpu_name)
TESTS_LOG="$RESULTS_DIR/e2e_gpu_${GPU:-cpu}_$(date -u +%Y-%m-%d)_tests.log"

# Each GPU e2e test in its own pytest process (own compile cache, so parallel engines never share one),
# TESTS_PARALLEL at a time: an engine start with CUDA graphs and torch.compile takes about a minute and a
# test starts two. The log gets every test's result lines; a failing test adds the last 40 lines of its output.
TESTS_PARALLEL=${TESTS_PARALLEL:-4}
gpu_tests() {
  local dir i=0 id rc=0
  dir=$(mktemp -d /tmp/kbit_e2e_tests.XXXXXX)
  for id in $("$PY" -m pytest -m gpu tests/vllm ${TESTS_K:+-k "$TESTS_K"} --collect-only -q -p no:cacheprovider 2>/dev/null | grep "::"); do
    i=$((i + 1))
    ( VLLM_CACHE_ROOT="$VLLM_CACHE_ROOT/t$i" timeout "${TESTS_TIMEOUT:-420}" "$PY" -m pytest "$id" -q -s -p no:cacheprovider \
        --tb=short >"$dir/$i.log" 2>&1; echo "exit $? $id" >>"$dir/$i.log" ) &
    if [ $((i % TESTS_PARALLEL)) = 0 ]; then wait; fi
  done
  wait
  echo "# GPU e2e tests (pytest -m gpu tests/vllm, one process per test) at commit $KBIT_COMMIT" >"$TESTS_LOG"
  for f in "$dir"/*.log; do
    [ -e "$f" ] || { echo "no GPU e2e tests collected" >>"$TESTS_LOG"; rc=1; break; }
    grep -E "^GPU |^exit " "$f" >>"$TESTS_LOG"
    grep -q "^exit 0 " "$f" || { rc=1; grep -vE "^(INFO|WARNING|DEBUG)|^\(EngineCore" "$f" | tail -40 >>"$TESTS_LOG"; }
  done
  rm -rf "$dir"
  return $rc
}

main() {
  if nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null; then
    ensure_extension || return 1
  else
    echo "no nvidia-smi: no GPU, the PyTorch reference ops serve kbit"
  fi
  ensure_plugin || return 1

  local status=0
  if [ "${TESTS:-0}" = 1 ]; then
    echo "== pytest -m gpu tests/vllm, one process per test, $TESTS_PARALLEL at a time ($(left) s left; log: $TESTS_LOG)"
    gpu_tests || status=1
    cat "$TESTS_LOG"
  fi
  if [ "${BENCH:-1}" = 1 ]; then
    echo "== bench_serve.py --out $RESULTS_DIR $* ($(left) s left)"
    "$PY" benchmarks/serve/bench_serve.py --deadline "$(( $(left) - 10 ))" --out "$RESULTS_DIR" "$@" || status=1
  fi
  for m in ${PROFILE//,/ }; do
    echo "== profile_decode.py --method $m ($(left) s left)"
    [ "$(left)" -gt 150 ] || { echo "skipped: too little time left"; continue; }
    # shellcheck disable=SC2086
    timeout "$(( $(left) - 10 ))" "$PY" benchmarks/serve/profile_decode.py --method "$m" --out "$RESULTS_DIR" $PROFILE_ARGS || status=1
  done
  return $status
}

main "${args[@]}"
