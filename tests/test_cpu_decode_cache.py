"""The CPU decode cache (vllm_kbit.ops.cpu_decoded): kbit::linear and kbit::fused_moe on CPU decode each
packed weight once, and give exactly the reference's outputs (decode, round to x's dtype, matmul)."""

from __future__ import annotations

import gc

import pytest
import torch

import vllm_kbit
from vllm_kbit import envs, ops
from vllm_kbit import reference as fmt
from vllm_kbit.moe import kbit_fused_moe, stack_runtime


@pytest.fixture
def decodes(monkeypatch):
    """Counts reference.dequantize_runtime calls (one per decoded weight or expert)."""
    calls = []
    real = fmt.dequantize_runtime

    def counting(*args):
        calls.append(args[3:5])
        return real(*args)

    monkeypatch.setattr(fmt, "dequantize_runtime", counting)
    monkeypatch.setattr(ops, "CPU_DECODE_CACHE", True)
    return calls


def _layer(N, K, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = vllm_kbit.quantize((torch.randn(N, K, generator=g) * 0.05).to(torch.bfloat16), k)
    q_rt, a_rt = w.repack()
    return q_rt, a_rt, w.codebook


def _reference_linear(x, q_rt, a_rt, cb, N, K, bias):
    return torch.nn.functional.linear(x, fmt.dequantize_runtime(q_rt, a_rt, cb, N, K, x.dtype), bias)


@pytest.mark.parametrize("k", fmt.SUPPORTED_BITS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cached_linear_equals_reference(k, dtype, decodes):
    N, K = 200, 352  # N not a multiple of the 64-row tile, K not of the 128-column tile
    q_rt, a_rt, cb = _layer(N, K, k, seed=k)
    bias = torch.randn(N).to(dtype)
    g = torch.Generator().manual_seed(10 + k)
    for shape in [(1, K), (2, K), (7, K), (3, 5, K)]:  # decode steps, a prefill, a 3-D batch
        x = torch.randn(*shape, generator=g).to(dtype)
        for b in (bias, None):
            got = torch.ops.kbit.linear(x, q_rt, a_rt, cb, N, K, b)
            assert torch.equal(got, _reference_linear(x, q_rt, a_rt, cb, N, K, b)), (shape, b is None)
    assert len(decodes) == 1 + 8  # one decode for the cache; the 8 others are _reference_linear's own


def test_linear_decodes_once_per_weight_and_dtype(decodes):
    q_rt, a_rt, cb = _layer(128, 256, 4, seed=0)
    q2, a2, cb2 = _layer(64, 256, 3, seed=1)
    before = ops.cpu_decode_cache_nbytes()
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    for _ in range(4):
        torch.ops.kbit.linear(x, q_rt, a_rt, cb, 128, 256, None)
        torch.ops.kbit.linear(x, q2, a2, cb2, 64, 256, None)
    assert len(decodes) == 2
    assert ops.cpu_decode_cache_nbytes() - before == (128 + 64) * 256 * 2
    torch.ops.kbit.linear(x.float(), q_rt, a_rt, cb, 128, 256, None)  # another activation dtype: its own entry
    assert len(decodes) == 3
    assert ops.cpu_decode_cache_nbytes() - before == (128 + 64) * 256 * 2 + 128 * 256 * 4
    del q_rt, a_rt  # the entries live as long as the packed weight
    gc.collect()
    assert ops.cpu_decode_cache_nbytes() - before == 64 * 256 * 2


def test_linear_cache_follows_writes_to_the_packed_weight(decodes):
    N, K = 64, 128
    q_rt, a_rt, cb = _layer(N, K, 4, seed=0)
    q_new, a_new, _ = _layer(N, K, 4, seed=1)
    x = torch.randn(3, K, dtype=torch.bfloat16)
    torch.ops.kbit.linear(x, q_rt, a_rt, cb, N, K, None)
    q_rt.copy_(q_new)  # in place (weight reloading): decoded again
    assert torch.equal(torch.ops.kbit.linear(x, q_rt, a_rt, cb, N, K, None), _reference_linear(x, q_new, a_rt, cb, N, K, None))
    a_rt.copy_(a_new)
    assert torch.equal(torch.ops.kbit.linear(x, q_rt, a_rt, cb, N, K, None), _reference_linear(x, q_new, a_new, cb, N, K, None))
    other_cb = fmt.normal_float_codebook(4) * 0.5  # another codebook tensor with the same packed words
    got = torch.ops.kbit.linear(x, q_rt, a_rt, other_cb, N, K, None)
    assert torch.equal(got, _reference_linear(x, q_new, a_new, other_cb, N, K, None))


def test_cache_off_decodes_every_call(decodes, monkeypatch):
    monkeypatch.setattr(ops, "CPU_DECODE_CACHE", False)
    q_rt, a_rt, cb = _layer(64, 128, 2, seed=0)
    before = ops.cpu_decode_cache_nbytes()
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    outs = [torch.ops.kbit.linear(x, q_rt, a_rt, cb, 64, 128, None) for _ in range(3)]
    assert len(decodes) == 3 and ops.cpu_decode_cache_nbytes() == before
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_cache_setting_from_environment(monkeypatch):
    monkeypatch.delenv("VLLM_KBIT_CPU_DECODE_CACHE", raising=False)
    assert envs.cpu_decode_cache() is True
    monkeypatch.setenv("VLLM_KBIT_CPU_DECODE_CACHE", "0")
    assert envs.cpu_decode_cache() is False
    monkeypatch.setenv("VLLM_KBIT_CPU_DECODE_CACHE", "off")
    with pytest.raises(ValueError, match=r"VLLM_KBIT_CPU_DECODE_CACHE='off' is not a setting; supported: 0 \(off\), 1"):
        envs.cpu_decode_cache()


E, H, I, T, TOP_K = 5, 64, 96, 6, 2


def _moe(k, seed):
    g = torch.Generator().manual_seed(seed)
    w13 = [vllm_kbit.quantize((torch.randn(2 * I, H, generator=g) * 0.1).to(torch.bfloat16), k) for _ in range(E)]
    w2 = [vllm_kbit.quantize((torch.randn(H, I, generator=g) * 0.1).to(torch.bfloat16), k) for _ in range(E)]
    q13, a13 = stack_runtime([(w.qweight, w.absmax) for w in w13])
    q2, a2 = stack_runtime([(w.qweight, w.absmax) for w in w2])
    return q13, a13, q2, a2, w13[0].codebook


@pytest.mark.parametrize("k", fmt.SUPPORTED_BITS)
@pytest.mark.parametrize("on_input", [False, True])
def test_cached_fused_moe_equals_reference(k, on_input, decodes, monkeypatch):
    weights = _moe(k, seed=k)
    g = torch.Generator().manual_seed(20 + k)
    top_k = 1 if on_input else TOP_K
    expert_map = torch.tensor([-1, 0, 1, 2, 3, 4, -1], dtype=torch.int32)  # expert parallel: global 1..5 here
    calls = []
    for tokens in (1, 2, T):
        x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(7, generator=g)[:top_k] for _ in range(tokens)]).to(torch.int32)
        router = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
        for emap in (None, expert_map):
            calls.append((x, ids.clamp(max=E - 1) if emap is None else ids, router, *weights, I, emap, on_input))
    cached = [kbit_fused_moe(*c) for c in calls]
    assert len(decodes) == 2 * E  # every expert's w13 and w2 once
    monkeypatch.setattr(ops, "CPU_DECODE_CACHE", False)
    for c, got in zip(calls, cached):
        assert torch.equal(got, kbit_fused_moe(*c))
    assert len(decodes) == 2 * E + 2 * E * len(calls)


def test_cache_hits_through_torch_compile(decodes):
    """A compiled module passes its packed parameters to the op as the same tensors: one decode, reference outputs."""

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            q_rt, a_rt, cb = _layer(64, 128, 3, seed=0)
            self.qweight = torch.nn.Parameter(q_rt, requires_grad=False)
            self.absmax = torch.nn.Parameter(a_rt, requires_grad=False)
            self.register_buffer("codebook", cb, persistent=False)

        def forward(self, x):
            return torch.ops.kbit.linear(x * 2, self.qweight, self.absmax, self.codebook, 64, 128, None)

    layer = Layer()
    compiled = torch.compile(layer, backend="aot_eager", dynamic=True)
    with torch.inference_mode():  # as vLLM runs its forwards
        outs = [(x, compiled(x)) for x in (torch.randn(rows, 128, dtype=torch.bfloat16) for rows in (1, 2, 5))]
    assert len(decodes) == 1
    for x, got in outs:
        assert torch.equal(got, _reference_linear(x * 2, layer.qweight, layer.absmax, layer.codebook, 64, 128, None))
