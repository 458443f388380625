"""Rotated checkpoints (docs/format.md, section 9) served through vLLM's CPU build equal their dequantized rotated
models: the bf16 checkpoint whose weights are what the conversion stored, decoded in the original basis
(Q(W R) R^T), run unquantized. Round to nearest on the tiny Qwen3-MoE (attention, routed experts), GPTQ on the tiny
dense Qwen3 (attention, dense MLP); online quantization with a rotation packs what convert writes.

Each engine configuration starts once per session (see conftest.engine)."""

from __future__ import annotations

import pytest

from kbit_e2e import (
    ONLINE, ROTATION, TEXT_PROMPTS, assert_agree, assert_rotated, online_kwargs, packed_weight_differences,
)



def test_rotated_moe_checkpoint_matches_its_dequantized_model(engine, rotated):
    out, deq = rotated("qwen3_moe")
    got = engine("qwen3_moe-rot4", out, text_prompts=TEXT_PROMPTS)
    assert_rotated("qwen3_moe rotated", got, 256)
    ref = engine("qwen3_moe-rot4-deq", deq, text_prompts=TEXT_PROMPTS)
    assert_agree("qwen3_moe rotated vs its dequantized model", got, ref)


def test_online_rotation_packs_what_convert_writes(engine, tiny, rotated):
    """--hf-overrides with a rotation quantizes W R online: the converted checkpoint's packed weights, bit for bit,
    and so the same outputs as its dequantized model."""
    out, deq = rotated("qwen3_moe")
    online = engine("qwen3_moe-online4-rot", tiny["qwen3_moe"], online_kwargs({**ONLINE[4], "rotation": ROTATION}),
                    text_prompts=TEXT_PROMPTS)
    assert_rotated("qwen3_moe online rotated", online, 256)
    conv = engine("qwen3_moe-rot4", out, text_prompts=TEXT_PROMPTS)
    assert packed_weight_differences(online, conv) == []
    assert_agree("qwen3_moe online rotated vs the converted one's dequantized model", online,
                 engine("qwen3_moe-rot4-deq", deq, text_prompts=TEXT_PROMPTS))


def test_rotated_gptq_dense_checkpoint_matches_its_dequantized_model(engine, rotated):
    out, deq = rotated("qwen3", gptq=True)
    got = engine("qwen3-rot4-gptq", out, text_prompts=TEXT_PROMPTS)
    assert_rotated("qwen3 --gptq rotated", got, 256)
    ref = engine("qwen3-rot4-gptq-deq", deq, text_prompts=TEXT_PROMPTS)
    assert_agree("qwen3 --gptq rotated vs its dequantized model", got, ref)
