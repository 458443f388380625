"""CUDA kernels of the kbit format (quantize, dequantize, repack, dequantize_runtime) against
the PyTorch reference in vllm_kbit.reference, run on CPU copies of the same inputs.

Everything must match bit for bit: packed words, scale codes, runtime layout with its zero
padding, and dequantized values. Each case draws fresh inputs from its own seed, and the
allocator's cache is filled with 0x7F bytes before each kernel call, so an element the kernel
fails to write keeps a value that differs from the reference.
"""

import random

import pytest
import torch

import vllm_kbit
from vllm_kbit import reference as fmt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
N_RANDOM_CASES = 240


def _poison_cache(nbytes: int) -> None:
    """Leaves a freed block of 0x7F bytes in the caching allocator for the next outputs to land in."""
    torch.full((nbytes + 4096,), 0x7F, dtype=torch.uint8, device="cuda")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Tensor as integers of the same width, so NaNs and signed zeros compare exactly."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype} {got.shape} vs {want.dtype} {want.shape}"
    diff = (_bits(got) != _bits(want)).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} of {got.numel()} elements differ, first at {diff[0].tolist()}"


def _codebook(k: int, rng: random.Random) -> torch.Tensor:
    """The default codebook, or a random ascending one with max |c| == 1 (asymmetric, uneven)."""
    if rng.random() < 0.6:
        return fmt.normal_float_codebook(k)
    while True:
        c = torch.tensor(sorted(rng.uniform(-1.0, 1.0) for _ in range(2**k)), dtype=torch.float64)
        cb = (c / c.abs().max()).float()
        if (cb[1:] > cb[:-1]).all() and cb.abs().max() == 1.0:
            return cb


def _random_weight(N: int, K: int, k: int, dtype: torch.dtype, cb: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Gaussian blocks at scales from 1e-6 to ~31, with zero blocks, blocks whose max sits on an E4M4
    midpoint (tie to the lower code), and elements placed exactly on scaled codebook thresholds."""
    KB = K // fmt.BLOCK_SIZE
    scales = torch.tensor([1e-6, 1e-3, 0.02, 0.3, 1.0, 4.0, 30.0])
    block_scale = scales[torch.randint(len(scales), (N, KB, 1), generator=gen)]
    w = torch.randn(N, KB, fmt.BLOCK_SIZE, generator=gen) * block_scale
    w = w.clamp(-31.0, 31.0)
    rows = torch.rand(N, KB, generator=gen)
    w[rows < 0.05] = 0.0
    # Block max exactly on a midpoint between two E4M4 codes (exact in every dtype used here).
    mid = (fmt.e4m4_table()[:-1] + fmt.e4m4_table()[1:]) * 0.5
    on_mid = (rows > 0.05) & (rows < 0.12)
    codes = torch.randint(40, 254, (N, KB), generator=gen)
    w[on_mid] = w[on_mid].clamp(-1, 1) * (mid[codes[on_mid]] * 0.5).unsqueeze(-1)
    w[on_mid, 0] = mid[codes[on_mid]]
    w = w.to(dtype)
    # Elements equal to fp32(t_i * s) rounded to the input dtype (w > t ties and near-ties).
    s = fmt.e4m4_decode(fmt.block_absmax_codes(w.view(N, K)))
    t = fmt.codebook_thresholds(cb)
    on_thr = torch.rand(N, KB, fmt.BLOCK_SIZE, generator=gen) < 0.1
    which = torch.randint(len(t), (N, KB, fmt.BLOCK_SIZE), generator=gen)
    thr_vals = (t[which] * s.unsqueeze(-1)).to(dtype)
    w = torch.where(on_thr & (w.abs().amax(-1, keepdim=True) > 0), thr_vals, w)
    return w.reshape(N, K).contiguous()


def _random_case(i: int):
    rng = random.Random(1000 + i)
    gen = torch.Generator().manual_seed(1000 + i)
    N = rng.choice((1, 2, 3, 5, 7, 31, 63, 64, 65, 100, 127, 129, rng.randint(1, 300), rng.randint(1, 1200)))
    KB = rng.choice((1, 2, 3, 4, 5, 7, 8, 9, 13, 31, 33, rng.randint(1, 64), rng.randint(1, 160)))
    k = fmt.SUPPORTED_BITS[i % 4]
    in_dtype = DTYPES[(i // 4) % 3]
    out_dtype = DTYPES[(i // 12) % 3]
    cb = _codebook(k, rng)
    W = _random_weight(N, KB * fmt.BLOCK_SIZE, k, in_dtype, cb, gen)
    return W, cb, k, out_dtype


def _random_packed(N: int, KB: int, k: int, gen: torch.Generator):
    """Every bit pattern and every scale code, 0 and 255 included."""
    q = torch.randint(-(2**31), 2**31, (N, KB, k), generator=gen, dtype=torch.int64).to(torch.int32)
    a = torch.randint(0, 256, (N, KB), generator=gen, dtype=torch.int64).to(torch.uint8)
    return q, a


def test_cuda_kernels_are_loaded():
    assert vllm_kbit.HAS_CUDA_KERNELS, "vllm_kbit/_C*.so is missing or failed to load"
    for op in ("quantize", "dequantize", "repack", "dequantize_runtime"):
        dump = torch._C._dispatch_dump(f"kbit::{op}")
        cuda_line = next(line for line in dump.splitlines() if line.startswith("CUDA"))
        assert "registration.cpp" in cuda_line, f"kbit::{op} CUDA kernel is not the C++ one: {cuda_line}"


@pytest.mark.parametrize("case", range(N_RANDOM_CASES))
def test_random_case_matches_reference(case):
    W, cb, k, out_dtype = _random_case(case)
    N, K = W.shape
    KB = K // fmt.BLOCK_SIZE
    search_scale = case % 3 != 0  # two cases in three with the (default) scale search, one plain absmax
    q_ref, a_ref = fmt.quantize(W, cb, k, search_scale)
    Wd, cbd = W.cuda(), cb.cuda()

    _poison_cache(W.numel() * 4)
    q, a = torch.ops.kbit.quantize(Wd, cbd, k, search_scale)
    _assert_same(a, a_ref, "absmax")
    _assert_same(q, q_ref, "qweight")

    _poison_cache(W.numel() * 4)
    _assert_same(torch.ops.kbit.dequantize(q, a, cbd, out_dtype), fmt.dequantize(q_ref, a_ref, cb, out_dtype), "dequantize")

    _poison_cache(q.numel() * 8)
    q_rt, a_rt = torch.ops.kbit.repack(q, a)
    q_rt_ref, a_rt_ref = fmt.repack(q_ref, a_ref)
    _assert_same(q_rt, q_rt_ref, "qweight_rt")
    _assert_same(a_rt, a_rt_ref, "absmax_rt")

    _poison_cache(W.numel() * 4)
    got = torch.ops.kbit.dequantize_runtime(q_rt, a_rt, cbd, N, K, out_dtype)
    _assert_same(got, fmt.dequantize_runtime(q_rt_ref, a_rt_ref, cb, N, K, out_dtype), "dequantize_runtime")
    assert KB * fmt.BLOCK_SIZE == K


@pytest.mark.parametrize("k", fmt.SUPPORTED_BITS)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_dequantize_every_pattern_and_code(k, out_dtype):
    gen = torch.Generator().manual_seed(77 + k)
    for N, KB in ((1, 1), (3, 5), (67, 9), (129, 130)):
        q, a = _random_packed(N, KB, k, gen)
        a.view(-1)[: min(256, a.numel())] = torch.arange(min(256, a.numel()), dtype=torch.uint8)
        cb = fmt.normal_float_codebook(k)
        _poison_cache(q.numel() * 256)
        _assert_same(
            torch.ops.kbit.dequantize(q.cuda(), a.cuda(), cb.cuda(), out_dtype), fmt.dequantize(q, a, cb, out_dtype), "dequantize"
        )
        q_rt, a_rt = fmt.repack(q, a)
        _poison_cache(q.numel() * 256)
        got = torch.ops.kbit.dequantize_runtime(q_rt.cuda(), a_rt.cuda(), cb.cuda(), N, KB * 32, out_dtype)
        _assert_same(got, fmt.dequantize_runtime(q_rt, a_rt, cb, N, KB * 32, out_dtype), "dequantize_runtime")


@pytest.mark.parametrize("k", fmt.SUPPORTED_BITS)
def test_repack_padding_is_zero(k):
    gen = torch.Generator().manual_seed(5 + k)
    for N, KB in ((1, 1), (65, 5), (64, 4), (200, 37)):
        q, a = _random_packed(N, KB, k, gen)
        q_rt, a_rt = torch.ops.kbit.repack(q.cuda(), a.cuda())
        q_ref, a_ref = fmt.repack(q, a)
        _assert_same(q_rt, q_ref, "qweight_rt")
        _assert_same(a_rt, a_ref, "absmax_rt")
        back_q, back_a = fmt.unrepack(q_rt.cpu(), a_rt.cpu(), N, KB * 32)
        assert torch.equal(back_q, q) and torch.equal(back_a, a)


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values(dtype):
    """Signed zeros, tiny values and magnitudes at the E4M4 saturation edge quantize like the reference."""
    k = 4
    cb = fmt.normal_float_codebook(k)
    gen = torch.Generator().manual_seed(3)
    W = torch.randn(8, 4 * 32, generator=gen)
    W[2, :32] = -0.0
    W[3, 5] = 31.0
    W[3, 40] = 31.4
    W[3, 70] = -31.375  # within the largest scale's rounding (and exact in bf16 and fp16): still representable
    W[5, :32] = 2.0**-20  # below every nonzero E4M4 code's midpoint
    W = W.to(dtype)
    q_ref, a_ref = fmt.quantize(W, cb, k)
    q, a = torch.ops.kbit.quantize(W.cuda(), cb.cuda(), k)
    _assert_same(a, a_ref, "absmax")
    _assert_same(q, q_ref, "qweight")


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), 31.5, -40.0])
def test_unrepresentable_values_raise_like_the_reference(value):
    """Non-finite weights and |w| beyond the largest E4M4 scale are refused, with the reference's message."""
    k = 4
    cb = fmt.normal_float_codebook(k)
    W = torch.randn(8, 4 * 32, generator=torch.Generator().manual_seed(4))
    W[1, 37] = value
    with pytest.raises(ValueError) as ref:
        fmt.quantize(W, cb, k)
    with pytest.raises(ValueError) as got:
        torch.ops.kbit.quantize(W.cuda(), cb.cuda(), k)
    assert str(got.value) == str(ref.value)


def test_no_stale_values_between_calls():
    """Two calls on different inputs of one shape (outputs reuse the same cached memory) both match."""
    k, N, K = 3, 130, 320
    cb = fmt.normal_float_codebook(k)
    gen = torch.Generator().manual_seed(11)
    for _ in range(2):
        W = torch.randn(N, K, generator=gen).to(torch.bfloat16)
        q_ref, a_ref = fmt.quantize(W, cb, k)
        q, a = torch.ops.kbit.quantize(W.cuda(), cb.cuda(), k)
        _assert_same(q, q_ref, "qweight")
        _assert_same(a, a_ref, "absmax")
        out = torch.ops.kbit.dequantize(q, a, cb.cuda(), torch.bfloat16)
        _assert_same(out, fmt.dequantize(q_ref, a_ref, cb, torch.bfloat16), "dequantize")
        del q, a, out


def test_unaligned_weight_view():
    """A contiguous view that starts at an odd element offset (not 16-byte aligned) still quantizes."""
    k, cb = 4, fmt.normal_float_codebook(4)
    flat = torch.randn(1 + 3 * 64, generator=torch.Generator().manual_seed(2)).to(torch.float16)
    W = flat[1:].view(3, 64)
    q_ref, a_ref = fmt.quantize(W.contiguous(), cb, k)
    q, a = torch.ops.kbit.quantize(flat.cuda()[1:].view(3, 64), cb.cuda(), k)
    _assert_same(q, q_ref, "qweight")
    _assert_same(a, a_ref, "absmax")


def test_large_tensor():
    """One weight big enough for a full persistent grid with many iterations per warp."""
    k, cb = 4, fmt.normal_float_codebook(4)
    W = torch.randn(2048, 4096, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    q_ref, a_ref = fmt.quantize(W, cb, k)
    q, a = torch.ops.kbit.quantize(W.cuda(), cb.cuda(), k)
    _assert_same(q, q_ref, "qweight")
    _assert_same(a, a_ref, "absmax")
    _assert_same(torch.ops.kbit.dequantize(q, a, cb.cuda(), torch.bfloat16), fmt.dequantize(q_ref, a_ref, cb, torch.bfloat16), "dequantize")


@pytest.mark.parametrize("k", fmt.SUPPORTED_BITS)
def test_large_runtime_dequantize(k):
    """The runtime layout's dequantize over a grid-stride loop of many steps per warp, with a partial last
    runtime tile in both N (an odd count of rows) and K (blocks not a multiple of 4), every code pattern."""
    gen = torch.Generator().manual_seed(20 + k)
    N, KB = 64 * 37 + 29, 4 * 61 + 3
    q, a = _random_packed(N, KB, k, gen)
    cb = _codebook(k, random.Random(k))
    q_rt, a_rt = fmt.repack(q, a)
    for out_dtype in DTYPES:
        _poison_cache(N * KB * 32 * 4)
        got = torch.ops.kbit.dequantize_runtime(q_rt.cuda(), a_rt.cuda(), cb.cuda(), N, KB * 32, out_dtype)
        _assert_same(got, fmt.dequantize_runtime(q_rt, a_rt, cb, N, KB * 32, out_dtype), "dequantize_runtime")


# ----------------------------------------------------------------------------- bad inputs


def _good():
    k = 4
    W = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    cb = fmt.normal_float_codebook(k, "cuda")
    q, a = torch.ops.kbit.quantize(W, cb, k)
    q_rt, a_rt = torch.ops.kbit.repack(q, a)
    return W, cb, k, q, a, q_rt, a_rt


BAD_CALLS = {
    "quantize int weight": (TypeError, lambda W, cb, k, q, a, qr, ar: torch.ops.kbit.quantize(W.int(), cb, k)),
    "quantize k=6": (ValueError, lambda W, cb, k, q, a, qr, ar: torch.ops.kbit.quantize(W, cb, 6)),
    "quantize K%32": (ValueError, lambda W, cb, k, q, a, qr, ar: torch.ops.kbit.quantize(W[:, :48].contiguous(), cb, k)),
    "quantize 1-D": (ValueError, lambda W, cb, k, q, a, qr, ar: torch.ops.kbit.quantize(W.view(-1), cb, k)),
    "quantize non-contiguous": (ValueError, lambda W, cb, k, q, a, qr, ar: torch.ops.kbit.quantize(W[:, ::2], cb, k)),
    "quantize codebook size": (ValueError, lambda W, cb, k, q, a, qr, ar: torch.ops.kbit.quantize(W, cb[:8], k)),
    "quantize codebook dtype": (TypeError, lambda W, cb, k, q, a, qr, ar: torch.ops.kbit.quantize(W, cb.double(), k)),
    "quantize codebook device": (ValueError, lambda W, cb, k, q, a, qr, ar: torch.ops.kbit.quantize(W, cb.cpu(), k)),
    "dequantize qweight dtype": (
        TypeError,
        lambda W, cb, k, q, a, qr, ar: torch.ops.kbit.dequantize(q.long(), a, cb, torch.bfloat16),
    ),
    "dequantize absmax shape": (
        ValueError,
        lambda W, cb, k, q, a, qr, ar: torch.ops.kbit.dequantize(q, a[:, :2].contiguous(), cb, torch.bfloat16),
    ),
    "dequantize k=6": (
        ValueError,
        lambda W, cb, k, q, a, qr, ar: torch.ops.kbit.dequantize(torch.cat([q, q[..., :2]], -1), a, cb, torch.bfloat16),
    ),
    "dequantize out dtype": (TypeError, lambda W, cb, k, q, a, qr, ar: torch.ops.kbit.dequantize(q, a, cb, torch.int32)),
    "dequantize non-contiguous": (
        ValueError,
        lambda W, cb, k, q, a, qr, ar: torch.ops.kbit.dequantize(q.transpose(0, 1), a.t(), cb, torch.bfloat16),
    ),
    "dequantize codebook size": (
        ValueError,
        lambda W, cb, k, q, a, qr, ar: torch.ops.kbit.dequantize(q, a, cb[:4].contiguous(), torch.bfloat16),
    ),
    "repack absmax dtype": (ValueError, lambda W, cb, k, q, a, qr, ar: torch.ops.kbit.repack(q, a.int())),
    "repack qweight 2-D": (TypeError, lambda W, cb, k, q, a, qr, ar: torch.ops.kbit.repack(q[..., 0].contiguous(), a)),
    "dequantize_runtime K%32": (
        ValueError,
        lambda W, cb, k, q, a, qr, ar: torch.ops.kbit.dequantize_runtime(qr, ar, cb, 64, 120, torch.bfloat16),
    ),
    "dequantize_runtime shape": (
        ValueError,
        lambda W, cb, k, q, a, qr, ar: torch.ops.kbit.dequantize_runtime(qr, ar, cb, 65, 128, torch.bfloat16),
    ),
    "dequantize_runtime dtype": (
        TypeError,
        lambda W, cb, k, q, a, qr, ar: torch.ops.kbit.dequantize_runtime(qr.float(), ar, cb, 64, 128, torch.bfloat16),
    ),
    "dequantize_runtime out dtype": (
        TypeError,
        lambda W, cb, k, q, a, qr, ar: torch.ops.kbit.dequantize_runtime(qr, ar, cb, 64, 128, torch.int8),
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_inputs_raise(name):
    exc, call = BAD_CALLS[name]
    with pytest.raises(exc, match="kbit: "):
        call(*_good())


# ----------------------------------------------------------------------------- opcheck


def _opcheck_cases():
    k = 3
    W = torch.randn(70, 96, device="cuda", dtype=torch.float16)
    cb = fmt.normal_float_codebook(k, "cuda")
    q, a = torch.ops.kbit.quantize(W, cb, k)
    q_rt, a_rt = torch.ops.kbit.repack(q, a)
    return {
        "quantize": (torch.ops.kbit.quantize.default, (W, cb, k)),
        "dequantize": (torch.ops.kbit.dequantize.default, (q, a, cb, torch.bfloat16)),
        "repack": (torch.ops.kbit.repack.default, (q, a)),
        "dequantize_runtime": (torch.ops.kbit.dequantize_runtime.default, (q_rt, a_rt, cb, 70, 96, torch.float32)),
    }


@pytest.mark.parametrize("op", ["quantize", "dequantize", "repack", "dequantize_runtime"])
def test_opcheck(op):
    fn, args = _opcheck_cases()[op]
    torch.library.opcheck(fn, args)
