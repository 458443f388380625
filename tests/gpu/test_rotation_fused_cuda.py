"""Rotated layers whose GEMV rotates its activations as it loads them (csrc/rotate/rotate_core.cuh, in gemv_core.cuh's
activation load): the dense GEMV and the routed-expert GEMVs' down projection (its SiLU-and-mul output; the hidden
states are rotated apart, once per layer, and checked here through the same op) at every k, M = 1..4, blocks 4..128 (inside one k-tile) and 256..1024 (mixed across k-tiles),
K a multiple of 128 and with a 32 / 64 tail, bf16 and fp16, against the fp32 reference: x rotated in fp32
(reference.hadamard_rotate; the fused path does not round x R to x's dtype), then the fp32 GEMM.
Outputs are poisoned with NaN first (every element written), graph replay equals eager, and the plan and the launch
say "fused".
"""

import pytest
import torch

from vllm_kbit import ops
from vllm_kbit import reference as fmt

from test_linear_cuda import _check, _poison_cache, _random_weight, _reference  # siblings: pytest puts tests/gpu on sys.path
from test_moe_cuda import Experts, captured, check, poison_cache, random_routing, reference
from test_plan_cuda import launched

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, requires_cuda]

BLOCKS = (4, 16, 32, 64, 128, 256, 512, 1024)


def _signs(K, seed):
    return fmt.rotation_signs(K, seed, "cuda")


def _rotated(x, signs, block):
    """x R in fp32 (x's values exact in fp32; no rounding to x's dtype)."""
    return fmt.hadamard_rotate(x.float(), signs, block)


def _gemv(x, w, signs, block, bias=None, splits=0):
    """The dense GEMV forced (kbit::_linear_forced), rotated by (signs, block)."""
    path_id = torch.ops.kbit._linear_path_id("gemv")
    return torch.ops.kbit._linear_forced(x, w.qweight_rt, w.absmax_rt, w.codebook, w.N, w.K, bias, path_id, 0, splits,
                                         0, rot_signs=signs, rot_block=block)


# K: multiples of 128 (one and several k-tiles; 1536: three blocks of 512), and 128 n + 32 / 64 tails (the last
# k-tile part padding).
DENSE_K = (128, 512, 1536, 2048, 160, 1184, 320, 2112)


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("K", DENSE_K)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense_gemv_rotates_in_its_activation_load(k, K, dtype):
    gen = torch.Generator().manual_seed(K + k)
    N = 200  # a partial last n-tile
    w, flat = _random_weight(N, K, k, gen)
    bias = torch.randn(N, generator=gen).to(dtype).cuda()
    x = torch.randn(4, K, generator=gen).to(dtype).cuda()
    ran = 0
    for block in BLOCKS:
        if K % block:
            continue
        signs = _signs(K, block)
        ref = _reference(_rotated(x, signs, block), flat, bias)
        plain = _reference(x, flat, bias)
        for M in (1, 2, 3, 4):
            for splits in sorted({0, 1, min(8, (K + 127) // 128)}):  # every split's k-tiles, and blocks across splits
                _poison_cache(M * N * 2)
                out = _gemv(x[:M], w, signs, block, bias, splits)
                _check(out, ref[:M], dtype, f"gemv k={k} K={K} b={block} M={M} splits={splits}")
            # The rotation changes the product: an unrotated load would be far off.
            assert not torch.allclose(out.float(), plain.val[:M], rtol=0.05, atol=0.05)
        ran += 1
    assert ran >= 1


def _rotated_moe_reference(x, ids, weights, ex, on_input, s13, b13, s2, b2):
    """fp32 reference of rotated experts: gate_up on x R_13, down on (silu(gate) * up) R_2, every step in fp32."""
    return reference(x, ids, weights, ex, None, on_input, rotate13=lambda v: _rotated(v, s13, b13),
                     rotate2=lambda v: _rotated(v, s2, b2))


def _moe(x, ids, weights, ex, on_input, path, s13, b13, s2, b2, poison=True):
    if poison:
        poison_cache()
    path_id = torch.ops.kbit._moe_path_id(path)
    return torch.ops.kbit._fused_moe_cuda(x, ids, weights, *ex.args(), ex.I, None, on_input, path_id,
                                          w13_rot_signs=s13, w13_rot_block=b13, w2_rot_signs=s2, w2_rot_block=b2)


# (H, I): both multiples of 128, and 32 / 64 tails on either projection's K.
MOE_SHAPES = [(256, 128), (384, 160), (160, 320), (2048, 768)]


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("H,I", MOE_SHAPES)
@pytest.mark.parametrize("path,T,top_k", [("gemv_direct", 1, 4), ("gemv_direct", 3, 2), ("gemv", 1, 8),
                                          ("gemv", 4, 2), ("gemv", 16, 4)])
def test_moe_gemv_rotates_both_projections(k, H, I, path, T, top_k):
    gen = torch.Generator().manual_seed(H + I + k + T)
    E = 8
    ex = Experts(E, H, I, k, gen)
    for dtype, b13, b2, on_input in ((torch.bfloat16, 128, 32, False), (torch.float16, 32, 64, False),
                                     (torch.bfloat16, 1024, 256, top_k == 1 or path == "gemv")):
        big = fmt.ROTATION_MAX_BLOCK
        b13, b2 = min(b13, fmt.rotation_block(H, big)), min(b2, fmt.rotation_block(I, big))  # the largest that divides
        x = torch.randn(T, H, generator=gen).to(dtype).cuda()
        ids, weights = random_routing(T, E, top_k, gen, "random")
        s13, s2 = _signs(H, 1), _signs(I, 2)
        out = _moe(x, ids, weights, ex, on_input, path, s13, b13, s2, b2)
        ref = _rotated_moe_reference(x, ids, weights, ex, on_input, s13, b13, s2, b2)
        check(out, ref, dtype, path)


def test_plan_and_launch_say_fused():
    """The planner fuses the rotation into the GEMV decode paths (blocks 4..1024) and keeps the separate pass for
    block 2; the launches carry what the plan says."""
    gen = torch.Generator().manual_seed(5)
    K, N = 2048, 256
    w, _ = _random_weight(N, K, 4, gen)
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(1, K, generator=gen).to(torch.bfloat16).cuda()
    for block, want in ((128, "fused"), (1024, "fused"), (32, "fused"), (2, "separate")):
        plan = ops.named(torch.ops.kbit.linear_plan.device, 1, N, K, torch.bfloat16, 4, dev, "gemv", rot_block=block)
        assert plan.path == "gemv" and plan.rotation == want, (block, plan)
        launched()
        _gemv(x, w, _signs(K, 0), block)
        got = launched()
        if want == "fused":
            assert [(g.kernel, g.rotation) for g in got] == [("gemv", "fused")], got
        else:
            assert [(g.kernel, g.rotation) for g in got] == [("rotate", "separate"), ("gemv", "none")], got
    assert ops.named(torch.ops.kbit.linear_plan.device, 1, N, K, torch.bfloat16, 4, dev, "gemv").rotation == "none"
    # Routed experts on the GEMV paths, at the Qwen3-30B-A3B shape's default blocks: the hidden states rotated apart
    # (once per layer), the down input inside the down projection's load.
    E, top_k, H, I = 16, 8, 2048, 768
    ex = Experts(E, H, I, 4, gen)
    ids, weights = random_routing(1, E, top_k, gen, "random")
    xm = torch.randn(1, H, generator=gen).to(torch.bfloat16).cuda()
    for path, kernel in (("gemv_direct", "moe_gemv_direct"), ("gemv", "moe_gemv")):
        plan = ops.named(torch.ops.kbit.moe_plan.device, 1, top_k, E, 4, H, I, dev, path, gate_up_rot_block=1024,
                         down_rot_block=256)
        assert plan.gate_up_rotation == "separate" and plan.down_rotation == "fused", plan
        launched()
        _moe(xm, ids, weights, ex, False, path, _signs(H, 0), 1024, _signs(I, 0), 256)
        got = [(g.kernel, g.rotation) for g in launched() if g.kernel == kernel]
        assert got == [(kernel, "none"), (kernel, "fused")], got
    auto = ops.named(torch.ops.kbit.moe_plan.device, 1, top_k, E, 4, H, I, dev, gate_up_rot_block=1024,
                     down_rot_block=256)
    assert auto.path == "gemv_direct", auto  # a fused down rotation keeps the direct GEMV at one token


@pytest.mark.parametrize("what", ["dense", "gemv_direct", "gemv"])
def test_cuda_graph_replay_equals_eager(what):
    gen = torch.Generator().manual_seed(11)
    if what == "dense":
        K = 2048
        w, flat = _random_weight(512, K, 3, gen)
        signs = _signs(K, 3)
        x = torch.randn(2, K, generator=gen).to(torch.bfloat16).cuda()

        def forward():
            return _gemv(x, w, signs, 1024)

        def new_inputs():
            x.copy_(torch.randn(2, K, generator=gen).to(torch.bfloat16))

        def reference():
            return _reference(_rotated(x, signs, 1024), flat, None)
    else:
        E, H, I, T, top_k = 16, 256, 192, (1 if what == "gemv_direct" else 4), 4
        ex = Experts(E, H, I, 4, gen)
        s13, s2 = _signs(H, 4), _signs(I, 5)
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
        ids, weights = random_routing(T, E, top_k, gen, "random")

        def forward():
            return _moe(x, ids, weights, ex, False, what, s13, 256, s2, 64, poison=False)

        def new_inputs():
            new_ids, new_w = random_routing(T, E, top_k, gen, "few")
            ids.copy_(new_ids)
            weights.copy_(new_w)
            x.copy_(torch.randn(T, H, generator=gen).to(torch.bfloat16))

        def reference():
            return _rotated_moe_reference(x, ids, weights, ex, False, s13, 256, s2, 64)

    graph, out = captured(forward)
    for _ in range(2):
        new_inputs()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = forward()
        assert torch.equal(out, eager), what
        if what == "dense":
            _check(out, reference(), torch.bfloat16, what)
        else:
            check(out, reference(), torch.bfloat16, what)
