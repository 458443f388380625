"""The planner's answer is what launches (csrc/plan/plan.h): over a sweep of shapes, bits, dtypes and paths,
kbit::linear_plan.device and kbit::moe_plan.device on this GPU against the configuration the launchers
recorded (kbit::_launch_record: kernel, p, r, grid rows, K splits of every launch since the last call)."""

import pytest
import torch

from test_linear_cuda import DESIGN_SHAPES, _random_weight  # a sibling: pytest puts tests/gpu on sys.path
from test_moe_cuda import Experts, random_routing

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, requires_cuda]

DEVICE = torch.device("cuda", 0)
MS = (1, 2, 5, 8, 9, 16, 17, 32, 33, 64, 65, 100, 128, 129, 300, 512, 513)


def launched():
    """The launches since the last call, as (kernel, p, r, m_blocks, splits) tuples."""
    return list(zip(*torch.ops.kbit._launch_record()))


def forced(x, w, path, row_groups=0, splits=0):
    """kbit::_linear_forced (the forced-plan op) on a KbitLinearWeight."""
    path_id = torch.ops.kbit._linear_path_id(path)
    return torch.ops.kbit._linear_forced(x, w.qweight_rt, w.absmax_rt, w.codebook, w.N, w.K, None, path_id, row_groups,
                                         splits)


def expected_linear(plan):
    path, splits, _, p, r, m_blocks = plan
    if path == "gemv":
        return [("gemv", 0, 0, 0, splits)]
    if path == "mma":
        return [("mma", p, r, m_blocks, splits)]
    return [(path, 0, 0, 0, 1)]


def _weights():
    gen = torch.Generator().manual_seed(0)
    shapes = [(K, N) for K, N in DESIGN_SHAPES if N * K <= 10240 * 2048] + [(128, 64), (256, 8 * 64 * 127)]
    for K, N in shapes:
        for k in (2, 3, 4, 5):
            yield K, N, k, _random_weight(N, K, k, gen)[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_launches_its_plan(dtype):
    torch.cuda.set_device(DEVICE)
    props = torch.cuda.get_device_properties(DEVICE)
    launched()
    for K, N, k, w in _weights():
        for M in MS:
            plan = torch.ops.kbit.linear_plan.device(M, N, K, dtype, k, DEVICE)
            x = torch.randn(M, K, dtype=dtype, device=DEVICE)
            torch.ops.kbit.linear(x, w.qweight_rt, w.absmax_rt, w.codebook, N, K, None)
            got = launched()
            assert got == expected_linear(plan), (M, N, K, k, dtype, plan)
            # The plan on given facts agrees but for the MMA split count (it cannot see cluster capacities).
            given = torch.ops.kbit.linear_plan(M, N, K, dtype, props.major, props.multi_processor_count)
            assert given[0] == plan[0] and given[2:] == plan[2:], (M, N, K, given, plan)
            if plan[0] == "gemv":
                assert given[1] == plan[1]


def test_forced_linear_launches_its_plan():
    """kbit::_linear_forced launches what linear_plan.device plans with the same forced fields."""
    torch.cuda.set_device(DEVICE)
    launched()
    for K, N, k, w in _weights():
        if k != 4 and N * K > 2048 * 4096:
            continue
        for M in (1, 3, 8, 9, 20, 40, 64, 200):
            x = torch.randn(M, K, dtype=torch.bfloat16, device=DEVICE)
            p = torch.ops.kbit.linear_plan.device(M, N, K, torch.bfloat16, k, DEVICE, "mma")[3]
            k_tiles = -(-K // 128)
            for row_groups in (0, 1, 2 if p == 8 else 4):
                for splits in (0, 1, 2, 8):
                    if splits > k_tiles:
                        continue
                    plan = torch.ops.kbit.linear_plan.device(M, N, K, torch.bfloat16, k, DEVICE, "mma", row_groups, splits)
                    forced(x, w, "mma", row_groups, splits)
                    assert launched() == expected_linear(plan), (M, N, K, k, row_groups, splits, plan)
            if M <= 4:
                for splits in (0, 1, 3):
                    if splits > k_tiles:
                        continue
                    plan = torch.ops.kbit.linear_plan.device(M, N, K, torch.bfloat16, k, DEVICE, "gemv", 0, splits)
                    forced(x, w, "gemv", 0, splits)
                    assert launched() == expected_linear(plan), (M, N, K, k, splits, plan)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9, reason="wgmma: Hopper")
def test_forced_paths_launch_their_kernel():
    torch.cuda.set_device(DEVICE)
    launched()
    w = _random_weight(10240, 2048, 4, torch.Generator().manual_seed(1))[0]
    for M in (1, 80, 300):
        x = torch.randn(M, 2048, dtype=torch.bfloat16, device=DEVICE)
        for path in ("wgmma", "wgmma_ws", "dequant_cublas", "mma") + (("gemv",) if M == 1 else ()):
            plan = torch.ops.kbit.linear_plan.device(M, 10240, 2048, torch.bfloat16, 4, DEVICE, path)
            forced(x, w, path)
            assert launched() == expected_linear(plan), (M, path, plan)


def expected_moe(plan):
    path, _, _, _, gate_up, down = plan
    if path == "grouped_mm":
        return [("grouped_mm", 0, 0, 0, 0)]
    kernel = {"gemv_direct": "moe_gemv_direct", "gemv": "moe_gemv", "grouped_mma": "mma_grouped",
              "grouped_wgmma": "wgmma_ws_grouped"}[path]
    return [(kernel, proj[1], proj[2], proj[3], proj[0]) for proj in (gate_up, down)]


# (E, top_k, H, I): tiny, Qwen3-30B-A3B-like, GLM-4.7-Flash-like and a 4-expert rank.
MOE_SHAPES = [(8, 2, 128, 64), (128, 8, 2048, 768), (64, 4, 2048, 1536), (4, 2, 512, 256)]


@pytest.mark.parametrize("E,top_k,H,I", MOE_SHAPES)
def test_fused_moe_launches_its_plan(E, top_k, H, I):
    torch.cuda.set_device(DEVICE)
    gen = torch.Generator().manual_seed(E + H)
    for k in (2, 3, 4, 5) if H * I <= 512 * 256 else (2, 4, 5):
        ex = Experts(E, H, I, k, gen)
        for T in (1, 2, 3, 8, 16, 33, 64, 256, 1024, 2048):
            x = torch.randn(T, H, dtype=torch.bfloat16, generator=gen).cuda() / 4
            ids, weights = random_routing(T, E, top_k, gen, "random")
            for path in ("auto", "gemv_direct", "gemv", "grouped_mma", "grouped_mm", "grouped_wgmma"):
                plan = torch.ops.kbit.moe_plan.device(T, top_k, E, k, H, I, DEVICE, path)
                launched()
                path_id = torch.ops.kbit._moe_path_id(path)
                torch.ops.kbit._fused_moe_cuda(x, ids, weights, *ex.args(), I, None, False, path_id)
                assert launched() == expected_moe(plan), (T, top_k, E, H, I, k, path, plan)
                # The plan without sizes names the same path and routing workspace.
                sm_major = torch.cuda.get_device_capability(DEVICE)[0]
                assert torch.ops.kbit.moe_plan(T, top_k, E, k, path, sm_major) == plan[:3]
