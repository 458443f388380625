#!/usr/bin/env bash
# The one-call GPU loop for the device tool's `run`: the extension (gpu_env.sh), the GPU tests, the
# benchmarks; logs and results in $OUT (the tool brings back at most 8 files).
#   bash benchmarks/run_gpu.sh
# Environment:
#   TESTS    pytest targets (default: tests/gpu); PYTEST_ARGS extra pytest arguments (e.g. -n 8)
#   BENCHES  benchmark scripts, each run as `python3 SCRIPT --out $OUT` (default: benchmarks/quantize_throughput.py)
#   SKIP_TESTS=1 / SKIP_BENCH=1 skip a step; KBIT_COMMIT names the commit in the results
source "$(dirname "$0")/gpu_env.sh"
TESTS=${TESTS:-tests/gpu}
BENCHES=${BENCHES:-benchmarks/quantize_throughput.py}
status=0

{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'
} >"$OUT/gpu.txt" 2>&1

# Resource usage of every kernel in the extension (registers, shared memory, stack).
cuobjdump -res-usage vllm_kbit/_C.abi3.so 2>&1 | grep -B1 "REG:" | grep -oE "(Function [A-Za-z0-9_]+|REG:[0-9]+|SHARED:[0-9]+|STACK:[0-9]+)" | paste - - - - >>"$OUT/gpu.txt"

if [ -z "$SKIP_TESTS" ]; then
  echo "== pytest -m gpu $TESTS"
  timeout 480 python3 -m pytest -m gpu $TESTS -q -p no:cacheprovider $PYTEST_ARGS 2>&1 | tee "$OUT/tests.log" | tail -25 || status=1
fi
if [ -z "$SKIP_BENCH" ]; then
  for bench in $BENCHES; do
    echo "== $bench"
    timeout 480 python3 "$bench" --out "$OUT" 2>&1 | tee "$OUT/$(basename "$bench" .py).log" | tail -60 || status=1
  done
fi
exit $status
