"""kbit::linear and kbit::fused_moe with an input rotation on CUDA (the plan's rotation "separate": the rotation
kernel into a scratch before the GEMM; the experts' SiLU-and-mul output rotated in place before down; "fused" on the
GEMV paths: the kernel rotates its activations as it loads them, tests/gpu/test_rotation_fused_cuda.py) against the
CPU reference and against rotating first with kbit::hadamard_rotate (bit for bit where the plan rotates separately,
within rounding where it fuses: no rounding of x R to x's dtype), over paths, bits, dtypes and sizes whose
blocks run from 32 to 1024 (and K with a small block: a tail of 2-element blocks); CUDA-graph replay equals eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_kbit import ops
from vllm_kbit import reference as fmt
from vllm_kbit.moe import ExpertsRotation, kbit_fused_moe
from test_linear_cuda import _random_weight  # a sibling: pytest puts tests/gpu on sys.path
from test_moe_cuda import Experts, captured, check, poison_cache, random_routing, reference

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, requires_cuda]

# (K, N, max_block): qkv, o, down, a 1024 block, a K whose block is 2 (96 * 2 = 192 at max_block 2), a 32-block.
LINEAR_SHAPES = [(2048, 512, 1024), (4096, 2048, 1024), (5120, 2048, 1024), (768, 1024, 256), (192, 128, 2),
                 (96, 64, 32)]
MS = (1, 2, 4, 5, 16, 33, 64, 129, 300)


def _rotation(K, max_block=1024, seed=11, device="cuda"):
    return fmt.rotation_signs(K, seed, device), fmt.rotation_block(K, max_block)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K,N,max_block", LINEAR_SHAPES)
def test_linear_with_rotation_is_linear_of_the_rotated_input(dtype, K, N, max_block):
    """Bit for bit the unrotated op on kbit::hadamard_rotate(x) (the same rotation kernel and the same plan) where the
    plan rotates separately, and the CPU reference within rounding everywhere."""
    gen = torch.Generator().manual_seed(K + N)
    signs, block = _rotation(K, max_block)
    for k in (2, 3, 4, 5):
        w, (q, a, cb) = _random_weight(N, K, k, gen)
        for M in MS:
            x = (torch.randn(M, K, generator=gen) / 4).to(dtype).cuda()
            poison_cache()
            got = torch.ops.kbit.linear(x, w.qweight_rt, w.absmax_rt, w.codebook, N, K, None, rot_signs=signs,
                                        rot_block=block)
            xr = torch.ops.kbit.hadamard_rotate(x, signs, block)
            want = torch.ops.kbit.linear(xr, w.qweight_rt, w.absmax_rt, w.codebook, N, K, None)
            plan = ops.named(torch.ops.kbit.linear_plan.device, M, N, K, dtype, k, x.device, "auto", 0, 0, 0, block)
            if plan.rotation == "separate":
                assert torch.equal(got, want), (K, N, k, M, dtype)
            ref = F.linear(fmt.hadamard_rotate(x.cpu(), signs.cpu(), block).float(),
                           fmt.dequantize(q.cpu(), a.cpu(), cb.cpu(), torch.float32))
            err = ((got.cpu().double() - ref.double()).norm() / ref.double().norm()).item()
            assert err < 1e-2, (K, N, k, M, dtype, err)


def test_linear_with_rotation_takes_any_row_layout_and_bias():
    gen = torch.Generator().manual_seed(1)
    K, N = 2048, 512
    w, _ = _random_weight(N, K, 4, gen)
    signs, block = _rotation(K)
    bias = torch.randn(N, generator=gen).to(torch.bfloat16).cuda()
    big = torch.randn(3, 5, 2 * K, generator=gen).to(torch.bfloat16).cuda()
    x = big[..., :K]  # rows at a stride
    got = torch.ops.kbit.linear(x, w.qweight_rt, w.absmax_rt, w.codebook, N, K, bias, rot_signs=signs, rot_block=block)
    want = torch.ops.kbit.linear(torch.ops.kbit.hadamard_rotate(x.contiguous(), signs, block), w.qweight_rt,
                                 w.absmax_rt, w.codebook, N, K, bias)
    assert got.shape == (3, 5, N) and torch.equal(got, want)


def rotated_reference(x, ids, weights, ex, r13, r2):
    """fp32: out[t] = sum_j w[t,j] * W2_e @ rot2(silu(G_e rot13(x)) * U_e rot13(x)), rotations in x's dtype as the op
    (the SiLU-and-mul output in the kernels' bf16)."""
    return reference(x, ids, weights, ex, None, False,
                     rotate13=lambda v: torch.ops.kbit.hadamard_rotate(v.to(x.dtype), *r13).float(),
                     rotate2=lambda v: torch.ops.kbit.hadamard_rotate(v.to(torch.bfloat16), *r2).float())


# (E, top_k, H, I): tiny (I block 32), Qwen3-30B-A3B-like (I = 768: block 256), a 4-expert rank (I block 256).
MOE_SHAPES = [(8, 2, 128, 96), (128, 8, 2048, 768), (4, 2, 512, 256)]
ROTATED_PATHS = ("auto", "grouped_mma", "grouped_mm", "grouped_wgmma")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("E,top_k,H,I", MOE_SHAPES)
def test_fused_moe_with_rotation(dtype, E, top_k, H, I):
    gen = torch.Generator().manual_seed(E + I)
    r13, r2 = _rotation(H), _rotation(I)
    rot = ExpertsRotation(*r13, *r2)
    hopper = torch.cuda.get_device_capability()[0] == 9
    for k in (2, 3, 4, 5) if H * I <= 512 * 256 else (3, 4):
        ex = Experts(E, H, I, k, gen)
        for T in (1, 3, 16, 40, 300):
            x = (torch.randn(T, H, generator=gen) / 4).to(dtype).cuda()
            ids, weights = random_routing(T, E, top_k, gen, "random")
            ref = rotated_reference(x, ids, weights, ex, r13, r2)
            for path in ROTATED_PATHS:
                if path == "grouped_wgmma" and not hopper:
                    continue
                poison_cache()
                if path == "auto":
                    out = kbit_fused_moe(x, ids, weights, *ex.args(), I, None, False, rot)
                else:
                    out = torch.ops.kbit._fused_moe_cuda(x, ids, weights, *ex.args(), I, None, False,
                                                         torch.ops.kbit._moe_path_id(path), **rot.op_kwargs())
                check(out, ref, dtype, path)
            # Only the hidden rotation, on every path: the op on hadamard_rotate(x), bit for bit where the plan rotates
            # separately, within rounding where the GEMV fuses it.
            xr = torch.ops.kbit.hadamard_rotate(x, *r13)
            for path in ("auto", "gemv_direct", "gemv", *ROTATED_PATHS[1:]):
                if path == "grouped_wgmma" and not hopper:
                    continue
                pid = torch.ops.kbit._moe_path_id(path)
                got = torch.ops.kbit._fused_moe_cuda(x, ids, weights, *ex.args(), I, None, False, pid,
                                                     w13_rot_signs=r13[0], w13_rot_block=r13[1])
                want = torch.ops.kbit._fused_moe_cuda(xr, ids, weights, *ex.args(), I, None, False, pid)
                plan = ops.named(torch.ops.kbit.moe_plan.device, T, top_k, E, k, H, I, x.device, path, 0, 0, 0, 0, 0,
                                 dtype, r13[1], 0)
                if plan.gate_up_rotation == "separate":
                    assert torch.equal(got, want), (T, k, path)
                else:
                    check(got, want.float(), dtype, path)


def test_fused_moe_refuses_a_rotated_down_input_on_the_gemv_paths():
    """A down block the GEMV kernels do not fuse (2: a butterfly inside a register pair) on a forced GEMV path."""
    gen = torch.Generator().manual_seed(2)
    E, H, I = 8, 128, 96
    ex = Experts(E, H, I, 4, gen)
    x = torch.randn(2, H, generator=gen).to(torch.bfloat16).cuda()
    ids, weights = random_routing(2, E, 2, gen, "random")
    rot = ExpertsRotation(*_rotation(H), *_rotation(I, max_block=2))
    for path in ("gemv", "gemv_direct"):
        with pytest.raises(ValueError, match=f"path {path} cannot rotate the down projection's input") as e:
            torch.ops.kbit._fused_moe_cuda(x, ids, weights, *ex.args(), I, None, False,
                                           torch.ops.kbit._moe_path_id(path), **rot.op_kwargs())
        assert "\n" not in str(e.value)


def test_cuda_graph_replay_equals_eager_with_rotation():
    gen = torch.Generator().manual_seed(4)
    K, N = 2048, 512
    w, _ = _random_weight(N, K, 3, gen)
    signs, block = _rotation(K)
    E, H, I = 16, 256, 96
    ex = Experts(E, H, I, 4, gen)
    rot = ExpertsRotation(*_rotation(H), *_rotation(I))
    for T in (1, 5, 40, 300):
        x = torch.randn(T, K, generator=gen).to(torch.bfloat16).cuda()
        xm = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
        ids, weights = random_routing(T, E, 4, gen, "random")

        def forward():
            return (torch.ops.kbit.linear(x, w.qweight_rt, w.absmax_rt, w.codebook, N, K, None, rot_signs=signs,
                                          rot_block=block),
                    kbit_fused_moe(xm, ids, weights, *ex.args(), I, None, False, rot))

        graph, outs = captured(forward)
        for _ in range(2):
            x.copy_(torch.randn(T, K, generator=gen).to(torch.bfloat16))
            xm.copy_(torch.randn(T, H, generator=gen).to(torch.bfloat16))
            new_ids, new_w = random_routing(T, E, 4, gen, "few")
            ids.copy_(new_ids)
            weights.copy_(new_w)
            for o in outs:
                o.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            eager = forward()
            for o, e in zip(outs, eager):
                assert torch.equal(o, e), T
