"""Bad input gets a one-line error saying what is wrong and what is supported."""

import pytest
import torch

import vllm_kbit
from vllm_kbit import reference as fmt


def _one_line(excinfo):
    assert "\n" not in str(excinfo.value)


@pytest.mark.parametrize("k", [1, 6, 8, 4.0])
def test_unsupported_k(k):
    with pytest.raises(ValueError, match="k must be one of") as e:
        vllm_kbit.quantize(torch.randn(4, 32), k)
    _one_line(e)


def test_unsupported_dtype():
    with pytest.raises(TypeError, match="supported: float16, bfloat16, float32") as e:
        vllm_kbit.quantize(torch.randn(4, 32).double(), 4)
    _one_line(e)
    with pytest.raises(TypeError, match="supported"):
        vllm_kbit.quantize(torch.randint(0, 3, (4, 32)), 4)


@pytest.mark.parametrize("shape", [(4, 33), (4, 0), (4, 48)])
def test_K_not_a_multiple_of_32(shape):
    with pytest.raises(ValueError, match="multiple of 32") as e:
        vllm_kbit.quantize(torch.randn(shape), 4)
    _one_line(e)


def test_not_2d():
    with pytest.raises(ValueError, match="2-D"):
        vllm_kbit.quantize(torch.randn(2, 4, 32), 4)


def test_non_contiguous():
    with pytest.raises(ValueError, match="contiguous"):
        vllm_kbit.quantize(torch.randn(64, 64).T, 4)


def test_non_finite_and_out_of_range_weights():
    W = torch.randn(4, 32)
    W[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        vllm_kbit.quantize(W, 4)
    W[1, 3] = 100.0
    with pytest.raises(ValueError, match="above the largest E4M4 block scale") as e:
        vllm_kbit.quantize(W, 4)
    _one_line(e)


def test_mismatched_packed_tensors_through_the_op():
    w = vllm_kbit.quantize(torch.randn(8, 64), 3)
    with pytest.raises(ValueError, match="absmax must be uint8"):
        torch.ops.kbit.dequantize(w.qweight, w.absmax[:, :1].contiguous(), w.codebook, torch.bfloat16)
    with pytest.raises(ValueError, match="absmax must be uint8"):
        torch.ops.kbit.dequantize(w.qweight, w.absmax.to(torch.int32), w.codebook, torch.bfloat16)
    with pytest.raises(ValueError, match="codebook has 16 entries but k=3 needs 8"):
        torch.ops.kbit.dequantize(w.qweight, w.absmax, fmt.normal_float_codebook(4), torch.bfloat16)
    with pytest.raises(TypeError, match="qweight must be int32"):
        torch.ops.kbit.dequantize(w.qweight.float(), w.absmax, w.codebook, torch.bfloat16)
    with pytest.raises(ValueError, match="k must be one of"):
        torch.ops.kbit.dequantize(torch.zeros(8, 2, 6, dtype=torch.int32), w.absmax[:, :2].contiguous(), w.codebook, torch.bfloat16)
    with pytest.raises(TypeError, match="output dtype"):
        torch.ops.kbit.dequantize(w.qweight, w.absmax, w.codebook, torch.int8)


def test_mismatched_runtime_tensors_and_activations():
    w = vllm_kbit.quantize(torch.randn(8, 64), 3)
    q_rt, a_rt = w.repack()
    with pytest.raises(ValueError, match="runtime tensors for \\[8, 544\\]"):
        torch.ops.kbit.dequantize_runtime(q_rt, a_rt, w.codebook, 8, 128 * 4 + 32, torch.float32)
    with pytest.raises(ValueError, match="x has 32 features but the weight has K=64"):
        torch.ops.kbit.linear(torch.randn(2, 32), q_rt, a_rt, w.codebook, 8, 64, None)
    with pytest.raises(TypeError, match="x has dtype torch.int64"):
        torch.ops.kbit.linear(torch.ones(2, 64, dtype=torch.long), q_rt, a_rt, w.codebook, 8, 64, None)
