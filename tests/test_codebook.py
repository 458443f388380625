"""Normal-float codebooks and the validation of custom ones."""

import math

import pytest
import torch

from vllm_kbit import reference as fmt


@pytest.mark.parametrize("k", fmt.SUPPORTED_BITS)
def test_normal_float_codebook_properties(k):
    cb = fmt.normal_float_codebook(k)
    assert cb.dtype == torch.float32 and cb.shape == (2**k,)
    fmt.check_codebook(cb, k)
    fmt.check_codebook_values(cb)
    assert torch.allclose(cb, -cb.flip(0), atol=1e-7)  # symmetric
    assert cb[0] == -1 and cb[-1] == 1


@pytest.mark.parametrize("k", fmt.SUPPORTED_BITS)
def test_levels_are_means_of_equiprobable_normal_bins(k):
    # Monte-Carlo: sort 2**21 N(0,1) draws, cut into 2**k equal-count bins, average each bin.
    x = torch.randn(2**21, generator=torch.Generator().manual_seed(k), dtype=torch.float64).sort().values
    means = x.view(2**k, -1).mean(1)
    expected = means / means.abs().max()
    assert torch.allclose(fmt.normal_float_codebook(k).double(), expected, atol=5e-3)


def test_k2_level_is_the_closed_form():
    # Quartile bins: outer mean = 4 phi(q), inner mean = 4 (phi(0) - phi(q)); the codebook is their ratio.
    q = 0.6744897501960817
    phi = lambda t: math.exp(-t * t / 2) / math.sqrt(2 * math.pi)
    assert fmt.normal_float_codebook(2)[2].item() == pytest.approx((phi(0) - phi(q)) / phi(q), rel=1e-6)


@pytest.mark.parametrize(
    "values, message",
    [
        ([-0.9, -0.5, 0.5, 0.9], "max |c| == 1"),
        ([-1.0, 0.5, -0.5, 1.0], "ascending"),
        ([-1.0, -0.5, -0.5, 1.0], "ascending"),
        ([-1.0, float("nan"), 0.5, 1.0], "non-finite"),
    ],
)
def test_bad_custom_codebook_values_are_refused(values, message):
    with pytest.raises(ValueError, match=message):
        fmt.check_codebook_values(torch.tensor(values))


def test_bad_codebook_structure_is_refused():
    with pytest.raises(ValueError, match="needs 8"):
        fmt.check_codebook(fmt.normal_float_codebook(2), 3)
    with pytest.raises(TypeError, match="float32"):
        fmt.check_codebook(fmt.normal_float_codebook(2).double(), 2)


def test_asymmetric_custom_codebook_quantizes_to_its_own_levels():
    import vllm_kbit

    cb = torch.tensor([-1.0, -0.2, 0.1, 0.3, 0.45, 0.6, 0.8, 0.95])
    W = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    w = vllm_kbit.quantize(W, 3, codebook=cb)
    D = w.dequantize(torch.float32).view(16, 2, 32)
    scale = fmt.e4m4_decode(w.absmax).unsqueeze(-1)
    levels = cb * scale.unsqueeze(-1)  # [16, 2, 1, 8]: the 8 values each block may hold
    assert (D.unsqueeze(-1) == levels).any(-1).all()


# bitsandbytes' NF4 table (bitsandbytes/functional.py, create_normal_map), rounded to 4 decimals.
BNB_NF4 = [-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
           0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0]


@pytest.mark.parametrize("k", fmt.SUPPORTED_BITS)
def test_normal_float_zero_codebook_has_an_exact_zero(k):
    cb = fmt.normal_float_zero_codebook(k)
    fmt.check_codebook(cb, k)
    fmt.check_codebook_values(cb)
    assert (cb == 0).sum() == 1 and cb[0] == -1 and cb[-1] == 1
    assert (cb > 0).sum() == 2 ** (k - 1) and (cb < 0).sum() == 2 ** (k - 1) - 1


def test_normal_float_zero_at_4_bits_is_nf4():
    assert torch.allclose(fmt.normal_float_zero_codebook(4), torch.tensor(BNB_NF4), atol=1e-4)


def test_default_codebook_is_symmetric_at_2_bits_with_zero_above_and_named_codebooks_still_load():
    from vllm_kbit.settings import KbitSettings

    assert fmt.DEFAULT_CODEBOOK == "normal_float_by_bits"
    assert torch.equal(fmt.default_codebook(2), fmt.normal_float_codebook(2))
    assert (fmt.default_codebook(2) != 0).all()
    for k in (3, 4, 5):
        assert torch.equal(fmt.default_codebook(k), fmt.normal_float_zero_codebook(k))
    assert torch.equal(KbitSettings(bits=3).codebook(3), fmt.normal_float_zero_codebook(3))
    assert torch.equal(KbitSettings(bits=2).codebook(2), fmt.normal_float_codebook(2))
    assert KbitSettings(bits=3).to_dict()["codebook"] == "normal_float_by_bits"
    for name in ("normal_float", "normal_float_zero"):  # checkpoints converted with an earlier default name theirs
        old = KbitSettings.from_dict({"quant_method": "kbit", "bits": 2, "codebook": name})
        assert torch.equal(old.codebook(2), fmt.CODEBOOKS[name](2))
    with pytest.raises(ValueError, match="codebook must be 'normal_float_by_bits' or 'normal_float_zero' or "
                                         "'normal_float', a list or a dict"):
        KbitSettings(bits=3, codebook="nf3")
