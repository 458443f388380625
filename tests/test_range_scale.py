"""The per-layer range scale (reference.range_scale): any finite weight quantizes, tiny layers keep their values,
layers in range are unchanged; through the Python API and every op on CPU."""

from __future__ import annotations

import math

import pytest
import torch

import vllm_kbit
from vllm_kbit import reference as fmt
from vllm_kbit.moe import kbit_fused_moe, stack_runtime


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("amax", [0.0, 2.0**-4, 0.0625001, 0.3, 1.0, 16.0, 31.0, fmt.RANGE_MAX])
def test_layers_in_range_get_scale_one(amax):
    assert fmt.range_scale(amax) == 1.0


@pytest.mark.parametrize("amax", [31.6, 32.0, 33.0, 100.0, 1e4, 3e38, 0.06, 2.0**-5, 1e-3, 1e-6, 3e-8, 1e-40])
def test_layers_out_of_range_get_a_power_of_two_that_brings_them_to_8_16(amax):
    s = fmt.range_scale(amax)
    m, _ = math.frexp(s)
    assert m == 0.5 and s != 1.0  # a power of two
    assert math.isfinite(s) and s > 0
    if 2.0**-100 * 8 < amax <= 2.0**127 * 16:  # inside the clamp
        assert 8 < amax / s <= 16, (amax, s)
    assert amax / s <= fmt.RANGE_MAX


def test_exact_powers_of_two_map_to_16():
    assert fmt.range_scale(64.0) == 4.0 and fmt.range_scale(2.0**-10) == 2.0**-14


@pytest.mark.parametrize("amax", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused(amax):
    with pytest.raises(ValueError, match="NaN or Inf"):
        fmt.range_scale(amax)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scale", [100.0, 1e-6])
def test_dividing_by_the_range_scale_is_exact(dtype, scale):
    W = (torch.randn(32, 64, generator=torch.Generator().manual_seed(0)) * scale).to(dtype)
    s = fmt.weight_range_scale(W)
    assert s != 1.0
    Ws = fmt.range_scaled(W, s)
    assert torch.equal(Ws * s, W.float())  # nothing rounded either way
    cb = fmt.default_codebook(4)
    assert torch.equal((cb * s) / s, cb)


def test_in_range_weights_quantize_exactly_as_without_range_scale():
    W = (torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 0.1).to(torch.bfloat16)
    q = vllm_kbit.quantize(W, 4)
    qw, am = torch.ops.kbit.quantize(W, fmt.default_codebook(4), 4)
    assert torch.equal(q.qweight, qw) and torch.equal(q.absmax, am)
    assert torch.equal(q.codebook, fmt.default_codebook(4))


def _layer(scale: float, seed: int = 2, dtype=torch.bfloat16) -> torch.Tensor:
    return (torch.randn(96, 256, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("k", [2, 4, 5])
@pytest.mark.parametrize("scale", [30.0, 1e-6])
def test_out_of_range_layers_keep_the_accuracy_of_a_normal_layer(k, scale):
    """|w| up to ~100 (refused before) and a layer of ~1e-6 (decoded to zero before) quantize with the
    relative error of the same weights at 0.05."""
    normal = vllm_kbit.quantize(_layer(0.05), k)
    normal_err = _rel_err(normal.dequantize(torch.float32), _layer(0.05))
    W = _layer(scale)
    q = vllm_kbit.quantize(W, k)
    s = fmt.weight_range_scale(W)
    assert s != 1.0 and torch.equal(q.codebook, fmt.default_codebook(k) * s)
    err = _rel_err(q.dequantize(torch.float32), W)
    assert err < 1.15 * normal_err, (err, normal_err)
    # Without the range scale: |w| ~100 is refused, 1e-6 decodes to nothing useful.
    cb = fmt.default_codebook(k)
    if W.abs().max() > fmt.RANGE_MAX:
        with pytest.raises(ValueError, match="above the largest E4M4"):
            torch.ops.kbit.quantize(W, cb, k)
    else:
        old = fmt.dequantize(*torch.ops.kbit.quantize(W, cb, k), cb, torch.float32)
        assert _rel_err(old, W) > 0.5  # vs ~0.02-0.4 above


def test_tiny_layer_values_are_kept():
    W = _layer(1e-6)
    d = vllm_kbit.quantize(W, 4).dequantize(torch.float32)
    assert (d != 0).float().mean() > 0.8  # the default codebook has a zero level: most values stay non-zero
    assert torch.allclose(d, W.float(), rtol=0, atol=0.35 * W.float().abs().max().item())


def test_every_op_reads_the_scaled_codebook():
    """dequantize, dequantize_runtime, linear and fused_moe give s * (the op on W / s): exact on CPU."""
    W = _layer(40.0)
    q = vllm_kbit.quantize(W, 3)
    s = fmt.weight_range_scale(W)
    cb = fmt.default_codebook(3)
    unscaled = fmt.dequantize(q.qweight, q.absmax, cb, torch.float32)
    assert torch.equal(q.dequantize(torch.float32), unscaled * s)
    qrt, art = q.repack()
    N, K = W.shape
    assert torch.equal(torch.ops.kbit.dequantize_runtime(qrt, art, q.codebook, N, K, torch.float32), unscaled * s)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(3))
    got = torch.ops.kbit.linear(x, qrt, art, q.codebook, N, K, None)
    assert torch.allclose(got, x @ (unscaled * s).T, rtol=1e-5, atol=1e-3)
    assert _rel_err(got, x @ W.float().T) < 0.2


def test_fused_moe_with_one_range_scale_for_the_layer():
    """One s over every expert (the MoE layer's rule): an expert at |w| = 100 and experts at 0.1 together."""
    E, H, I = 4, 64, 96
    g = torch.Generator().manual_seed(4)
    w13 = [torch.randn(2 * I, H, generator=g) * 0.1 for _ in range(E)]
    w2 = [torch.randn(H, I, generator=g) * 0.1 for _ in range(E)]
    w2[2][5, 7] = 100.0
    s = fmt.range_scale(max(w.abs().max().item() for w in w13 + w2))
    assert s == 8.0
    cb = fmt.default_codebook(4)
    pq13 = [torch.ops.kbit.quantize(fmt.range_scaled(w, s).contiguous(), cb, 4) for w in w13]
    pq2 = [torch.ops.kbit.quantize(fmt.range_scaled(w, s).contiguous(), cb, 4) for w in w2]
    q13, a13 = stack_runtime(pq13)
    q2, a2 = stack_runtime(pq2)
    T = 6
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)]).to(torch.int32)
    weights = torch.softmax(torch.randn(T, 2, generator=g), -1)
    got = kbit_fused_moe(x, ids, weights, q13, a13, q2, a2, cb * s, I, None, False)
    # Each expert decodes to the per-tensor range-scaled quantization of its own weights (same values: every
    # block has a normal E4M4 scale under either s), so the layer equals the loop over KbitWeight experts.
    want = torch.zeros(T, H)
    for t in range(T):
        for j in range(2):
            e = int(ids[t, j])
            d13 = vllm_kbit.quantize(w13[e], 4).dequantize(torch.float32)
            d2 = vllm_kbit.quantize(w2[e], 4).dequantize(torch.float32)
            gu = x[t] @ d13.T
            want[t] += weights[t, j] * ((torch.nn.functional.silu(gu[:I]) * gu[I:]) @ d2.T)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-3)
