"""Tiny random Hugging Face checkpoints (built locally, nothing downloaded) for the demo and the tests.

Each builder writes a complete model directory: ``config.json``, bf16
``model.safetensors`` from ``save_pretrained``, a byte-level tokenizer (256 byte
tokens + ``<|endoftext|>``) and ``generation_config.json``. Weights are drawn
from a seeded generator, so the same call always writes the same checkpoint.
"""

from __future__ import annotations

import os

import torch

VOCAB_SIZE = 384  # 256 byte tokens + 1 special token, padded
EOS_TOKEN = "<|endoftext|>"
EOS_TOKEN_ID = 256


def _byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: ord(c)))}
    vocab[EOS_TOKEN] = EOS_TOKEN_ID
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)


def _common(hidden: int, layers: int) -> dict:
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        initializer_range=0.05,
        tie_word_embeddings=False,
        bos_token_id=EOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=EOS_TOKEN_ID,
    )


def _qwen_moe(hidden: int, experts: int, top_k: int, moe_intermediate: int) -> dict:
    """The routed-expert fields Qwen3-MoE and Qwen3-Next configs share: every layer sparse."""
    return dict(
        intermediate_size=4 * hidden,
        moe_intermediate_size=moe_intermediate,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def qwen3_moe_config(hidden: int = 256, layers: int = 2, experts: int = 8, top_k: int = 2, moe_intermediate: int = 128):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**_common(hidden, layers), **_qwen_moe(hidden, experts, top_k, moe_intermediate))


def glm4_moe_config(hidden: int = 256, layers: int = 2, experts: int = 8, top_k: int = 2, moe_intermediate: int = 128):
    """GLM-4 MoE: first layer dense, then shared + routed experts with grouped sigmoid routing."""
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(
        **_common(hidden, layers),
        intermediate_size=2 * hidden,
        moe_intermediate_size=moe_intermediate,
        n_routed_experts=experts,
        n_shared_experts=1,
        num_experts_per_tok=top_k,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        partial_rotary_factor=0.5,
        use_qk_norm=False,
    )


def qwen3_dense_config(hidden: int = 256, layers: int = 2, intermediate: int | None = None):
    from transformers import Qwen3Config

    return Qwen3Config(**_common(hidden, layers), intermediate_size=intermediate or 4 * hidden)


def glm4_moe_lite_config(hidden: int = 256, layers: int = 2, experts: int = 8, top_k: int = 2,
                         moe_intermediate: int = 128):
    """GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``): multi-head latent attention (MLA), first layer dense, then
    shared + routed experts. The MLA sizes are the real model's: kv_lora_rank 512 and qk_rope_head_dim 64 are the
    only latent size vLLM's CPU MLA kernels take, and qk_nope / v head dims 192 / 256 one that its GPU MLA prefill
    backends take (64 / 64 is refused); every linear's K (hidden, q_lora_rank, kv_lora_rank, heads x v_head_dim,
    intermediate sizes) is a multiple of 32."""
    from transformers import Glm4MoeLiteConfig

    common = _common(hidden, layers)
    common.update(num_key_value_heads=common["num_attention_heads"])
    del common["head_dim"]  # MLA: head sizes come from the q/k/v dims below
    return Glm4MoeLiteConfig(
        **common,
        intermediate_size=2 * hidden,
        moe_intermediate_size=moe_intermediate,
        n_routed_experts=experts,
        n_shared_experts=1,
        num_experts_per_tok=top_k,
        first_k_dense_replace=1,  # read by vLLM (the real config.json has it); transformers uses mlp_layer_types
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        q_lora_rank=128,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
    )


def qwen3_next_config(hidden: int = 256, layers: int = 2, experts: int = 8, top_k: int = 2,
                      moe_intermediate: int = 128):
    """Qwen3-Next (``Qwen3NextForCausalLM``): gated delta-net linear attention layers, then a full (gated)
    attention layer; every layer routed + shared experts with a sigmoid shared-expert gate."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        **_common(hidden, layers),
        **_qwen_moe(hidden, experts, top_k, moe_intermediate),
        shared_expert_intermediate_size=moe_intermediate,
        layer_types=(["linear_attention"] * (layers - 1) + ["full_attention"]),
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        partial_rotary_factor=0.25,
    )


BUILDERS = {
    "qwen3_moe": qwen3_moe_config,
    "glm4_moe": glm4_moe_config,
    "qwen3": qwen3_dense_config,
    "glm4_moe_lite": glm4_moe_lite_config,
    "qwen3_next": qwen3_next_config,
}


def build(kind: str, out_dir: str, seed: int = 0, **overrides) -> str:
    """Writes the tiny ``kind`` checkpoint (a key of :data:`BUILDERS`) to out_dir; returns out_dir."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    if kind not in BUILDERS:
        raise ValueError(f"unknown tiny model {kind!r}; choose from {sorted(BUILDERS)}")
    config = BUILDERS[kind](**overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # transformers zero-inits some tensors (biases, router bias); make every weight non-trivial
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * config.initializer_range)
    model = model.to(torch.bfloat16)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    _byte_tokenizer().save_pretrained(out_dir)
    GenerationConfig(bos_token_id=EOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID).save_pretrained(
        out_dir
    )
    return out_dir


if __name__ == "__main__":
    # python -m kbit_dev.tiny_models KIND OUT_DIR: writes the checkpoint (if absent) and prints OUT_DIR.
    import sys

    kind, out = sys.argv[1], sys.argv[2]
    if not os.path.exists(os.path.join(out, "config.json")):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        build(kind, out)
    print(out)
