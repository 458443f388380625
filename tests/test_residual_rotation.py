"""benchmarks/residual_rotation.py's transform (the residual-stream rotation it measures against kbit's per-layer
rotation) leaves a Llama-style model's function unchanged: norms folded, R1 on the residual stream (kbit's block
Hadamard or a random orthogonal matrix), R2 per head in v / o, the LM head untied. A wrong fold or rotation moves
the logits by far more than float32 rounding."""

from __future__ import annotations


import pytest
import torch

from kbit_dev import benchmarks


@pytest.fixture(scope="module")
def rr():
    return benchmarks.load("residual_rotation")


def _tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, max_position_embeddings=64)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # norm weights far from 1 (as trained models' are), so a missing fold shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand_like(p) * 3 + 0.1)
    return model


@pytest.mark.parametrize("r1,fold_only", [("hadamard", False), ("ortho", False), ("hadamard", True)])
def test_transform_keeps_the_logits(rr, r1, fold_only):
    model = _tiny_llama(0)
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        embed_before = model.model.embed_tokens.weight.clone()
        rr.Transform(model, seed=3, r1=r1, fold_only=fold_only).apply(model)
        got = model(ids).logits
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()  # untied
    assert all(torch.equal(layer.input_layernorm.weight, torch.ones(64)) for layer in model.model.layers)
    assert fold_only == torch.equal(model.model.embed_tokens.weight, embed_before)  # rotated unless fold-only


def test_only_input_size_rotates_that_size_alone(rr):
    from vllm_kbit.settings import Rotation

    rot = rr.OnlyInputSize(Rotation(seed=1), 96)
    W64, W96 = torch.randn(8, 64), torch.randn(8, 96)
    assert torch.equal(rot.rotate(W64), W64)
    torch.testing.assert_close(rot.rotate(W96), Rotation(seed=1).rotate(W96))
    torch.testing.assert_close(rot.rotate(rot.rotate(W96), inverse=True), W96, atol=1e-5, rtol=1e-5)
