"""Range-scaled weights (reference.range_scale: the layer's power of two folded into its codebook) through the
CUDA kernels: |w| = 100 and |w| ~ 1e-6 on every dense path (GEMV, MMA with table and with shuffle decode,
wgmma, dequantize + cuBLAS) and every MoE path, against the fp32 product of the same dequantized weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vllm_kbit
from vllm_kbit import reference as fmt
from vllm_kbit.moe import kbit_fused_moe, stack_runtime

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, requires_cuda]

# (M, N, K): GEMV (M = 1), MMA table decode (M = 4, p = 1), MMA shuffle decode (M = 40, p = 8), wgmma
# (M = 100 on >= 10240 rows), dequantize + cuBLAS (M = 600 on a small weight).
DENSE_CASES = [(1, 1024, 2048), (4, 1024, 2048), (40, 1024, 2048), (100, 10240, 2048), (600, 512, 1024)]
MOE_PATHS = ("auto", "gemv", "grouped_mm", "grouped_mma", "gemv_direct", "grouped_wgmma")


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _weight(N: int, K: int, scale: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, K, generator=g) * scale).to(torch.bfloat16).cuda()


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("scale,dtype", [(100.0, torch.bfloat16), (100.0, torch.float16), (1e-6, torch.bfloat16)])
@pytest.mark.parametrize("M,N,K", DENSE_CASES)
def test_linear_on_range_scaled_weights(k, scale, dtype, M, N, K):
    W = _weight(N, K, scale, seed=k)
    q = vllm_kbit.quantize(W, k)
    assert fmt.weight_range_scale(W) != 1.0
    qrt, art = q.repack()
    deq = torch.ops.kbit.dequantize_runtime(qrt, art, q.codebook, N, K, torch.float32)
    assert torch.isfinite(deq).all() and _rel_err(deq, W.float()) < 0.6  # kept (zeroed weights: 1.0; k = 2: ~0.4)
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    if dtype == torch.float16 and scale > 1:
        x = x / 64  # keeps 100-sized weights' outputs (~1e4) far from fp16's 65504
    out = torch.ops.kbit.linear(x, qrt, art, q.codebook, N, K, None)
    assert out.dtype == dtype and torch.isfinite(out).all()
    ref = x.float() @ deq.T
    assert _rel_err(out, ref) < 1.5e-2


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("path", MOE_PATHS)
@pytest.mark.parametrize("T", [1, 8, 200])
def test_fused_moe_with_one_expert_at_100(k, path, T):
    E, H, I, top_k = 8, 256, 512, 2
    g = torch.Generator().manual_seed(10 + k)
    w13 = [torch.randn(2 * I, H, generator=g) * 0.05 for _ in range(E)]
    w2 = [torch.randn(H, I, generator=g) * 0.05 for _ in range(E)]
    w13[3][7, 11] = 100.0  # one weight of one expert beyond the old E4M4 limit of 31
    s = fmt.range_scale(max(w.abs().max().item() for w in w13 + w2))
    assert s != 1.0
    cb = fmt.default_codebook(k).cuda()
    q13, a13 = stack_runtime([torch.ops.kbit.quantize(fmt.range_scaled(w, s).cuda().contiguous(), cb, k) for w in w13])
    q2, a2 = stack_runtime([torch.ops.kbit.quantize(fmt.range_scaled(w, s).cuda().contiguous(), cb, k) for w in w2])
    codebook = cb * s
    D13 = torch.stack([torch.ops.kbit.dequantize_runtime(q13[e], a13[e], codebook, 2 * I, H, torch.float32) for e in range(E)])
    D2 = torch.stack([torch.ops.kbit.dequantize_runtime(q2[e], a2[e], codebook, H, I, torch.float32) for e in range(E)])
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(T)]).to(torch.int32)
    ids[0, 0] = 3  # the expert with the large weight is used
    ids = ids.cuda()
    weights = torch.softmax(torch.randn(T, top_k, generator=g), -1).cuda()
    if path == "auto":
        out = kbit_fused_moe(x, ids, weights, q13, a13, q2, a2, codebook, I, None, False)
    else:
        out = torch.ops.kbit._fused_moe_cuda(x, ids, weights, q13, a13, q2, a2, codebook, I, None, False,
                                             torch.ops.kbit._moe_path_id(path))
    ref = torch.zeros(T, H, device="cuda")
    for t in range(T):
        for j in range(top_k):
            e = int(ids[t, j])
            gu = x[t].float() @ D13[e].T
            ref[t] += weights[t, j] * ((F.silu(gu[:I]) * gu[I:]) @ D2[e].T)
    assert torch.isfinite(out).all()
    assert _rel_err(out, ref) < 1.5e-2, path
