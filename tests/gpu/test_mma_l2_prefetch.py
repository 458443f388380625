"""The MMA kernels' L2 prefetch of weight tiles ahead of their copy pipeline (csrc/plan/plan.h: mma_l2_ahead;
VLLM_KBIT_MMA_L2_AHEAD forces a depth). The planner's depth runs in every other test; here the dense and
grouped MMA tests run again in a child process (the variable is read once per process) with no prefetch and
with the deepest one, whose prefetches run past every CTA's last k-tile (they must stop there), against the
same fp32 references.
"""

import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from child_env import child_env  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Dense MMA cases (random M, N, K, k, dtype, tile shape and split count) and routed-expert cases that run
# every MoE path, the grouped MMA among them.
TESTS = [f"{HERE}/test_linear_cuda.py::test_mma_random_cases_match_reference[{seed}]" for seed in range(64)] + [
    f"{HERE}/test_moe_cuda.py::test_random_cases_match_reference[{seed}]" for seed in range(24)
] + [f"{HERE}/test_moe_cuda.py::test_grouped_single_projection"]


@pytest.mark.parametrize("ahead", ["0", "16"])
def test_forced_prefetch_depth_matches_reference(ahead):
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *TESTS],
                         env=child_env(VLLM_KBIT_MMA_L2_AHEAD=ahead), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and " passed" in run.stdout, f"VLLM_KBIT_MMA_L2_AHEAD={ahead}: {run.stdout[-4000:]}"


@pytest.mark.parametrize("value", ["17", "-1", "four"])
def test_prefetch_depth_refuses_other_values(value):
    code = ("import torch, vllm_kbit; from vllm_kbit.linear import KbitLinearWeight, kbit_linear; "
            "w = KbitLinearWeight.from_kbit(vllm_kbit.quantize(torch.randn(64, 256).to(torch.bfloat16).cuda(), 4)); "
            "kbit_linear(torch.randn(16, 256).to(torch.bfloat16).cuda(), w); torch.cuda.synchronize()")
    run = subprocess.run([sys.executable, "-c", code], env=child_env(VLLM_KBIT_MMA_L2_AHEAD=value), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode != 0 and f"VLLM_KBIT_MMA_L2_AHEAD={value} is not supported" in run.stderr, run.stderr[-2000:]
