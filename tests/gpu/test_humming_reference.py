"""benchmarks/accuracy_moe.py's humming_rtn (Humming's uint-k round to nearest, written out so the accuracy table
can run it on a CPU) against Humming's own quantizer and dequantizer (humming-kernels, GPU only): bit-identical
weights. Skipped where humming-kernels is not installed."""

from __future__ import annotations


import pytest
import torch

from kbit_dev import benchmarks

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, requires_cuda]


def _accuracy_moe():
    return benchmarks.load("accuracy_moe")


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("shape", [(256, 1536), (512, 576)])  # K = 576: SmolLM2's hidden size, padded to 640
def test_humming_rtn_matches_hummings_quantizer_bit_for_bit(k, shape):
    pytest.importorskip("humming", reason="humming-kernels is not installed")
    from humming.schema import HummingWeightSchema

    acc = _accuracy_moe()
    N, K = shape
    Kp = acc.humming_peer.round_up(K, acc.HUMMING_GROUP)
    g = torch.Generator().manual_seed(1000 * k + K)
    W = (torch.randn(N, K, generator=g) * 0.02).to(torch.bfloat16)
    W[0, :32] *= 40  # a row whose first group has one side much larger (the signed-scale choice)
    schema = HummingWeightSchema.from_config({"quant_method": "humming", "dtype": f"uint{k}", "group_size": acc.HUMMING_GROUP})
    padded = torch.zeros(N, Kp, dtype=torch.bfloat16)
    padded[:, :K] = W
    tensors = HummingWeightSchema.quant_tensor(padded.cuda(), schema, torch.bfloat16)
    theirs = schema.dequant_tensors(tensors).float().cpu()[:, :K]
    ours = acc.humming_rtn(W, k)
    assert torch.isfinite(theirs).all()
    assert torch.equal(ours, theirs), f"k={k} {shape}: {(ours != theirs).sum().item()} weights differ"
