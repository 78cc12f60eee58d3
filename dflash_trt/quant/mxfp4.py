"""MXFP4 (OCP Microscaling): gpt-oss expert weights, read (dequantized for the torch runtime) and,
for stand-in checkpoints of the release layout, written.

Format: OCP Microscaling Formats (MX) Specification v1.0, MXFP4 = blocks of 32 FP4 E2M1
elements (see `dflash_trt.quant.e2m1`) sharing one E8M0 scale. E8M0 is an unsigned 8-bit
exponent with bias 127: code e means 2^(e - 127) for e in 0..254, and code 255 is NaN.

gpt-oss checkpoints store each expert projection `W` [..., out, in] as two tensors:
    `*_blocks` uint8 [..., out, G, 16]: G = in / 32 groups of 32 codes, two codes per byte, element
               2k of a group in the LOW nibble of byte k;
    `*_scales` uint8 [..., out, G]: the E8M0 exponent of each group.
so W[..., o, 32 g + j] = e2m1(code j of group g) * 2^(scales[..., o, g] - 127).

`dequantize_mxfp4` returns the natural [..., out, in] layout. (transformers' gpt-oss integration
returns the transpose [..., in, out], the layout its expert modules multiply with.)

`quantize_mxfp4` follows the MX specification's conversion (section 6.3): the shared exponent of a
group is floor(log2(amax)) - 2 (2 = the largest E2M1 exponent), elements are x / 2^exponent
rounded to nearest-even E2M1 and clamped to +-6. It exists to write test stand-ins in the release
layout; release checkpoints are never re-quantized by this project.
"""
from __future__ import annotations

import torch

from dflash_trt.errors import CheckpointError, InputError
from dflash_trt.quant._checks import FLOAT_DTYPES, check_dtype, check_finite, check_min_ndim
from dflash_trt.quant.e2m1 import decode_e2m1, encode_e2m1, pack_nibbles, unpack_nibbles

MX_BLOCK_SIZE = 32
E8M0_BIAS = 127
E8M0_NAN = 255


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 codes (uint8, not 255) -> exact fp32 powers of two 2^(code - 127).

    Built from the fp32 bit pattern: a biased fp32 exponent equals the E8M0 code for codes 1..254
    (fp32 also uses bias 127); code 0 is 2^-127, the fp32 subnormal with only mantissa bit 22 set.
    """
    codes = scales.to(torch.int32)
    bits = torch.where(codes == 0, torch.full_like(codes, 1 << 22), codes << 23)
    return bits.view(torch.float32)


def dequantize_mxfp4(
    blocks: torch.Tensor,  # [..., G, 16] uint8
    scales: torch.Tensor,  # [..., G] uint8 (E8M0)
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """gpt-oss `*_blocks` / `*_scales` -> weight [..., G * 32] in `dtype`.

    Values are formed exactly in fp32 (a 2-significant-bit E2M1 value times a power of two), then
    cast once to `dtype`; products beyond the fp32 range become inf, as with `torch.ldexp`.
    """
    check_dtype("mxfp4 blocks", blocks, (torch.uint8,))
    check_dtype("mxfp4 scales", scales, (torch.uint8,))
    check_min_ndim("mxfp4 blocks", blocks, 2, "[..., G, 16]")
    if blocks.shape[-1] != MX_BLOCK_SIZE // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise InputError(
            f"mxfp4 blocks must be [..., G, {MX_BLOCK_SIZE // 2}] and scales [..., G]; got blocks "
            f"{tuple(blocks.shape)}, scales {tuple(scales.shape)}"
        )
    if bool((scales == E8M0_NAN).any()):
        raise CheckpointError(
            f"mxfp4 scales contain the E8M0 NaN code {E8M0_NAN}; the checkpoint is corrupt or not MXFP4"
        )
    values = decode_e2m1(unpack_nibbles(blocks))  # [..., G, 32] fp32
    weight = values * e8m0_to_float(scales).unsqueeze(-1)
    return weight.flatten(-2).to(dtype)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., in] (float, in % 32 == 0, finite) -> (blocks [..., in/32, 16] uint8,
    scales [..., in/32] uint8 E8M0), the gpt-oss `*_blocks` / `*_scales` layout.

    An all-zero group gets code 0 (2^-127); exponents are clamped to the E8M0 range [-127, 127]."""
    check_dtype("weight", weight, FLOAT_DTYPES)
    check_min_ndim("weight", weight, 1, "[..., in]")
    if weight.shape[-1] % MX_BLOCK_SIZE:
        raise InputError(f"MXFP4 needs the last dim to be a multiple of {MX_BLOCK_SIZE}, got {tuple(weight.shape)}")
    check_finite("weight", weight)
    groups = weight.float().contiguous().reshape(*weight.shape[:-1], -1, MX_BLOCK_SIZE)  # [..., G, 32]
    amax = groups.abs().amax(dim=-1)  # [..., G]
    exponent = torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)))) - 2
    exponent = torch.where(amax > 0, exponent, torch.full_like(exponent, -E8M0_BIAS)).clamp(-E8M0_BIAS, E8M0_BIAS)
    scales = (exponent + E8M0_BIAS).to(torch.uint8)
    codes = encode_e2m1(groups / e8m0_to_float(scales).unsqueeze(-1))  # [..., G, 32]
    return pack_nibbles(codes), scales


__all__ = ["E8M0_BIAS", "MX_BLOCK_SIZE", "dequantize_mxfp4", "e8m0_to_float", "quantize_mxfp4"]
