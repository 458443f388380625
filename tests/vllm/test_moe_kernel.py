"""The kbit routed experts as vLLM's modular-kernel experts (vllm_kbit.vllm.moe_method.KbitExperts), without an
engine: what they declare to vLLM, their apply against the fused op (router weights on the input too), LoRA
contexts on vLLM's CPU build, and the refusal of all-to-all backends in the batched format."""

from __future__ import annotations

import types

import pytest
import torch

import vllm_kbit
from vllm_kbit.moe import kbit_fused_moe, stack_runtime
from vllm_kbit.vllm.compat import FusedMoEActivationFormat, MoEActivation, TopKWeightAndReduceNoOP
from vllm_kbit.vllm.moe_method import KbitExperts, _KbitMoEBase

E, H, I, T, TOP_K = 6, 64, 96, 7, 2


def _kbit_experts(k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = [vllm_kbit.quantize((torch.randn(2 * I, H, generator=g) * 0.1).to(torch.bfloat16), k) for _ in range(E)]
    w2 = [vllm_kbit.quantize((torch.randn(H, I, generator=g) * 0.1).to(torch.bfloat16), k) for _ in range(E)]
    q13, a13 = stack_runtime([(w.qweight, w.absmax) for w in w13])
    q2, a2 = stack_runtime([(w.qweight, w.absmax) for w in w2])
    experts = object.__new__(KbitExperts)  # vLLM's configs aside: the state apply uses
    experts.w13_absmax, experts.w2_absmax, experts.codebook, experts.intermediate_size = a13, a2, w13[0].codebook, I
    experts.rotation = None  # unrotated experts
    return experts, q13, q2


def _apply(experts, q13, q2, x, ids, weights, on_input=False):
    out = torch.empty_like(x)
    assert experts.apply(out, x, q13, q2, weights, ids, MoEActivation.SILU, E, None, None, None, None, None, None,
                         on_input) is None
    return out


def test_experts_declare_what_vllm_asks():
    assert KbitExperts.activation_format() == FusedMoEActivationFormat.Standard
    assert KbitExperts.supports_lora() and not KbitExperts.is_monolithic()
    assert KbitExperts._supports_activation(MoEActivation.SILU) and not KbitExperts._supports_no_act_and_mul()
    experts, q13, q2 = _kbit_experts()
    assert isinstance(experts.finalize_weight_and_reduce_impl(), TopKWeightAndReduceNoOP)
    ws13, ws2, out = experts.workspace_shapes(7, 2 * I, H, TOP_K, E, E, None, MoEActivation.SILU)
    assert out == (7, H) and ws13 == (0,) and ws2 == (0,)
    x = torch.zeros(5, H)
    assert experts.moe_problem_size(x, q13, q2, torch.zeros(5, TOP_K, dtype=torch.int32)) == (E, 5, 2 * I, H, TOP_K)


def test_apply_is_the_fused_op_and_takes_weights_already_on_the_input():
    experts, q13, q2 = _kbit_experts()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(T)]).to(torch.int32)
    weights = torch.softmax(torch.randn(T, TOP_K, generator=g), -1)
    want = kbit_fused_moe(x, ids, weights, q13, experts.w13_absmax, q2, experts.w2_absmax, experts.codebook, I)
    assert torch.equal(_apply(experts, q13, q2, x, ids, weights), want)
    # vLLM's prepare step scaled the input already (top-k 1): the experts must not weight again.
    one = ids[:, :1].contiguous()
    w1 = weights[:, :1].contiguous()
    scaled = (x.float() * w1).to(x.dtype)
    plain = kbit_fused_moe(scaled, one, torch.ones_like(w1), q13, experts.w13_absmax, q2, experts.w2_absmax,
                           experts.codebook, I)
    assert torch.equal(_apply(experts, q13, q2, scaled, one, w1, on_input=True), plain)


def test_lora_contexts_on_cpu_run_the_fused_op_or_refuse_expert_adapters():
    """vLLM's CPU build has no MoE LoRA kernels: adapters without routed-expert weights (zero B factors) leave the
    experts to the fused op; one with expert weights is refused in one line."""
    experts, q13, q2 = _kbit_experts()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(T)]).to(torch.int32)
    weights = torch.softmax(torch.randn(T, TOP_K, generator=g), -1)
    plain = _apply(experts, q13, q2, x, ids, weights)
    b13 = tuple(torch.zeros(4, E, I, 8) for _ in range(2))
    b2 = (torch.zeros(4, E, H, 8),)
    experts.set_lora_context(types.SimpleNamespace(w13_lora_b_stacked=b13, w2_lora_b_stacked=b2))
    assert torch.equal(_apply(experts, q13, q2, x, ids, weights), plain)
    b2[0][1, 3, 5, 2] = 0.5
    with pytest.raises(NotImplementedError, match="routed-expert weights needs vLLM's GPU MoE LoRA kernels") as e:
        _apply(experts, q13, q2, x, ids, weights)
    assert "\n" not in str(e.value)


def test_all_to_all_backends_in_the_batched_format_are_refused_naming_the_backend():
    method = types.SimpleNamespace(prefix="model.layers.3.mlp.experts", moe_quant_config=None,
                                   moe=types.SimpleNamespace(moe_parallel_config=types.SimpleNamespace(
                                       all2all_backend="deepep_low_latency")))
    batched = types.SimpleNamespace(activation_format=FusedMoEActivationFormat.BatchedExperts)
    with pytest.raises(ValueError, match="all-to-all backend 'deepep_low_latency'.*standard format") as e:
        _KbitMoEBase._experts(method, None, batched)
    assert "model.layers.3.mlp.experts" in str(e.value) and "\n" not in str(e.value)
