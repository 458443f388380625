"""Bitwise repeatability of the CUDA ops: the same inputs give the same output bits on every call, eager
and under CUDA-graph replay, on every MoE path and every dense kernel the dispatch picks; and a token's
output does not depend on the other tokens of its batch (their values or where they are routed), as long
as the batch size is the same (vLLM pads CUDA-graph batches with rows of stale data).

The routing kernel orders the slots inside an expert by atomics (a different order per call), and the
split-K reductions run across CTAs; neither may leak into the result. Sizes cover the tiny Qwen3-MoE of
the vLLM e2e tests (H=256, I=128, 8 experts, top-2) at decode and prefill token counts, and the
Qwen3-30B-A3B layer.
"""

import pytest
import torch

import vllm_kbit
from vllm_kbit.linear import KbitLinearWeight, kbit_linear
from vllm_kbit.moe import kbit_fused_moe

from test_moe_cuda import Experts, poison_cache, random_routing, run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
REPEATS = 8


def assert_same_bits(outs, what):
    first = outs[0]
    assert not first.isnan().any(), f"{what}: NaN in the output (an element left unwritten)"
    for i, o in enumerate(outs[1:], start=1):
        differ = (o.view(torch.int16) != first.view(torch.int16)).sum().item()
        assert differ == 0, f"{what}: call {i} differs from call 0 in {differ} of {first.numel()} elements"


@pytest.mark.parametrize("E,top_k,H,I,T", [(8, 2, 256, 128, T) for T in (1, 2, 8, 36, 288, 512)]
                         + [(128, 8, 2048, 768, T) for T in (1, 16, 64, 300)])
@pytest.mark.parametrize("path", ("auto", "gemv", "grouped_mm", "grouped_mma", "gemv_direct", "grouped_wgmma"))
@pytest.mark.parametrize("bits", (2, 4))  # k = 2: the one-row decode differs from the others (gemv_core.cuh kPairs)
def test_fused_moe_repeats_bitwise(E, top_k, H, I, T, path, bits):
    gen = torch.Generator().manual_seed(T * 131 + E)
    ex = Experts(E, H, I, bits, gen)
    ids, w = random_routing(T, E, top_k, gen, "random")
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
    assert_same_bits([run(x, ids, w, ex, None, False, path) for _ in range(REPEATS)], f"fused_moe path {path} T={T}")


@pytest.mark.parametrize("E,top_k,H,I,T", [(8, 2, 256, 128, 8), (8, 2, 256, 128, 96), (128, 8, 2048, 768, 16)])
@pytest.mark.parametrize("path", ("auto", "gemv", "grouped_mm", "grouped_mma", "gemv_direct", "grouped_wgmma"))
@pytest.mark.parametrize("bits", (2, 4))
def test_fused_moe_rows_ignore_the_rest_of_the_batch(E, top_k, H, I, T, path, bits):
    gen = torch.Generator().manual_seed(T + E + len(path))
    ex = Experts(E, H, I, bits, gen)
    keep = T // 2
    outs = []
    for _ in range(3):  # the first `keep` tokens fixed; the others drawn afresh: other values, other experts
        ids, w = random_routing(T, E, top_k, gen, "random")
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
        if outs:
            ids[:keep], w[:keep], x[:keep] = ids0[:keep], w0[:keep], x0[:keep]
        else:
            ids0, w0, x0 = ids, w, x
        outs.append(run(x, ids, w, ex, None, False, path)[:keep])
    assert_same_bits(outs, f"fused_moe path {path} T={T}: the kept tokens")


@pytest.mark.parametrize("T", (2, 36))
def test_fused_moe_graph_replays_bitwise(T):
    gen = torch.Generator().manual_seed(T)
    ex = Experts(8, 256, 128, 4, gen)
    ids, w = random_routing(T, 8, 2, gen, "random")
    x = torch.randn(T, 256, generator=gen).to(torch.bfloat16).cuda()
    eager = run(x, ids, w, ex, None, False, "auto")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kbit_fused_moe(x, ids, w, *ex.args(), ex.I)
    outs = []
    for _ in range(REPEATS):
        out.fill_(float("nan"))
        graph.replay()
        outs.append(out.clone())
    assert_same_bits([eager] + outs, f"fused_moe graph replay T={T}")


@pytest.mark.parametrize("N,K", [(512, 256), (256, 256), (2048, 1024), (5120, 2048), (2048, 4096)])
@pytest.mark.parametrize("M", (1, 2, 3, 8, 16, 36, 128, 288, 512))
def test_kbit_linear_repeats_bitwise(N, K, M):
    gen = torch.Generator().manual_seed(N + K + M)
    weight = KbitLinearWeight.from_kbit(vllm_kbit.quantize(torch.randn(N, K, generator=gen).to(torch.bfloat16).cuda(), 4))
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16).cuda()
    outs = []
    for _ in range(REPEATS):
        poison_cache()
        outs.append(kbit_linear(x, weight))
    assert_same_bits(outs, f"kbit_linear {N}x{K} M={M}")


@pytest.mark.parametrize("M", (2, 8, 36, 288))
def test_kbit_linear_rows_ignore_the_other_rows(M):
    gen = torch.Generator().manual_seed(M)
    weight = KbitLinearWeight.from_kbit(vllm_kbit.quantize(torch.randn(2048, 1024, generator=gen).to(torch.bfloat16).cuda(), 4))
    x = torch.randn(M, 1024, generator=gen).to(torch.bfloat16).cuda()
    outs = []
    for _ in range(3):
        x[1:] = torch.randn(M - 1, 1024, generator=gen).to(torch.bfloat16).cuda()  # row 0 kept
        poison_cache()
        outs.append(kbit_linear(x, weight)[:1])
    assert_same_bits(outs, f"kbit_linear M={M}: row 0")
