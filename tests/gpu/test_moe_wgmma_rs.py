"""The grouped_wgmma MoE path's two kernels (csrc/plan/plan.h: moe_wgmma_rs): the register-operand one
(128-row chunks, the wgmma N fitted to each chunk, the expert's weights decoded into registers), which the
rule picks up to 128 slots per expert (k = 2: 96), and the warp-specialized one (256-row chunks) past it.
VLLM_KBIT_MOE_WGMMA=rs|ws forces one; every routed-expert suite that runs the grouped_wgmma path (random
cases with expert maps and weights on the input, the Qwen3-30B design shape, CUDA-graph replay, run-to-run
determinism) runs again in a child process under each (the variable is read once per process), against the
same fp32 references; the parent suites run the rule.
"""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from child_env import child_env  # noqa: E402
from vllm_kbit import ops  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("kernel", ["rs", "ws"])
def test_routed_suites_on_each_grouped_wgmma_kernel(kernel):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the grouped wgmma is built for Hopper")
    args = [f"{HERE}/test_moe_cuda.py", f"{HERE}/test_determinism.py", "-k",
            "random_cases_match or design_shape or cuda_graph or fused_moe"]
    workers = ["-n", "8"] if importlib.util.find_spec("xdist") else []  # pytest-xdist where installed
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *workers, *args],
                         env=child_env(VLLM_KBIT_MOE_WGMMA=kernel), capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-4000:]


def test_the_rule_picks_the_kernel_by_rows_per_expert_and_a_forced_producer_count_picks_ws():
    def plan(tokens, **forced):
        p = ops.named(torch.ops.kbit.moe_plan.device, tokens, 8, 128, 4, 2048, 768, torch.device("cuda"),
                      "grouped_wgmma", **forced)
        assert p.kernel == {128: "wgmma_rs_grouped", 256: "wgmma_ws_grouped"}[p.chunk_rows], p
        return p.chunk_rows, p.gate_up_producers

    assert plan(768) == (128, 0) and plan(2048)[0] == 128  # 48 and 128 slots per expert (k = 4)
    assert plan(2049)[0] == 256 and plan(4096)[0] == 256 and plan(4096)[1] > 0
    assert plan(1024, producers=1) == (256, 1)
    # Forced to rs (the switch itself: tests/test_fused_moe_op.py), a producer count is refused.
    code = ("import torch, vllm_kbit; torch.ops.kbit.moe_plan.device(1024, 8, 128, 4, 2048, 768, torch.device('cuda'), "
            "'grouped_wgmma', producers=1)")
    run = subprocess.run([sys.executable, "-c", code], env=child_env(VLLM_KBIT_MOE_WGMMA="rs"),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "not the register-operand one" in run.stderr, run.stderr[-2000:]
