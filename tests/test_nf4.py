"""code/torchbook/nf4.py: NF4 by hand, byte for byte bitsandbytes' on the CPU.

The reference is bitsandbytes 0.50.2's ``quantize_4bit(..., quant_type="nf4")``
and ``dequantize_4bit``: every comparison is exact (``torch.equal``), of the
packed bytes, the scales and their statistics, and the dequantized tensor.
"""

from __future__ import annotations

import math

import bitsandbytes.functional as bnb
import pytest
import torch

from torchbook.nf4 import (
    DYNAMIC_GRID,
    DYNAMIC_LEVELS,
    NF4_LEVELS,
    NF4_OFFSET,
    _nearest_dynamic,
    dequantize_nf4,
    nf4_levels,
    quantize_nf4,
)


def reference(weight: torch.Tensor, double_quant: bool):
    """bitsandbytes' packed bytes, state and dequantized tensor for ``weight``."""
    packed, state = bnb.quantize_4bit(
        weight, blocksize=64, quant_type="nf4", compress_statistics=double_quant
    )
    return packed, state, bnb.dequantize_4bit(packed, state)


def assert_same_as_bitsandbytes(weight: torch.Tensor, double_quant: bool) -> None:
    packed, state, dequantized = reference(weight, double_quant)
    q = quantize_nf4(weight, blocksize=64, double_quant=double_quant)
    assert torch.equal(q.codes, packed.flatten())
    assert torch.equal(q.scales, state.absmax)
    if double_quant:
        assert torch.equal(q.scale_absmax, state.state2.absmax)
        assert torch.equal(q.scale_offset, state.offset)
    mine = dequantize_nf4(q)
    assert mine.dtype == dequantized.dtype == weight.dtype
    assert mine.shape == weight.shape
    # bitsandbytes returns a vector of even length as one row, (1, n)
    assert torch.equal(mine, dequantized.view(weight.shape))


def test_the_levels_are_normal_quantiles_equal_to_bitsandbytes_table():
    assert torch.equal(NF4_LEVELS, bnb.get_4bit_type("nf4", device="cpu"))
    assert NF4_LEVELS.dtype == torch.float32 and NF4_LEVELS.numel() == 16
    assert NF4_LEVELS[0] == -1 and NF4_LEVELS[-1] == 1
    assert (NF4_LEVELS < 0).sum() == 7 and (NF4_LEVELS > 0).sum() == 8
    assert (NF4_LEVELS == 0).sum() == 1  # zero is a level: it comes back exactly


def test_the_offset_is_written_to_the_digits_bitsandbytes_uses():
    # the mean of 1 - 1/30 and 1 - 1/32 rounds to another float32 than the
    # 7-digit constant does, and the levels move with it
    exact = (1 - 1 / 30 + 1 - 1 / 32) / 2
    assert abs(exact - NF4_OFFSET) < 5e-8
    assert not torch.equal(nf4_levels(exact), NF4_LEVELS)


def test_the_dynamic_levels_equal_bitsandbytes_map():
    assert torch.equal(DYNAMIC_LEVELS, bnb.create_dynamic_map())


SHAPES = {
    "whole blocks": (64, 128),
    "a partial block": (100, 37),  # 3,700 = 57 blocks of 64 and 52 more
    "odd count": (7, 9, 11),  # 693 values: the last byte holds one code
    "vector": (33,),
    "two scale blocks": (300, 64),  # 300 scales: 256 and 44 for the 8-bit step
}


@pytest.mark.parametrize("double_quant", [True, False], ids=["double", "single"])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str
)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_quantize_and_dequantize_equal_bitsandbytes(shape, dtype, double_quant):
    generator = torch.Generator().manual_seed(len(shape) * 100 + shape[0])
    weight = torch.randn(shape, generator=generator) * 0.02
    weight.view(-1)[::97] *= 30  # outliers, as real weights have
    assert_same_as_bitsandbytes(weight.to(dtype), double_quant)


@pytest.mark.parametrize("seed", range(8))
def test_many_weights_equal_bitsandbytes_with_double_quantization(seed):
    # more scales, and more of them near a boundary between 8-bit levels
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(257, 191, generator=generator) * 10 ** (seed - 4)
    assert_same_as_bitsandbytes(weight, double_quant=True)


def test_blocks_of_zeros_equal_bitsandbytes():
    weight = torch.randn(64 * 5 + 10, generator=torch.Generator().manual_seed(0))
    weight[64:128] = 0  # a whole block of zeros
    weight[-10:] = 0  # and a partial one
    for double_quant in (True, False):
        assert_same_as_bitsandbytes(weight, double_quant)
    assert torch.equal(dequantize_nf4(quantize_nf4(weight))[64:128], weight[64:128])


def test_a_value_halfway_between_two_levels_takes_the_lower_as_bitsandbytes_does():
    midpoints = (NF4_LEVELS[:-1] + NF4_LEVELS[1:]) / 2
    weight = torch.cat([torch.ones(1), midpoints, -torch.ones(2)])  # absmax 1
    q = quantize_nf4(weight, double_quant=False)
    codes = torch.stack([q.codes >> 4, q.codes & 15], dim=1).flatten()
    assert torch.equal(codes[1:16], torch.arange(15, dtype=torch.uint8))
    assert_same_as_bitsandbytes(weight, double_quant=False)


def test_the_first_value_of_a_pair_is_in_the_high_four_bits():
    weight = torch.tensor([1.0, -1.0, 0.0, 1.0])
    q = quantize_nf4(weight, double_quant=False)
    # levels: -1 is code 0, 0 is code 7, 1 is code 15
    assert q.codes.tolist() == [0xF0, 0x7F]


def test_the_8bit_scale_codes_equal_bitsandbytes_at_every_grid_point_and_boundary():
    # values on the grid, on each midpoint between levels and a float32 step
    # either side, and random ones; each block of 256 holds a 1.0 so that its
    # absmax is 1 and bitsandbytes codes the values themselves
    steps = torch.arange(DYNAMIC_GRID, dtype=torch.float32)
    grid = -1.0 + 2.0 * steps / (DYNAMIC_GRID - 1)
    midpoints = (DYNAMIC_LEVELS[:-1] + DYNAMIC_LEVELS[1:]) / 2
    up, down = midpoints.nextafter(torch.ones(1)), midpoints.nextafter(-torch.ones(1))
    random = torch.rand(50_000, generator=torch.Generator().manual_seed(0)) * 2 - 1
    values = torch.cat([grid, midpoints, up, down, random]).clamp(-1, 1)
    blocks = math.ceil(values.numel() / 255)
    padded = torch.zeros(blocks * 255)
    padded[: values.numel()] = values
    data = torch.cat([padded.view(blocks, 255), torch.ones(blocks, 1)], 1).flatten()

    codes, state = bnb.quantize_blockwise(data, blocksize=256)
    assert torch.equal(state.absmax, torch.ones(blocks))
    assert torch.equal(_nearest_dynamic(data), codes)


def test_double_quantization_stores_4_127_bits_per_weight():
    weight = torch.randn(256, 1024)
    single, double = quantize_nf4(weight, double_quant=False), quantize_nf4(weight)
    # 4 bits, plus a float32 scale per 64 weights, or an 8-bit one and a
    # float32 per 256 scales (and one float32 mean)
    assert single.nbytes * 8 / weight.numel() == 4 + 32 / 64
    expected = 4 + 8 / 64 + 32 / (64 * 256) + 32 / weight.numel()
    assert double.nbytes * 8 / weight.numel() == pytest.approx(expected, rel=1e-12)
    assert round(expected, 3) == 4.127


def test_the_error_is_at_most_half_the_widest_gap_of_a_block():
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    q = quantize_nf4(weight, double_quant=False)
    half_gap = (NF4_LEVELS[1:] - NF4_LEVELS[:-1]).max() / 2
    error = (dequantize_nf4(q) - weight).abs().view(-1, 64)
    bound = half_gap * q.scales[:, None] * (1 + 1e-6)  # float32 rounding
    assert (error <= bound).all()


def test_an_integer_tensor_is_refused():
    with pytest.raises(ValueError, match="quantize_nf4: weight must be a float"):
        quantize_nf4(torch.ones(64, dtype=torch.int32))
