#!/usr/bin/env bash
# One device call for the routed-expert (MoE) path: the extension (gpu_env.sh), kernel resource
# usage, GPU tests, compute-sanitizer memcheck on a few small cases through the three paths, an Nsight
# Compute profile of the grouped MMA and GEMV kernels on the Qwen3-30B-A3B layer, then bench_moe.py.
# Everything lands in $OUT.
#   KBIT_COMMIT=<sha> bash benchmarks/run_moe_gpu.sh [bench args...]
# Steps are skipped with SKIP_TESTS=1, SKIP_SANITIZER=1, SKIP_PROFILE=1, SKIP_BENCH=1; the benchmark gets what is
# left of DEADLINE seconds (default 520) after the other steps.
source "$(dirname "$0")/gpu_env.sh"
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv
  cuobjdump -res-usage vllm_kbit/_C.abi3.so 2>&1 | grep -A1 -E "moe_(gemv|route|gather|silu|combine)" |
    grep -oE "(moe_[a-z_]+kernelI[A-Za-z0-9_]+|REG:[0-9]+|SHARED:[0-9]+|STACK:[0-9]+|LOCAL:[0-9]+)" | paste - - - - -
} >"$OUT/kernel_info.txt" 2>&1

if [ -z "$SKIP_TESTS" ]; then
  timeout 200 python3 -m pytest tests/gpu/test_moe_cuda.py tests/gpu/test_linear_cuda.py -k "moe or random" -q --maxfail=10 -n 4 -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -15 ||
    echo "GPU tests FAILED"
fi
if [ -z "$SKIP_SANITIZER" ]; then
  cat >/tmp/sanitize_moe.py <<'PY'
import torch
import sys; sys.path.insert(0, "tests/gpu")
from test_moe_cuda import Experts, random_routing
gen = torch.Generator().manual_seed(0)
ex = Experts(6, 96, 64, 4, gen)
emap = torch.tensor([0, -1, 1, 2, -1, 3, 4, 5], dtype=torch.int32, device="cuda")
for T, on_input, m in [(1, False, None), (5, True, None), (7, False, emap), (40, False, None)]:
    ids, w = random_routing(T, 8 if m is not None else 6, 1 if on_input else 3, gen, "few")
    x = torch.randn(T, 96, generator=gen).to(torch.bfloat16).cuda()
    for path in (1, 2, 3):
        torch.ops.kbit._fused_moe_cuda(x, ids, w, *ex.args(), 64, m, on_input, path)
torch.cuda.synchronize()
print("sanitizer workload done")
PY
  timeout 150 compute-sanitizer --tool memcheck python3 /tmp/sanitize_moe.py 2>&1 | tail -6 | tee "$OUT/sanitizer.log"
fi
if [ -z "$SKIP_PROFILE" ]; then  # Nsight Compute: the grouped MMA (T=16, 64) and GEMV (T=1) on the Qwen3-30B-A3B layer, k=4
  cat >/tmp/profile_moe.py <<'PY'
import torch
import sys; sys.path.insert(0, "tests/gpu")
from test_moe_cuda import Experts, random_routing
gen = torch.Generator().manual_seed(0)
ex = Experts(128, 2048, 768, 4, gen)
for T, path in ((16, 3), (64, 3), (1, 1)):
    ids, w = random_routing(T, 128, 8, gen, "uniform")
    x = torch.randn(T, 2048, generator=gen).to(torch.bfloat16).cuda()
    torch.ops.kbit._fused_moe_cuda(x, ids, w, *ex.args(), 768, None, False, path)
torch.cuda.synchronize()
PY
  timeout 240 ncu --clock-control none --kernel-name regex:"mma_kernel|moe_gemv_kernel" --launch-count 6 --section SpeedOfLight \
    --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
    --section MemoryWorkloadAnalysis --section SchedulerStats --section SourceCounters python3 /tmp/profile_moe.py >>"$OUT/kernel_info.txt" 2>&1
fi
if [ -z "$SKIP_BENCH" ]; then
  timeout $((${DEADLINE:-520} - SECONDS)) python3 benchmarks/bench_moe.py --commit "${KBIT_COMMIT:-unknown}" --out "$OUT" "$@" 2>&1 |
    tee "$OUT/bench.log" | tail -60
fi
