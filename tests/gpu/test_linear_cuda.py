"""kbit::linear on CUDA (GEMV for M <= 4, dequantize + cuBLAS above) against the fp32 reference.

Reference: A.float() @ dequant(W).float().T (+ bias), with dequant from vllm_kbit.format.
Outputs are checked everywhere: the allocator's cache is poisoned with NaN before each call
so an unwritten element shows up as non-finite.
"""

import random

import pytest
import torch

import vllm_kbit
from vllm_kbit import format as fmt
from vllm_kbit.linear import GEMV_MAX_SPLITS, KbitLinearWeight, gemv_splits, gemv_tiles, kbit_linear

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
gpu = [pytest.mark.gpu, requires_cuda]

# design.md section 6, as (K, N); the MoE gate_up is the fused x2 shape.
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


def _reference(x, flat, bias, rows_per_chunk=1024):
    q, a, cb = flat
    W = torch.cat(
        [fmt.dequantize(q[i : i + rows_per_chunk], a[i : i + rows_per_chunk], cb, torch.float32) for i in range(0, q.shape[0], rows_per_chunk)]
    )
    out = x.float() @ W.T
    return out if bias is None else out + bias.float()


def _poison_cache(nbytes):
    torch.full((nbytes // 4 + 1024,), float("nan"), device="cuda")  # freed at once: its block stays cached


def _check(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "unwritten or non-finite outputs"
    err = (out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)
    tol = 6e-3 if dtype == torch.bfloat16 else 2e-3
    assert err < tol, f"relative error {err:.2e} >= {tol}"
    # Elementwise: every output within a few output ulps of the reference, scaled by the row's size.
    scale = ref.abs() + ref.pow(2).mean(-1, keepdim=True).sqrt()
    assert ((out.float() - ref).abs() <= 4 * tol * scale).all()


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


@pytest.mark.parametrize("K,N", DESIGN_SHAPES)
@pytest.mark.gpu
@requires_cuda
def test_design_shapes_every_gemv_m(K, N):
    gen = torch.Generator().manual_seed(K * 7 + N)
    for k in fmt.SUPPORTED_BITS:
        w, flat = _random_weight(N, K, k, gen)
        x = torch.randn(8, K, generator=gen).to(torch.bfloat16).cuda()
        ref = _reference(x, flat, None)
        for M in (1, 2, 3, 4, 8):
            _poison_cache(M * N * 2)
            _check(kbit_linear(x[:M], w), ref[:M], torch.bfloat16)
        del w, flat, ref
        torch.cuda.empty_cache()


@pytest.mark.gpu
@requires_cuda
def test_leading_dims_strided_and_unaligned_inputs():
    gen = torch.Generator().manual_seed(1)
    w, flat = _random_weight(100, 96, 3, gen)
    x = torch.randn(2, 2, 97, generator=gen).to(torch.float16).cuda()[..., 1:]  # strided, 2-byte offset
    out = kbit_linear(x, w)
    assert out.shape == (2, 2, 100)
    _check(out.view(4, 100), _reference(x.reshape(4, 96), flat, None), torch.float16)


@pytest.mark.gpu
@requires_cuda
def test_fp32_activations_use_dequant_path():
    gen = torch.Generator().manual_seed(2)
    w, flat = _random_weight(65, 160, 5, gen)
    x = torch.randn(2, 160, generator=gen).cuda()
    out = kbit_linear(x, w)
    ref = _reference(x, flat, None)
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


@pytest.mark.gpu
@requires_cuda
def test_cuda_graph_capture_and_replay():
    gen = torch.Generator().manual_seed(3)
    w, flat = _random_weight(1000, 2048, 4, gen)
    bias = torch.randn(1000, generator=gen).to(torch.bfloat16).cuda()
    Ms = (1, 2, 3, 4, 16)
    static_x = {M: torch.randn(M, 2048, generator=gen).to(torch.bfloat16).cuda() for M in Ms}
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
        new_x = {M: torch.randn(M, 2048, generator=gen).to(torch.bfloat16).cuda() for M in Ms}
        for M in Ms:
            static_x[M].copy_(new_x[M])
        graph.replay()
        torch.cuda.synchronize()
        for M in Ms:
            assert torch.equal(static_out[M], kbit_linear(new_x[M], w, bias)), f"replay differs from eager at M={M}"
            _check(static_out[M], _reference(new_x[M], flat, bias), torch.bfloat16)


@pytest.mark.parametrize("M", [1, 3, 4, 9])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.gpu
@requires_cuda
def test_opcheck_cuda(M, with_bias):
    gen = torch.Generator().manual_seed(M)
    w, _ = _random_weight(70, 160, 3, gen)
    x = torch.randn(M, 160, generator=gen).to(torch.bfloat16).cuda()
    bias = torch.randn(70, generator=gen).to(torch.bfloat16).cuda() if with_bias else None
    torch.library.opcheck(torch.ops.kbit.linear.default, (x, w.qweight_rt, w.absmax_rt, w.codebook, 70, 160, bias))


@pytest.mark.gpu
@requires_cuda
def test_split_heuristic_cpp_matches_python():
    if not vllm_kbit.HAS_CUDA_KERNELS:
        pytest.skip("CUDA extension not built")
    rng = random.Random(0)
    cases = [(*gemv_tiles(N, K), sms) for K, N in DESIGN_SHAPES for sms in (114, 132, 148)]
    cases += [(rng.randint(1, 3000), rng.randint(1, 300), rng.choice([1, 7, 114, 132, 148])) for _ in range(2000)]
    for n_tiles, k_tiles, sms in cases:
        assert torch.ops.kbit._gemv_splits(n_tiles, k_tiles, sms) == gemv_splits(n_tiles, k_tiles, sms)


# ----------------------------------------------------------------------------- CPU: the split-K heuristic


def _assert_no_empty_split(n_tiles, k_tiles, sms):
    S = gemv_splits(n_tiles, k_tiles, sms)
    assert 1 <= S <= min(GEMV_MAX_SPLITS, k_tiles)
    bounds = [s * k_tiles // S for s in range(S + 1)]  # the kernel's partition
    assert bounds[0] == 0 and bounds[-1] == k_tiles
    assert all(bounds[s + 1] - bounds[s] >= 1 for s in range(S)), (n_tiles, k_tiles, sms, S)


@pytest.mark.parametrize("sms", [114, 132, 148])
def test_split_heuristic_never_makes_an_empty_split(sms):
    for K, N in DESIGN_SHAPES:
        _assert_no_empty_split(*gemv_tiles(N, K), sms)
    rng = random.Random(sms)
    for _ in range(5000):
        _assert_no_empty_split(rng.randint(1, 5000), rng.randint(1, 400), sms)
    for k_tiles in range(1, 20):  # the smallest K, where splits are tightest
        for n_tiles in range(1, 300):
            _assert_no_empty_split(n_tiles, k_tiles, sms)
