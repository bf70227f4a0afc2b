"""NF4 by hand: QLoRA's 4-bit weights, stored byte for byte as bitsandbytes stores them.

QLoRA (Dettmers et al. 2023) keeps the frozen base model in 4 bits per weight
and trains LoRA adapters beside it. Its format, NormalFloat4, has four parts:

- **Levels.** A 4-bit code is an index into 16 values in [-1, 1], the
  quantiles of a normal distribution: pretrained weights are roughly normal,
  so each level is used about equally often. They are asymmetric, 7 below
  zero and 8 above, so that 0 itself is a level: padding and zero weights
  come back exactly.
- **Block-wise absmax.** The weight is read flat, in blocks of ``blocksize``
  (64) values. Each block is divided by its largest magnitude, its *scale*,
  so it lies in [-1, 1], and each value becomes the index of its nearest
  level. One outlier then coarsens only its own 64 values.
- **Packing.** Two codes per byte, the first of each pair in the high four
  bits, the second in the low four.
- **Double quantization.** A float32 scale per 64 weights costs 0.5 bits per
  weight. QLoRA stores the scales in 8 bits instead: minus their mean, in
  blocks of 256, each block with its own float32 absmax, coded with
  bitsandbytes' signed 8-bit *dynamic* levels (dense near zero, a decade per
  step). That costs 8/64 + 32/(64 * 256) = 0.127 bits per weight.

``quantize_nf4`` gives the codes, scales, their mean and absmax exactly as
bitsandbytes 0.50.2's ``quantize_4bit(..., quant_type="nf4")`` does on the CPU,
and ``dequantize_nf4`` the tensor its ``dequantize_4bit`` gives; the tests hold
both bit for bit. To get there the arithmetic follows bitsandbytes where the
rounding could tip a value from one level to the next (said where it does).

On CUDA, bitsandbytes finds the levels by comparisons instead: a tree of the
same 15 NF4 midpoints, and a binary search of the 256 dynamic levels. From its
source (this book has not run it), the NF4 codes should agree with the CPU's
but in a partial last block, which CUDA multiplies by ``1 / absmax`` and the
CPU divides; the 8-bit codes of the scales can differ where the CPU's grid
(``dynamic_table``) tips a value within 1.5e-5 of a midpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# The probability of the outermost levels, -1 and 1 (a normal quantile at
# probability 1 would be infinite). bitsandbytes' docstring calls it tuned by
# experiment; to its seven digits it is the mean of 1 - 1/(2 * 15) and
# 1 - 1/(2 * 16), between the last quantile of a 15- and of a 16-level grid. The
# digits matter: 0.96770833... rounds to another float32 than 0.9677083 does,
# and the levels move with it.
NF4_OFFSET = 0.9677083
SCALE_BLOCKSIZE = 256  # double quantization: scales per 8-bit block
DYNAMIC_GRID = 65536  # bitsandbytes' CPU code rounds to this grid (see below)
TINY = 1e-38  # what bitsandbytes divides by instead of the 0 of an all-zero block


def nf4_levels(offset: float = NF4_OFFSET) -> torch.Tensor:
    """The 16 NF4 levels, float32, sorted, from -1 to 1 with 0 among them.

    The 8 positive levels are the quantiles of N(0, 1) at 8 evenly spaced
    probabilities from ``offset`` down towards 0.5 (9 steps, the last, 0.5,
    left out); the 7 negative ones mirror 7 such probabilities (8 steps); 0.5
    itself gives the level 0. Quantiles by ``torch.special.ndtri`` (the
    inverse of the normal CDF) in float64 at float32 probabilities, then
    float32 and divided by the largest: the order of operations that gives
    bitsandbytes' table exactly.
    """
    positive = torch.linspace(offset, 0.5, 9)[:-1]  # 8 probabilities above 0.5
    negative = torch.linspace(offset, 0.5, 8)[:-1]  # 7, mirrored below
    levels = torch.cat(
        [
            torch.special.ndtri(positive.double()),
            -torch.special.ndtri(negative.double()),
            torch.zeros(1, dtype=torch.float64),  # the probability 0.5 itself
        ]
    )
    levels = levels.float().sort().values
    return levels / levels.max()


def dynamic_levels() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic levels: 256 float32 values, sorted.

    Dettmers' dynamic type spends the bits after the sign on a decade and a
    linear fraction within it: for e = 0 to 6, the decade from 10^(e-7) to
    10^(e-6) gets ``2^e`` values, ``10^(e-6)`` times the midpoints of ``2^e``
    equal steps from 0.1 to 1. Small numbers get fine steps, large ones coarse
    steps, as the scales' spread around their mean needs. With both signs, 0
    and 1 that is 2 * 127 + 2 = 256 values.
    """
    values = [torch.zeros(1), torch.ones(1)]
    for e in range(7):
        edges = torch.linspace(0.1, 1, 2**e + 1)
        midpoints = (edges[:-1] + edges[1:]) / 2.0
        values += [10.0 ** (e - 6) * midpoints, -(10.0 ** (e - 6)) * midpoints]
    return torch.cat(values).sort().values


NF4_LEVELS = nf4_levels()
DYNAMIC_LEVELS = dynamic_levels()


@dataclass(frozen=True)
class NF4Weight:
    """A tensor in NF4: packed codes, per-block scales, and what restores it.

    ``codes``: uint8, ``ceil(numel / 2)`` bytes of two level indices each.
    ``scales``: one per block of ``blocksize`` values; float32 absmax, or with
    double quantization uint8 codes of ``absmax - scale_offset`` into
    ``DYNAMIC_LEVELS``, with ``scale_absmax`` (float32, one per 256 scales).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    blocksize: int = 64
    scale_absmax: torch.Tensor | None = None
    scale_offset: torch.Tensor | None = None

    @property
    def double_quant(self) -> bool:
        return self.scale_absmax is not None

    @property
    def nbytes(self) -> int:
        """Bytes stored: codes, scales and, if double-quantized, their statistics."""
        stored = [self.codes, self.scales, self.scale_absmax, self.scale_offset]
        return sum(t.numel() * t.element_size() for t in stored if t is not None)


def _absmax_and_normalized(flat: torch.Tensor, blocksize: int):
    """Each block's absmax, and the float32 values divided by it, into [-1, 1].

    bitsandbytes multiplies the whole blocks by ``1 / absmax`` but divides the
    last, partial block by its absmax; the two can round one float32 step
    apart, enough to tip a value lying on the boundary between two levels, so
    this does the same. A block of zeros divides by ``TINY`` (its values code
    to the level 0 either way); bitsandbytes stores that ``TINY`` as the scale
    of a partial block and 0 for a whole one, and so does this.
    """
    whole = flat.numel() // blocksize * blocksize
    blocks = flat[:whole].view(-1, blocksize)
    absmax = blocks.abs().amax(dim=1)
    normalized = blocks * (1.0 / absmax.clamp(min=TINY))[:, None]
    absmax, normalized = [absmax], [normalized.flatten()]
    if whole < flat.numel():
        rest = flat[whole:]
        rest_absmax = rest.abs().amax().clamp(min=TINY)
        absmax.append(rest_absmax[None])
        normalized.append(rest / rest_absmax)
    return torch.cat(absmax), torch.cat(normalized).clamp(-1.0, 1.0)


def _nearest_nf4(normalized: torch.Tensor) -> torch.Tensor:
    """The index of the nearest NF4 level; a value exactly halfway takes the lower.

    The boundaries are the midpoints between neighbouring levels, in float32.
    """
    midpoints = (NF4_LEVELS[:-1] + NF4_LEVELS[1:]) / 2
    return torch.searchsorted(midpoints.to(normalized.device), normalized)


def dynamic_table() -> torch.Tensor:
    """For each of ``DYNAMIC_GRID`` points evenly spaced on [-1, 1], its level.

    bitsandbytes' CPU code does not search the 256 dynamic levels for each
    value: it rounds the value to the nearest grid point and reads that
    point's level from this table, the nearest (the lower one on a tie). A
    value within half a grid step (1.5e-5) of a midpoint between two levels
    can so land on the farther one; to store the same bytes, this does the
    same, in the same float32 steps.
    """
    steps = DYNAMIC_GRID - 1
    points = -1.0 + (2.0 * torch.arange(DYNAMIC_GRID, dtype=torch.float32)) / steps
    midpoints = 0.5 * (DYNAMIC_LEVELS[:-1] + DYNAMIC_LEVELS[1:])
    return torch.searchsorted(midpoints, points).to(torch.uint8)


DYNAMIC_TABLE = dynamic_table()


def _nearest_dynamic(normalized: torch.Tensor) -> torch.Tensor:
    """The dynamic level of each value in [-1, 1]: its grid point's, rounded."""
    point = ((normalized + 1.0) * 0.5 * (DYNAMIC_GRID - 1) + 0.5).long()
    return DYNAMIC_TABLE.to(normalized.device)[point]


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte: the first in the high four bits."""
    return (codes[0::2] << 4 | codes[1::2]).to(torch.uint8)


def byte_levels() -> torch.Tensor:
    """(256, 2): the two levels each byte stands for, the high four bits' first.

    Decoding looks a byte up once here instead of splitting it into two codes
    and looking each up: half the lookups, and no unpacked copy of the codes.
    """
    return torch.stack([NF4_LEVELS.repeat_interleave(16), NF4_LEVELS.repeat(16)], 1)


BYTE_LEVELS = byte_levels()


def quantize_nf4(
    weight: torch.Tensor, blocksize: int = 64, double_quant: bool = True
) -> NF4Weight:
    """``weight`` (float32, bf16 or float16, any shape) in NF4.

    ``blocksize`` 64 is QLoRA's; ``double_quant`` stores the scales in 8 bits
    (bitsandbytes' ``compress_statistics``, transformers'
    ``bnb_4bit_use_double_quant``).
    """
    if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"quantize_nf4: weight must be a float tensor, got {weight.dtype}"
        )
    if blocksize < 2 or blocksize % 2:
        raise ValueError(f"quantize_nf4: blocksize must be even, got {blocksize}")
    flat = weight.detach().reshape(-1).float()
    absmax, normalized = _absmax_and_normalized(flat, blocksize)
    if normalized.numel() % 2:  # pad to whole bytes with 0.0, whose level is exact
        normalized = torch.cat([normalized, normalized.new_zeros(1)])
    codes = _pack(_nearest_nf4(normalized).to(torch.uint8))
    if not double_quant:
        return NF4Weight(codes, absmax, weight.shape, weight.dtype, blocksize)
    # the scales are all positive and alike: code their spread about the mean
    offset = absmax.mean()
    scale_absmax, scales = _quantize_scales(absmax - offset)
    return NF4Weight(
        codes, scales, weight.shape, weight.dtype, blocksize, scale_absmax, offset
    )


def _quantize_scales(centered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise 8-bit dynamic codes of ``centered``, 256 values per block.

    Each block is multiplied by ``1 / absmax``; a block of zeros (the scales
    all equal to their mean: a weight of one block, say) gets code 0, as in
    bitsandbytes, and decodes to ``0 + mean`` whatever its code.
    """
    n_blocks = math.ceil(centered.numel() / SCALE_BLOCKSIZE)
    padded = centered.new_zeros(n_blocks * SCALE_BLOCKSIZE)
    padded[: centered.numel()] = centered  # zeros leave each block's absmax as is
    blocks = padded.view(-1, SCALE_BLOCKSIZE)
    absmax = blocks.abs().amax(dim=1)
    normalized = (blocks * (1.0 / absmax)[:, None]).clamp(-1.0, 1.0)
    codes = _nearest_dynamic(normalized.nan_to_num(-1.0))  # 0 / 0: the lowest code
    return absmax, codes.flatten()[: centered.numel()]


def dequantize_scales(q: NF4Weight) -> torch.Tensor:
    """The float32 absmax of every block, decoded from 8 bits if need be."""
    if not q.double_quant:
        return q.scales
    levels = DYNAMIC_LEVELS.to(q.scales.device)[q.scales.long()]
    per_scale = q.scale_absmax.repeat_interleave(SCALE_BLOCKSIZE)[: q.scales.numel()]
    return levels * per_scale + q.scale_offset


def dequantize_nf4(q: NF4Weight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensor ``q`` stands for, in ``dtype`` (by default the one it came from).

    Each value is its level times its block's scale, in float32, rounded once
    to ``dtype``: bitsandbytes' ``dequantize_4bit`` to the same dtype.
    """
    numel = math.prod(q.shape)
    levels = BYTE_LEVELS.to(q.codes.device)[q.codes.long()].view(-1)[:numel]
    scales = dequantize_scales(q).repeat_interleave(q.blocksize)[:numel]
    return (levels * scales).to(dtype or q.dtype).view(q.shape)
