#!/usr/bin/env bash
# On a machine with a CUDA GPU and this repository: build the CUDA extension if it is missing, run the GPU
# tests, then a set of benchmarks, each writing its results (GPU name, date and commit in the file names
# and contents) into the output folder.
#
#   bash benchmarks/run_gpu.sh [--out DIR] [--no-tests] [--no-bench] [BENCHMARK.py ...]
#
#   --out DIR     where results go (default benchmarks/results); the GPU test log goes there too, as
#                 gpu_tests_<gpu>_<date>.log
#   --no-tests    skip the GPU tests;  --no-bench  skip the benchmarks
#   BENCHMARK.py  benchmark scripts to run (default: $BENCHES, else benchmarks/bench_kernels.py if it
#                 exists, else benchmarks/bench_linear.py and benchmarks/bench_moe.py; then
#                 benchmarks/quantize_throughput.py); each runs as `$PYTHON SCRIPT --out DIR $BENCH_ARGS`
#
# Environment: PYTHON (default .venv/bin/python, else python3), TESTS (pytest targets, default tests/gpu),
# PYTEST_ARGS (e.g. "-n 4 -x"), BENCHES (e.g. "benchmarks/bench_kernels.py benchmarks/quantize_throughput.py"),
# BENCH_ARGS (extra arguments for every benchmark), KBIT_COMMIT (the commit to record; default git's HEAD).
source "$(dirname "$0")/gpu_common.sh"

RESULTS_DIR=benchmarks/results
RUN_TESTS=1
RUN_BENCH=1
benches=()
while [ $# -gt 0 ]; do
  case $1 in
    --out) RESULTS_DIR=${2:?--out needs a folder}; shift 2 ;;
    --out=*) RESULTS_DIR=${1#--out=}; shift ;;
    --no-tests) RUN_TESTS=0; shift ;;
    --no-bench) RUN_BENCH=0; shift ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "run_gpu.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) benches+=("$1"); shift ;;
  esac
done
if [ ${#benches[@]} = 0 ]; then
  if [ -n "${BENCHES:-}" ]; then
    read -r -a benches <<<"$BENCHES"
  elif [ -f benchmarks/bench_kernels.py ]; then
    benches=(benchmarks/bench_kernels.py benchmarks/quantize_throughput.py)
  else
    benches=(benchmarks/bench_linear.py benchmarks/bench_moe.py benchmarks/quantize_throughput.py)
  fi
fi
for bench in "${benches[@]}"; do
  [ -f "$bench" ] || { echo "run_gpu.sh: no benchmark script $bench" >&2; exit 2; }
done

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null ||
  { echo "run_gpu.sh: needs a CUDA GPU (nvidia-smi failed)" >&2; exit 1; }
ensure_extension || exit 1
"$PYTHON" -c "import sys, torch, vllm_kbit; print('torch', torch.__version__, '| kbit CUDA kernels:', vllm_kbit.HAS_CUDA_KERNELS); sys.exit(0 if vllm_kbit.HAS_CUDA_KERNELS else 1)" ||
  { echo "run_gpu.sh: vllm_kbit/_C*.so did not load on this GPU" >&2; exit 1; }
mkdir -p "$RESULTS_DIR"
echo "commit $KBIT_COMMIT; results in $RESULTS_DIR"

status=0
if [ "$RUN_TESTS" = 1 ]; then
  log="$RESULTS_DIR/gpu_tests_$(gpu_name)_$(date -u +%Y-%m-%d).log"
  echo "== pytest -m gpu ${TESTS:-tests/gpu} (log: $log)"
  # shellcheck disable=SC2086
  { echo "# pytest -m gpu ${TESTS:-tests/gpu} ${PYTEST_ARGS:-} at commit $KBIT_COMMIT"
    "$PYTHON" -m pytest -m gpu ${TESTS:-tests/gpu} -q -p no:cacheprovider ${PYTEST_ARGS:-}; } 2>&1 | tee "$log" | tail -25 ||
    status=1
fi
if [ "$RUN_BENCH" = 1 ]; then
  for bench in "${benches[@]}"; do
    echo "== $bench --out $RESULTS_DIR ${BENCH_ARGS:-}"
    # shellcheck disable=SC2086
    "$PYTHON" "$bench" --out "$RESULTS_DIR" ${BENCH_ARGS:-} || status=1
  done
fi
exit $status
