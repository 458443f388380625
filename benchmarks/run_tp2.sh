#!/usr/bin/env bash
# On a machine with 2 GPUs and this repository: tensor and expert parallel in two phases, each under its own
# time limit, writing logs and results into RESULTS_DIR. The second phase runs even if the first fails.
#
#   bash benchmarks/run_tp2.sh RESULTS_DIR [--no-tests] [--no-bench]
#
# 1. Tests: `pytest -m gpu tests/vllm/test_gpu_e2e.py -k test_gpu_parallel_matches_tp1` in one process: the
#    tiny qwen3_moe and glm4_moe, online kbit-4, a converted mixed-bits checkpoint (routed experts 3 bits,
#    attention 5) and a rotated one (convert --rotate --rotation-tp 2), at TP=2 and at TP=2 with expert parallel,
#    each against TP=1 (18 engines, 6 of them the TP=1 references, KBIT_E2E_ENGINES at a time).
#    Log: RESULTS_DIR/tp2_tests.log.
# 2. Serving benchmark at TP=2: benchmarks/serve/run.sh --tp 2 (Qwen3-30B-A3B shape, dummy weights,
#    1024 in / 256 out). Results: RESULTS_DIR/serve_tp2_<gpu>_<date>.{jsonl,md,png}, the servers' log beside them,
#    the harness's output in RESULTS_DIR/serve_tp2.log. Running the script again with the same RESULTS_DIR (on the
#    same day and commit) skips the benchmark steps already measured there, so a run cut short by its time
#    limit can be finished by a second one (e.g. with --no-tests).
#
# Environment (defaults in brackets):
#   TESTS_TIMEOUT [360]   seconds for phase 1      BENCH_TIMEOUT [540]   seconds for phase 2
#   KBIT_E2E_ENGINES [6]  test engines running at once
#   METHODS [kbit-4,bf16,gptq-int4]   CONCURRENCY [1,16,64,128]   SETTING [1024/256]
#   PROMPTS_PER_C [2]     prompts per bench = max(8, PROMPTS_PER_C x concurrency)
#   PYTHON (default .venv/bin/python, else python3), KBIT_COMMIT (the commit to record; default git's HEAD)
set -u
RESULTS_ARG=""
RUN_TESTS=1
RUN_BENCH=1
for arg in "$@"; do
  case $arg in
    --no-tests) RUN_TESTS=0 ;;
    --no-bench) RUN_BENCH=0 ;;
    -h|--help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "run_tp2.sh: unknown option $arg (see --help)" >&2; exit 2 ;;
    *) [ -z "$RESULTS_ARG" ] || { echo "run_tp2.sh: one output folder only" >&2; exit 2; }; RESULTS_ARG=$arg ;;
  esac
done
[ -n "$RESULTS_ARG" ] || { echo "usage: bash benchmarks/run_tp2.sh RESULTS_DIR [--no-tests] [--no-bench]" >&2; exit 2; }
mkdir -p "$RESULTS_ARG" || exit 1
RESULTS_DIR=$(cd "$RESULTS_ARG" && pwd)  # absolute: gpu_common.sh changes to the repository root
source "$(dirname "$0")/gpu_common.sh"

TESTS_TIMEOUT=${TESTS_TIMEOUT:-360}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-540}
METHODS=${METHODS:-kbit-4,bf16,gptq-int4}
CONCURRENCY=${CONCURRENCY:-1,16,64,128}
SETTING=${SETTING:-1024/256}
PROMPTS_PER_C=${PROMPTS_PER_C:-2}
export KBIT_E2E_ENGINES=${KBIT_E2E_ENGINES:-6}
stamp() { date -u +%H:%M:%S; }

echo "== $(stamp) commit $KBIT_COMMIT; output in $RESULTS_DIR"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader ||
  { echo "run_tp2.sh: needs CUDA GPUs (nvidia-smi failed)" >&2; exit 1; }
GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
[ "${GPUS:-0}" -ge 2 ] || { echo "run_tp2.sh: torch sees ${GPUS:-0} GPU(s), needs 2 (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset})" >&2; exit 1; }
# The CUDA extension (built if missing) and this package installed in $PYTHON with its vLLM plugin entry
# point: serve/run.sh with neither tests nor benchmark does exactly that set-up.
TESTS=0 BENCH=0 bash benchmarks/serve/run.sh --out "$RESULTS_DIR" || { echo "run_tp2.sh: set-up failed" >&2; exit 1; }

status=0
if [ "$RUN_TESTS" = 1 ]; then
  log="$RESULTS_DIR/tp2_tests.log"
  echo "== $(stamp) phase 1: TP=2 / TP=2+EP vs TP=1 end-to-end tests (limit ${TESTS_TIMEOUT} s, $KBIT_E2E_ENGINES engines at a time; log: $log)"
  # timeout signals its whole process group: pytest, the engine processes and their vLLM workers.
  # TORCHINDUCTOR_COMPILE_THREADS: the engines compiling at once share the CPU cores.
  { echo "# pytest -m gpu tests/vllm/test_gpu_e2e.py -k test_gpu_parallel_matches_tp1 at commit $KBIT_COMMIT ($(date -u '+%F %H:%M UTC'))"
    TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-4} timeout -k 30 "$TESTS_TIMEOUT" \
      "$PYTHON" -m pytest -m gpu tests/vllm/test_gpu_e2e.py -k test_gpu_parallel_matches_tp1 -v -s -p no:cacheprovider \
      --tb=short --durations=0
    rc=$?
    [ $rc = 124 ] && echo "phase 1 stopped at its time limit (${TESTS_TIMEOUT} s)"
    echo "exit $rc"; } 2>&1 | tee "$log" | grep -E "^GPU |PASSED|FAILED|ERROR|SKIPPED|passed|failed|error|^exit |time limit"
  tail -n 1 "$log" | grep -q "^exit 0$" || status=1
  echo "== $(stamp) phase 1 done"
fi

if [ "$RUN_BENCH" = 1 ]; then
  # Nothing of phase 1 should still hold GPU memory; listed so the log shows it if something does.
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>/dev/null | sed 's/^/GPU process still running: /'
  stem="serve_tp2_$(gpu_name)_$(date -u +%F)"
  log="$RESULTS_DIR/serve_tp2.log"
  echo "== $(stamp) phase 2: serving benchmark at TP=2, $METHODS, $SETTING, c = $CONCURRENCY, $PROMPTS_PER_C prompts per concurrency (limit ${BENCH_TIMEOUT} s; results: $RESULTS_DIR/$stem.md)"
  # run.sh's DEADLINE makes bench_serve.py skip what would not fit; timeout is the hard stop behind it.
  DEADLINE=$BENCH_TIMEOUT timeout -k 60 $((BENCH_TIMEOUT + 30)) bash benchmarks/serve/run.sh --out "$RESULTS_DIR" --tp 2 \
    --methods "$METHODS" --settings "$SETTING:$PROMPTS_PER_C" --concurrency "$CONCURRENCY" \
    --tag "$stem" --skip-done "$RESULTS_DIR/$stem.jsonl" 2>&1 | tee "$log" || status=1
  [ -f "$RESULTS_DIR/$stem.md" ] && cat "$RESULTS_DIR/$stem.md"
  echo "== $(stamp) phase 2 done"
fi
exit $status
