"""GPTQ rounding into the kbit format (vllm_kbit.gptq): a valid kbit weight, equal to the reference's
round-to-nearest when there is nothing to compensate, and a smaller layer output error than
round-to-nearest on correlated inputs."""

from __future__ import annotations

import pytest
import torch

from vllm_kbit import gptq
from vllm_kbit import reference as fmt


def _correlated_inputs(n: int, K: int, seed: int, scattered: bool = False) -> torch.Tensor:
    """Inputs with strongly correlated features and a few large channels, as in a transformer: the
    first 4, or (``scattered``) 8 at random positions."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(K, K, generator=g) / K**0.5 + torch.eye(K)
    X = torch.randn(n, K, generator=g) @ mix
    X[:, torch.randperm(K, generator=g)[:8] if scattered else slice(0, 4)] *= 8
    return X


@pytest.mark.parametrize("k", fmt.SUPPORTED_BITS)
@pytest.mark.parametrize("search", [True, False])
@pytest.mark.parametrize("options", [{"act_order": False, "scale_rule": "mse"}, {}], ids=["natural-mse", "defaults"])
def test_identity_hessian_is_round_to_nearest(k, search, options):
    """H = I: no error is propagated (and every column weighs the same), so every index, and every
    scale, of GPTQ's column loop (no refinement) is the reference's."""
    W = (torch.randn(80, 256, generator=torch.Generator().manual_seed(k)) * 0.02).to(torch.bfloat16)
    cb = fmt.normal_float_codebook(k)
    got = gptq.gptq_quantize(W, torch.eye(256), cb, k, search, refine_passes=0, **options)
    want = fmt.quantize(W, cb, k, search)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("k", fmt.SUPPORTED_BITS)
@pytest.mark.parametrize("act_order", [False, True])
def test_uncorrelated_inputs_are_round_to_nearest_in_either_order(k, act_order):
    """Diagonal H with distinct entries: act-order visits the columns (and decides the blocks' scales)
    in a scattered order across lazy batches, and still nothing is propagated, so it is the reference's
    round-to-nearest bit for bit."""
    g = torch.Generator().manual_seed(10 + k)
    W = (torch.randn(48, 512, generator=g) * 0.02).to(torch.bfloat16)
    H = torch.diag(torch.rand(512, generator=g) + 0.1)
    cb = fmt.default_codebook(k)
    got = gptq.gptq_quantize(W, H, cb, k, act_order=act_order, scale_rule="mse", refine_passes=0)
    want = fmt.quantize(W, cb, k)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("k", fmt.SUPPORTED_BITS)
def test_act_order_lowers_output_error_on_scattered_large_inputs(k):
    """Large input channels at random positions: rounding them first, while most columns are still open
    to absorb their error, beats rounding them where they fall."""
    K, N = 512, 64
    W = (torch.randn(N, K, generator=torch.Generator().manual_seed(70 + k)) * 0.02).to(torch.bfloat16)
    X = _correlated_inputs(2048, K, 80 + k, scattered=True)
    H, cb, ref = X.T @ X, fmt.default_codebook(k), X @ W.float().T

    def out_err(act_order):
        q, a = gptq.gptq_quantize(W, H, cb, k, act_order=act_order, scale_rule="mse", refine_passes=0)
        return (X @ fmt.dequantize(q, a, cb, torch.float32).T - ref).square().sum().item()

    assert out_err(True) < 0.9 * out_err(False)


@pytest.mark.parametrize("k", [3, 4])
def test_act_order_does_not_depend_on_the_lazy_batch(k):
    """A block whose first column in act-order lies past the lazy batch gets its scale from the pending
    updates applied on the fly: the same scales, and the same indices up to float rounding, as with one
    batch holding every column."""
    K, N = 512, 64
    W = (torch.randn(N, K, generator=torch.Generator().manual_seed(90 + k)) * 0.02).to(torch.bfloat16)
    X = _correlated_inputs(2048, K, 100 + k, scattered=True)
    cb = fmt.default_codebook(k)
    (q32, a32), (qall, aall) = (gptq.gptq_quantize(W, X.T @ X, cb, k, act_order=True, lazy_cols=n, refine_passes=0)
                                for n in (32, K))
    assert torch.equal(a32, aall)
    assert (fmt.unpack_bitplanes(q32) != fmt.unpack_bitplanes(qall)).float().mean() <= 0.005


@pytest.mark.parametrize("k", fmt.SUPPORTED_BITS)
@pytest.mark.parametrize("rule", ["hdiag", "gptq"])
def test_weighted_scale_rules_minimize_output_error_of_uncorrelated_inputs(k, rule):
    """Diagonal H: a column's output error is H[i, i] x its squared weight error, which both weighted rules
    minimize block by block over the reference's candidates; so every row's output error is at most
    round-to-nearest's, and below it in total."""
    g = torch.Generator().manual_seed(110 + k)
    W = (torch.randn(64, 256, generator=g) * 0.02).to(torch.bfloat16)
    d = torch.rand(256, generator=g).pow(4) * 100 + 0.01  # input energies spread over four decades
    cb = fmt.default_codebook(k)
    got = fmt.dequantize(*gptq.gptq_quantize(W, torch.diag(d), cb, k, scale_rule=rule, refine_passes=0), cb, torch.float32)
    rtn = fmt.dequantize(*fmt.quantize(W, cb, k), cb, torch.float32)

    def row_err(D):
        return ((D - W.float()).square() * d).sum(-1)

    assert (row_err(got) <= row_err(rtn) * (1 + 1e-5)).all()
    assert row_err(got).sum() < 0.99 * row_err(rtn).sum()


def test_gptq_quantize_refuses_an_unknown_scale_rule():
    with pytest.raises(ValueError, match="scale_rule='max'"):
        gptq.gptq_quantize(torch.randn(8, 64), torch.eye(64), fmt.normal_float_codebook(4), 4, scale_rule="max")


@pytest.mark.parametrize("k", fmt.SUPPORTED_BITS)
def test_gptq_reduces_layer_output_error(k):
    K, N = 256, 96
    W = (torch.randn(N, K, generator=torch.Generator().manual_seed(50 + k)) * 0.02).to(torch.bfloat16)
    X = _correlated_inputs(2048, K, 60 + k)
    cb = fmt.normal_float_codebook(k)
    q, a = gptq.gptq_quantize(W, X.T @ X, cb, k)
    assert q.shape == (N, K // 32, k) and q.dtype == torch.int32 and a.shape == (N, K // 32) and a.dtype == torch.uint8
    gptq_W = fmt.dequantize(q, a, cb, torch.float32)
    rtn_W = fmt.dequantize(*fmt.quantize(W, cb, k), cb, torch.float32)
    ref = X @ W.float().T

    def out_err(D):
        return (X @ D.T - ref).square().sum().item()

    # GPTQ trades weight error for output error: its output error is clearly below RTN's.
    assert out_err(gptq_W) < 0.8 * out_err(rtn_W)
    assert (gptq_W - W.float()).square().sum() > (rtn_W - W.float()).square().sum()


def _layer_loss(W, q, a, cb, H):
    E = W.float() - fmt.dequantize(q, a, cb, torch.float32)
    return torch.einsum("nk,kl,nl->", E.double(), H.double(), E.double()).item()


@pytest.mark.parametrize("k", fmt.SUPPORTED_BITS)
def test_refinement_lowers_gptqs_loss_pass_by_pass(k):
    """Coordinate descent from GPTQ's rounding: each pass keeps or lowers the loss it descends on (the damped H's),
    the first pass by a clear margin on correlated inputs, and the result is a kbit weight of the same layout."""
    K, N = 256, 96
    W = (torch.randn(N, K, generator=torch.Generator().manual_seed(70 + k)) * 0.02).to(torch.bfloat16)
    X = _correlated_inputs(2048, K, 80 + k, scattered=True)
    H = X.T @ X
    Hd = gptq._damped(H, gptq.DEFAULT_DAMP)
    cb = fmt.normal_float_codebook(k)
    losses, last = [], None
    for passes in (0, 1, 2, 3):
        q, a = gptq.gptq_quantize(W, H, cb, k, refine_passes=passes)
        assert q.shape == (N, K // 32, k) and q.dtype == torch.int32 and a.shape == (N, K // 32) and a.dtype == torch.uint8
        losses.append(_layer_loss(W, q, a, cb, Hd))
        last = (q, a)
    assert all(b <= a * (1 + 1e-6) for a, b in zip(losses, losses[1:])), losses
    assert losses[1] < 0.98 * losses[0], losses
    assert not torch.equal(last[0], gptq.gptq_quantize(W, H, cb, k)[0])


def test_refinement_with_identity_hessian_rounds_to_nearest_and_moves_scales_on_correlated_inputs():
    """H = I: a column's exact step is the nearest level, so every index ends as round-to-nearest under its block's
    final scale, at a block error no larger than the reference's scale search. Correlated inputs: some block
    scales move (the pass revisits scales, not only indices)."""
    k, K, N = 3, 128, 64
    W = torch.randn(N, K, generator=torch.Generator().manual_seed(5)) * 0.02
    cb = fmt.normal_float_codebook(k)
    q0, a0 = fmt.quantize(W, cb, k)
    idx0 = fmt.unpack_bitplanes(q0).reshape(N, K).to(torch.uint8)
    idx, codes = gptq.refine_rounding(W, torch.eye(K), idx0, a0, cb, 2)
    assert torch.equal(idx, fmt.choose_indices(W, fmt.e4m4_decode(codes), cb).reshape(N, K))
    err = (W - cb[idx.long()] * fmt.e4m4_decode(codes).repeat_interleave(32, -1)).square().sum()
    assert err <= (W - fmt.dequantize(q0, a0, cb, torch.float32)).square().sum() * (1 + 1e-6)
    X = _correlated_inputs(1024, K, 6, scattered=True)
    q, a = gptq.gptq_quantize(W, X.T @ X, cb, k)
    idx1 = fmt.unpack_bitplanes(q).reshape(N, K).to(torch.uint8)
    _, codes = gptq.refine_rounding(W, gptq._damped(X.T @ X, gptq.DEFAULT_DAMP), idx1, a, cb, 2)
    assert (codes != a).any()


def test_refinement_of_experts_is_each_expert_alone():
    """The experts' loop refines each weight with its own H: the same words as one weight at a time."""
    k, K, N = 3, 128, 48
    g = torch.Generator().manual_seed(9)
    W = torch.randn(3, N, K, generator=g) * 0.02
    Hs = torch.stack([(lambda X: X.T @ X)(_correlated_inputs(512, K, 20 + b)) for b in range(3)])
    cb = fmt.normal_float_codebook(k)
    q, a = gptq.gptq_quantize_experts(W, Hs, cb, k, refine_passes=2)
    for b in range(3):
        qb, ab = gptq.gptq_quantize(W[b], Hs[b], cb, k, refine_passes=2)
        assert torch.equal(q[b], qb) and torch.equal(a[b], ab)


@pytest.mark.parametrize("passes", [-1, 17, 1.5, True, "2"])
def test_gptq_quantize_refuses_bad_refine_passes(passes):
    with pytest.raises(ValueError, match=r"refine_passes=.* is not supported; it must be an integer in \[0, 16\]"):
        gptq.gptq_quantize(torch.randn(8, 64), torch.eye(64), fmt.normal_float_codebook(4), 4, refine_passes=passes)


def test_gptq_quantize_refuses_a_wrong_hessian():
    W = torch.randn(8, 64)
    with pytest.raises(ValueError, match=r"H has shape \[32, 32\], weight \[8, 64\] needs \[64, 64\]"):
        gptq.gptq_quantize(W, torch.eye(32), fmt.normal_float_codebook(4), 4)


def test_calibration_text_is_not_the_perplexity_text():
    from kbit_dev import real_model

    text = gptq.calibration_text()
    assert len(text) > 100_000 and text == gptq.calibration_text()
    ppl_text, _ = real_model.bundled_text()
    assert text[:2000] not in ppl_text and ppl_text[:2000] not in text


def test_convert_with_gptq_writes_the_same_layout_with_other_indices(tmp_path):
    """`convert(gptq=True)` on a tiny dense model: same tensors, shapes and config as plain convert, the
    linear weights rounded differently, and the first layer's q_proj output on the calibration text
    closer to bf16's than round-to-nearest's."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_kbit.convert import convert
    from vllm_kbit.settings import KbitSettings
    from kbit_dev import tiny_models

    src = tiny_models.build("qwen3", str(tmp_path / "src"), hidden=128, layers=1)
    settings = KbitSettings(bits=3)
    text = gptq.calibration_text()[:20000]
    rtn_dir, gptq_dir = str(tmp_path / "rtn"), str(tmp_path / "gptq")
    convert(src, rtn_dir, settings, progress=False)
    convert(src, gptq_dir, settings, progress=False, gptq=True, calibration_text=text)
    rtn = load_file(f"{rtn_dir}/model-00001-of-00001.safetensors")
    got = load_file(f"{gptq_dir}/model-00001-of-00001.safetensors")
    assert {n: (t.shape, t.dtype) for n, t in rtn.items()} == {n: (t.shape, t.dtype) for n, t in got.items()}
    assert open(f"{rtn_dir}/config.json").read() == open(f"{gptq_dir}/config.json").read()
    qnames = [n for n in rtn if n.endswith(".qweight")]
    assert len(qnames) == 7 and all(not torch.equal(rtn[n], got[n]) for n in qnames)

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src)
    ids = tok(text, return_tensors="pt").input_ids[:, :512]
    captured = {}
    layer = model.model.layers[0]
    h = layer.self_attn.q_proj.register_forward_pre_hook(lambda m, a: captured.setdefault("x", a[0]))
    with torch.no_grad():
        model.model(input_ids=ids)
    h.remove()
    x, W = captured["x"][0], layer.self_attn.q_proj.weight
    cb = settings.codebook(3)
    p = "model.layers.0.self_attn.q_proj"

    def out_err(t):
        D = fmt.dequantize(t[f"{p}.qweight"], t[f"{p}.absmax"], cb, torch.float32)
        return (x @ (D - W).T).square().sum().item()

    assert out_err(got) < 0.9 * out_err(rtn)


def test_cli_calibration_file_needs_gptq(tmp_path, capsys):
    from vllm_kbit import cli

    assert cli.main(["convert", str(tmp_path / "in"), str(tmp_path / "out"), "--calibration-file", "x.txt"]) == 2
    assert "--calibration-file needs --gptq" in capsys.readouterr().err
