"""E4M4 block scales: every code, subnormals, zero, rounding to nearest, saturation."""

import torch

from vllm_kbit import reference as fmt


def _value(code: int) -> float:
    e, m = code >> 4, code & 15
    return 2.0 ** (e - 11) * (1 + m / 16) if e else 2.0**-10 * (m / 16)


def test_table_matches_the_definition_for_all_256_codes():
    table = fmt.e4m4_table()
    assert table.dtype == torch.float32 and table.shape == (256,)
    assert table.tolist() == [_value(c) for c in range(256)]
    assert table[0] == 0 and table[255] == fmt.E4M4_MAX


def test_subnormal_range_is_evenly_spaced_and_continuous_with_normals():
    table = fmt.e4m4_table().double()
    step = 2.0**-14
    assert torch.equal(table[:16], torch.arange(16, dtype=torch.float64) * step)
    assert table[16] - table[15] == step  # first normal continues the subnormal grid


def test_strictly_monotone_in_the_code():
    table = fmt.e4m4_table()
    assert (table[1:] > table[:-1]).all()


def test_decode_then_encode_round_trips_every_code():
    codes = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(fmt.e4m4_encode(fmt.e4m4_decode(codes)), codes)


def test_encode_is_nearest_with_ties_to_the_lower_code():
    g = torch.Generator().manual_seed(1)
    x = torch.exp(torch.empty(200_000).uniform_(-16, 3.6, generator=g)).float()
    table = fmt.e4m4_table().double()
    dist = (x.double().unsqueeze(1) - table).abs()
    best = dist.min(1, keepdim=True).values
    lowest_nearest = (dist == best).int().argmax(1)  # first (lowest) code at the minimum distance
    assert torch.equal(fmt.e4m4_encode(x).long(), lowest_nearest)
    mid = (fmt.e4m4_table()[:-1] + fmt.e4m4_table()[1:]) * 0.5
    assert torch.equal(fmt.e4m4_encode(mid).long(), torch.arange(255))


def test_zero_tiny_and_saturation():
    x = torch.tensor([0.0, 2.0**-16, 2.0**-15 * 1.01, 31.0, 31.49, 1e6])
    assert fmt.e4m4_encode(x).tolist() == [0, 0, 1, 255, 255, 255]


def test_relative_error_of_normal_range_is_at_most_one_32nd():
    x = torch.exp(torch.empty(100_000).uniform_(-6.9, 3.4, generator=torch.Generator().manual_seed(2))).float()
    rel = (fmt.e4m4_decode(fmt.e4m4_encode(x)).double() - x.double()).abs() / x.double()
    assert rel.max() <= 1 / 32 + 1e-12
