"""GPTQ on a CUDA device: refinement's steps replayed as CUDA graphs (gptq._GraphedStep) give what the same steps give
run one kernel at a time, and asymmetric calibration runs on the device."""

from __future__ import annotations

import pytest
import torch

from vllm_kbit import gptq
from vllm_kbit import reference as fmt

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, requires_cuda]


def _problem(B, N, K, k, seed):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(B, 1024, K, generator=g) @ (torch.eye(K) + 0.5 * torch.randn(K, K, generator=g) / K**0.5)
    H = (X.transpose(1, 2) @ X).cuda()
    W = (torch.randn(B, N, K, generator=g) * 0.02).cuda()
    cb = fmt.default_codebook(k, "cuda")
    q, a = gptq.gptq_quantize_experts(W, H, cb, k, refine_passes=0)
    idx = fmt.unpack_bitplanes(q).reshape(B, N, K).to(torch.uint8)
    Hd = torch.stack([gptq._damped(H[b], gptq.DEFAULT_DAMP) for b in range(B)])
    return W, Hd, idx, a, cb


@pytest.mark.parametrize("B,N,K,k,chunk", [(1, 96, 256, 3, 1 << 24), (3, 100, 192, 2, 1 << 14), (2, 64, 128, 4, 1 << 13)])
def test_refinement_graph_replay_equals_eager(monkeypatch, B, N, K, k, chunk):
    """Several blocks, passes and row chunks (a short last one where the chunk does not divide N): the graphed loop's
    indices and scale codes equal the eager loop's bit for bit, and the refinement changed something."""
    W, Hd, idx, a, cb = _problem(B, N, K, k, seed=B * 100 + k)
    monkeypatch.setattr(gptq, "REFINE_CHUNK", chunk)
    monkeypatch.setattr(gptq, "REFINE_CUDA_GRAPHS", True)
    i1, c1 = gptq.refine_rounding(W, Hd, idx, a, cb, 2)
    monkeypatch.setattr(gptq, "REFINE_CUDA_GRAPHS", False)
    i0, c0 = gptq.refine_rounding(W, Hd, idx, a, cb, 2)
    assert torch.equal(i1, i0) and torch.equal(c1, c0)
    assert not torch.equal(i1, idx) or not torch.equal(c1, a)


def test_asymmetric_target_on_cuda_matches_cpu():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(512, 64, generator=g)
    x_fp = x + 0.1 * torch.randn(512, 64, generator=g)
    W = torch.randn(2, 48, 64, generator=g)
    H = (x.T @ x).expand(2, -1, -1).contiguous()
    dC = gptq._input_shift(x_fp, x).expand(2, -1, -1).contiguous()
    want = gptq.asymmetric_target(W, H, dC, gptq.DEFAULT_DAMP, 1.0)
    got = gptq.asymmetric_target(W.cuda(), H.cuda(), dC.cuda(), gptq.DEFAULT_DAMP, 1.0)
    assert torch.allclose(got.cpu(), want, rtol=1e-4, atol=1e-4)
