#!/usr/bin/env bash
# One device call for the dense linear path: the extension (gpu_env.sh), resource usage + SASS of
# one GEMV and one MMA instance, the GPU tests, compute-sanitizer memcheck + racecheck on one shape per kernel, each kernel
# on its own workload, and initcheck on all of them (the
# MMA kernel at every row-group width and cluster size, both wgmma kernels), an Nsight Compute profile of the largest
# shape (with the MMA kernel's shared-memory bank conflicts), and bench_linear.py. Everything lands
# in $OUT (at most 8 files). For a short call: SKIP_PROFILE=1 ... run_linear_gpu.sh --short
#   KBIT_COMMIT=<sha> bash benchmarks/run_linear_gpu.sh [bench args...]
# Steps are skipped with SKIP_TESTS=1, SKIP_SANITIZER=1, SKIP_PROFILE=1, SKIP_BENCH=1 (SANITIZE_KERNELS="wgmma_kernel ..."
# narrows the sanitizer to some kernels); SWEEP=1 adds the
# GEMV split sweep (sweep_splits.py --kernel gemv: 2 more files, so skip the sanitizer or the bench with it).
source "$(dirname "$0")/gpu_env.sh"
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv
  cuobjdump -res-usage vllm_kbit/_C.abi3.so 2>&1 | grep -A1 -E "gemv_kernel|mma_kernel" | grep -oE "((gemv|mma)_kernelI[A-Za-z0-9_]+|REG:[0-9]+|SHARED:[0-9]+|STACK:[0-9]+)" | paste - - - -
  for pat in gemv_kernelI13__nv_bfloat16Li4ELi1EE mma_kernelI13__nv_bfloat16Li4ELi2ELi4EE; do
    fn=$(cuobjdump -symbols vllm_kbit/_C.abi3.so 2>/dev/null | grep -oE "_ZN[A-Za-z0-9_]*$pat[A-Za-z0-9_]*" | head -1)
    echo "== SASS op counts of $fn"
    cuobjdump -sass -fun "$fn" vllm_kbit/_C.abi3.so | grep -oE "^\s+/\*[0-9a-f]{4}\*/\s+[A-Z0-9_.]+" | awk '{print $2}' | sed -E 's/\..*//' | sort | uniq -c | sort -rn
  done
} >"$OUT/kernel_info.txt" 2>&1

if [ -z "$SKIP_TESTS" ]; then
  timeout 420 python3 -m pytest tests/gpu/test_linear_cuda.py -q -x -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -15 ||
    { echo "GPU tests failed: not benchmarking"; exit 1; }
fi
if [ -z "$SKIP_SANITIZER" ]; then
  # One part of the workload per kernel (argv[1]: gemv, mma, wgmma, wgmma_ws or all): a kernel-filtered
  # run still executes the other kernels uninstrumented, and racecheck fails on some of those (an
  # "Internal Sanitizer Error" at the GEMV), so each kernel is checked on a workload that runs it alone.
  cat >/tmp/sanitize_linear.py <<'EOF'
import sys, torch, vllm_kbit
from vllm_kbit.linear import KbitLinearWeight, kbit_linear
part = sys.argv[1]
for (N, K, k) in [(1000, 2080, 4), (130, 4096, 5), (64, 96, 2)]:
    w = KbitLinearWeight.from_kbit(vllm_kbit.quantize(torch.randn(N, K, device="cuda", dtype=torch.bfloat16), k))
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    if part in ("gemv", "all"):
        for M in (1, 2):
            kbit_linear(torch.randn(M, K, device="cuda", dtype=torch.bfloat16), w, bias)
    if part in ("mma", "all"):
        for M in (3, 4, 5, 16, 40):
            kbit_linear(torch.randn(M, K, device="cuda", dtype=torch.bfloat16), w, bias)
        for M, r, s in ((20, 1, 1), (20, 4, 3), (70, 2, 8)):  # every row-group width, clusters of 1, 3, 8, two CTA rows
            if s <= w.qweight_rt.shape[1]:
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                torch.ops.kbit._mma_linear(x, w.qweight_rt, w.absmax_rt, w.codebook, N, K, None, r, s)
    for ws in (False, True):  # both wgmma kernels (Hopper), partial row tiles
        if part in ("wgmma_ws" if ws else "wgmma", "all"):
            for M in (7, 300):
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                torch.ops.kbit._wgmma_linear(x, w.qweight_rt, w.absmax_rt, w.codebook, N, K, bias, ws)
torch.cuda.synchronize()
print("sanitizer workload done")
EOF
  # (mma_detail: the mma.sync kernel's namespace); the first reports in full (kind, kernel, source line), then the summary
  for kernel in ${SANITIZE_KERNELS:-gemv_kernel mma_detail wgmma_kernel wgmma_ws_kernel}; do
    part=$(case $kernel in gemv_kernel) echo gemv;; mma_detail) echo mma;; wgmma_ws_kernel) echo wgmma_ws;; *) echo wgmma;; esac)
    for tool in memcheck racecheck; do
      echo "== $tool, $kernel"
      timeout 240 compute-sanitizer --tool $tool --kernel-name kns=$kernel --print-limit 4 python3 /tmp/sanitize_linear.py $part 2>&1 |
        grep -v "^W[0-9]" | awk 'NR <= 60 || /SUMMARY|workload done/'
    done
  done | tee "$OUT/sanitizer.log" | grep -E "^==|SUMMARY|workload done"
  # initcheck unfiltered: with a kernel filter, memory written by the uninstrumented kernels (repack,
  # torch's) reads as uninitialized
  echo "== initcheck, all kernels" | tee -a "$OUT/sanitizer.log"
  timeout 240 compute-sanitizer --tool initcheck --print-limit 4 python3 /tmp/sanitize_linear.py all 2>&1 |
    grep -v "^W[0-9]" | awk 'NR <= 60 || /SUMMARY|workload done/' | tee -a "$OUT/sanitizer.log" | grep -E "SUMMARY|workload done"
fi
if [ -z "$SKIP_PROFILE" ]; then  # Nsight Compute, k=4: the largest shape at M=1..256 (GEMV, MMA, both wgmma kernels) and two Qwen3
  # attention shapes, at the card's own clocks
  cat >/tmp/profile_linear.py <<'EOF'
import torch
from vllm_kbit import reference as fmt
from vllm_kbit.linear import KbitLinearWeight, kbit_linear
k = 4
# the largest shape, then Qwen3-30B-A3B's qkv and o_proj (the small shapes a decode step runs)
for (N, K), Ms in (((28672, 8192), (1, 4, 16, 64, 128, 256)), ((5120, 2048), (1, 16)), ((2048, 4096), (1,))):
    q_shape, a_shape = fmt.runtime_shapes(N, K, k)
    w = KbitLinearWeight(torch.randint(-2**31, 2**31 - 1, q_shape, dtype=torch.int32, device="cuda"),
                         torch.randint(100, 180, a_shape, dtype=torch.uint8, device="cuda"), fmt.normal_float_codebook(k, "cuda"), N, K, k)
    for M in Ms:
        kbit_linear(torch.randn(M, K, device="cuda", dtype=torch.bfloat16), w)
torch.cuda.synchronize()
EOF
  timeout 180 ncu --clock-control none --kernel-name regex:"gemv_kernel|mma_kernel|wgmma_ws_kernel" --launch-count 9 --section SpeedOfLight \
    --section ComputeWorkloadAnalysis --section WarpStateStats --section SourceCounters --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis \
    --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum \
    python3 /tmp/profile_linear.py >>"$OUT/kernel_info.txt" 2>&1
fi
if [ -n "$SWEEP" ]; then  # the GEMV's K split count swept on every design shape at M = 1, 2, 4 (sweep_splits.py)
  timeout 240 python3 benchmarks/sweep_splits.py --kernel gemv --m 1,2,4 --commit "${KBIT_COMMIT:-unknown}" --out "$OUT" \
    --shapes all 2>&1 | tail -25
fi
if [ -z "$SKIP_BENCH" ]; then
  timeout 420 python3 benchmarks/bench_linear.py --commit "${KBIT_COMMIT:-unknown}" --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | tail -80
fi
