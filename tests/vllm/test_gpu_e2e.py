"""The end-to-end checks on a GPU with vLLM's CUDA build (`pytest -m gpu`); skipped without a CUDA GPU."""

from __future__ import annotations

import pytest
import torch
from kbit_e2e import ONLINE, assert_agree, dequantized_checkpoint, online_kwargs, packed_weight_differences, settings_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and vLLM's CUDA build"),
]


@pytest.mark.parametrize("kind", ["qwen3_moe", "glm4_moe"])
def test_gpu_online_matches_dequantized_model(engine, tiny, tmp_path_factory, kind):
    got = engine(f"gpu-{kind}-online4", tiny[kind], online_kwargs(ONLINE[4]))
    ref_dir = dequantized_checkpoint(tiny[kind], str(tmp_path_factory.mktemp(f"gpu-{kind}-deq4")), settings_of(ONLINE[4]))
    ref = engine(f"gpu-{kind}-deq4", ref_dir)
    assert any(i.get("method") == "KbitOnlineMoEMethod" for i in got["layers"].values())
    assert_agree(f"GPU {kind}", got, ref)


def test_gpu_converted_checkpoint_identical_to_online(engine, tiny, converted_qwen3_moe):
    """Bit-identical packed weights, and outputs that agree like two runs of one engine do.

    Not token-identical outputs (the CPU test asks for those): under CUDA graphs and torch.compile two
    processes serving the same weights need not produce bit-identical logits (tests/vllm/repeatability.py
    measures it; docs/decisions.md, "End-to-end tests compare agreement"), and on this tiny random MoE
    router near-ties turn any last-bit difference into a different free-running continuation."""
    online = engine("gpu-qwen3_moe-online4", tiny["qwen3_moe"], online_kwargs(ONLINE[4]))
    conv = engine("gpu-qwen3_moe-converted4", converted_qwen3_moe)
    assert any("hash" in i for i in online["layers"].values()), "no kbit layer in the online model"
    differ = packed_weight_differences(conv, online)
    assert not differ, f"packed weights differ from online quantization in {differ}"
    assert_agree("GPU converted vs online", conv, online)


def test_gpu_mixed_bits_match_dequantized_model(engine, tiny, tmp_path_factory):
    """k=3 with attention at 5 bits and layer 1's routed experts left in bf16: the settings take effect
    on the CUDA build too (k=5 dense MMA/GEMV, k=3 MoE kernels, an unquantized MoE beside them)."""
    config = ONLINE[3]
    got = engine("gpu-qwen3_moe-online3", tiny["qwen3_moe"], online_kwargs(config))
    layers = got["layers"]
    assert (layers["model.layers.0.self_attn.qkv_proj"]["method"], layers["model.layers.0.self_attn.qkv_proj"]["bits"]) == (
        "KbitOnlineLinearMethod", 5)
    assert (layers["model.layers.0.mlp.experts"]["method"], layers["model.layers.0.mlp.experts"]["bits"]) == (
        "KbitOnlineMoEMethod", 3)
    assert layers["model.layers.1.mlp.experts"]["method"] == "UnquantizedFusedMoEMethod"
    ref_dir = dequantized_checkpoint(tiny["qwen3_moe"], str(tmp_path_factory.mktemp("gpu-qwen3_moe-deq3")),
                                     settings_of(config))
    ref = engine("gpu-qwen3_moe-deq3", ref_dir)
    assert_agree("GPU mixed bits", got, ref)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_tensor_parallel_2_matches_tp1(engine, tiny):
    tp1 = engine("gpu-qwen3_moe-online4", tiny["qwen3_moe"], online_kwargs(ONLINE[4]))
    tp2 = engine("gpu-qwen3_moe-online4-tp2", tiny["qwen3_moe"], {**online_kwargs(ONLINE[4]), "tensor_parallel_size": 2})
    assert len(tp2["layers_per_rank"]) == 2
    assert_agree("GPU TP2 vs TP1", tp2, tp1)
