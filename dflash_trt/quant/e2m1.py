"""The FP4 E2M1 element format and its two-per-byte packing (shared by NVFP4 and MXFP4).

E2M1 is defined in the OCP Microscaling Formats (MX) Specification v1.0 (element data types): one sign
bit, two exponent bits (bias 1), one mantissa bit, no inf/NaN. Its 16 codes decode to

    code  0..7 : +0, 0.5, 1, 1.5, 2, 3, 4, 6
    code  8..15: -0, -0.5, -1, -1.5, -2, -3, -4, -6      (bit 3 is the sign)

torch has `float4_e2m1fn_x2` but cannot cast to it on CPU, so this module emulates the format with
a 16-entry lookup table for decoding and threshold counting for encoding.

Encoding rounds to nearest, ties to even (the "even" neighbour is the one with mantissa bit 0:
0, 1, 2, 4), and saturates to +-6. This is the rounding NVIDIA ModelOpt uses for NVFP4 weights,
so the codes agree bit for bit with `NVFP4QTensor.quantize`. Negative values that round to zero
keep their sign (code 8), again as ModelOpt does; positive and -0.0 inputs give code 0.

Packing: element 2k goes into the LOW nibble of byte k and element 2k+1 into the HIGH nibble
(the order of gpt-oss `*_blocks`, of ModelOpt NVFP4 weights and of TensorRT-LLM FP4 tensors).
"""
from __future__ import annotations

import torch

E2M1_MAX = 6.0

# Decoded value of each 4-bit code, indexed by the code.
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)

# Midpoints between neighbouring magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6. A tie rounds towards the
# neighbour with an even mantissa, so at these midpoints the value rounds DOWN ...
_TIES_DOWN = torch.tensor([0.25, 1.25, 2.5, 5.0], dtype=torch.float32)
# ... and at these it rounds UP (0.75 -> 1, 1.75 -> 2, 3.5 -> 4).
_TIES_UP = torch.tensor([0.75, 1.75, 3.5], dtype=torch.float32)


def encode_e2m1(values: torch.Tensor) -> torch.Tensor:
    """Round already-scaled fp32 values to E2M1 codes (uint8 in 0..15, same shape).

    The magnitude code is the number of midpoints the magnitude lies beyond: strictly beyond a
    "ties down" midpoint, or at/beyond a "ties up" one. Values above 6 saturate to code 7.
    """
    assert values.dtype == torch.float32, values.dtype
    magnitude = values.abs()
    down = _TIES_DOWN.to(values.device)
    up = _TIES_UP.to(values.device)
    # bucketize(right=False) counts boundaries < x; right=True counts boundaries <= x.
    code = torch.bucketize(magnitude, down, right=False) + torch.bucketize(magnitude, up, right=True)
    sign = (values < 0).to(torch.uint8) << 3
    return code.to(torch.uint8) | sign


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 in 0..15) -> fp32 values of the same shape."""
    assert codes.dtype == torch.uint8, codes.dtype
    return E2M1_VALUES.to(codes.device)[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes [..., 2n] (uint8 < 16) into bytes [..., n]: even element low nibble."""
    assert codes.dtype == torch.uint8 and codes.shape[-1] % 2 == 0, (codes.dtype, codes.shape)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes [..., n] into codes [..., 2n]: low nibble first."""
    assert packed.dtype == torch.uint8, packed.dtype
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)
