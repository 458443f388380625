"""kbit::fused_moe on CUDA (routing, grouped GEMV, grouped dequant + MMA and dequantize + grouped-GEMM
paths) against an fp32 reference: dequantized weights, a loop over experts, fp32 matmuls.

Every call runs on an allocator cache poisoned with NaN, so an unwritten output shows up.
Every path is checked on every random case (gemv = grouped GEMV, gemv_direct = grouped GEMV without
routing and with the combine in the down projection, grouped_mm = dequantize + torch._grouped_mm,
grouped_mma = grouped dequant + MMA, grouped_wgmma = grouped dequant + wgmma on Hopper, auto = the choice
of torch.ops.kbit.fused_moe).
"""

import functools
import random

import pytest
import torch
import torch.nn.functional as F

from vllm_kbit import ops
from vllm_kbit import reference as fmt
from vllm_kbit.moe import kbit_fused_moe, route_reference, stack_runtime

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PATHS = ("auto", "gemv", "grouped_mm", "grouped_mma", "gemv_direct", "grouped_wgmma")
pytestmark = [pytest.mark.gpu, requires_cuda]


class Experts:
    """Random packed experts: stacked runtime tensors, and fp32 dequantized copies (W13, W2) made on
    first use: tests without a reference (test_determinism.py) never pay for them, which at the
    Qwen3-30B size are the ~12 GiB of unpacked bit planes that otherwise limit how many run at once."""

    def __init__(self, E, H, I, k, gen):
        self.E, self.H, self.I, self.k = E, H, I, k
        self.codebook = fmt.normal_float_codebook(k).cuda()
        self.q13, self.a13, self._flat13 = self._make(E, 2 * I, H, gen)
        self.q2, self.a2, self._flat2 = self._make(E, H, I, gen)

    def _make(self, E, N, K, gen):
        KB = K // fmt.BLOCK_SIZE
        q = torch.randint(-(2**31), 2**31, (E * N, KB, self.k), generator=gen, dtype=torch.int64).to(torch.int32)
        # Scales about 2^-6..2^-4 (so layer outputs stay in fp16 range), some blocks zero.
        a = torch.randint(80, 120, (E * N, KB), generator=gen, dtype=torch.int64)
        a[torch.rand(E * N, KB, generator=gen) < 0.02] = 0
        q, a = q.cuda(), a.to(torch.uint8).cuda()
        qs, as_ = stack_runtime([(q[e * N : (e + 1) * N], a[e * N : (e + 1) * N]) for e in range(E)])
        return qs, as_, (q, a, E, N, K)

    def _dequantized(self, flat):
        q, a, E, N, K = flat
        return fmt.dequantize(q, a, self.codebook, torch.float32).view(E, N, K)

    @functools.cached_property
    def W13(self):
        return self._dequantized(self._flat13)

    @functools.cached_property
    def W2(self):
        return self._dequantized(self._flat2)

    def args(self):
        return self.q13, self.a13, self.q2, self.a2, self.codebook


def reference(x, ids, weights, ex, expert_map, on_input, rotate13=None, rotate2=None):
    """fp32: out[t] = sum_j w[t,j] * W2_e @ (silu(G_e x) * U_e x), e = local(ids[t, j]). Rotated experts: rotate13
    maps each gate_up input row (fp32) to what gate_up multiplies, rotate2 each SiLU-and-mul row to down's input."""
    rotate13 = rotate13 or (lambda v: v)
    rotate2 = rotate2 or (lambda v: v)
    T, top_k = ids.shape
    local = route_reference(ids, expert_map, ex.E)[2].view(T, top_k).long()
    out = torch.zeros(T, ex.H, dtype=torch.float32, device=x.device)
    for e in torch.unique(local[local >= 0]).tolist():
        t, j = torch.nonzero(local == e, as_tuple=True)
        xe = x[t].float()
        w = weights[t, j].float()[:, None]
        if on_input:
            xe = (xe * w).to(x.dtype).float()
        gu = rotate13(xe) @ ex.W13[e].T
        y = rotate2(F.silu(gu[:, : ex.I]) * gu[:, ex.I :]) @ ex.W2[e].T
        out.index_add_(0, t, y if on_input else y * w)
    return out


def captured(forward):
    """(graph, outputs) of forward captured in a CUDA graph, after one warm-up run on a side stream (as vLLM
    captures): replaying the graph recomputes the outputs in place from whatever the captured inputs hold."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        forward()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = forward()
    return graph, outs


def poison_cache(nbytes=64 << 20):
    torch.full((nbytes // 4,), float("nan"), device="cuda")  # freed at once: its block stays cached


def run(x, ids, weights, ex, expert_map, on_input, path):
    poison_cache()
    if path == "auto":
        return kbit_fused_moe(x, ids, weights, *ex.args(), ex.I, expert_map, on_input)
    path_id = torch.ops.kbit._moe_path_id(path)
    return torch.ops.kbit._fused_moe_cuda(x, ids, weights, *ex.args(), ex.I, expert_map, on_input, path_id)


def check(out, ref, dtype, path):
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "unwritten or non-finite outputs"
    if ref.abs().max() == 0:
        assert (out == 0).all()
        return
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    # The grouped-GEMM and grouped-MMA paths round x, weights, gate_up and h to bf16 (also for fp16 inputs).
    tol = 5e-3 if (dtype == torch.float16 and path in ("gemv", "gemv_direct")) else 1.5e-2
    assert err < tol, f"path {path}: relative error {err:.2e} >= {tol}"
    scale = ref.abs() + ref.pow(2).mean(-1, keepdim=True).sqrt()
    assert ((out.float() - ref).abs() <= 8 * tol * scale).all(), f"path {path}: elementwise error too large"


def random_routing(T, E_global, top_k, gen, mode):
    """ids [T, top_k] int32 (distinct per token) and softmax weights; mode 'one' sends every token to expert 0 first."""
    scores = torch.rand(T, E_global, generator=gen)
    if mode == "one":
        scores[:, 0] = 2.0
    if mode == "few":  # a handful of popular experts: some with many tokens, most with none
        scores[:, : min(3, E_global)] += 1.0
    ids = torch.topk(scores, top_k, dim=1).indices.to(torch.int32)
    weights = torch.softmax(torch.randn(T, top_k, generator=gen), -1)
    return ids.cuda(), weights.cuda()


def random_case(seed):
    rng = random.Random(seed)
    E = rng.choice([1, 2, 3, 4, 8, 16, 64])
    top_k = rng.randint(1, min(E, 8))
    T = rng.choice([1, 1, 2, 3, 4, 5, 7, 16, 33, 64, 130, 300])
    H = rng.choice([32, 64, 128, 256, 96 * 4])
    I = rng.choice([32, 64, 96, 160, 256])
    k = rng.choice(fmt.SUPPORTED_BITS)
    dtype = rng.choice([torch.bfloat16, torch.float16])
    mode = rng.choice(["random", "random", "one", "few"])
    use_map = rng.random() < 0.25
    on_input = top_k == 1 and rng.random() < 0.5 or rng.random() < 0.15
    return E, top_k, T, H, I, k, dtype, mode, use_map, on_input


@pytest.mark.parametrize("seed", range(210))
def test_random_cases_match_reference(seed):
    E, top_k, T, H, I, k, dtype, mode, use_map, on_input = random_case(seed)
    gen = torch.Generator().manual_seed(seed)
    ex = Experts(E, H, I, k, gen)
    expert_map = None
    E_global = E
    if use_map:  # this rank holds E of 2E + 1 global experts, scattered
        E_global = 2 * E + 1
        expert_map = torch.full((E_global,), -1, dtype=torch.int32)
        expert_map[torch.randperm(E_global, generator=gen)[:E]] = torch.arange(E, dtype=torch.int32)
        expert_map = expert_map.cuda()
    top_k = min(top_k, E_global)
    ids, weights = random_routing(T, E_global, top_k, gen, mode)
    x = torch.randn(T, H, generator=gen).to(dtype).cuda()
    ref = reference(x, ids, weights, ex, expert_map, on_input)
    for path in PATHS:
        check(run(x, ids, weights, ex, expert_map, on_input, path), ref, dtype, path)


def test_design_shape_qwen3_30b():
    """Qwen3-30B-A3B routed experts at full size (E=128, top-8, H=2048, I=768), k=4, int64 ids like vLLM may pass,
    at T = 1, 4, 16 (the grouped gate_up on narrow warps, mma_grouped_r) and 64. One test, so the ~30 GiB of
    reference weights exist once (parallel workers share the GPU)."""
    gen = torch.Generator().manual_seed(0)
    ex = Experts(128, 2048, 768, 4, gen)
    for T in (1, 4, 16, 64):
        ids, weights = random_routing(T, 128, 8, gen, "random")
        x = torch.randn(T, 2048, generator=gen).to(torch.bfloat16).cuda()
        ref = reference(x, ids, weights, ex, None, False)
        for path in PATHS:
            check(run(x, ids.long(), weights, ex, None, False, path), ref, torch.bfloat16, path)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [2, 4])
def test_one_token_direct_gemv_is_the_routed_gemv_bit_for_bit(k, dtype):
    """One token: the direct GEMV (no routing, the combine done by the last CTA of each token and n-tile)
    gives exactly the routed GEMV + combine kernel's bits: the same one-row GEMV per slot, the same split
    count and the same slot-order fmaf chain. Also with some picks on another rank and with the router
    weights applied to the input."""
    gen = torch.Generator().manual_seed(k)
    E, H, I, top_k = 64, 512, 256, 8
    ex = Experts(E, H, I, k, gen)
    expert_map = torch.full((2 * E,), -1, dtype=torch.int32)
    expert_map[torch.randperm(2 * E, generator=gen)[:E]] = torch.arange(E, dtype=torch.int32)
    for case in range(6):
        on_input, mapped = case % 2 == 1, case >= 2
        E_global = 2 * E if mapped else E
        ids, weights = random_routing(1, E_global, top_k, gen, "random")
        x = torch.randn(1, H, generator=gen).to(dtype).cuda()
        emap = expert_map.cuda() if mapped else None
        assert torch.ops.kbit.moe_plan(1, top_k, E, k)[0] == "gemv_direct"
        direct = run(x, ids, weights, ex, emap, on_input, "auto")
        routed = run(x, ids, weights, ex, emap, on_input, "gemv")
        assert torch.isfinite(direct).all() and torch.equal(direct.view(torch.int16), routed.view(torch.int16)), case


def test_every_slot_on_another_rank_gives_zeros():
    gen = torch.Generator().manual_seed(5)
    ex = Experts(2, 64, 32, 3, gen)
    expert_map = torch.tensor([-1, -1, -1, 0, 1], dtype=torch.int32, device="cuda")
    ids = torch.randint(0, 3, (9, 2), generator=gen, dtype=torch.int32).cuda()
    weights = torch.rand(9, 2, generator=gen).cuda()
    x = torch.randn(9, 64, generator=gen).to(torch.bfloat16).cuda()
    for path in PATHS:
        out = run(x, ids, weights, ex, expert_map, False, path)
        assert (out == 0).all()


def test_fp32_activations_run_the_reference():
    gen = torch.Generator().manual_seed(6)
    ex = Experts(4, 64, 32, 4, gen)
    ids, weights = random_routing(5, 4, 2, gen, "random")
    x = torch.randn(5, 64, generator=gen).cuda()
    assert ops.named(torch.ops.kbit.moe_plan, 5, 2, 4, 4, "auto", 9, torch.float32).path == "reference"
    torch.ops.kbit._launch_record()
    out = kbit_fused_moe(x, ids, weights, *ex.args(), ex.I)
    assert torch.ops.kbit._launch_record()[0] == []  # the plan's reference path: no kernel of ours
    ref = reference(x, ids, weights, ex, None, False)
    assert out.dtype == torch.float32
    with pytest.raises(TypeError, match="the CUDA kernels support bfloat16 and float16"):
        torch.ops.kbit._fused_moe_cuda(x, ids, weights, *ex.args(), ex.I, None, False)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_bad_input_is_refused():
    gen = torch.Generator().manual_seed(7)
    ex = Experts(4, 64, 32, 4, gen)
    ids, weights = random_routing(5, 4, 2, gen, "random")
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16).cuda()
    with pytest.raises(ValueError, match="intermediate size 64"):
        kbit_fused_moe(x, ids, weights, *ex.args(), 64)
    with pytest.raises(ValueError, match="topk_ids"):
        kbit_fused_moe(x, ids[:4], weights[:4], *ex.args(), ex.I)
    with pytest.raises(ValueError, match="device"):
        kbit_fused_moe(x, ids.cpu(), weights, *ex.args(), ex.I)


def test_opcheck_cuda():
    gen = torch.Generator().manual_seed(8)
    ex = Experts(4, 64, 32, 3, gen)
    ids, weights = random_routing(6, 4, 2, gen, "random")
    x = torch.randn(6, 64, generator=gen).to(torch.bfloat16).cuda()
    torch.library.opcheck(torch.ops.kbit.fused_moe.default, (x, ids, weights, *ex.args(), ex.I, None, False))


# ----------------------------------------------------------------------------- routing


@pytest.mark.parametrize("seed", range(40))
def test_routing_matches_reference(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    E = rng.choice([1, 3, 8, 64, 128, 512, 1500])
    T = rng.choice([1, 2, 5, 64, 300, 4096])
    top_k = rng.randint(1, min(E, 10))
    ids, _ = random_routing(T, E, top_k, gen, rng.choice(["random", "one", "few"]))
    expert_map = None
    if rng.random() < 0.4:
        expert_map = torch.randint(-1, E, (E,), generator=gen, dtype=torch.int32).cuda()
    gemv_rows = ops.named(torch.ops.kbit.moe_plan, T, top_k, E, 4, "gemv").chunk_rows
    R = rng.choice([gemv_rows, gemv_rows, 4, 8, 16, 64])  # GEMV and grouped-MMA chunk heights
    G = torch.ops.kbit._moe_max_chunks(T * top_k, E, R)
    offsets, pos, slot_of, chunks, num_chunks = torch.ops.kbit._moe_route(ids, expert_map, E, R, G)
    ref_offsets, ref_pos, local = route_reference(ids, expert_map, E)
    S = T * top_k
    assert torch.equal(offsets.cpu(), ref_offsets.cpu())
    pos, slot_of, local, offsets = pos.cpu().long(), slot_of.cpu().long(), local.cpu().long(), offsets.cpu().long()
    assert torch.equal(pos < 0, local < 0)
    mine = torch.nonzero(local >= 0).flatten()
    e = local[mine]
    assert ((pos[mine] >= offsets[e]) & (pos[mine] < offsets[e + 1])).all()
    assert torch.equal(slot_of[pos[mine]], mine)
    n_local = int(offsets[-1])
    assert (slot_of[n_local:] == -1).all() and slot_of[:n_local].unique().numel() == n_local
    counts = (offsets[1:] - offsets[:-1]).tolist()
    want = [(ex, int(offsets[ex]) + q * R, min(R, c - q * R)) for ex, c in enumerate(counts) for q in range(-(-c // R))]
    assert int(num_chunks) == len(want) <= G
    got = [tuple(row[:3]) for row in chunks.cpu()[: len(want)].tolist()]
    assert got == want
    unused = chunks.cpu()[len(want):]  # loaded by grouped-GEMV CTAs before they check num_chunks
    assert (unused == torch.tensor([-1, 0, 0, 0], dtype=torch.int32)).all()
    assert S >= n_local


# The kernel of _moe_grouped_linear for each chunk height (a MoE plan's kernel: moe_plan's `kernel`).
KERNEL_OF_ROWS = {1: "moe_gemv", 4: "moe_gemv", 8: "mma_grouped", 16: "mma_grouped", 24: "mma_grouped",
                  32: "mma_grouped", 64: "mma_grouped", 128: "wgmma_rs_grouped", 256: "wgmma_ws_grouped"}


def grouped_linear(A, chunks, num_chunks, ex, N, K, rows, *forced, kernel=None):
    """kbit::_moe_grouped_linear with the kernel a plan names for `rows`-row chunks (or `kernel`)."""
    kernel_id = torch.ops.kbit._moe_kernel_id(kernel or KERNEL_OF_ROWS[rows])
    return torch.ops.kbit._moe_grouped_linear(A, chunks, num_chunks, ex.q13, ex.a13, ex.codebook, N, K, kernel_id, rows,
                                              *forced)


@pytest.mark.parametrize("rows", [1, 4, 8, 16, 24, 32, 64, 128, 256])
@pytest.mark.parametrize("M", [1, 3, 16, 37, 130, 600])
def test_grouped_single_projection(rows, M):
    """_moe_grouped_linear on rows already grouped by expert (the single-GEMM benchmark's op): the
    grouped GEMV for 1- and 4-row chunks (at every K split count), the grouped MMA for 8..64 (several
    chunks per expert at M=130) at forced K splits and row groups per warp, the register-operand grouped
    wgmma for 128 (every wgmma width it builds: 16..128 rows per chunk, five chunks per expert at M=600)
    and the warp-specialized one for 256 (three chunks per expert at M=600, the last a partial 64-row
    half); a split count the kernel cannot take is refused."""
    if rows == 1 and M != 1:
        pytest.skip("one-row chunks are for one token per expert")
    if M == 600 and rows not in (64, 128, 256):
        pytest.skip("600 rows per expert: the two tallest chunk heights")
    gen = torch.Generator().manual_seed(M)
    E, N, K, k = 8, 320, 512, 4
    ex = Experts(E, K, N // 2, k, gen)  # w13 is [2I, H] = [N, K]
    ids = torch.arange(E, dtype=torch.int32).repeat_interleave(M).view(-1, 1).cuda()
    offsets, pos, slot_of, chunks, num_chunks = torch.ops.kbit._moe_route(ids, None, E, rows, torch.ops.kbit._moe_max_chunks(E * M, E, rows))
    A = torch.randn(E * M, K, generator=gen).to(torch.bfloat16).cuda()
    ref = torch.einsum("emk,enk->emn", A.float().view(E, M, K), ex.W13).reshape(E * M, N)
    wide = 2 if rows == 64 else 4  # the MMA's built row groups per warp besides 1
    # K split count forced (K=512: 4 k-tiles); for the MMA with the row groups per warp (0: the rules)
    cases = ([(s, 0) for s in (0, 1, 2, 3, 4)] if rows <= 4 else [(0, 0)] if rows in (128, 256)
             else [(0, 0), (1, 1), (2, wide), (3, 1), (4, wide), (0, 1)])
    for splits, row_groups in cases:
        poison_cache()
        C = grouped_linear(A, chunks, num_chunks, ex, N, K, rows, splits, row_groups)
        check(C, ref, torch.bfloat16, "gemv" if rows <= 4 else "mma")
    # A kernel takes only its own chunk heights (the plan's), not another kernel's.
    other = "mma_grouped" if rows <= 4 or rows >= 128 else "moe_gemv"
    with pytest.raises(ValueError, match=f"takes chunks of .* rows, not {rows}$"):
        grouped_linear(A, chunks, num_chunks, ex, N, K, rows, kernel=other)
    if rows in (128, 256):  # the grouped wgmmas plan nothing a caller could force but the producers (ws)
        with pytest.raises(ValueError, match="do not apply to the grouped wgmma"):
            grouped_linear(A, chunks, num_chunks, ex, N, K, rows, 2)
        if rows == 128:
            with pytest.raises(ValueError, match="producers apply to the warp-specialized grouped_wgmma kernel"):
                grouped_linear(A, chunks, num_chunks, ex, N, K, rows, 0, 0, 1)
        else:
            C = grouped_linear(A, chunks, num_chunks, ex, N, K, rows, 0, 0, 1)  # one producer warpgroup, forced
            check(C, ref, torch.bfloat16, "grouped_wgmma")
        return
    with pytest.raises(ValueError, match="splits=5 outside"):  # 5 > the 4 k-tiles
        grouped_linear(A, chunks, num_chunks, ex, N, K, rows, 5)
    with pytest.raises(ValueError, match="row_groups"):  # 3 row groups per warp: no such instance (GEMV: none)
        grouped_linear(A, chunks, num_chunks, ex, N, K, rows, 0, 3)


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_register_operand_wgmma_fits_each_chunk(dtype, k):
    """The register-operand grouped wgmma (chunk_rows 128) issues the narrowest built wgmma N that holds a
    chunk: experts of 5, 20, 40, 70, 100, 128, 200 and 0 rows take N = 16, 32, 64, 96, 128, 128 and 128 + 96
    (an expert of several chunks; one without rows), on a ragged N, at every k (k = 2..4 through the wide
    table: quads, pairs by PRMT; k = 5 by shuffle)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the grouped wgmma is built for Hopper")
    gen = torch.Generator().manual_seed(11 + k)
    counts = [5, 20, 40, 70, 100, 128, 200, 0]
    E, N, K = len(counts), 320, 512
    ex = Experts(E, K, N // 2, k, gen)  # w13 is [2I, H] = [N, K]
    ids = torch.repeat_interleave(torch.arange(E), torch.tensor(counts)).to(torch.int32).view(-1, 1).cuda()
    S = int(sum(counts))
    offsets, pos, slot_of, chunks, num_chunks = torch.ops.kbit._moe_route(ids, None, E, 128, torch.ops.kbit._moe_max_chunks(S, E, 128))
    A = torch.randn(S, K, generator=gen).to(dtype).cuda()
    starts = [sum(counts[:e]) for e in range(E)]
    ref = torch.cat([A[s : s + c].float() @ ex.W13[e].T for e, (s, c) in enumerate(zip(starts, counts))])
    poison_cache()
    C = grouped_linear(A, chunks, num_chunks, ex, N, K, 128)
    check(C, ref, dtype, "grouped_wgmma")


# ----------------------------------------------------------------------------- CUDA graphs


def test_cuda_graph_capture_and_replay():
    gen = torch.Generator().manual_seed(9)
    E, H, I = 16, 256, 96
    ex = Experts(E, H, I, 4, gen)
    expert_map = None
    # auto at one token (the direct GEMV), the routed GEMV's 4-row chunks, grouped mm, grouped MMA, the
    # direct GEMV's combine counters over several tokens, the grouped wgmma's 256-row chunks (each path named:
    # auto picks by slots per expert)
    for T, path in ((1, "auto"), (8, "gemv"), (200, "grouped_mm"), (40, "grouped_mma"), (5, "gemv_direct"),
                    (300, "grouped_wgmma")):
        ids, weights = random_routing(T, E, 4, gen, "random")
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()

        def forward():
            if path == "auto":
                return kbit_fused_moe(x, ids, weights, *ex.args(), I, expert_map)
            path_id = torch.ops.kbit._moe_path_id(path)
            return torch.ops.kbit._fused_moe_cuda(x, ids, weights, *ex.args(), I, expert_map, False, path_id)

        graph, out = captured(forward)
        for _ in range(2):  # new inputs in the captured buffers, then replay
            new_ids, new_w = random_routing(T, E, 4, gen, "few")
            ids.copy_(new_ids)
            weights.copy_(new_w)
            x.copy_(torch.randn(T, H, generator=gen).to(torch.bfloat16))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            check(out, reference(x, ids, weights, ex, expert_map, False), torch.bfloat16, 2)
