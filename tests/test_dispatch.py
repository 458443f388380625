"""The planner (csrc/plan/) through the ops that expose it (csrc/ops/dispatch.cpp): kbit::linear_plan, and the split-K
heuristics and routing bound behind the plans. Host C++ only, so this runs on CPU wherever the
extension is built; tests/test_fused_moe_op.py covers kbit::moe_plan."""

import functools
import random
import subprocess
import sys

import pytest
import torch

from vllm_kbit import ops
from vllm_kbit.linear import gemv_tiles
from child_env import child_env

pytestmark = pytest.mark.skipif(not ops.HAS_EXTENSION, reason="the C++ extension is not built or not loadable")

# The target shapes of docs/architecture.md, as (K, N) (tests/gpu/test_linear_cuda.py runs them on a GPU).
from gpu.test_linear_cuda import DESIGN_SHAPES  # noqa: E402


def plan(M, N, K, dtype=torch.bfloat16, sm_major=9, num_sms=132, ctas_per_sm=1, path="auto", bits=0):
    return ops.named(torch.ops.kbit.linear_plan, M, N, K, dtype, sm_major, num_sms, ctas_per_sm, path, bits)


def test_linear_plan_paths_on_both_sides_of_each_bound():
    # big: >= 10240 rows (register-fragment wgmma); small: 2^25 elements; short: 2^25 elements, K short of the
    # K-split rule's 32 k-tiles (test_wgmma_ws_k_split_rule)
    big, small, short = (14336, 4096), (8192, 4096), (8960, 3840)
    assert [plan(M, *big)[0] for M in (1, 2, 3, 32, 33, 64, 65, 128, 129, 512, 513)] == [
        "gemv", "mma", "mma", "mma", "wgmma_ws", "wgmma_ws", "wgmma", "wgmma", "wgmma_ws", "wgmma_ws", "dequant_cublas"]
    # M = 33..64: the warp-specialized wgmma on weights of >= 2^25 elements (two producers: k <= 4) whose 2-tile CTAs
    # fill 3/4 of the SMs (224 n-tiles: 112 CTAs), else the MMA kernel (128 n-tiles: 64 CTAs; below 2^25 elements)
    assert [plan(48, *shape)[0] for shape in (big, small, (8192, 4064), (1024, 2048))] == [
        "wgmma_ws", "mma", "mma", "mma"]
    assert plan(48, 12672, 8192)[0] == "wgmma_ws" and plan(48, 12544, 8192)[0] == "mma"  # 99 / 98 CTAs: 0.75 x 132 = 99
    assert {plan(M, *big, sm_major=8)[0] for M in (33, 64)} == {"mma"}
    assert [plan(M, *short)[0] for M in (65, 128, 129, 512)] == ["dequant_cublas", "dequant_cublas", "wgmma_ws", "wgmma_ws"]
    assert [plan(M, *small)[0] for M in (65, 128, 129, 512)] == ["wgmma_ws"] * 4  # 65, 128: the K-split rule
    assert plan(129, 8704, 3840)[0] == "dequant_cublas"  # under 2^25 elements
    assert plan(100, 10240, 2048)[0] == "wgmma" and plan(100, 10240, 2016)[0] == "dequant_cublas"
    assert {plan(M, *big, sm_major=8)[0] for M in (65, 128, 129, 512)} == {"dequant_cublas"}  # wgmma: Hopper only
    assert {plan(M, *big, dtype=torch.float16)[0] for M in (1, 3, 100)} == {"gemv", "mma", "wgmma"}
    assert {plan(M, *big, dtype=torch.float32)[0] for M in (1, 3, 100)} == {"dequant_cublas"}
    # M = 17..64 at k = 2..5 on Hopper: the register-operand wgmma's narrow instance where its 4-tile CTAs fill at
    # least 3/4 of the SMs at M <= 32 (28672 rows: 112 CTAs of 132), 0.6 of them at M = 33..64 (21888 rows: 86), else
    # the MMA kernel or wgmma_ws.
    wide = (28672, 4096)
    assert [plan(M, *wide, bits=4)[0] for M in (16, 17, 32, 33, 64, 65)] == [
        "mma", "wgmma", "wgmma", "wgmma", "wgmma", "wgmma"]
    assert [plan(48, *wide, bits=b)[0] for b in (0, 2, 4, 5)] == ["wgmma_ws", "wgmma", "wgmma", "wgmma"]
    assert [plan(M, 21888, 4096, bits=4)[0] for M in (24, 48)] == ["mma", "wgmma"]  # 86 CTAs
    assert [plan(48, N, 4096, bits=4)[0] for N in (20480, 20224)] == ["wgmma", "wgmma_ws"]  # 80 / 79 CTAs: 0.6 x 132 = 79.2
    assert [plan(24, *wide, bits=b)[0] for b in (0, 2, 3, 4, 5)] == ["mma", "wgmma", "wgmma", "wgmma", "wgmma"]
    assert plan(24, 21888, 4096, bits=4)[0] == "mma"  # 86 CTAs
    assert plan(24, *wide, bits=4, sm_major=8)[0] == "mma" and plan(24, *wide, bits=4, num_sms=150)[0] == "mma"
    assert plan(24, *wide, bits=4, dtype=torch.float16)[0] == "wgmma"


def test_linear_plan_fields():
    n_tiles, k_tiles = gemv_tiles(4096, 2048)
    g = plan(1, 4096, 2048)
    assert g.path == "gemv" and 1 < g.max_splits <= k_tiles and (g.p, g.r, g.producers) == (0, 0, 0)
    assert g.splits == torch.ops.kbit._gemv_splits(n_tiles, k_tiles, 132)
    assert (g.m_blocks, g.cols, g.pdl) == (1, n_tiles, True)  # one CTA row of n-tiles, a programmatic dependent
    for M, (want_p, want_blocks) in {1: (1, 1), 8: (1, 1), 9: (2, 1), 17: (3, 1), 24: (3, 1), 25: (4, 1), 33: (8, 1), 64: (8, 1)}.items():
        m = plan(M, 14336, 4096, ctas_per_sm=3, path="mma")
        assert (m.path, m.p, m.m_blocks) == ("mma", want_p, want_blocks)
        assert m.r == (1 if m.p < 4 else 4 if m.p == 4 else 2)  # wide warps on this 224-tile weight from p = 4
        n_tiles, k_tiles = gemv_tiles(14336, 4096)
        assert m.splits == torch.ops.kbit._mma_splits(-(-n_tiles // m.r), m.m_blocks, k_tiles, 132, 3,
                                                      torch.ops.kbit._mma_split_cost(False))
        assert m.cols == -(-n_tiles // m.r) and m.pdl and m.table_blocks == 0
    assert plan(200, 14336, 2048, path="mma")[3:7] == (8, 2, 4, 112)  # 4 CTA rows of 64, 224 n-tiles / 2
    assert plan(40, 64 * 127, 2048, path="mma").r == 1  # under 128 n-tiles: narrow warps
    assert plan(600, 14336, 4096)[1:] == (1, 1, 0, 0, 0, 0, 0, 0, False, "none")  # dequant_cublas: no grid of ours
    # The register-operand wgmma: a CTA per 128 rows and per 2 n-tiles; no programmatic dependent launch.
    w = plan(100, 10240, 2048)
    assert (w.path, w.m_blocks, w.cols, w.splits, w.producers, w.pdl) == ("wgmma", 1, 80, 1, 0, False)
    assert plan(128, 10240, 2048).m_blocks == 1 and plan(129, 14336, 4096, path="wgmma").m_blocks == 2
    # At M <= 64 its narrow instance: 4 n-tiles a CTA, every k decoding through the table.
    assert [plan(64, 28672, 8192, path="wgmma", bits=b).cols for b in (2, 4, 5)] == [112, 112, 112]
    assert plan(65, 28672, 8192, path="wgmma", bits=4).cols == 224 and plan(1, 28672, 8192, path="wgmma").cols == 112
    # The warp-specialized wgmma: a CTA per 256 rows and per 2 n-tiles; two producer warpgroups, one at k = 5.
    ws = plan(300, 14336, 4096)
    assert (ws.path, ws.m_blocks, ws.cols, ws.producers, ws.pdl) == ("wgmma_ws", 2, 112, 2, False)
    assert plan(300, 14336, 4096, bits=5).producers == 1 and plan(300, 14336, 4096, bits=4).producers == 2
    # Off Hopper nothing launches as a programmatic dependent.
    assert not plan(1, 4096, 2048, sm_major=8).pdl and not plan(16, 4096, 2048, sm_major=8).pdl
    with pytest.raises(ValueError, match="is not one of auto, gemv, mma, wgmma, wgmma_ws, dequant_cublas"):
        plan(1, 64, 128, path="fastest")
    with pytest.raises(ValueError, match="multiple of 32"):
        plan(1, 64, 100)
    with pytest.raises(ValueError, match="k=6 is not supported; supported: 0 \\(not named\\), 2..5"):
        plan(1, 64, 128, bits=6)


def test_gemv_decode_is_the_plans():
    """How the GEMV decodes (blocks of each k-tile through the table, the rest by shuffle) is a plan field: one row
    at k = 4 three of four blocks, k = 3 all, k = 2 and 5 none (k = 2 at one row has no table), more rows at k = 3,
    4 all; unnamed k (0) none. Forced on the GEMV path at up to 4 rows, the same rule."""
    want = {(1, 2): 0, (1, 3): 4, (1, 4): 3, (1, 5): 0, (2, 2): 0, (2, 3): 4, (2, 4): 4, (4, 4): 4, (3, 5): 0}
    for (M, bits), blocks in want.items():
        got = plan(M, 4096, 2048, path="gemv", bits=bits)
        assert (got.path, got.table_blocks) == ("gemv", blocks), (M, bits, got)
    assert plan(1, 4096, 2048).table_blocks == 0  # k not named
    assert {plan(M, 4096, 2048, path="mma", bits=4).table_blocks for M in (1, 8, 64)} == {0}


@pytest.mark.parametrize("env,field,want", [("VLLM_KBIT_GEMV_DECODE=shuffle", "table_blocks", 0),
                                             ("VLLM_KBIT_GEMV_DECODE=table", "table_blocks", 4),
                                             ("VLLM_KBIT_PDL=0", "pdl", False)])
def test_overrides_reach_the_plan(env, field, want):
    """The settings that force a decode or turn PDL off change the plan (what launches), read once per process:
    a child process per setting."""
    code = ("import torch; from vllm_kbit import ops; "
            "p = ops.named(torch.ops.kbit.linear_plan, 1, 4096, 2048, torch.bfloat16, 9, 132, 1, 'gemv', 4); "
            f"print(repr(p.{field}))")
    name, value = env.split("=")
    run = subprocess.run([sys.executable, "-c", code], env=child_env(**{name: value}), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == repr(want), (env, run.stdout)
    assert getattr(plan(1, 4096, 2048, path="gemv", bits=4), field) != want  # this process: the rules (3; on)


def test_wgmma_ws_takes_k_splits_up_to_a_cluster_of_eight():
    """The warp-specialized kernel's K splits (clusters of up to 8 CTAs per column, the portable cluster size); below
    the rule's 32 k-tiles, or forced at M <= 64, the rule keeps 1."""
    for K, want in ((128, 1), (384, 3), (2048, 8)):
        p = plan(256, 5120, K, path="wgmma_ws", bits=4)
        assert (p.path, p.splits, p.max_splits) == ("wgmma_ws", 1, want), (K, p)
    assert plan(64, 2048, 8192, path="wgmma_ws", bits=4).splits == 1
    _assert_no_empty_split(3, 3, "wgmma_ws", "3 splits of 3 k-tiles")


def test_wgmma_ws_k_split_rule():
    """Above M = 64 on Hopper, a weight of >= 32 k-tiles whose 128-row x 256-row CTA tiles leave SMs idle runs the
    warp-specialized kernel with K split over clusters: the count minimising waves x (k-tiles per split + 10), here
    with every SM reachable (given facts: no cluster capacities); dequantize + cuBLAS keeps small weights past M = 256."""
    def ws(M, N, K, **kw):
        p = plan(M, N, K, **kw)
        return p.path, p.splits

    # 2048 x 4096 (16 CTA tiles at M <= 256, 32 k-tiles): 8 splits, 128 CTAs, cost 14 (7: 15; 1: 42)
    assert [ws(M, 2048, 4096) for M in (65, 128, 256)] == [("wgmma_ws", 8)] * 3
    assert ws(64, 2048, 4096)[0] == "mma" and ws(512, 2048, 4096) == ("dequant_cublas", 1)
    # 32 CTA tiles: 4 splits; 64 tiles (Llama-8B down, 58.7 M elements, M = 512 too): 2; 112 (Llama-8B gate_up): none
    assert ws(200, 4096, 8192) == ("wgmma_ws", 4) and ws(512, 4096, 14336) == ("wgmma_ws", 2)
    assert ws(128, 14336, 4096) == ("wgmma", 1) and ws(256, 14336, 4096) == ("wgmma_ws", 1)
    # 31 k-tiles, fp32 x, no wgmma (sm_80), k = 5 (one producer: the same rule)
    assert ws(128, 2048, 3968) == ("dequant_cublas", 1) and ws(128, 2048, 4096, dtype=torch.float32)[0] == "dequant_cublas"
    assert ws(128, 2048, 4096, sm_major=8)[0] == "dequant_cublas" and ws(128, 2048, 4096, bits=5) == ("wgmma_ws", 8)
    assert ws(128, 2048, 4096, dtype=torch.float16) == ("wgmma_ws", 8)
    # fewer SMs, fewer splits: 16 tiles on 66 SMs, 4 splits (64 CTAs, cost 18; 8: 2 waves x 14)
    assert ws(128, 2048, 4096, num_sms=66) == ("wgmma_ws", 4)


@functools.lru_cache(maxsize=None)
def _max_splits(path, k_tiles):
    """The most K splits the kernel takes over k_tiles k-tiles (a cluster's size, at most k_tiles)."""
    return plan(1, 64, 128 * k_tiles, path=path)[2]


def _assert_no_empty_split(S, k_tiles, path, what):
    assert 1 <= S <= _max_splits(path, k_tiles) <= k_tiles, what
    bounds = [s * k_tiles // S for s in range(S + 1)]  # the kernels' partition
    assert bounds[0] == 0 and bounds[-1] == k_tiles
    assert all(bounds[s + 1] - bounds[s] >= 1 for s in range(S)), what


@pytest.mark.parametrize("sms", [114, 132, 148])
def test_gemv_split_heuristic_never_makes_an_empty_split(sms):
    cases = [(*gemv_tiles(N, K), sms) for K, N in DESIGN_SHAPES]
    rng = random.Random(sms)
    cases += [(rng.randint(1, 5000), rng.randint(1, 400), sms) for _ in range(5000)]
    cases += [(n_tiles, k_tiles, sms) for k_tiles in range(1, 20) for n_tiles in range(1, 300)]  # tightest: small K
    for n_tiles, k_tiles, sms in cases:
        _assert_no_empty_split(torch.ops.kbit._gemv_splits(n_tiles, k_tiles, sms), k_tiles, "gemv", (n_tiles, k_tiles, sms))


# SMs that clusters of 1..8 CTAs reach on an H200 at one CTA per SM (torch.ops.kbit._cluster_sms() there, 2026-12-04).
H200_CLUSTER_SMS = [132, 132, 117, 120, 110, 102, 105, 120]


def test_gemv_splits_count_only_the_sms_clusters_reach():
    """The GLM shared-expert gate_up at decode (160 n-tiles, 16 k-tiles): counting every SM, 4 splits look
    cheaper than 2, but clusters of 4 reach 120 of the 132 SMs, 6 CTAs on the busiest SM; told so, the rule takes 2
    (measured 1.05-1.45x faster, docs/decisions.md). Where clusters reach every SM the facts change nothing."""
    splits = torch.ops.kbit._gemv_splits
    assert splits(160, 16, 132) == 4
    assert splits(160, 16, 132, H200_CLUSTER_SMS) == 2
    assert all(splits(n, kt, 132, [0] * 8) == splits(n, kt, 132) == splits(n, kt, 132, [132] * 8)
               for n in (1, 8, 32, 64, 80, 160, 224, 448, 2374) for kt in (6, 16, 32, 40, 64, 80, 112))
    for n_tiles, k_tiles in [(*gemv_tiles(N, K),) for K, N in DESIGN_SHAPES] + [(8 * 24, 16), (8 * 32, 6)]:
        _assert_no_empty_split(splits(n_tiles, k_tiles, 132, H200_CLUSTER_SMS), k_tiles, "gemv", (n_tiles, k_tiles))
    for bad in ([132] * 7, [132, 132, -1, 120, 110, 102, 105, 120]):
        with pytest.raises(ValueError, match="cluster_sms"):
            splits(160, 16, 132, bad)


@pytest.mark.parametrize("sms", [114, 132, 148])
def test_mma_split_heuristic_never_makes_an_empty_split(sms):
    cases = []
    for K, N in DESIGN_SHAPES:
        n_tiles, k_tiles = gemv_tiles(N, K)
        for M in (1, 5, 8, 16, 32, 64, 128, 256, 1024, 4096):
            p, r, m_blocks = plan(M, N, K, path="mma")[3:6]
            cases += [(-(-n_tiles // rg), m_blocks, k_tiles, sms, c) for rg in (r, 1, 2, 4) for c in range(1, 9)]
    rng = random.Random(sms)
    cases += [(rng.randint(1, 2000), rng.randint(1, 70), rng.randint(1, 400), sms, rng.randint(1, 8)) for _ in range(5000)]
    cases += [(cols, 1, k_tiles, sms, 1 + cols % 4) for k_tiles in range(1, 20) for cols in range(1, 200)]
    for args in cases:
        _assert_no_empty_split(torch.ops.kbit._mma_splits(*args), args[2], "mma", args)


def test_device_plans_and_launch_record_off_gpu():
    """The .device overloads need a CUDA device (tests/gpu/test_plan_cuda.py runs them against launches); the
    launch record is empty where nothing launched (taken once first: on a GPU machine this thread may have launched
    kernels in earlier tests)."""
    torch.ops.kbit._launch_record()
    with pytest.raises(ValueError, match="must be a CUDA device"):
        torch.ops.kbit.linear_plan.device(1, 64, 128, torch.bfloat16, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="must be a CUDA device"):
        torch.ops.kbit.moe_plan.device(1, 1, 8, 4, 128, 64, torch.device("cpu"))
    with pytest.raises(ValueError, match="k=7 is not supported"):
        torch.ops.kbit.linear_plan.device(1, 64, 128, torch.bfloat16, 7, torch.device("cuda"))
    assert torch.ops.kbit._launch_record() == ([], [], [], [], [], [], [], [], [], [])
