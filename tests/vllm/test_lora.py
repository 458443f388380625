"""LoRA adapters on kbit models, end to end on vLLM's CPU backend: three random adapters at once (max_loras 4)
beside the base model, outputs against the dequantized bf16 model with each adapter merged in.

Dense Qwen3: adapters on attention and the MLP (q/k/v/o, gate/up/down: kbit linear layers under vLLM's LoRA
wrappers). Qwen3-MoE: adapters on attention; the routed experts run as vLLM's modular kernel under its MoE LoRA
layer (vLLM's CPU build has no kernels for LoRA on experts; the GPU suite covers those, test_gpu_e2e.py)."""

from __future__ import annotations

import pytest

from kbit_dev.lora import ATTENTION, MLP
from kbit_e2e import assert_lora_agrees, lora_runs


@pytest.mark.parametrize("kind,targets", [("qwen3", ATTENTION + MLP), ("qwen3_moe", ATTENTION)])
def test_lora_adapters_match_merged_dequantized_model(engine, tiny, tmp_path_factory, kind, targets):
    got, ref, plain = lora_runs(engine, tiny, tmp_path_factory, kind, targets)
    layers = {name: info for name, info in got["layers"].items() if "bits" in info}
    assert any(info["method"] == "KbitOnlineLinearMethod" for info in layers.values()), layers
    if kind == "qwen3_moe":
        moe = got["layers"]["model.layers.0.mlp.experts"]
        assert moe["bits"] == 4 and "w13_qweight" in moe["params"], moe
    assert_lora_agrees(f"{kind} kbit-4 + 3 LoRA adapters", got, ref, plain)
