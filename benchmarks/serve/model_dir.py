"""Weightless model directories for serving benchmarks: config.json + a text tokenizer, served with --load-format dummy.

vLLM's dummy loader never reads a weight file (``DummyModelLoader.download_model`` is a no-op and every
parameter is filled with uniform(-1e-3, 1e-3)), so a directory with only config.json, the tokenizer and
generation_config.json is a complete model for throughput measurements. ``vllm bench serve``'s random
dataset samples token ids below the tokenizer's vocab size, decodes and re-encodes them, and the server
counts completion tokens itself, so a small tokenizer with a large model vocabulary is fine.

The tokenizer (:func:`text_tokenizer`) has the model's vocabulary size and every token is printable ASCII, as
with a real model's tokenizer every id the model can emit decodes to text. A small tokenizer (the tests'
256 byte tokens) would decode every id the dummy model emits above its vocabulary, or any random byte
prompt, to no complete character; the server's incremental detokenizer (tokenizers' ``DecodeStream``) then
decodes the whole prompt again at every generated token: host work per step that grows with prompt length x
batch and leaves the GPU idle (docs/decisions.md, "Serving benchmark").

GPTQ: a ``quantization_config`` in config.json (``quant_method: gptq``, 4 bits, group 128, desc_act false,
sym true) makes vLLM 0.26 pick its Marlin kernels. ``modules_in_block_to_quantize`` is written explicitly:
without it vLLM derives the quantized linear layers from the checkpoint's safetensors dtypes, finds no
files, and leaves attention in bf16 (routed experts are quantized either way).
"""

from __future__ import annotations

import itertools
import os

from vllm_kbit.testing.tiny_models import EOS_TOKEN

VOCAB_SIZE = 151936  # Qwen3's vocabulary: the model's and the tokenizer's
EOS_TOKEN_ID = VOCAB_SIZE - 1

# Qwen3-30B-A3B (docs/architecture.md, "Target shapes"); the fields not listed are transformers' Qwen3MoeConfig defaults.
SHAPES = {
    "qwen3-30b-a3b": dict(
        hidden_size=2048,
        num_hidden_layers=48,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        intermediate_size=6144,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
    ),
    # Same architecture and vocabulary, CPU-sized: checks the harness end to end in about a minute per server.
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
    ),
}

GPTQ_INT4 = {
    "quant_method": "gptq",
    "bits": 4,
    "group_size": 128,
    "desc_act": False,
    "sym": True,
    "modules_in_block_to_quantize": [
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.experts",
    ],
}


def model_config(shape: str, quantization_config: dict | None = None):
    """transformers Qwen3MoeConfig of the named shape (bf16, every layer MoE, untied embeddings)."""
    from transformers import Qwen3MoeConfig

    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; choose from {sorted(SHAPES)}")
    extra = {"quantization_config": quantization_config} if quantization_config else {}
    return Qwen3MoeConfig(
        **SHAPES[shape],
        architectures=["Qwen3MoeForCausalLM"],
        dtype="bfloat16",
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        tie_word_embeddings=False,
        bos_token_id=EOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=EOS_TOKEN_ID,
        **extra,
    )


def text_tokenizer():
    """BPE tokenizer with the model's vocabulary size in which every token is printable ASCII: ids
    0..93 are the characters "!".."~" (all that encoding produces: no merges), the others strings of two or
    three of them, the last id ``<|endoftext|>``. Any id decodes to text, so the server's incremental
    detokenizer emits every generated token at once, as it does with a real tokenizer and text."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(0x21, 0x7F)]  # the printable ASCII characters but space
    words = itertools.chain(chars, map("".join, itertools.product(chars, repeat=2)),
                            map("".join, itertools.product(chars, repeat=3)))
    vocab = dict(zip(words, range(EOS_TOKEN_ID)))
    vocab[EOS_TOKEN] = EOS_TOKEN_ID
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()  # tokens are text: concatenate them
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)


def write(shape: str, out_dir: str, quantization_config: dict | None = None) -> str:
    """Writes config.json, the text tokenizer and generation_config.json (no weights) to out_dir; returns out_dir."""
    from transformers import GenerationConfig

    os.makedirs(out_dir, exist_ok=True)
    model_config(shape, quantization_config).save_pretrained(out_dir)
    text_tokenizer().save_pretrained(out_dir)
    GenerationConfig(bos_token_id=EOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID).save_pretrained(
        out_dir
    )
    return out_dir

