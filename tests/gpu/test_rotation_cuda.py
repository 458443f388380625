"""kbit::hadamard_rotate on CUDA tensors (the reference on any device) against the CPU result, and under CUDA-graph
capture: what the runtime's fused or Hadacore rotation will be compared with."""

from __future__ import annotations

import pytest
import torch

from vllm_kbit import ops  # noqa: F401  (registers torch.ops.kbit)
from vllm_kbit import reference as fmt
from vllm_kbit.settings import Rotation

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, requires_cuda]


@pytest.mark.parametrize("K,dtype", [(2048, torch.bfloat16), (768, torch.float16), (5120, torch.float32)])
def test_cuda_equals_cpu_and_round_trips(K, dtype):
    rot = Rotation(seed=3)
    b, s = rot.block(K), rot.signs(K)
    x = torch.randn(37, K).to(dtype)
    want = torch.ops.kbit.hadamard_rotate(x, s, b)
    got = torch.ops.kbit.hadamard_rotate(x.cuda(), s.cuda(), b)
    assert torch.equal(got.cpu(), want)  # the same fp32 adds in the same order, one rounding to dtype
    back = torch.ops.kbit.hadamard_rotate(got.float(), s.cuda(), b, True)
    assert (back.cpu() - x.float()).abs().max() <= 1e-2 * x.float().abs().max()


def test_cuda_graph_replay_equals_eager():
    K = 4096
    s = fmt.rotation_signs(K, 0, "cuda")
    x = torch.randn(8, K, device="cuda", dtype=torch.bfloat16)
    eager = torch.ops.kbit.hadamard_rotate(x, s, 1024)
    g = torch.cuda.CUDAGraph()
    torch.ops.kbit.hadamard_rotate(x, s, 1024)  # warm-up outside capture
    with torch.cuda.graph(g):
        out = torch.ops.kbit.hadamard_rotate(x, s, 1024)
    x.copy_(torch.randn_like(x))
    g.replay()
    assert torch.equal(out, torch.ops.kbit.hadamard_rotate(x, s, 1024))
    assert not torch.equal(out, eager)
