"""The GEMV kernels' weight decodes (csrc/plan/plan.h: gemv_table_blocks; VLLM_KBIT_GEMV_DECODE forces one): a
shared-memory table of codebook pairs / quads, one register shuffle per weight, or a mix by block. The planner's
choice runs in every other test; here the dense GEMV and the routed-expert tests run again in a child process
(the variable is read once per process) with each decode forced, against the same fp32 references.
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

# Every GEMV split count at k = 2..4 and M = 1..4 (dense), and routed-expert cases that cover the grouped
# and direct GEMV at every k (test_moe_cuda.py's random cases run every MoE path on each).
TESTS = [f"{HERE}/test_linear_cuda.py::test_gemv_every_split_count"] + [
    f"{HERE}/test_moe_cuda.py::test_random_cases_match_reference[{seed}]" for seed in range(24)
]


@pytest.mark.parametrize("mode", ["shuffle", "table", "mixed"])
def test_forced_decode_matches_reference(mode):
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *TESTS],
                         env=child_env(VLLM_KBIT_GEMV_DECODE=mode), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and " passed" in run.stdout, f"VLLM_KBIT_GEMV_DECODE={mode}: {run.stdout[-4000:]}"


def test_decode_switch_refuses_other_values():
    code = ("import torch, vllm_kbit; from vllm_kbit.linear import KbitLinearWeight, kbit_linear; "
            "w = KbitLinearWeight.from_kbit(vllm_kbit.quantize(torch.randn(64, 256).to(torch.bfloat16).cuda(), 3)); "
            "kbit_linear(torch.randn(1, 256).to(torch.bfloat16).cuda(), w); torch.cuda.synchronize()")
    run = subprocess.run([sys.executable, "-c", code], env=child_env(VLLM_KBIT_GEMV_DECODE="fast"), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode != 0 and "VLLM_KBIT_GEMV_DECODE=fast is not supported" in run.stderr, run.stderr[-2000:]
