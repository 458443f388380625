"""Bit-plane packing: bit i of word b is bit b of element i's index."""

import pytest
import torch

from vllm_kbit import reference as fmt


@pytest.mark.parametrize("k", fmt.SUPPORTED_BITS)
def test_pack_unpack_round_trip(k):
    idx = torch.randint(0, 2**k, (7, 5, 32), generator=torch.Generator().manual_seed(k))
    words = fmt.pack_bitplanes(idx, k)
    assert words.dtype == torch.int32 and words.shape == (7, 5, k)
    assert torch.equal(fmt.unpack_bitplanes(words), idx)


def test_bit_layout_by_hand():
    idx = torch.zeros(32, dtype=torch.int64)
    idx[0] = 0b101  # element 0: planes 0 and 2
    idx[31] = 0b010  # element 31: plane 1 -> the sign bit of word 1
    idx[7] = 0b111
    words = fmt.pack_bitplanes(idx, 3)
    as_u32 = [w & 0xFFFFFFFF for w in words.tolist()]
    assert as_u32 == [(1 << 0) | (1 << 7), (1 << 31) | (1 << 7), (1 << 0) | (1 << 7)]


def test_all_ones_plane_is_minus_one():
    words = fmt.pack_bitplanes(torch.full((32,), 3), 2)
    assert words.tolist() == [-1, -1]
