"""torch.ops.kbit on CPU: opcheck, the Python API, and agreement with the format module."""

import pytest
import torch

import vllm_kbit
from vllm_kbit import reference as fmt


def _weight(N, K, k, dtype=torch.bfloat16, seed=0):
    W = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return W, vllm_kbit.quantize(W, k)


@pytest.mark.parametrize("k", fmt.SUPPORTED_BITS)
def test_opcheck_every_op(k):
    W, w = _weight(70, 160, k, seed=k)
    q_rt, a_rt = w.repack()
    x = torch.randn(3, 160, dtype=torch.bfloat16)
    bias = torch.randn(70, dtype=torch.bfloat16)
    cases = [
        (torch.ops.kbit.quantize.default, (W, w.codebook, k)),
        (torch.ops.kbit.quantize.default, (W, w.codebook, k, False)),
        (torch.ops.kbit.dequantize.default, (w.qweight, w.absmax, w.codebook, torch.float16)),
        (torch.ops.kbit.repack.default, (w.qweight, w.absmax)),
        (torch.ops.kbit.unrepack.default, (q_rt, a_rt, 70, 160)),
        (torch.ops.kbit.dequantize_runtime.default, (q_rt, a_rt, w.codebook, 70, 160, torch.float32)),
        (torch.ops.kbit.linear.default, (x, q_rt, a_rt, w.codebook, 70, 160, bias)),
        (torch.ops.kbit.linear.default, (x, q_rt, a_rt, w.codebook, 70, 160, None)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_quantize_api_returns_one_object_with_everything():
    W, w = _weight(48, 96, 3)
    assert isinstance(w, vllm_kbit.KbitWeight)
    assert w.k == 3 and w.shape == (48, 96)
    assert w.qweight.shape == (48, 3, 3) and w.qweight.dtype == torch.int32
    assert w.absmax.shape == (48, 3) and w.absmax.dtype == torch.uint8
    assert torch.equal(w.codebook, fmt.default_codebook(3))
    assert w.bits_per_weight == 3.25
    q, a = fmt.quantize(W, w.codebook, 3)
    assert torch.equal(w.qweight, q) and torch.equal(w.absmax, a)
    assert torch.equal(w.dequantize(torch.float16), fmt.dequantize(q, a, w.codebook, torch.float16))


def test_linear_matches_dequantized_matmul():
    W, w = _weight(100, 256, 4, dtype=torch.float32)
    q_rt, a_rt = w.repack()
    x = torch.randn(2, 7, 256)
    bias = torch.randn(100)
    out = torch.ops.kbit.linear(x, q_rt, a_rt, w.codebook, 100, 256, bias)
    ref = x.double() @ w.dequantize(torch.float32).double().T + bias.double()
    assert out.shape == (2, 7, 100)
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-4)


def test_ops_run_under_torch_compile():
    W, w = _weight(64, 128, 2)
    q_rt, a_rt = w.repack()
    fn = torch.compile(lambda x: torch.ops.kbit.linear(x, q_rt, a_rt, w.codebook, 64, 128, None), fullgraph=True)
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    assert torch.equal(fn(x), torch.ops.kbit.linear(x, q_rt, a_rt, w.codebook, 64, 128, None))
