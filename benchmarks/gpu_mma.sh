#!/usr/bin/env bash
# The fused dequant + MMA kernel's part of a shared device call, given an already built extension:
# GPU tests of kbit::linear / kbit::_mma_linear, the short benchmark, compute-sanitizer (memcheck,
# racecheck) on the MMA kernel, Nsight Compute (shared-memory bank conflicts + speed of light,
# 8192x28672 k=4 M=16/64), in that order of importance. At most ~165 s (step timeouts); writes $OUT/mma_checks.log, $OUT/mma_bench.json, $OUT/mma_bench.md.
#   KBIT_COMMIT=<sha> bash benchmarks/gpu_mma.sh
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kbit_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOG="$OUT/mma_checks.log"
T0=$(date +%s)
{
  echo "== $(nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader) commit ${KBIT_COMMIT:-unknown}"
  cuobjdump -res-usage vllm_kbit/_C.abi3.so 2>&1 | grep -A1 mma_kernel | grep -oE "(mma_kernelI[A-Za-z0-9_]+|REG:[0-9]+|SHARED:[0-9]+|STACK:[0-9]+)" | paste - - - -
} >"$LOG" 2>&1

echo "== GPU tests ($(($(date +%s) - T0)) s)" | tee -a "$LOG"
timeout 60 python3 -m pytest tests/gpu/test_linear_cuda.py -q -p no:cacheprovider -n 12 --maxfail=10 -rf 2>&1 | tee -a "$LOG" | tail -30

echo "== bench ($(($(date +%s) - T0)) s)" | tee -a "$LOG"
timeout 45 python3 benchmarks/bench_linear.py --short --commit "${KBIT_COMMIT:-unknown}" --out /tmp/mma_bench --tag _mma 2>&1 | tee -a "$LOG" | tail -45
cp /tmp/mma_bench/bench_linear_*_mma.json "$OUT/mma_bench.json" 2>/dev/null
cp /tmp/mma_bench/bench_linear_*_mma.md "$OUT/mma_bench.md" 2>/dev/null
echo "== compute-sanitizer on mma_kernel ($(($(date +%s) - T0)) s)" | tee -a "$LOG"
cat >/tmp/sanitize_mma.py <<'PY'
import torch
import vllm_kbit
from vllm_kbit.linear import KbitLinearWeight, kbit_linear
N, K, k = 130, 1056, 5  # N and K tails (3 blocks in the last k-tile), 9 k-tiles
w = KbitLinearWeight.from_kbit(vllm_kbit.quantize(torch.randn(N, K, device="cuda", dtype=torch.bfloat16), k))
bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
for M in (5, 40):  # kbit_linear's MMA path, p = 1 and p = 8
    kbit_linear(torch.randn(M, K, device="cuda", dtype=torch.bfloat16), w, bias)
for M, r, s in ((20, 1, 1), (20, 4, 3), (70, 2, 8)):  # every row-group width, clusters of 1, 3, 8, two CTA rows
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    torch.ops.kbit._mma_linear(x, w.qweight_rt, w.absmax_rt, w.codebook, N, K, bias, r, s)
torch.cuda.synchronize()
print("sanitizer workload done")
PY
for tool in memcheck racecheck; do
  echo "-- $tool"
  timeout 20 compute-sanitizer --tool $tool --kernel-name kns=mma_kernel python3 /tmp/sanitize_mma.py 2>&1 | tail -4
done | tee -a "$LOG"

echo "== ncu: mma_kernel, 8192x28672 k=4, M=16 and M=64 ($(($(date +%s) - T0)) s)" | tee -a "$LOG"
cat >/tmp/profile_mma.py <<'PY'
import torch
from vllm_kbit import format as fmt
from vllm_kbit.linear import KbitLinearWeight, kbit_linear
N, K, k = 28672, 8192, 4
q_shape, a_shape = fmt.runtime_shapes(N, K, k)
w = KbitLinearWeight(torch.randint(-2**31, 2**31 - 1, q_shape, dtype=torch.int32, device="cuda"),
                     torch.randint(100, 180, a_shape, dtype=torch.uint8, device="cuda"), fmt.normal_float_codebook(k, "cuda"), N, K, k)
for M in (16, 64):
    kbit_linear(torch.randn(M, K, device="cuda", dtype=torch.bfloat16), w)
torch.cuda.synchronize()
PY
timeout 18 ncu --clock-control none --kernel-name regex:mma_kernel --launch-count 2 --section SpeedOfLight \
  --section WarpStateStats --section Occupancy \
  --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,smsp__inst_executed_op_shared_ld.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed_op_shfl.sum,smsp__inst_executed.sum \
  python3 /tmp/profile_mma.py 2>&1 | grep -vE "^==PROF==|^\s*$" | tee -a "$LOG" | tail -40

echo "== done ($(($(date +%s) - T0)) s)" | tee -a "$LOG"
