"""vllm_kbit.moe.fused_moe_stages (the routed experts stage by stage, with hooks after gate_up and after down, which
vLLM's LoRA on experts uses) against the fused op and against a per-slot loop that adds the same deltas."""

from __future__ import annotations

import pytest
import torch

from vllm_kbit.moe import fused_moe_stages, kbit_fused_moe

from test_fused_moe_op import E, H, I, T, TOP_K, _experts, _pack


def _routing(seed, top_k=TOP_K):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(T)]).to(torch.int32)
    weights = torch.softmax(torch.randn(T, top_k, generator=g), -1)
    return x, ids, weights, g


@pytest.mark.parametrize("expert_map", [None, [-1, 0, -1, 1, 2, -1]])
def test_stages_without_hooks_equal_the_fused_op(expert_map):
    w13, w2 = _experts(4)
    x, ids, weights, _ = _routing(3)
    emap = None if expert_map is None else torch.tensor(expert_map, dtype=torch.int32)
    local = list(range(E)) if emap is None else [e for e in range(E) if emap[e] >= 0]
    packed = _pack([w13[e] for e in local], [w2[e] for e in local])
    got = fused_moe_stages(x, ids, weights, *packed, w13[0].codebook, I, emap)
    want = kbit_fused_moe(x, ids, weights, *packed, w13[0].codebook, I, emap, False)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_hooks_see_each_slot_and_their_additions_count():
    """after_gate_up adds x_t @ D1 to slot (t, j)'s gate_up output, after_down adds act @ D2 (times the router
    weight) to its down output: the result is a per-slot loop over dequantized experts with those deltas."""
    w13, w2 = _experts(3, seed=5)
    x, ids, weights, g = _routing(4)
    D1 = torch.randn(TOP_K, H, 2 * I, generator=g) * 0.05  # a different delta per pick j
    D2 = torch.randn(I, H, generator=g) * 0.05
    seen = {}

    def after_gate_up(h13):
        seen["h13"] = tuple(h13.shape)
        delta = torch.einsum("th,jhn->tjn", x.float(), D1).reshape(T * TOP_K, 2 * I)
        h13 += delta.to(h13.dtype)

    def after_down(y, act):
        seen["y"], seen["act"] = tuple(y.shape), tuple(act.shape)
        y += ((act.float() @ D2).view(T, TOP_K, H) * weights[..., None]).to(y.dtype)

    got = fused_moe_stages(x, ids, weights, *_pack(w13, w2), w13[0].codebook, I, None, after_gate_up, after_down)
    assert seen == {"h13": (T * TOP_K, 2 * I), "y": (T, TOP_K, H), "act": (T * TOP_K, I)}
    want = torch.zeros(T, H)
    for t in range(T):
        for j in range(TOP_K):
            e = int(ids[t, j])
            gu = (torch.nn.functional.linear(x[t : t + 1], w13[e].dequantize(x.dtype)).float()
                  + x[t : t + 1].float() @ D1[j]).to(x.dtype)
            act = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
            y = torch.nn.functional.linear(act, w2[e].dequantize(x.dtype)).float() + act.float() @ D2
            want[t] += weights[t, j] * y[0]
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    plain = fused_moe_stages(x, ids, weights, *_pack(w13, w2), w13[0].codebook, I)
    assert (got.float() - plain.float()).abs().max() > 0.1  # the deltas changed the result


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [1, 3, 16, 300, 2048])
@pytest.mark.parametrize("expert_map", [None, "half"])
def test_cuda_stages_equal_the_fused_op(T, expert_map):
    """On CUDA the stages run the fused op's routing and grouped kernels (at the planner's chunk height, the grouped
    MMA where the plan routes no chunks): equal to the fused op up to bf16 rounding of the intermediate results,
    at decode (GEMV plans), medium and prefill (grouped wgmma) sizes, with and without an expert map. Also inside a
    CUDA graph."""
    from vllm_kbit import ops

    if not ops.HAS_CUDA_KERNELS:
        pytest.skip("the CUDA extension is not built")
    import vllm_kbit

    gen = torch.Generator().manual_seed(T)
    E, H, I, top_k, k = 16, 256, 128, 4, 4
    w13 = [vllm_kbit.quantize((torch.randn(2 * I, H, generator=gen) * 0.05).to(torch.bfloat16), k) for _ in range(E)]
    w2 = [vllm_kbit.quantize((torch.randn(H, I, generator=gen) * 0.05).to(torch.bfloat16), k) for _ in range(E)]
    emap = None
    if expert_map == "half":  # this rank holds the odd global experts of 2 E
        emap = torch.full((2 * E,), -1, dtype=torch.int32)
        emap[1::2] = torch.arange(E, dtype=torch.int32)
        emap = emap.cuda()
    packed = [t.cuda() for t in _pack(w13, w2)]
    cb = w13[0].codebook.cuda()
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
    ids = torch.stack([torch.randperm(E * (2 if emap is not None else 1), generator=gen)[:top_k]
                       for _ in range(T)]).to(torch.int32).cuda()
    weights = torch.softmax(torch.randn(T, top_k, generator=gen), -1).cuda()
    want = kbit_fused_moe(x, ids, weights, *packed, cb, I, emap, False)
    got = fused_moe_stages(x, ids, weights, *packed, cb, I, emap)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    graph, out = torch.cuda.CUDAGraph(), None
    fused_moe_stages(x, ids, weights, *packed, cb, I, emap)  # warm-up outside the graph
    with torch.cuda.graph(graph):
        out = fused_moe_stages(x, ids, weights, *packed, cb, I, emap)
    graph.replay()
    torch.testing.assert_close(out, got)
