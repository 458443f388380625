#!/usr/bin/env bash
# Reliability checks on a machine with a GPU (Hopper, extension built: `pip install -e .` or
# `python setup.py build_ext --inplace`):
#   1. the bad-input table through the CUDA ops, one subprocess per case (tests/gpu/test_bad_input_cuda.py):
#      every case raises its one-line error, none crashes; routing ids outside the experts contribute zero;
#   2. compute-sanitizer memcheck over the same cases in one process (tests/bad_input_cases.py --device cuda),
#      and racecheck over the routing cases (the routing kernel's shared-memory counters);
#   3. memcheck over tests/gpu/sanitizer_workload.py (every MMA instance, dense and grouped) and racecheck
#      over its --quick set.
# PYTEST_ARGS are added to step 1's pytest (e.g. "-n 16": each case starts a process of its own, ~5 s);
# KBIT_COMMIT, when set, is the commit recorded in the summary.
# Logs go to the directory given as $1 (default: reliability-logs), one per step, with summary.txt.
# Exit status 0 only when every step passed (sanitizer steps: 0 errors).
#   bash tests/gpu/run_reliability.sh benchmarks/results/reliability_H100
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# The steps run tests/*.py as scripts: they import this checkout's vllm_kbit, installed or not.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${1:-reliability-logs}
mkdir -p "$OUT"
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
SAN=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
status=0

step() {
  local name=$1
  shift
  echo "== $name: $*"
  local start=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc ($((SECONDS - start)) s)" | tee -a "$OUT/$name.log" >> "$OUT/summary.txt"
  tail -n 4 "$OUT/$name.log"
  [ "$rc" -eq 0 ] || status=1
}

{
  echo "commit ${KBIT_COMMIT:-$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- csrc vllm_kbit tests || echo ' (with local changes)')}"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  "$PY" -c 'import torch, vllm_kbit; print("torch", torch.__version__, "cuda", torch.version.cuda, "extension loaded", vllm_kbit.HAS_CUDA_KERNELS)'
  "$SAN" --version | tail -n 1
} > "$OUT/summary.txt" 2>&1

routing_cases=$("$PY" tests/bad_input_cases.py --list | grep -E '^fused_moe-(id|map)-')

# shellcheck disable=SC2086  (PYTEST_ARGS: e.g. "-n 16" with pytest-xdist; each case starts its own process)
step bad_input_subprocess "$PY" -m pytest tests/gpu/test_bad_input_cuda.py -q -p no:cacheprovider ${PYTEST_ARGS:-}
step memcheck_bad_input "$SAN" --tool memcheck --error-exitcode 9 "$PY" tests/bad_input_cases.py --device cuda
# shellcheck disable=SC2086  (one argument per case id)
step racecheck_routing "$SAN" --tool racecheck --error-exitcode 9 "$PY" tests/bad_input_cases.py --device cuda $routing_cases
step memcheck_workload "$SAN" --tool memcheck --error-exitcode 9 "$PY" tests/gpu/sanitizer_workload.py
step racecheck_workload "$SAN" --tool racecheck --error-exitcode 9 "$PY" tests/gpu/sanitizer_workload.py --quick

echo "== summary ($OUT/summary.txt)"
cat "$OUT/summary.txt"
exit $status
