"""kbit::linear on CUDA (GEMV for M <= 2, fused dequant + MMA up to M = 64, on large weights the fused
dequant + wgmma kernels up to 128 (register-fragment) and 512 (warp-specialized), dequantize + cuBLAS
elsewhere) and the kernels on their own (kbit::_linear_forced: the GEMV, the MMA at any M and tile shape, the
wgmma kernels) against the fp32 reference.

Reference: A.float() @ dequant(W).float().T (+ bias), with dequant from vllm_kbit.reference.
Outputs are checked everywhere: the allocator's cache is poisoned with NaN before each call
so an unwritten element shows up as non-finite.
"""

import random
from dataclasses import dataclass

import pytest
import torch

import vllm_kbit
from vllm_kbit import reference as fmt
from vllm_kbit.linear import KbitLinearWeight, kbit_linear

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
gpu = [pytest.mark.gpu, requires_cuda]

def _plan(M, N, K, path="auto"):
    """torch.ops.kbit.linear_plan on this GPU's facts, its fields named (path, splits, max_splits, p, r, ...)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return vllm_kbit.ops.named(torch.ops.kbit.linear_plan, M, N, K, torch.bfloat16, props.major,
                               props.multi_processor_count, 1, path)


# The target shapes of docs/architecture.md ("Target shapes"), as (K, N); the MoE gate_up is the
# fused x2 shape.
DESIGN_SHAPES = [
    (2048, 4096), (2048, 512), (4096, 2048), (2048, 5120), (5120, 2048), (2048, 1024), (512, 2048),
    (2048, 10240), (10240, 2048), (2048, 1536), (1536, 2048), (4096, 14336), (8192, 28672),
]


def _random_weight(N, K, k, gen, device="cuda"):
    """Random packed weight (every bit pattern, scales 2^-5..2^2 and some zero blocks) as KbitLinearWeight."""
    KB = K // fmt.BLOCK_SIZE
    q = torch.randint(-(2**31), 2**31, (N, KB, k), generator=gen, dtype=torch.int64).to(torch.int32)
    a = torch.randint(96, 208, (N, KB), generator=gen, dtype=torch.int64)
    a[torch.rand(N, KB, generator=gen) < 0.02] = 0
    a = a.to(torch.uint8)
    cb = fmt.normal_float_codebook(k)
    q, a, cb = q.to(device), a.to(device), cb.to(device)
    q_rt, a_rt = fmt.repack(q, a)
    return KbitLinearWeight(q_rt, a_rt, cb, N, K, k), (q, a, cb)


@dataclass
class _Ref:
    """fp32 reference outputs and |x| @ |W|^T, which bounds the error of rounding W to x's dtype
    (the MMA and dequant + cuBLAS paths do): |sum (w' - w) x| <= u * sum |w x|."""

    val: torch.Tensor
    mag: torch.Tensor

    def __getitem__(self, rows):
        return _Ref(self.val[rows], self.mag[rows])


def _reference(x, flat, bias, rows_per_chunk=1024):
    q, a, cb = flat
    W = torch.cat(
        [fmt.dequantize(q[i : i + rows_per_chunk], a[i : i + rows_per_chunk], cb, torch.float32) for i in range(0, q.shape[0], rows_per_chunk)]
    )
    out = x.float() @ W.T
    return _Ref(out if bias is None else out + bias.float(), x.float().abs() @ W.abs().T)


def _poison_cache(nbytes):
    torch.full((nbytes // 4 + 1024,), float("nan"), device="cuda")  # freed at once: its block stays cached


def _check(out, ref, dtype, what=""):
    ref, mag = (ref.val, ref.mag) if isinstance(ref, _Ref) else (ref, None)
    assert out.dtype == dtype and out.shape == ref.shape, what
    bad = ~torch.isfinite(out)
    assert not bad.any(), f"{what}: {int(bad.sum())} unwritten or non-finite outputs, first at {bad.nonzero()[0].tolist()}"
    err = (out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)
    tol = 6e-3 if dtype == torch.bfloat16 else 2e-3
    assert err < tol, f"{what}: relative error {err:.2e} >= {tol}"
    # Elementwise: every output within a few output ulps of the reference, scaled by the row's size,
    # plus the hard bound on rounding W to x's dtype, which matters where a dot product cancels (an
    # output far below the row's size): the MMA kernel rounds the codebook value, then its product
    # with the scale (2u, unit roundoff u), and 0.5u covers the fp32 sums.
    scale = ref.abs() + ref.pow(2).mean(-1, keepdim=True).sqrt()
    allowed = 4 * tol * scale
    if mag is not None:
        allowed = allowed + 2.5 * (2.0**-8 if dtype == torch.bfloat16 else 2.0**-11) * mag
    off = (out.float() - ref).abs() > allowed
    assert not off.any(), f"{what}: {int(off.sum())} outputs off, first at {off.nonzero()[0].tolist()}"


def _random_case(seed):
    rng = random.Random(seed)
    M = rng.choice([1, 1, 2, 3, 4, 4, 5, 8, 17])
    N = rng.choice([rng.randint(1, 200), rng.randint(1, 1200), 64 * rng.randint(1, 20)])
    K = 32 * rng.choice([rng.randint(1, 12), rng.randint(1, 100), 4 * rng.randint(1, 25)])
    k = rng.choice(fmt.SUPPORTED_BITS)
    dtype = rng.choice([torch.bfloat16, torch.float16])
    return M, N, K, k, dtype, rng.random() < 0.5


@pytest.mark.parametrize("seed", range(320))
@pytest.mark.gpu
@requires_cuda
def test_random_cases_match_reference(seed):
    M, N, K, k, dtype, with_bias = _random_case(seed)
    gen = torch.Generator().manual_seed(seed)
    w, flat = _random_weight(N, K, k, gen)
    x = torch.randn(M, K, generator=gen).to(dtype).cuda()
    bias = torch.randn(N, generator=gen).to(dtype).cuda() if with_bias else None
    _poison_cache(M * N * 2)
    out = kbit_linear(x, w, bias)
    _check(out, _reference(x, flat, bias), dtype)


def _forced(x, w, path, bias=None, row_groups=0, splits=0):
    """kbit::_linear_forced: the kernel of `path` with row_groups / splits forced (0: the planner's rules)."""
    path_id = torch.ops.kbit._linear_path_id(path)
    return torch.ops.kbit._linear_forced(x, w.qweight_rt, w.absmax_rt, w.codebook, w.N, w.K, bias, path_id, row_groups,
                                         splits)


def _mma(x, w, bias=None, row_groups=0, splits=0):
    return _forced(x, w, "mma", bias, row_groups, splits)


def _built_row_groups(M):
    """The r (16-row groups per warp) the MMA kernel is built with at this M (mma_kernel.cuh: launch_bits)."""
    return [1, 2 if _plan(M, 64, 128, "mma").p == 8 else 4]


def _random_mma_case(seed):
    rng = random.Random(10_000 + seed)
    M = rng.choice([rng.randint(1, 8), rng.randint(5, 16), rng.randint(9, 64), rng.randint(33, 200)])
    N = rng.choice([rng.randint(1, 200), rng.randint(1, 1500), 64 * rng.randint(1, 24)])
    K = 32 * rng.choice([rng.randint(1, 12), rng.randint(1, 100), 4 * rng.randint(1, 25)])
    k = rng.choice(fmt.SUPPORTED_BITS)
    dtype = rng.choice([torch.bfloat16, torch.float16])
    row_groups = rng.choice([0] + _built_row_groups(M))
    splits = rng.choice([0, 0, rng.randint(1, _plan(M, N, K, "mma").max_splits)])
    return M, N, K, k, dtype, rng.random() < 0.5, row_groups, splits


@pytest.mark.parametrize("seed", range(320))
@pytest.mark.gpu
@requires_cuda
def test_mma_random_cases_match_reference(seed):
    M, N, K, k, dtype, with_bias, row_groups, splits = _random_mma_case(seed)
    gen = torch.Generator().manual_seed(seed)
    w, flat = _random_weight(N, K, k, gen)
    x = torch.randn(M, K, generator=gen).to(dtype).cuda()
    bias = torch.randn(N, generator=gen).to(dtype).cuda() if with_bias else None
    _poison_cache(M * N * 2)
    out = _mma(x, w, bias, row_groups, splits)
    _check(out, _reference(x, flat, bias), dtype, f"M={M} N={N} K={K} k={k} {dtype} bias={with_bias} r={row_groups} S={splits}")


MMA_MS = (1, 2, 5, 8, 16, 20, 32, 64, 128)
# M = 1, 2, 4, ..., 4096 plus 3 and 5: every path of kbit_linear on both sides of each
# boundary (2 | 3 GEMV | MMA, 64 | 128 MMA | wgmma or dequant + cuBLAS, 128 | 256 wgmma | warp-specialized wgmma,
# 512 | 1024 warp-specialized wgmma | dequant + cuBLAS).
LINEAR_MS = (1, 2, 3, 4, 5, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


@pytest.mark.parametrize("K,N", DESIGN_SHAPES)
@pytest.mark.gpu
@requires_cuda
def test_design_shapes_every_m(K, N):
    """kbit_linear at every M of LINEAR_MS, and the MMA kernel itself at every MMA M (default tile
    shape), on every target shape (docs/architecture.md) and k."""
    gen = torch.Generator().manual_seed(K * 7 + N)
    for k in fmt.SUPPORTED_BITS:
        w, flat = _random_weight(N, K, k, gen)
        x = torch.randn(max(LINEAR_MS), K, generator=gen).to(torch.bfloat16).cuda()
        ref = _reference(x, flat, None)
        for M in LINEAR_MS:
            _poison_cache(M * N * 2 + M * K * 2)
            _check(kbit_linear(x[:M], w), ref[:M], torch.bfloat16, f"kbit_linear M={M} k={k} ({_plan(M, N, K)[0]})")
        for M in MMA_MS:
            _poison_cache(M * N * 2)
            _check(_mma(x[:M], w), ref[:M], torch.bfloat16, f"mma M={M} k={k} config={_plan(M, N, K, 'mma')[3:]}")
        del w, flat, ref
        torch.cuda.empty_cache()


requires_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU (wgmma)"
)


def _wgmma(x, w, bias=None, warp_specialized=False):
    return _forced(x, w, "wgmma_ws" if warp_specialized else "wgmma", bias)


def _random_wgmma_case(seed):
    rng = random.Random(20_000 + seed)
    M = rng.choice([rng.randint(1, 130), rng.randint(100, 600), 128 * rng.randint(1, 4)])
    N = rng.choice([rng.randint(1, 300), rng.randint(1, 1500), 64 * rng.randint(1, 24), 128 * rng.randint(1, 12)])
    K = 32 * rng.choice([rng.randint(1, 12), rng.randint(1, 100), 4 * rng.randint(1, 25)])
    k = rng.choice(fmt.SUPPORTED_BITS)
    dtype = rng.choice([torch.bfloat16, torch.float16])
    return M, N, K, k, dtype, rng.random() < 0.5


@pytest.mark.parametrize("warp_specialized", [False, True])
@pytest.mark.parametrize("seed", range(120))
@pytest.mark.gpu
@requires_hopper
def test_wgmma_random_cases_match_reference(seed, warp_specialized):
    """Both fused dequant + wgmma kernels: M not a multiple of their 128 / 256 rows, N not a multiple of
    the CTA's two n-tiles, K not a multiple of a k-tile, every k, both dtypes, with and without bias."""
    M, N, K, k, dtype, with_bias = _random_wgmma_case(seed)
    gen = torch.Generator().manual_seed(seed)
    w, flat = _random_weight(N, K, k, gen)
    x = torch.randn(M, K, generator=gen).to(dtype).cuda()
    bias = torch.randn(N, generator=gen).to(dtype).cuda() if with_bias else None
    _poison_cache(M * N * 2 + M * K * 2)
    out = _wgmma(x, w, bias, warp_specialized)
    _check(out, _reference(x, flat, bias), dtype, f"M={M} N={N} K={K} k={k} {dtype} bias={with_bias}")


@pytest.mark.parametrize("seed", range(60))
@pytest.mark.gpu
@requires_hopper
def test_wgmma_ws_k_splits_match_reference(seed):
    """The warp-specialized kernel with its K split over a cluster of 2..8 CTAs (forced; fp32 tiles summed through
    distributed shared memory): M across one and several 256-row blocks, N and K tails, every k, both dtypes, bias
    (tests/gpu/test_plan_cuda.py checks that launches record their split count)."""
    _check_ws_k_splits(seed, first=2)


def _check_ws_k_splits(seed, first):
    """Random case `seed` through the warp-specialized kernel forced at splits first .. max, each against the fp32
    reference and equal to itself on repeat (also benchmarks/probes/ws_splits.py --cases, at every count)."""
    M, N, K, k, dtype, with_bias = _random_wgmma_case(seed)
    K = max(K, 256)  # at least two k-tiles
    gen = torch.Generator().manual_seed(seed)
    w, flat = _random_weight(N, K, k, gen)
    x = torch.randn(M, K, generator=gen).to(dtype).cuda()
    bias = torch.randn(N, generator=gen).to(dtype).cuda() if with_bias else None
    ref = _reference(x, flat, bias)
    for splits in range(first, _plan(M, N, K, "wgmma_ws").max_splits + 1):
        _poison_cache(M * N * 2 + M * K * 2)
        out = _forced(x, w, "wgmma_ws", bias, 0, splits)
        _check(out, ref, dtype, f"seed {seed} M={M} N={N} K={K} k={k} {dtype} bias={with_bias} splits={splits}")
        again = _forced(x, w, "wgmma_ws", bias, 0, splits)
        assert torch.equal(out, again), "the rank-ordered sum is deterministic"


@pytest.mark.parametrize("K,N", DESIGN_SHAPES)
@pytest.mark.gpu
@requires_hopper
def test_wgmma_design_shapes(K, N):
    gen = torch.Generator().manual_seed(K * 11 + N)
    for k in fmt.SUPPORTED_BITS:
        w, flat = _random_weight(N, K, k, gen)
        x = torch.randn(600, K, generator=gen).to(torch.bfloat16).cuda()
        ref = _reference(x, flat, None)
        for M in (128, 300, 600):
            for ws in (False, True):
                _poison_cache(M * N * 2 + M * K * 2)
                _check(_wgmma(x[:M], w, None, ws), ref[:M], torch.bfloat16, f"wgmma M={M} k={k} ws={ws}")
        del w, flat, ref
        torch.cuda.empty_cache()


@pytest.mark.parametrize("k", fmt.SUPPORTED_BITS)
@pytest.mark.gpu
@requires_hopper
def test_wgmma_narrow_instance_every_width(k):
    """The register-operand wgmma's narrow instance (dense M <= 64: one block of rows, the wgmma N fitted to it, four
    warpgroups at k <= 4): M at every built width's edges, n-tiles not a multiple of the CTA's, K tails and 1, 2, 3 and
    10 k-tiles (the N = 64 width refills one fragment buffer behind its wgmmas: its first and last k-tiles), both
    dtypes, with bias."""
    gen = torch.Generator().manual_seed(300 + k)
    for N, K in ((64 * 9 + 5, 32 * 37), (64 * 4, 128 * 3), (64 * 5, 32 * 3), (64 * 3 + 7, 32 * 6)):
        w, flat = _random_weight(N, K, k, gen)
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.randn(64, K, generator=gen).to(dtype).cuda()
            bias = torch.randn(N, generator=gen).to(dtype).cuda()
            ref = _reference(x, flat, bias)
            for M in (1, 2, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64):
                _poison_cache(M * N * 2 + M * K * 2)
                _check(_wgmma(x[:M], w, bias), ref[:M], dtype,
                       f"narrow M={M} N={N} K={K} k={k} {dtype}")


@pytest.mark.gpu
@requires_cuda
def test_mma_fp16_bias_every_tile_shape():
    gen = torch.Generator().manual_seed(5)
    w, flat = _random_weight(1000, 1056, 5, gen)
    bias = torch.randn(1000, generator=gen).to(torch.float16).cuda()
    x = torch.randn(130, 1056, generator=gen).to(torch.float16).cuda()
    ref = _reference(x, flat, bias)
    for M in (1, 7, 9, 16, 17, 24, 31, 64, 65, 130):
        for r in _built_row_groups(M):
            for splits in (1, 3, 8):
                _poison_cache(M * 1000 * 2)
                _check(_mma(x[:M], w, bias, r, splits), ref[:M], torch.float16, f"M={M} r={r} S={splits}")


@pytest.mark.gpu
@requires_cuda
def test_mma_refuses_unbuilt_tile_shapes_and_bad_splits():
    gen = torch.Generator().manual_seed(6)
    w, _ = _random_weight(64, 256, 4, gen)  # 2 k-tiles
    x = torch.randn(5, 256, generator=gen).to(torch.bfloat16).cuda()
    for r, s in ((2, 0), (3, 0), (1, 3), (1, -1)):
        with pytest.raises(RuntimeError, match="row_groups|splits"):
            _mma(x, w, None, r, s)


@pytest.mark.parametrize("k", [2, 3, 4])  # k = 2 at M = 1: pair tables of partial sums; k = 3, 4: the pair table (gemv_core.cuh)
@pytest.mark.parametrize("N,K", [(1000, 2080), (64, 96), (130, 4096), (5120, 2048)])
@pytest.mark.gpu
@requires_cuda
def test_gemv_every_split_count(N, K, k):
    """The GEMV at every K split count it accepts (1 .. min(8, k-tiles); 0 = heuristic), M = 1..4, fp16 + bias."""
    gen = torch.Generator().manual_seed(N + K)
    w, flat = _random_weight(N, K, k, gen)
    bias = torch.randn(N, generator=gen).to(torch.float16).cuda()
    x = torch.randn(4, K, generator=gen).to(torch.float16).cuda()
    ref = _reference(x, flat, bias)
    for M in (1, 2, 3, 4):
        for splits in range(0, _plan(M, N, K, "gemv").max_splits + 1):
            _poison_cache(M * N * 2)
            out = _forced(x[:M], w, "gemv", bias, splits=splits)
            _check(out, ref[:M], torch.float16, f"gemv M={M} S={splits}")


@pytest.mark.gpu
@requires_cuda
def test_gemv_refuses_bad_splits_and_rows():
    gen = torch.Generator().manual_seed(7)
    w, _ = _random_weight(64, 256, 4, gen)  # 2 k-tiles
    for M, s in ((1, 3), (1, -1), (5, 0)):
        x = torch.randn(M, 256, generator=gen).to(torch.bfloat16).cuda()
        with pytest.raises(RuntimeError, match="splits|rows"):
            _forced(x, w, "gemv", splits=s)


@pytest.mark.gpu
@requires_cuda
def test_leading_dims_strided_and_unaligned_inputs():
    gen = torch.Generator().manual_seed(1)
    w, flat = _random_weight(100, 96, 3, gen)
    x = torch.randn(2, 2, 97, generator=gen).to(torch.float16).cuda()[..., 1:]  # strided, 2-byte offset
    out = kbit_linear(x, w)
    assert out.shape == (2, 2, 100)
    _check(out.view(4, 100), _reference(x.reshape(4, 96), flat, None), torch.float16)
    x = torch.randn(3, 5, 97, generator=gen).to(torch.bfloat16).cuda()[..., 1:]  # M = 15: the MMA path
    out = kbit_linear(x, w)
    assert out.shape == (3, 5, 100)
    _check(out.view(15, 100), _reference(x.reshape(15, 96), flat, None), torch.bfloat16, "strided x, M=15")


@pytest.mark.gpu
@requires_cuda
def test_fp32_activations_use_dequant_path():
    gen = torch.Generator().manual_seed(2)
    w, flat = _random_weight(65, 160, 5, gen)
    x = torch.randn(2, 160, generator=gen).cuda()
    out = kbit_linear(x, w)
    ref = _reference(x, flat, None).val
    assert out.dtype == torch.float32 and torch.allclose(out, ref, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@requires_cuda
def test_from_quantized_weight():
    W = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16)
    kw = vllm_kbit.quantize(W, 4)
    w = KbitLinearWeight.from_kbit(kw)
    x = torch.randn(3, 512, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ kw.dequantize(torch.float32).T
    _check(kbit_linear(x, w), ref, torch.bfloat16)


@pytest.mark.parametrize(
    "N,K,Ms",
    [(1000, 2048, (1, 2, 3, 4, 5, 16, 33, 64, 100)),  # GEMV, MMA, dequant + cuBLAS
     (10300, 4096, (65, 128, 200, 300, 600))],  # both wgmma kernels (Hopper), then dequant + cuBLAS
)
@pytest.mark.gpu
@requires_cuda
def test_cuda_graph_capture_and_replay(N, K, Ms):
    hopper = torch.cuda.get_device_capability()[0] == 9
    expected = {"gemv", "mma", "dequant_cublas"} if N == 1000 else {"wgmma", "wgmma_ws", "dequant_cublas"} if hopper else {"dequant_cublas"}
    assert {_plan(M, N, K)[0] for M in Ms} == expected, "the case no longer covers the paths it names"
    gen = torch.Generator().manual_seed(3)
    w, flat = _random_weight(N, K, 4, gen)
    bias = torch.randn(N, generator=gen).to(torch.bfloat16).cuda()
    static_x = {M: torch.randn(M, K, generator=gen).to(torch.bfloat16).cuda() for M in Ms}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for M in Ms:  # warm-up outside capture (cuBLAS handles, the dispatcher's caches)
            kbit_linear(static_x[M], w, bias)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = {M: kbit_linear(static_x[M], w, bias) for M in Ms}
    for _ in range(3):
        new_x = {M: torch.randn(M, K, generator=gen).to(torch.bfloat16).cuda() for M in Ms}
        for M in Ms:
            static_x[M].copy_(new_x[M])
        graph.replay()
        torch.cuda.synchronize()
        for M in Ms:
            assert torch.equal(static_out[M], kbit_linear(new_x[M], w, bias)), f"replay differs from eager at M={M}"
            _check(static_out[M], _reference(new_x[M], flat, bias), torch.bfloat16)


@pytest.mark.parametrize("M", [1, 3, 4, 9, 40, 100])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.gpu
@requires_cuda
def test_opcheck_cuda(M, with_bias):
    gen = torch.Generator().manual_seed(M)
    w, _ = _random_weight(70, 160, 3, gen)
    x = torch.randn(M, 160, generator=gen).to(torch.bfloat16).cuda()
    bias = torch.randn(70, generator=gen).to(torch.bfloat16).cuda() if with_bias else None
    torch.library.opcheck(torch.ops.kbit.linear.default, (x, w.qweight_rt, w.absmax_rt, w.codebook, 70, 160, bias))
