"""kbit::quantize on CPU tensors runs the compiled kernel (vllm_kbit._cpu): bit for bit the reference's."""

import glob
import os

import pytest
import torch

from vllm_kbit import ops
from vllm_kbit import reference as fmt

# Where setup.py built the CPU kernels they must load; the reference-only install is tested by the
# tests that set VLLM_KBIT_LOAD_EXTENSION=0.
BUILT = bool(glob.glob(os.path.join(os.path.dirname(ops.__file__), "_cpu*.so")))
pytestmark = pytest.mark.skipif(not BUILT, reason="vllm_kbit._cpu is not built (pip install --no-build-isolation .)")


def test_the_cpu_kernel_serves_quantize():
    assert ops.HAS_CPU_KERNELS


def weights(seed: int, dtype: torch.dtype, n: int = 96, kb: int = 24) -> torch.Tensor:
    """Rows of N(0, 1) at scales 1e-6 .. 20, with blocks the scale rules treat specially: all zero,
    subnormal-scale, at the E4M4 ceiling, few distinct values (ties between candidates), and
    elements exactly on a threshold * scale product."""
    g = torch.Generator().manual_seed(seed)
    W = (torch.randn(n, kb * 32, generator=g) * torch.exp(torch.empty(n, 1).uniform_(-14, 3, generator=g))).clamp(-31, 31)
    W[0, :32] = 0
    W[1, :32] = 2.0**-16
    W[2, :32] = torch.linspace(-31, 31, 32)
    W[3, :64] = torch.randint(-2, 3, (64,), generator=g).float()
    cb = fmt.default_codebook(4)
    W[4, :32] = (fmt.codebook_thresholds(cb) * 0.25).repeat(3)[:32]  # scale 0.25 products, ties to the lower level
    return W.to(dtype).contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k", fmt.SUPPORTED_BITS)
@pytest.mark.parametrize("search_scale", [True, False])
def test_equals_reference_bit_for_bit(dtype, k, search_scale):
    W = weights(10 * k + search_scale, dtype)
    cb = fmt.default_codebook(k)
    q, a = torch.ops.kbit._quantize_cpu(W, cb, k, search_scale)
    q_ref, a_ref = fmt.quantize(W, cb, k, search_scale)
    assert torch.equal(a, a_ref)
    assert torch.equal(q, q_ref)


@pytest.mark.parametrize("k", [3, 4])
def test_other_codebooks_equal_reference(k):
    W = weights(7, torch.bfloat16)
    for cb in (fmt.normal_float_codebook(k), torch.linspace(-1, 1, 2**k)):
        got = torch.ops.kbit.quantize(W, cb.contiguous(), k)
        ref = fmt.quantize(W, cb.contiguous(), k)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_public_op_keeps_the_reference_checks():
    cb = fmt.default_codebook(4)
    with pytest.raises(ValueError, match="not a positive multiple of 32"):
        torch.ops.kbit.quantize(torch.randn(4, 40), cb, 4)
    with pytest.raises(ValueError, match="above the largest E4M4 block scale"):
        torch.ops.kbit.quantize(torch.full((2, 32), 100.0), cb, 4)
    with pytest.raises(ValueError, match="NaN or Inf"):
        torch.ops.kbit.quantize(torch.full((2, 32), float("nan")), cb, 4)


@pytest.mark.parametrize(
    "args, error, text",
    [
        ((torch.randn(4, 32), torch.zeros(16), 6, True), ValueError, "k=6 is not supported"),
        ((torch.randn(4, 32, dtype=torch.float64), torch.zeros(16), 4, True), TypeError, "weight has dtype torch.float64"),
        ((torch.randn(4, 40), torch.zeros(16), 4, True), ValueError, "positive multiple of 32"),
        ((torch.randn(32, 4).t(), torch.zeros(16), 4, True), ValueError, "contiguous"),
        ((torch.randn(4, 32), torch.zeros(8), 4, True), ValueError, "codebook has 8 entries but k=4 needs 16"),
    ],
)
def test_raw_kernel_refuses_bad_input_in_one_line(args, error, text):
    with pytest.raises(error, match=text) as e:
        torch.ops.kbit._quantize_cpu(*args)
    assert "\n" not in str(e.value).strip()
