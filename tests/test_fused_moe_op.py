"""torch.ops.kbit.fused_moe (reference) against a per-token loop over dequantized experts."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import vllm_kbit
from vllm_kbit import ops
from vllm_kbit.moe import kbit_fused_moe, route_reference, stack_runtime

from child_env import child_env

requires_extension = pytest.mark.skipif(not ops.HAS_EXTENSION, reason="the C++ extension is not built or not loadable")

E, H, I, T, TOP_K = 6, 64, 96, 7, 2


def _experts(k, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = [vllm_kbit.quantize((torch.randn(2 * I, H, generator=g) * 0.1).to(dtype), k) for _ in range(E)]
    w2 = [vllm_kbit.quantize((torch.randn(H, I, generator=g) * 0.1).to(dtype), k) for _ in range(E)]
    return w13, w2


def _naive(x, ids, weights, w13, w2, expert_map, on_input):
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) if expert_map is None else int(expert_map[ids[t, j]])
            if e < 0:
                continue
            xt = x[t : t + 1]
            if on_input:
                xt = (xt.float() * weights[t, j]).to(x.dtype)
            gu = torch.nn.functional.linear(xt, w13[e].dequantize(x.dtype))
            h = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
            y = torch.nn.functional.linear(h, w2[e].dequantize(x.dtype)).float()
            out[t] += (y if on_input else y * weights[t, j])[0]
    return out.to(x.dtype)


def _pack(w13, w2):
    q13, a13 = stack_runtime([(w.qweight, w.absmax) for w in w13])
    q2, a2 = stack_runtime([(w.qweight, w.absmax) for w in w2])
    return q13, a13, q2, a2


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("on_input", [False, True])
def test_fused_moe_matches_per_token_loop(k, on_input):
    w13, w2 = _experts(k)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    top_k = 1 if on_input else TOP_K
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(T)]).to(torch.int32)
    weights = torch.softmax(torch.randn(T, top_k, generator=g), -1)
    got = kbit_fused_moe(x, ids, weights, *_pack(w13, w2), w13[0].codebook, I, None, on_input)
    want = _naive(x, ids, weights, w13, w2, None, on_input)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_fused_moe_expert_map_skips_other_ranks():
    """Expert parallel: this rank holds global experts 3..5 as local 0..2; picks of 0..2 contribute nothing."""
    w13, w2 = _experts(4)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(T)]).to(torch.int32)
    weights = torch.softmax(torch.randn(T, TOP_K, generator=g), -1)
    expert_map = torch.tensor([-1, -1, -1, 0, 1, 2], dtype=torch.int32)
    local13, local2 = w13[3:], w2[3:]
    got = kbit_fused_moe(x, ids, weights, *_pack(local13, local2), w13[0].codebook, I, expert_map, False)
    want = _naive(x, ids, weights, local13, local2, expert_map, False)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert not torch.equal(got, kbit_fused_moe(x, ids, weights, *_pack(w13, w2), w13[0].codebook, I, None, False))


def test_fused_moe_opcheck_and_fake():
    w13, w2 = _experts(3)
    x = torch.randn(T, H).to(torch.bfloat16)
    ids = torch.randint(0, E, (T, TOP_K), dtype=torch.int32)
    weights = torch.rand(T, TOP_K)
    args = (x, ids, weights, *_pack(w13, w2), w13[0].codebook, I, None, False)
    torch.library.opcheck(torch.ops.kbit.fused_moe.default, args)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out = torch.ops.kbit.fused_moe(*fake_args)
    assert out.shape == (T, H) and out.dtype == torch.bfloat16


def test_route_reference_groups_slots_by_local_expert():
    """Slots sorted by local expert (stable), -1 for experts not on this rank or ids past the map."""
    ids = torch.tensor([[1, 0], [1, 3], [2, 5]], dtype=torch.int32)
    expert_map = torch.tensor([0, 1, -1, 2], dtype=torch.int32)
    offsets, pos, local = route_reference(ids, expert_map, 3)
    assert offsets.tolist() == [0, 1, 3, 4]
    assert local.tolist() == [1, 0, 1, 2, -1, -1]
    assert pos.tolist() == [1, 0, 2, 3, -1, -1]
    offsets, pos, local = route_reference(ids, None, 2)  # no map: ids >= E are not local
    assert offsets.tolist() == [0, 1, 3] and pos.tolist() == [1, 0, 2, -1, -1, -1]


@requires_extension
def test_max_chunks_bounds_every_routing():
    """The routing's chunk list (kbit::_moe_max_chunks rows) covers the chunks any split of the slots over the experts needs."""
    g = torch.Generator().manual_seed(0)
    gemv_rows = ops.named(torch.ops.kbit.moe_plan, 2, 1, 8, 4, "gemv").chunk_rows
    assert ops.named(torch.ops.kbit.moe_plan, 1, 1, 8, 4, "gemv").chunk_rows == 1 and gemv_rows > 1  # one row: one token
    for _ in range(3000):
        E = int(torch.randint(1, 24, (1,), generator=g))
        S = int(torch.randint(0, 100, (1,), generator=g))
        rows = int(torch.tensor([1, gemv_rows, 8, 16, 32, 64])[torch.randint(0, 6, (1,), generator=g)])
        picks = torch.randint(0, E + 1, (S,), generator=g)  # E: on another rank
        if torch.rand(1, generator=g) < 0.2:
            picks[:] = 0
        counts = torch.bincount(picks[picks < E], minlength=E)
        need = int(((counts + rows - 1) // rows).sum())
        assert need <= torch.ops.kbit._moe_max_chunks(S, E, rows) <= max(S, 0)


@requires_extension
def test_expected_chunks_matches_random_routings():
    """kbit::_moe_expected_chunks (what the grouped MMA plans its K splits for) is the mean chunk count of
    random top-k routings within 6%, and never above the workspace bound."""
    g = torch.Generator().manual_seed(1)
    for E, top_k, T, rows in ((128, 8, 4, 8), (128, 8, 16, 8), (128, 8, 64, 8), (128, 8, 128, 16), (128, 8, 256, 16),
                              (64, 6, 512, 16), (128, 8, 2048, 64), (128, 8, 8192, 64), (16, 2, 3, 8)):
        S = T * top_k
        need = []
        for _ in range(40):
            ids = torch.topk(torch.rand(T, E, generator=g), top_k, dim=1).indices.flatten()
            counts = torch.bincount(ids, minlength=E)
            need.append(int(((counts + rows - 1) // rows).sum()))
        mean = sum(need) / len(need)
        got = torch.ops.kbit._moe_expected_chunks(S, E, rows)
        assert abs(got - mean) <= 0.06 * mean + 1, (E, top_k, T, rows, got, mean)
        assert 1 <= got <= torch.ops.kbit._moe_max_chunks(S, E, rows)
    assert torch.ops.kbit._moe_expected_chunks(0, 128, 8) == 0


@requires_extension
def test_grouped_split_cost_keeps_full_grids_unsplit():
    """Grouped launches weigh a further K split 16x the dense kernel's: a routed projection that fills the GPU
    (Qwen3-30B-A3B's down projection at 64 tokens: 8 CTA columns x 128 expected of at most 176 chunks, 6
    k-tiles, 3 CTAs per SM) stays unsplit, where the dense kernel's former weighting over the worst case split it 3 ways; one
    that leaves most SMs idle (4 tokens, 30 chunks) still splits."""
    cost = torch.ops.kbit._mma_split_cost
    assert cost(True) > cost(False) >= 1
    expected = torch.ops.kbit._moe_expected_chunks(512, 128, 8)
    assert 120 <= expected <= 135 and torch.ops.kbit._moe_max_chunks(512, 128, 8) == 176
    assert torch.ops.kbit._mma_splits(8, 176, 6, 132, 3, 1) == 3  # the weighting grouped launches had
    assert torch.ops.kbit._mma_splits(8, expected, 6, 132, 3, cost(True)) == 1
    assert torch.ops.kbit._mma_splits(8, 176, 6, 132, 3, cost(True)) == 1
    assert torch.ops.kbit._mma_splits(6, 30, 16, 132, 3, cost(True)) > 1


@requires_extension
def test_grouped_row_groups_narrow_only_for_light_last_waves():
    """The grouped MMA's row groups per warp (mma_grouped_r): wide (4; 2 at p = 8) unless an expert has under 4
    n-tiles, or at k = 4 with 8-row chunks (p = 1) on long experts (>= 16 k-tiles) the wide grid's expected CTAs
    run past one wave and leave the last under half full (3 wide CTAs per SM). Qwen3-30B-A3B's gate_up (24
    n-tiles, 16 k-tiles) at 16 tokens: ~81 chunks x 6 wide columns = 486 CTAs for 396 slots, narrow; at 4 tokens
    one wave and at 64 a nearly full second one, wide; never at k = 2, 3, 5, on the 6-k-tile down projection or
    at p = 2. GLM-4.5-Air's gate_up (44 n-tiles, 32 k-tiles) at 16 tokens: 891 CTAs, 2.25 waves, narrow."""
    r = torch.ops.kbit._mma_grouped_r

    def chunks(tokens):  # 8-row chunks of top-8 routing over 128 experts
        return torch.ops.kbit._moe_expected_chunks(8 * tokens, 128, 8)

    assert r(1, 24, 16, 4, chunks(16), 132) == 1
    assert r(1, 24, 16, 4, chunks(4), 132) == 4 and r(1, 24, 16, 4, chunks(64), 132) == 4
    assert all(r(1, 24, 16, bits, chunks(16), 132) == 4 for bits in (2, 3, 5))
    assert r(1, 32, 6, 4, chunks(16), 132) == 4  # down: K = 768
    assert r(2, 24, 16, 4, chunks(16), 132) == 4
    assert r(1, 44, 32, 4, chunks(16), 132) == 1
    assert r(8, 24, 16, 4, chunks(16), 132) == 2 and r(1, 2, 16, 4, chunks(16), 132) == 1


@requires_extension
def test_moe_plan_paths_and_workspace():
    """kbit::moe_plan: few slots over many experts take the direct GEMV, up to 256 slots per expert the grouped
    MMA (chunk height from the average rows of a busy expert and k), beyond that grouped mm (no chunks), and
    on Hopper from 32 slots per expert the grouped wgmma (k = 2: 48; 128-row chunks up to 128 per expert at
    k = 3..5 and 96 at k = 2, 256 beyond);
    the workspace always bounds the chunks; forced paths and bad names."""
    def plan(tokens, top_k, experts, *path, bits=4):  # (path, chunk_rows, max_chunks)
        p = ops.named(torch.ops.kbit.moe_plan, tokens, top_k, experts, bits, *path)
        return p.path, p.chunk_rows, p.max_chunks

    # Few slots: the direct GEMV (no routing, one CTA row per slot); forced, the routed GEMV's chunks.
    assert plan(1, 8, 128) == ("gemv_direct", 1, 8) and plan(1, 8, 128, "gemv") == ("gemv", 1, 8)
    assert plan(2, 8, 128) == ("gemv_direct", 1, 16) and plan(8, 2, 128) == ("gemv_direct", 1, 16)
    assert plan(5, 8, 128, "gemv_direct") == ("gemv_direct", 1, 40)  # forced: one CTA row per slot at any T
    path, rows, chunks = plan(2, 8, 128, "gemv")
    assert rows > 1 and chunks == torch.ops.kbit._moe_max_chunks(16, 128, rows)
    assert plan(3, 8, 128)[0] == "grouped_mma"  # 24 slots: past the GEMV's
    assert plan(1, 8, 8)[0] == "grouped_mma"  # 8 slots on 8 experts: most experts would hold a row
    # Chunk height by average rows per busy expert (8T / 128 here) and k: 8 up to 4 rows (k = 2: up to 8),
    # 16 up to 12, 24 up to 32 (k = 2, 3: up to 63), 64 beyond; k = 5: 16 up to 8, 32 up to 32, 64 beyond.
    heights = {2: ((16, 8), (64, 8), (128, 8), (129, 16), (192, 16), (193, 24), (512, 24), (1000, 24)),
               3: ((64, 8), (65, 16), (192, 16), (193, 24), (1000, 24)),
               4: ((16, 8), (64, 8), (65, 16), (128, 16), (192, 16), (193, 24), (512, 24), (513, 64), (1000, 64)),
               5: ((64, 8), (65, 16), (128, 16), (129, 32), (512, 32), (513, 64))}
    for bits, cases in heights.items():
        for T, rows in cases:
            path, got_rows, chunks = plan(T, 8, 128, bits=bits)
            assert (path, got_rows) == ("grouped_mma", rows), (bits, T)
            assert chunks == torch.ops.kbit._moe_max_chunks(8 * T, 128, rows) <= 8 * T
    assert plan(256 * 128 // 8, 8, 128)[0] == "grouped_mma" and plan(256 * 128 // 8 + 1, 8, 128)[:3:2] == ("grouped_mm", 0)
    assert plan(1, 8, 128, "grouped_mm")[0] == "grouped_mm" and plan(5000, 8, 128, "gemv")[0] == "gemv"
    # On Hopper (sm_major 9) from 32 slots per expert the grouped wgmma (k = 2: 48); elsewhere never. Its
    # register-operand kernel (128-row chunks) up to 128 slots per expert (k = 2: 96), the warp-specialized
    # one (256) past it.
    def hopper(tokens, *path, bits=4):
        p = ops.named(torch.ops.kbit.moe_plan, tokens, 8, 128, bits, *(path or ("auto",)), 9)
        return p.path, p.chunk_rows, p.max_chunks

    assert hopper(511)[0] == "grouped_mma" and hopper(512) == ("grouped_wgmma", 128, torch.ops.kbit._moe_max_chunks(4096, 128, 128))
    assert hopper(2048)[:2] == ("grouped_wgmma", 128) and hopper(2049) == ("grouped_wgmma", 256, torch.ops.kbit._moe_max_chunks(16392, 128, 256))
    assert hopper(1536, bits=2)[:2] == ("grouped_wgmma", 128) and hopper(1537, bits=2)[:2] == ("grouped_wgmma", 256)
    assert hopper(2048, bits=5)[:2] == ("grouped_wgmma", 128) and hopper(2049, bits=5)[:2] == ("grouped_wgmma", 256)
    assert hopper(511, bits=5)[0] == "grouped_mma" and hopper(512, bits=5)[:2] == ("grouped_wgmma", 128)
    assert hopper(512, bits=3)[0] == "grouped_wgmma"
    assert hopper(767, bits=2)[0] == "grouped_mma" and hopper(768, bits=2)[0] == "grouped_wgmma"
    assert hopper(5000)[:2] == ("grouped_wgmma", 256) and plan(5000, 8, 128)[0] == "grouped_mm"
    assert hopper(16)[0] == plan(16, 8, 128)[0] == "grouped_mma" and hopper(1)[0] == "gemv_direct"
    assert plan(3, 8, 128, "grouped_wgmma")[:2] == ("grouped_wgmma", 128)  # forced: the plan names it anywhere
    assert plan(5000, 8, 128, "grouped_wgmma")[:2] == ("grouped_wgmma", 256)
    assert plan(0, 8, 128)[2] == 0
    with pytest.raises(ValueError, match="is not one of auto, gemv, grouped_mm, grouped_mma, gemv_direct"):
        plan(1, 1, 1, "fastest")
    with pytest.raises(ValueError, match="local experts"):
        plan(1, 1, 5000)
    with pytest.raises(ValueError, match="k=6 is not supported; supported: 2..5"):
        plan(1, 1, 8, bits=6)
    names = ("auto", "gemv", "grouped_mm", "grouped_mma", "gemv_direct", "grouped_wgmma")
    assert [torch.ops.kbit._moe_path_id(name) for name in names] == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="is not one of auto, gemv, grouped_mm, grouped_mma, gemv_direct, grouped_wgmma$"):
        torch.ops.kbit._moe_path_id("fastest")
    with pytest.raises(ValueError, match="is not one of auto"):  # the reference is the dtype's, never forced
        torch.ops.kbit._moe_path_id("reference")


@requires_extension
def test_moe_plan_kernel_pdl_and_reference():
    """The plan names each path's kernel (what kbit::_launch_record records), whether its routing kernels launch
    as programmatic dependents (sm_90 on), and sends fp32 activations to the reference whatever is forced."""
    def plan(tokens, path="auto", sm_major=9, dtype=None, bits=4):
        return ops.named(torch.ops.kbit.moe_plan, tokens, 8, 128, bits, path, sm_major, dtype)

    kernels = {"gemv_direct": "moe_gemv_direct", "gemv": "moe_gemv", "grouped_mma": "mma_grouped",
               "grouped_mm": "grouped_mm"}
    for path, kernel in kernels.items():
        assert plan(300, path).kernel == kernel, path
    assert plan(512).kernel == "wgmma_rs_grouped" and plan(4096).kernel == "wgmma_ws_grouped"
    assert plan(5000, sm_major=8).kernel == "grouped_mm" and plan(1).kernel == "moe_gemv_direct"
    assert plan(300).pdl and not plan(300, sm_major=8).pdl
    for dtype in (torch.bfloat16, torch.float16):
        assert plan(300, dtype=dtype)[:2] == plan(300)[:2] == ("grouped_mma", "mma_grouped")
    for path in ("auto", "gemv", "grouped_wgmma"):
        ref = plan(300, path, dtype=torch.float32)
        assert (ref.path, ref.kernel, ref.chunk_rows, ref.max_chunks) == ("reference", "none", 0, 0), path
    with pytest.raises(ValueError, match="is not one of auto"):
        plan(300, "reference")
    assert torch.ops.kbit._moe_kernel_id("mma_grouped") != torch.ops.kbit._moe_kernel_id("moe_gemv")
    with pytest.raises(ValueError, match="is not one of moe_gemv_direct, moe_gemv, mma_grouped"):
        torch.ops.kbit._moe_kernel_id("none")


@requires_extension
@pytest.mark.parametrize("kernel,tokens,rows", [("rs", 4096, 128), ("ws", 1024, 256)])
def test_the_grouped_wgmma_kernel_can_be_forced(kernel, tokens, rows):
    """VLLM_KBIT_MOE_WGMMA=rs|ws forces the grouped_wgmma path's kernel against the rule (rs up to 96 slots per
    expert): 128-row chunks at 256 slots per expert, 256-row chunks at 64; read once per process, so each runs
    in a child."""
    code = (f"import torch, vllm_kbit; p = torch.ops.kbit.moe_plan({tokens}, 8, 128, 4, 'auto', 9); "
            f"assert p[:4] == ('grouped_wgmma', 'wgmma_{kernel}_grouped', {rows}, "
            f"torch.ops.kbit._moe_max_chunks({8 * tokens}, 128, {rows})), p; print('ok')")
    run = subprocess.run([sys.executable, "-c", code], env=child_env(VLLM_KBIT_MOE_WGMMA=kernel), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-2000:]


@requires_extension
def test_the_grouped_wgmma_switch_refuses_other_values():
    code = "import torch, vllm_kbit; torch.ops.kbit.moe_plan(1024, 8, 128, 4, 'auto', 9)"
    run = subprocess.run([sys.executable, "-c", code], env=child_env(VLLM_KBIT_MOE_WGMMA="yes"), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode != 0 and "VLLM_KBIT_MOE_WGMMA=yes is not supported; supported: ws" in run.stderr, run.stderr[-2000:]


def test_without_extension_the_reference_needs_no_plan():
    """The package without its C++ extension (VLLM_KBIT_LOAD_EXTENSION=0, as a CPU torch install has
    it): no plan ops, and the public ops still run (the reference never asks for a plan)."""
    code = (
        "import torch, vllm_kbit, vllm_kbit.moe as moe\n"
        "from vllm_kbit import ops\n"
        "assert not ops.HAS_EXTENSION and not ops.HAS_CUDA_KERNELS\n"
        "assert not hasattr(torch.ops.kbit, 'linear_plan') and not hasattr(torch.ops.kbit, 'moe_plan')\n"
        "w = vllm_kbit.KbitLinearWeight.from_kbit(vllm_kbit.quantize(torch.randn(70, 64), 3))\n"
        "x = torch.randn(5, 64)\n"
        "assert torch.allclose(vllm_kbit.kbit_linear(x, w), x @ w.dequantize(torch.float32).T, atol=1e-4)\n"
        "flat = lambda n: [(q.qweight, q.absmax) for q in (vllm_kbit.quantize(torch.randn(n, 32) * 0.1, 3) for _ in range(2))]\n"
        "(q13, a13), (q2, a2) = moe.stack_runtime(flat(64)), moe.stack_runtime(flat(32))\n"
        "cb = vllm_kbit.reference.normal_float_codebook(3)\n"
        "out = moe.kbit_fused_moe(torch.randn(4, 32), torch.tensor([[0], [1], [1], [0]]), torch.ones(4, 1), q13, a13, q2, a2, cb, 32)\n"
        "assert out.shape == (4, 32) and torch.isfinite(out).all()\n"
    )
    env = child_env(VLLM_KBIT_LOAD_EXTENSION="0")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


def test_fused_moe_refuses_bad_input():
    w13, w2 = _experts(4)
    x = torch.randn(T, H).to(torch.bfloat16)
    ids = torch.randint(0, E, (T, TOP_K), dtype=torch.int32)
    weights = torch.rand(T, TOP_K)
    packed = _pack(w13, w2)
    with pytest.raises(ValueError, match="intermediate size 64"):
        kbit_fused_moe(x, ids, weights, *packed, w13[0].codebook, 64)
    with pytest.raises(ValueError, match="topk_ids"):
        kbit_fused_moe(x, ids[:-1], weights[:-1], *packed, w13[0].codebook, I)
    with pytest.raises(TypeError, match="integer"):
        kbit_fused_moe(x, ids.float(), weights, *packed, w13[0].codebook, I)
    with pytest.raises(ValueError, match="codebook"):
        kbit_fused_moe(x, ids, weights, *packed, w13[0].codebook[:4], I)
    with pytest.raises(ValueError, match="hidden size"):
        kbit_fused_moe(x[:, :40], ids, weights, *packed, w13[0].codebook, I)
