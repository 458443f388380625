"""Rotated checkpoints (docs/format.md, section 9) served through vLLM's CPU build equal their dequantized rotated
models: the bf16 checkpoint whose weights are what the conversion stored, decoded in the original basis
(Q(W R) R^T), run unquantized. Round to nearest on the tiny Qwen3-MoE (attention, routed experts), GPTQ on the tiny
dense Qwen3 (attention, dense MLP), `--rotation-tp 2` at tensor parallel 2 (each rank its slice of the signs);
online quantization with a rotation packs what convert writes.

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


def test_rotated_checkpoint_at_tensor_parallel_2_matches_its_dequantized_model(engine, rotated):
    """`convert --rotate --rotation-tp 2` at TP=2: each rank rotates its shard of o_proj's and down's inputs (and of
    the experts' intermediate size) with its slice of the signs; the reference is the dequantized rotated model at
    TP=2, which shards and all-reduces as kbit does."""
    out, deq = rotated("qwen3_moe", tp=2)
    tp2 = {"tensor_parallel_size": 2}
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    got = engine("qwen3_moe-rot4-tp2", out, tp2, env=env, text_prompts=TEXT_PROMPTS)
    ranks = got["layers_per_rank"]
    assert len(ranks) == 2
    for layers in ranks:
        assert_rotated("qwen3_moe rotated TP2", {"layers": layers}, 256)
        assert layers["model.layers.0.self_attn.o_proj"]["rotation"] == {"kbit_rot_signs": 128}  # K 256 / 2
        assert layers["model.layers.0.self_attn.qkv_proj"]["rotation"] == {"kbit_rot_signs": 256}  # not sharded
        assert layers["model.layers.0.mlp.experts"]["rotation"]["kbit_w2_rot_signs"] == 64  # I 128 / 2
    ref = engine("qwen3_moe-rot4-tp2-deq", deq, tp2, env=env, text_prompts=TEXT_PROMPTS)
    assert_agree("qwen3_moe rotated TP2 vs its dequantized model at TP2", got, ref)
