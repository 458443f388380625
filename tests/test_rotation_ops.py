"""The ops' input rotation on CPU (docs/format.md, section 9): kbit::linear and kbit::fused_moe given a rotation
compute on x R (and, for the experts' down projection, on act R), which equals rotating first and running the
unrotated computation; fused_moe_stages' hooks see the unrotated input and activations (vLLM's LoRA adds its
deltas from those); opcheck and fake tensors with the rotation arguments."""

from __future__ import annotations

import functools

import pytest
import torch

import vllm_kbit
from vllm_kbit import ops
from vllm_kbit import reference as fmt
from vllm_kbit.moe import ExpertsRotation, fused_moe_stages, kbit_fused_moe

from test_fused_moe_op import E, H, I, T, TOP_K, _experts, _pack


def _rotation(K, seed=0, max_block=1024):
    return fmt.rotation_signs(K, seed), fmt.rotation_block(K, max_block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K,max_block", [(160, 1024), (256, 64), (96, 2)])
def test_linear_with_rotation_is_the_linear_of_the_rotated_input(dtype, K, max_block):
    N = 48
    g = torch.Generator().manual_seed(K)
    w = vllm_kbit.quantize(torch.randn(N, K, generator=g).to(dtype), 4)
    q_rt, a_rt = w.repack()
    signs, block = _rotation(K, 5, max_block)
    bias = torch.randn(N, generator=g).to(dtype)
    for shape in ((1, K), (3, K), (2, 5, K)):
        x = torch.randn(*shape, generator=g).to(dtype)
        got = torch.ops.kbit.linear(x, q_rt, a_rt, w.codebook, N, K, bias, rot_signs=signs, rot_block=block)
        want = torch.ops.kbit.linear(fmt.hadamard_rotate(x, signs, block), q_rt, a_rt, w.codebook, N, K, bias)
        assert torch.equal(got, want), (shape, dtype)
        assert not torch.equal(got, torch.ops.kbit.linear(x, q_rt, a_rt, w.codebook, N, K, bias))


def test_a_rotated_layer_fed_through_the_op_computes_x_w():
    """Q(W R) fed x through the op's rotation is x W^T up to the quantization error, as the unrotated layer is."""
    N, K = 64, 256
    g = torch.Generator().manual_seed(0)
    W = torch.randn(N, K, generator=g)
    x = torch.randn(8, K, generator=g)
    signs, block = _rotation(K)
    rotated = vllm_kbit.quantize(fmt.hadamard_rotate(W, signs, block), 5)
    plain = vllm_kbit.quantize(W, 5)
    want = x @ W.T
    got = torch.ops.kbit.linear(x, *rotated.repack(), rotated.codebook, N, K, None, rot_signs=signs, rot_block=block)
    base = torch.ops.kbit.linear(x, *plain.repack(), plain.codebook, N, K, None)
    err, err_plain = (got - want).norm() / want.norm(), (base - want).norm() / want.norm()
    assert err < 0.05 and err < 1.5 * err_plain, (err, err_plain)
    # Without the rotation the same weights compute something else entirely.
    wrong = torch.ops.kbit.linear(x, *rotated.repack(), rotated.codebook, N, K, None)
    assert (wrong - want).norm() / want.norm() > 0.5


def _naive_rotated(x, ids, weights, w13, w2, r13, r2):
    """Per slot: down(rot2(silu(gate) * up)) of gate_up(rot13(x)), weighted, summed in fp32."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    xr = fmt.hadamard_rotate(x, *r13)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = torch.nn.functional.linear(xr[t : t + 1], w13[e].dequantize(x.dtype))
            h = fmt.hadamard_rotate(torch.nn.functional.silu(gu[:, :I]) * gu[:, I:], *r2)
            out[t] += weights[t, j] * torch.nn.functional.linear(h, w2[e].dequantize(x.dtype))[0].float()
    return out.to(x.dtype)


def _moe_case(k=4, seed=0, dtype=torch.bfloat16):
    w13, w2 = _experts(k, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(T)]).to(torch.int32)
    weights = torch.softmax(torch.randn(T, TOP_K, generator=g), -1)
    return w13, w2, x, ids, weights


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_moe_with_rotation_is_the_per_slot_loop_on_rotated_inputs(dtype):
    w13, w2, x, ids, weights = _moe_case(dtype=dtype)
    r13, r2 = _rotation(H, 1), _rotation(I, 1)
    rot = ExpertsRotation(*r13, *r2)
    got = kbit_fused_moe(x, ids, weights, *_pack(w13, w2), w13[0].codebook, I, None, False, rot)
    want = _naive_rotated(x, ids, weights, w13, w2, r13, r2)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # Only the hidden rotation (gate_up): the op rotates what it is given, nothing else.
    one = torch.ops.kbit.fused_moe(x, ids, weights, *_pack(w13, w2), w13[0].codebook, I, None, False,
                                   w13_rot_signs=r13[0], w13_rot_block=r13[1])
    plain_on_rotated = kbit_fused_moe(fmt.hadamard_rotate(x, *r13), ids, weights, *_pack(w13, w2), w13[0].codebook, I)
    assert torch.equal(one, plain_on_rotated)


@pytest.mark.parametrize("expert_map", [None, [-1, 0, -1, 1, 2, -1]])
def test_stages_with_rotation_equal_the_fused_op_and_hooks_see_unrotated_values(expert_map):
    w13, w2, x, ids, weights = _moe_case(k=3, seed=2)
    emap = None if expert_map is None else torch.tensor(expert_map, dtype=torch.int32)
    local = list(range(E)) if emap is None else [e for e in range(E) if emap[e] >= 0]
    packed = _pack([w13[e] for e in local], [w2[e] for e in local])
    rot = ExpertsRotation(*_rotation(H, 7), *_rotation(I, 7))
    seen = {}

    def after_gate_up(h13):
        seen["h13"] = h13.clone()

    def after_down(y, act):
        seen["act"] = act.clone()

    got = fused_moe_stages(x, ids, weights, *packed, w13[0].codebook, I, emap, after_gate_up, after_down, rot)
    want = kbit_fused_moe(x, ids, weights, *packed, w13[0].codebook, I, emap, False, rot)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    # The activations handed to after_down are silu(gate) * up of the gate_up output, not rotated: an adapter's
    # delta computed from them (vLLM's LoRA) is what it adds to the unrotated layer.
    h13 = seen["h13"]
    torch.testing.assert_close(seen["act"], torch.nn.functional.silu(h13[:, :I]) * h13[:, I:])
    # gate_up's output per slot is that of x R with the slot's expert (zeros for experts of other ranks).
    xr = fmt.hadamard_rotate(x, rot.w13_signs, rot.w13_block)
    for s in range(T * TOP_K):
        e = int(ids.view(-1)[s])
        e = e if emap is None else int(emap[e])
        want_row = (torch.zeros(2 * I, dtype=x.dtype) if e < 0 else
                    torch.nn.functional.linear(xr[s // TOP_K], w13[local[e]].dequantize(x.dtype)))
        torch.testing.assert_close(h13[s], want_row, atol=2e-2, rtol=2e-2)


def test_opcheck_and_fake_with_rotation():
    w = vllm_kbit.quantize(torch.randn(40, 128).to(torch.bfloat16), 3)
    q_rt, a_rt = w.repack()
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    signs, block = _rotation(128)
    torch.library.opcheck(torch.ops.kbit.linear.default, (x, q_rt, a_rt, w.codebook, 40, 128, None),
                          {"rot_signs": signs, "rot_block": block})
    w13, w2, xm, ids, weights = _moe_case(k=3)
    rot = ExpertsRotation(*_rotation(H), *_rotation(I)).op_kwargs()
    args = (xm, ids, weights, *_pack(w13, w2), w13[0].codebook, I, None, False)
    torch.library.opcheck(torch.ops.kbit.fused_moe.default, args, rot)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        out = torch.ops.kbit.fused_moe(*map(fake, args), **{k: fake(v) for k, v in rot.items()})
        y = torch.ops.kbit.linear(fake(x), fake(q_rt), fake(a_rt), fake(w.codebook), 40, 128, None,
                                  rot_signs=fake(signs), rot_block=block)
    assert out.shape == (T, H) and y.shape == (3, 40)


requires_extension = pytest.mark.skipif(not ops.HAS_EXTENSION, reason="the C++ extension is not built or not loadable")


@requires_extension
def test_plans_name_the_rotation_and_keep_the_down_rotation_off_the_gemv_paths():
    """The GEMV paths fuse the rotation for blocks 4..1024 (their activation load); the other paths and block 2
    rotate separately, and a down rotation they cannot fuse keeps the MoE off the GEMV paths."""
    plan = functools.partial(ops.named, torch.ops.kbit.linear_plan, N=2048, K=2048, dtype=torch.bfloat16, sm_major=9,
                             num_sms=132, ctas_per_sm=1, path="auto", bits=4)
    plain = plan(M=1)
    assert plain.rotation == "none" and plain.path == "gemv"
    for block, want in ((1024, "fused"), (128, "fused"), (4, "fused"), (2, "separate")):
        rotated = plan(M=1, rot_block=block)
        assert rotated.rotation == want and rotated._replace(rotation="none") == plain, (block, rotated)
    assert plan(M=64, rot_block=1024).rotation == "separate" and plan(M=64, rot_block=1024).path != "gemv"
    moe = functools.partial(ops.named, torch.ops.kbit.moe_plan, 1, 8, 128, 4)
    assert moe("auto", 9).path == moe("auto", 9, None, 1024, 0).path == moe("auto", 9, None, 1024, 256).path == "gemv_direct"
    assert moe("auto", 9, None, 1024, 2).path == "grouped_mma"  # SiLU-and-mul on its own, then the rotation
    for path in ("gemv_direct", "gemv"):
        assert moe(path, 9, None, 128, 128).path == path
        with pytest.raises(ValueError, match=f"path {path} cannot rotate the down projection's input") as e:
            moe(path, 9, None, 0, 2)
        assert "\n" not in str(e.value)
