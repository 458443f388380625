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

Full shapes of public models (:data:`PUBLIC`): ``configs/<name>.json`` holds the model's public Hugging Face
config.json (its fields as published); :func:`write` copies it verbatim into config.json (plus a
``quantization_config`` for GPTQ) beside a text tokenizer of that model's vocabulary size.

GPTQ: a ``quantization_config`` in config.json (``quant_method: gptq``, 4 bits, group 128, desc_act false,
sym true) makes vLLM 0.26 pick its Marlin kernels. ``modules_in_block_to_quantize`` is written explicitly:
without it vLLM derives the quantized linear layers from the checkpoint's safetensors dtypes, finds no
files, and leaves attention in bf16 (routed experts are quantized either way).
"""

from __future__ import annotations

import copy
import itertools
import json
import os

from dataclasses import dataclass

import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # kbit_dev: the checkout's fixtures
from kbit_dev.tiny_models import EOS_TOKEN  # noqa: E402

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


CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


@dataclass(frozen=True)
class PublicModel:
    """A public model served at its full shape: where its config.json comes from and what it advertises."""

    repo: str  # the Hugging Face repository whose config.json configs/<name>.json records
    total_params_b: float  # the advertised total parameter count, billions
    gptq_modules: tuple[str, ...]  # GPTQ ``modules_in_block_to_quantize`` (substrings of vLLM module names)


_ATTN_AND_MLP = ("self_attn.", "mlp.experts", "shared_expert.", "shared_experts.", "mlp.gate_proj", "mlp.up_proj",
                 "mlp.down_proj")
PUBLIC = {
    # Qwen3-Next architecture: 36 gated delta-net + 12 gated attention layers, 512 routed experts top-10 + shared.
    "qwen3-coder-next": PublicModel("Qwen/Qwen3-Coder-Next", 80, _ATTN_AND_MLP + ("linear_attn.in_proj", "linear_attn.out_proj")),
    # GLM-4 MoE Lite: multi-head latent attention, first layer dense, 64 routed experts top-4 + shared.
    "glm-4.7-flash": PublicModel("zai-org/GLM-4.7-Flash", 30, _ATTN_AND_MLP),
    "qwen3-235b-a22b": PublicModel("Qwen/Qwen3-235B-A22B", 235, _ATTN_AND_MLP),
    "glm-4.5-air": PublicModel("zai-org/GLM-4.5-Air", 106, _ATTN_AND_MLP),
}


def public_config(name: str) -> dict:
    """The recorded public config.json of a :data:`PUBLIC` model, as a dict (a fresh copy)."""
    if name not in PUBLIC:
        raise ValueError(f"unknown public model {name!r}; choose from {sorted(PUBLIC)}")
    with open(os.path.join(CONFIGS, f"{name}.json")) as f:
        return json.load(f)


def gptq_config(name: str) -> dict:
    """GPTQ_INT4 with the model's quantized module names (the Qwen3-MoE list for SHAPES)."""
    qc = copy.deepcopy(GPTQ_INT4)
    if name in PUBLIC:
        qc["modules_in_block_to_quantize"] = list(PUBLIC[name].gptq_modules)
    return qc


def names() -> list[str]:
    return sorted(SHAPES) + sorted(PUBLIC)


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


def text_tokenizer(vocab_size: int = VOCAB_SIZE):
    """BPE tokenizer with the model's vocabulary size in which every token is printable ASCII: ids
    0..93 are the characters "!".."~" (all that encoding produces: no merges), the others strings of two or
    three of them, the last id ``<|endoftext|>``. Any id decodes to text, so the server's incremental
    detokenizer emits every generated token at once, as it does with a real tokenizer and text."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(0x21, 0x7F)]  # the printable ASCII characters but space
    words = itertools.chain(chars, map("".join, itertools.product(chars, repeat=2)),
                            map("".join, itertools.product(chars, repeat=3)))
    eos = vocab_size - 1
    vocab = dict(zip(words, range(eos)))
    vocab[EOS_TOKEN] = eos
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()  # tokens are text: concatenate them
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)


def write(shape: str, out_dir: str, quantization_config: dict | None = None) -> str:
    """Writes config.json, the text tokenizer and generation_config.json (no weights) to out_dir; returns out_dir.

    ``shape``: a name of :data:`SHAPES` (a Qwen3-MoE config built here) or of :data:`PUBLIC` (the recorded public
    config.json, written as recorded plus ``quantization_config`` if given)."""
    from transformers import GenerationConfig

    os.makedirs(out_dir, exist_ok=True)
    if shape in PUBLIC:
        config = public_config(shape)
        if quantization_config:
            config["quantization_config"] = quantization_config
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        vocab_size = config["vocab_size"]
    else:
        model_config(shape, quantization_config).save_pretrained(out_dir)
        vocab_size = VOCAB_SIZE
    eos = vocab_size - 1
    text_tokenizer(vocab_size).save_pretrained(out_dir)
    GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos).save_pretrained(out_dir)
    return out_dir


# Weights kbit quantizes: every linear / routed-expert weight but the embedding, the output head, router gates,
# Qwen3-Next's one-output shared-expert gate and its gated delta-net's depthwise conv1d (vLLM builds those without
# a quantization config; tests/vllm/test_e2e.py, NOT_OFFERED). Names as transformers builds the model.
_KEPT_BF16 = ("embed_tokens", "lm_head", "mlp.gate.", "shared_expert_gate", "conv1d")


def parameter_counts(shape: str) -> tuple[int, int]:
    """(all parameters, the ones kbit quantizes) of the model transformers builds from the shape's config, counted
    on the meta device (no memory). Multi-token-prediction layers are not built, as vLLM serves without them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if shape in PUBLIC:
        config = AutoConfig.for_model(**public_config(shape))
    else:
        config = model_config(shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = quantized = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if p.dim() >= 2 and not any(k in name for k in _KEPT_BF16):
            quantized += p.numel()
    return total, quantized


def weight_gib_estimate(shape: str, bits: float) -> float:
    """Weights in GiB at ``bits`` per quantized weight (kbit k: k + 0.25; GPTQ int4 group 128: about 4.16; bf16: 16),
    everything else bf16; what vLLM's "Model loading took" line should show at tensor parallel 1."""
    total, quantized = parameter_counts(shape)
    return (quantized * bits / 8 + (total - quantized) * 2) / 2**30

