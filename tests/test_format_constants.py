"""The format's constants are written once, in vllm_kbit/format_constants.h: the CUDA extension
includes it and vllm_kbit/reference.py reads it. These tests hold the reader to the header and the
header's values to the reference's behaviour (and, where built, to the C++ checks)."""

import os
import re

import pytest
import torch

import vllm_kbit
from vllm_kbit import ops
from vllm_kbit import reference as fmt

_HEADER = os.path.join(os.path.dirname(fmt.__file__), "format_constants.h")


def test_every_constant_of_the_header_is_read():
    with open(_HEADER) as f:
        text = f.read()
    declared = re.findall(r"^\s*constexpr\s+\w+\s+(k\w+)\s*=", text, re.MULTILINE)
    assert declared and sorted(declared) == sorted(fmt._FORMAT), "a constant the reference does not read (one line, int literal)"
    c = fmt._FORMAT
    assert fmt.BLOCK_SIZE == c["kBlockSize"] and (fmt.TILE_N, fmt.TILE_KB) == (c["kTileN"], c["kTileKB"])
    assert fmt.SUPPORTED_BITS == tuple(range(c["kMinBits"], c["kMaxBits"] + 1)) and fmt.E4M4_BIAS == c["kE4M4Bias"]
    assert max(fmt.SCALE_SEARCH_OFFSETS) == -min(fmt.SCALE_SEARCH_OFFSETS) == c["kScaleSearchRadius"]


def test_the_reference_behaves_as_the_constants_say():
    for k in fmt.SUPPORTED_BITS:
        assert fmt.normal_float_codebook(k).numel() == 2**k
    with pytest.raises(ValueError, match=re.escape(f"k must be one of {fmt.SUPPORTED_BITS}")):
        vllm_kbit.quantize(torch.randn(4, 64), max(fmt.SUPPORTED_BITS) + 1)
    w = vllm_kbit.quantize(torch.randn(3, 5 * fmt.BLOCK_SIZE), 4)
    assert w.qweight.shape == (3, 5, 4) and w.absmax.shape == (3, 5)  # one scale per BLOCK_SIZE weights
    table = fmt.e4m4_table()
    assert table[255].item() == fmt.E4M4_MAX == 31.0  # docs/format.md: the largest block scale
    assert table[16].item() == 2.0 ** (1 - fmt.E4M4_BIAS)  # smallest normal code: e = 1, m = 0
    q_shape, a_shape = fmt.runtime_shapes(fmt.TILE_N + 1, fmt.TILE_KB * fmt.BLOCK_SIZE + fmt.BLOCK_SIZE, 3)
    assert q_shape == (2, 2, 3, fmt.TILE_N, fmt.TILE_KB) and a_shape == (2, 2, fmt.TILE_N, fmt.TILE_KB)


@pytest.mark.skipif(not ops.HAS_CPU_KERNELS, reason="the CPU extension (with the C++ checks) is not built or not loadable")
def test_the_extension_uses_the_same_constants():
    """The C++ checks compiled from the header refuse and accept exactly what the reference's constants say."""
    W = torch.randn(4, 2 * fmt.BLOCK_SIZE)
    cb = fmt.normal_float_codebook(4)
    torch.ops.kbit._check_quantize(W, cb, 4)
    for k in (min(fmt.SUPPORTED_BITS) - 1, max(fmt.SUPPORTED_BITS) + 1):
        with pytest.raises(ValueError, match=re.escape(f"k must be one of {fmt.SUPPORTED_BITS}")):
            torch.ops.kbit._check_quantize(W, fmt.normal_float_codebook(4), k)
    with pytest.raises(ValueError, match=f"multiple of {fmt.BLOCK_SIZE}"):
        torch.ops.kbit._check_quantize(torch.randn(4, fmt.BLOCK_SIZE + 1), cb, 4)
    q, a = fmt.repack(*fmt.quantize(torch.randn(fmt.TILE_N + 1, 3 * fmt.BLOCK_SIZE), cb, 4))
    torch.ops.kbit._check_dequantize_runtime(q, a, cb, fmt.TILE_N + 1, 3 * fmt.BLOCK_SIZE, torch.float32)


@pytest.mark.skipif(not ops.HAS_CPU_KERNELS, reason="the CPU extension (with the C++ checks) is not built or not loadable")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_representable_bound_is_the_headers(dtype):
    """|w| up to kRangeMax64 / 64 (the largest scale, 31, and the 1/64 above it that rounds to it) quantizes at
    scale 1, just above it is refused: the one bound the C++ check (which the reference asks) and range_scale read."""
    assert fmt.RANGE_MAX == fmt._FORMAT["kRangeMax64"] / 64 == 31 * (1 + 1 / 64) and fmt.E4M4_MAX == 31.0
    at_bound = torch.zeros(2, fmt.BLOCK_SIZE)
    at_bound[1, 3] = -fmt.RANGE_MAX  # exact in fp32 and fp16 (11 significant bits); bf16 rounds it up to 31.5
    if dtype != torch.bfloat16:
        fmt.check_representable(at_bound.to(dtype))
    above = at_bound.clone()
    above[0, 0] = torch.nextafter(torch.tensor(fmt.RANGE_MAX), torch.tensor(100.0)).item() if dtype == torch.float32 else 32.0
    with pytest.raises(ValueError, match="above the largest E4M4 block scale 31.0"):
        fmt.check_representable(above.to(dtype))
    assert fmt.range_scale(fmt.RANGE_MAX) == 1.0 and fmt.range_scale(32.0) == 2.0
