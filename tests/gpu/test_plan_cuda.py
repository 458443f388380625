"""The planner's answer is what launches (csrc/plan/plan.h): over a sweep of shapes, bits, dtypes and paths,
kbit::linear_plan.device and kbit::moe_plan.device on this GPU against the configuration the launchers
recorded (kbit::_launch_record: of every launch since the last call the kernel, its tile (p, r), grid (CTA rows,
CTA columns per split), K splits, producer warpgroups, GEMV decode (table blocks) and whether it launched as a
programmatic dependent)."""

import collections
import functools

import pytest
import torch

from vllm_kbit import ops
from vllm_kbit.linear import gemv_tiles
from test_linear_cuda import DESIGN_SHAPES, _random_weight  # a sibling: pytest puts tests/gpu on sys.path
from test_moe_cuda import KERNEL_OF_ROWS, Experts, random_routing

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, requires_cuda]

DEVICE = torch.device("cuda", 0)
MS = (1, 2, 5, 8, 9, 16, 17, 32, 33, 64, 65, 100, 128, 129, 300, 512, 513)


@functools.cache
def launch_type():
    """Launch(kernel, p, r, m_blocks, cols, splits, producers, table_blocks, pdl, rotation): kbit::_launch_record's
    return names (asked when a test runs: CPU-only collections import this module without the extension)."""
    return collections.namedtuple("Launch", [r.name for r in torch.ops.kbit._launch_record.default._schema.returns])


def Launch(*fields):
    return launch_type()(*fields)


def plan_fields():
    return launch_type()._fields[1:]  # every field but the kernel is a plan field of the same name


def launched():
    """The launches since the last call, as Launch tuples."""
    return [Launch(*fields) for fields in zip(*torch.ops.kbit._launch_record())]


def linear_plan(*args):
    return ops.named(torch.ops.kbit.linear_plan.device, *args)


def moe_plan(*args):
    return ops.named(torch.ops.kbit.moe_plan.device, *args)


def forced(x, w, path, row_groups=0, splits=0, producers=0):
    """kbit::_linear_forced (the forced-plan op) on a KbitLinearWeight."""
    path_id = torch.ops.kbit._linear_path_id(path)
    return torch.ops.kbit._linear_forced(x, w.qweight_rt, w.absmax_rt, w.codebook, w.N, w.K, None, path_id, row_groups,
                                         splits, producers)


def as_launched(plan_fields_of):
    """A plan's fields as its kernel records them: a "separate" rotation is the rotation kernel's own launch, the
    GEMM after it reads x R as any input ("none")."""
    return {f: ("none" if f.endswith("rotation") and v == "separate" else v) for f, v in plan_fields_of.items()}


def expected_linear(plan):
    """The one launch of a dense plan: its path's kernel with the plan's fields."""
    fields = as_launched({f: getattr(plan, f) for f in plan_fields()})
    return [Launch(plan.path, *fields.values())]


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
    pdl = torch.ops.kbit._pdl_enabled()
    reach = torch.ops.kbit._cluster_sms()
    launched()
    for K, N, k, w in _weights():
        for M in MS:
            plan = linear_plan(M, N, K, dtype, k, DEVICE)
            x = torch.randn(M, K, dtype=dtype, device=DEVICE)
            torch.ops.kbit.linear(x, w.qweight_rt, w.absmax_rt, w.codebook, N, K, None)
            got = launched()
            assert got == expected_linear(plan), (M, N, K, k, dtype, plan)
            # PDL: the GEMV and MMA kernels as the GPU allows, the wgmma kernels and cuBLAS never.
            assert plan.pdl == (pdl and plan.path in ("gemv", "mma")), plan
            # The plan on given facts with the same k agrees but for the MMA, GEMV and wgmma_ws split counts (it cannot
            # see cluster capacities); the GEMV's is the rule's on the SMs this GPU's clusters reach.
            given = ops.named(torch.ops.kbit.linear_plan, M, N, K, dtype, props.major, props.multi_processor_count, 1,
                              "auto", k)
            split_paths = ("mma", "gemv", "wgmma_ws")
            assert (given._replace(splits=plan.splits) if plan.path in split_paths else given) == plan, (given, plan)
            if plan.path == "gemv":
                sms = props.multi_processor_count
                assert plan.splits == torch.ops.kbit._gemv_splits(*gemv_tiles(N, K), sms, reach), (M, N, K, k, plan)
            if plan.path == "wgmma_ws":
                assert plan.producers == (1 if k == 5 else 2), (M, N, K, k, plan)
            if plan.path == "gemv":
                assert plan.table_blocks == {2: 0, 3: 4, 4: 3 if M == 1 else 4, 5: 0}[k], (M, k, plan)


def test_gemv_splits_count_the_sms_this_gpus_clusters_reach():
    """The device facts behind the GEMV's split rule: clusters of 1..8 CTAs reach between 1 and all of the SMs, all
    of them at 1 (Hopper places a cluster in one GPC); the device plan's split count is the rule's on those facts,
    and it launches. The GLM shared-expert gate_up (2048 -> 10240) at decode takes 2 splits on an H100 / H200
    (measured 1.05-1.45x faster than the 4 that counting every SM gave; docs/decisions.md)."""
    torch.cuda.set_device(DEVICE)
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    reach = torch.ops.kbit._cluster_sms()
    assert len(reach) == 8 and reach[0] == sms and all(1 <= r <= sms for r in reach), reach
    gen = torch.Generator().manual_seed(11)
    for K, N in DESIGN_SHAPES:
        plan = linear_plan(1, N, K, torch.bfloat16, 4, DEVICE)
        assert plan.splits == torch.ops.kbit._gemv_splits(*gemv_tiles(N, K), sms, reach), (K, N, plan)
    if sms == 132:
        assert linear_plan(1, 10240, 2048, torch.bfloat16, 3, DEVICE).splits == 2
    w = _random_weight(10240, 2048, 3, gen)[0]
    x = torch.randn(1, 2048, dtype=torch.bfloat16, device=DEVICE)
    launched()
    out = torch.ops.kbit.linear(x, w.qweight_rt, w.absmax_rt, w.codebook, 10240, 2048, None)
    assert launched() == expected_linear(linear_plan(1, 10240, 2048, torch.bfloat16, 3, DEVICE))
    ref = forced(x, w, "mma")
    assert torch.isfinite(out).all() and ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


def test_dense_mma_takes_one_full_wave_of_lone_ctas_past_24_rows():
    """The attention qkv weight (2048 -> 4096: 64 CTA columns) at M = 25..64 on a 132-SM GPU: 2 splits, one CTA on
    each of 128 SMs (measured 1.16-1.45x faster than the 4 the cost model gives, whose CTAs share SMs)."""
    torch.cuda.set_device(DEVICE)
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    if sms != 132:
        pytest.skip("the counts below are for 132 SMs")
    for k in (2, 3, 4, 5):
        for M in (25, 32, 48, 64):
            plan = linear_plan(M, 4096, 2048, torch.bfloat16, k, DEVICE)
            assert (plan.path, plan.splits, plan.cols * plan.m_blocks * plan.splits) == ("mma", 2, 128), (M, k, plan)


def test_large_weights_take_the_warp_specialized_wgmma_from_33_rows_where_it_has_two_producers():
    """M = 33..64 on a >= 2^25-element weight whose 2-tile CTAs fill 3/4 of the SMs and whose 4-tile ones are too few for
    the narrow wgmma (224 n-tiles: 112 and 56 CTAs): wgmma_ws at k = 2..4 (launched, and correct), the MMA kernel at
    k = 5 (one producer) and at M = 32; on 128 n-tiles (64 CTAs) the MMA kernel with its K splits."""
    torch.cuda.set_device(DEVICE)
    gen = torch.Generator().manual_seed(7)
    N, K = 14336, 4096
    assert {linear_plan(M, 8192, 8192, torch.bfloat16, 4, DEVICE).path for M in (33, 64)} == {"mma"}
    for k in (2, 3, 4, 5):
        w = _random_weight(N, K, k, gen)[0]
        assert linear_plan(32, N, K, torch.bfloat16, k, DEVICE).path == "mma"
        for M in (33, 47, 64):
            plan = linear_plan(M, N, K, torch.bfloat16, k, DEVICE)
            assert plan.path == ("mma" if k == 5 else "wgmma_ws"), (M, k, plan)
            x = torch.randn(M, K, dtype=torch.bfloat16, device=DEVICE)
            launched()
            out = torch.ops.kbit.linear(x, w.qweight_rt, w.absmax_rt, w.codebook, N, K, None)
            assert launched() == expected_linear(plan), (M, k, plan)
            ref = forced(x, w, "mma")
            assert torch.isfinite(out).all() and ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


def test_forced_linear_launches_its_plan():
    """kbit::_linear_forced launches what linear_plan.device plans with the same forced fields."""
    torch.cuda.set_device(DEVICE)
    launched()
    for K, N, k, w in _weights():
        if k != 4 and N * K > 2048 * 4096:
            continue
        for M in (1, 3, 8, 9, 20, 40, 64, 200):
            x = torch.randn(M, K, dtype=torch.bfloat16, device=DEVICE)
            p = linear_plan(M, N, K, torch.bfloat16, k, DEVICE, "mma").p
            k_tiles = -(-K // 128)
            for row_groups in (0, 1, 2 if p == 8 else 4):
                for splits in (0, 1, 2, 8):
                    if splits > k_tiles:
                        continue
                    plan = linear_plan(M, N, K, torch.bfloat16, k, DEVICE, "mma", row_groups, splits)
                    forced(x, w, "mma", row_groups, splits)
                    assert launched() == expected_linear(plan), (M, N, K, k, row_groups, splits, plan)
            if M <= 4:
                for splits in (0, 1, 3):
                    if splits > k_tiles:
                        continue
                    plan = linear_plan(M, N, K, torch.bfloat16, k, DEVICE, "gemv", 0, splits)
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
            plan = linear_plan(M, 10240, 2048, torch.bfloat16, 4, DEVICE, path)
            forced(x, w, path)
            assert launched() == expected_linear(plan), (M, path, plan)
            # a CTA per 128 (256) rows and per 2 n-tiles of the 160 (the narrow wgmma at M <= 64: per 4)
            if path in ("wgmma", "wgmma_ws"):
                tiles = 4 if path == "wgmma" and M <= 64 else 2
                assert (plan.m_blocks, plan.cols) == (-(-M // (128 if path == "wgmma" else 256)), 160 // tiles), plan
        plan = linear_plan(M, 10240, 2048, torch.bfloat16, 4, DEVICE, "wgmma_ws", 0, 0, 1)
        forced(x, w, "wgmma_ws", producers=1)
        assert plan.producers == 1 and launched() == expected_linear(plan), (M, plan)
    with pytest.raises(ValueError, match="producers apply to the wgmma_ws path only"):
        forced(x, w, "wgmma", producers=1)
    with pytest.raises(ValueError, match="producers=3 is not built for k=4"):
        forced(x, w, "wgmma_ws", producers=3)


def proj_launch(plan, proj):
    """The launch of one projection of a MoE plan: the plan's kernel with the projection's fields."""
    return Launch(plan.kernel, *as_launched({f: getattr(plan, f"{proj}_{f}") for f in plan_fields()}).values())


def expected_moe(plan):
    if plan.path == "grouped_mm":  # dequantize + cuBLAS: one record, no grid of ours
        return [Launch("grouped_mm", *(0,) * (len(plan_fields()) - 2), False, "none")]
    return [proj_launch(plan, proj) for proj in ("gate_up", "down")]


GEMV_MMA = ("moe_gemv_direct", "moe_gemv", "mma_grouped")  # the kernels that launch as programmatic dependents

# (E, top_k, H, I): tiny, Qwen3-30B-A3B-like, GLM-4.7-Flash-like and a 4-expert rank.
MOE_SHAPES = [(8, 2, 128, 64), (128, 8, 2048, 768), (64, 4, 2048, 1536), (4, 2, 512, 256)]


@pytest.mark.parametrize("E,top_k,H,I", MOE_SHAPES)
def test_fused_moe_launches_its_plan(E, top_k, H, I):
    torch.cuda.set_device(DEVICE)
    gen = torch.Generator().manual_seed(E + H)
    sm_major = torch.cuda.get_device_capability(DEVICE)[0]
    pdl = torch.ops.kbit._pdl_enabled()
    for k in (2, 3, 4, 5) if H * I <= 512 * 256 else (2, 4, 5):
        ex = Experts(E, H, I, k, gen)
        for T in (1, 2, 3, 8, 16, 33, 64, 256, 1024, 2048):
            x = torch.randn(T, H, dtype=torch.bfloat16, generator=gen).cuda() / 4
            ids, weights = random_routing(T, E, top_k, gen, "random")
            for path in ("auto", "gemv_direct", "gemv", "grouped_mma", "grouped_mm", "grouped_wgmma"):
                plan = moe_plan(T, top_k, E, k, H, I, DEVICE, path)
                launched()
                path_id = torch.ops.kbit._moe_path_id(path)
                torch.ops.kbit._fused_moe_cuda(x, ids, weights, *ex.args(), I, None, False, path_id)
                assert launched() == expected_moe(plan), (T, top_k, E, H, I, k, path, plan)
                assert plan.pdl == pdl and plan.gate_up_pdl == (pdl and plan.kernel in GEMV_MMA), plan
                # The plan without sizes names the same path, kernel, routing workspace and PDL.
                host = ops.named(torch.ops.kbit.moe_plan, T, top_k, E, k, path, sm_major)
                assert tuple(host) == tuple(getattr(plan, f) for f in host._fields), (host, plan)


# Forced fields per path: (path, gate_up_splits, down_splits, gate_up_row_groups, down_row_groups, producers).
# "W": the grouped MMA's wide row groups at the plan's p (4; 2 at p = 8).
MOE_FORCED = [("gemv_direct", 1, 3, 0, 0, 0), ("gemv", 2, 1, 0, 0, 0), ("grouped_mma", 2, 1, 1, "W", 0),
              ("grouped_mma", 0, 3, "W", 0, 0), ("grouped_wgmma", 0, 0, 0, 0, 1), ("grouped_wgmma", 0, 0, 0, 0, 2)]


def test_forced_fused_moe_launches_its_plan():
    """kbit::_fused_moe_cuda with forced splits / row groups / producers launches what moe_plan.device plans
    with the same fields, and its output stays the auto plan's within rounding; a field the path does not
    have, or a value no kernel is built for, is refused with a one-line ValueError."""
    torch.cuda.set_device(DEVICE)
    gen = torch.Generator().manual_seed(3)
    E, top_k, H, I = 16, 4, 512, 512  # 4 k-tiles per projection
    for k in (2, 4, 5):
        ex = Experts(E, H, I, k, gen)
        for T in (3, 40, 400):
            x = torch.randn(T, H, dtype=torch.bfloat16, generator=gen).cuda() / 4
            ids, weights = random_routing(T, E, top_k, gen, "random")
            ref = torch.ops.kbit._fused_moe_cuda(x, ids, weights, *ex.args(), I, None, False, 0).float()
            for path, *fields in MOE_FORCED:
                wide = 2 if moe_plan(T, top_k, E, k, H, I, DEVICE, path).gate_up_p == 8 else 4
                fields = [wide if f == "W" else f for f in fields]
                if path == "grouped_wgmma" and (torch.cuda.get_device_capability(DEVICE)[0] != 9 or
                                                (k == 5 and fields[4] == 2)):
                    continue
                plan = moe_plan(T, top_k, E, k, H, I, DEVICE, path, *fields)
                launched()
                out = torch.ops.kbit._fused_moe_cuda(x, ids, weights, *ex.args(), I, None, False,
                                                     torch.ops.kbit._moe_path_id(path), *fields)
                assert launched() == expected_moe(plan), (T, k, path, fields, plan)
                for proj, s, rg in (("gate_up", fields[0], fields[2]), ("down", fields[1], fields[3])):
                    launch = proj_launch(plan, proj)
                    assert (s == 0 or launch.splits == s) and (rg == 0 or launch.r == rg), (path, fields, plan)
                assert fields[4] == 0 or plan.gate_up_producers == plan.down_producers == fields[4], (path, fields, plan)
                err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
                assert err < 0.05, (T, k, path, fields, err)
    x, ids, weights = x[:8], ids[:8], weights[:8]
    direct = torch.ops.kbit._moe_path_id("gemv_direct")
    for fields, match in (((0, 0, 1, 0, 0), "row_groups apply to the grouped_mma path, not gemv_direct"),
                          ((0, 0, 0, 0, 2), "producers apply to the grouped_wgmma path, not gemv_direct"),
                          ((9, 0, 0, 0, 0), "splits=9 outside 0 \\(the rule\\)")):
        with pytest.raises(ValueError, match=match):
            torch.ops.kbit._fused_moe_cuda(x, ids, weights, *ex.args(), I, None, False, direct, *fields)
    with pytest.raises(ValueError, match="row_groups=3 is not a built grouped MMA shape"):
        torch.ops.kbit._fused_moe_cuda(x, ids, weights, *ex.args(), I, None, False,
                                       torch.ops.kbit._moe_path_id("grouped_mma"), 0, 0, 3, 0, 0)


@pytest.mark.parametrize("path", ["gemv", "grouped_mma", "grouped_wgmma"])
def test_grouped_linear_launches_the_plans_projection(path):
    """kbit::_moe_grouped_linear takes a plan's kernel and chunk height and plans nothing else itself: routed with
    the plan's chunk list, its gate_up launch is the plan's gate_up projection (moe_plan.device), at every k."""
    if path == "grouped_wgmma" and torch.cuda.get_device_capability(DEVICE)[0] != 9:
        pytest.skip("the grouped wgmma is built for Hopper")
    torch.cuda.set_device(DEVICE)
    gen = torch.Generator().manual_seed(4)
    E, top_k, H, I = 16, 4, 512, 256
    for k in (2, 3, 4, 5):
        ex = Experts(E, H, I, k, gen)
        for T in (2, 40, 300, 1500):
            plan = moe_plan(T, top_k, E, k, H, I, DEVICE, path)
            ids, _ = random_routing(T, E, top_k, gen, "random")
            _, _, slot_of, chunks, num_chunks = torch.ops.kbit._moe_route(ids, None, E, plan.chunk_rows,
                                                                          plan.max_chunks)
            assert KERNEL_OF_ROWS[plan.chunk_rows] == plan.kernel, plan
            A = torch.randn(T * top_k, H, generator=gen).to(torch.bfloat16).cuda()
            launched()
            torch.ops.kbit._moe_grouped_linear(A, chunks, num_chunks, ex.q13, ex.a13, ex.codebook, 2 * I, H,
                                               torch.ops.kbit._moe_kernel_id(plan.kernel), plan.chunk_rows)
            assert launched() == [proj_launch(plan, "gate_up")], (T, k, plan)


# ----------------------------------------------------------------------------- input rotation


def expected_rotated(plan_launches, rotations):
    """Kernel names of a rotated call: a "rotate" launch before each projection the plan rotates separately."""
    out = []
    for launch, rotation in zip(plan_launches, rotations):
        out += (["rotate"] if rotation == "separate" else []) + [launch.kernel]
    return out


def rotation_of(gemv, block):
    """The planner's rule (plan.cpp: input_rotation) as these tests expect it: the GEMV kernels fuse blocks 4..1024."""
    return "fused" if gemv and 4 <= block <= 1024 else "separate"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotated_linear_launches_its_plan(dtype):
    """A rotated layer's plan: the GEMV fuses the rotation into its activation load (rotation "fused", one launch
    recorded "fused"); every other path has rotation "separate": the rotation kernel (PDL as the GPU allows), then
    the plan's GEMM with the same fields as unrotated; the plan on given facts says the same."""
    torch.cuda.set_device(DEVICE)
    props = torch.cuda.get_device_properties(DEVICE)
    pdl = torch.ops.kbit._pdl_enabled()
    launched()
    for K, N, k, w in _weights():
        block = min(K & -K, 1024)
        signs = torch.ones(K, device=DEVICE)
        for M in (1, 5, 64, 300):
            plan = linear_plan(M, N, K, dtype, k, DEVICE, "auto", 0, 0, 0, block)
            want = rotation_of(plan.path == "gemv", block)
            assert plan.rotation == want and plan._replace(rotation="none") == linear_plan(M, N, K, dtype, k, DEVICE)
            given = ops.named(torch.ops.kbit.linear_plan, M, N, K, dtype, props.major, props.multi_processor_count, 1,
                              "auto", k, block)
            assert given.rotation == want, given
            x = torch.randn(M, K, dtype=dtype, device=DEVICE)
            torch.ops.kbit.linear(x, w.qweight_rt, w.absmax_rt, w.codebook, N, K, None, rot_signs=signs,
                                  rot_block=block)
            got = launched()
            if want == "fused":
                assert got == expected_linear(plan) and got[0].rotation == "fused", (M, N, K, k, got)
            else:
                assert [g.kernel for g in got] == ["rotate", plan.path] and got[0].pdl == pdl, (M, N, K, k, got)
                assert got[0].rotation == "separate" and got[1:] == expected_linear(plan), (M, N, K, k, plan)


@pytest.mark.parametrize("E,top_k,H,I", MOE_SHAPES)
def test_rotated_fused_moe_launches_its_plan(E, top_k, H, I):
    """Rotated experts: the hidden states are rotated apart on every path (gate_up_rotation "separate", one rotation
    launch); the GEMV paths fuse the down input's rotation (down_rotation "fused"), the other paths rotate it separately (a rotation launch before each projection; grouped mm: both before
    its one record); a down block no GEMV fuses (2) keeps auto off the direct GEMV and a forced GEMV path refused."""
    torch.cuda.set_device(DEVICE)
    gen = torch.Generator().manual_seed(E + H + 1)
    sm_major = torch.cuda.get_device_capability(DEVICE)[0]
    b13, b2 = min(H & -H, 1024), min(I & -I, 1024)
    r13 = dict(w13_rot_signs=torch.ones(H, device=DEVICE), w13_rot_block=b13)
    r2 = dict(w2_rot_signs=torch.ones(I, device=DEVICE), w2_rot_block=b2)
    r2_pairs = dict(w2_rot_signs=torch.ones(I, device=DEVICE), w2_rot_block=2)
    for k in (2, 4):
        ex = Experts(E, H, I, k, gen)
        for T in (1, 3, 16, 64, 1024):
            x = torch.randn(T, H, dtype=torch.bfloat16, generator=gen).cuda() / 4
            ids, weights = random_routing(T, E, top_k, gen, "random")
            for path in ("auto", "grouped_mma", "grouped_mm", "grouped_wgmma", "gemv_direct", "gemv"):
                if path == "grouped_wgmma" and sm_major != 9:
                    continue
                for rot in (r13, {**r13, **r2}, {**r13, **r2_pairs}):
                    down = rot.get("w2_rot_block", 0)
                    args = (T, top_k, E, k, H, I, DEVICE, path, 0, 0, 0, 0, 0, None, b13, down)
                    if down == 2 and path in ("gemv_direct", "gemv"):
                        with pytest.raises(ValueError, match="cannot rotate the down projection's input"):
                            moe_plan(*args)
                        continue
                    plan = moe_plan(*args)
                    gemv = plan.path in ("gemv_direct", "gemv")
                    assert plan.gate_up_rotation == "separate", plan
                    assert plan.down_rotation == (rotation_of(gemv, down) if down else "none"), plan
                    assert not (down == 2 and plan.path == "gemv_direct"), plan
                    host = ops.named(torch.ops.kbit.moe_plan, T, top_k, E, k, path, sm_major, None, b13, down)
                    assert tuple(host) == tuple(getattr(plan, f) for f in host._fields), (host, plan)
                    launched()
                    torch.ops.kbit._fused_moe_cuda(x, ids, weights, *ex.args(), I, None, False,
                                                   torch.ops.kbit._moe_path_id(path), **rot)
                    got = launched()
                    want = expected_moe(plan)
                    if plan.path == "grouped_mm":
                        names = ["rotate"] * (1 + bool(down)) + ["grouped_mm"]
                    else:
                        names = expected_rotated(want, (plan.gate_up_rotation, plan.down_rotation))
                    assert [g.kernel for g in got] == names, (T, k, path, down, got)
                    assert [g for g in got if g.kernel != "rotate"] == want, (T, k, path, down, plan)
