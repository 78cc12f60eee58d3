"""NVFP4 quantization (NVIDIA's 4-bit float format with two-level scaling), emulated on any device.

Format (NVIDIA, "Introducing NVFP4 for Efficient and Accurate Low-Precision Inference", and the
NVIDIA ModelOpt / TensorRT-LLM checkpoint layout):
- elements are FP4 E2M1 (see `dflash_trt.quant.e2m1`: values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and sign);
- every 16 consecutive elements along the LAST (input) dim share one FP8 E4M3 block scale;
- the whole tensor shares one fp32 global scale.

    x[i] ~= e2m1[i] * float(block_scale[i // 16]) * global_scale

Conventions (those of ModelOpt's `NVFP4QTensor`, so the stored tensors match bit for bit):
    global_scale = amax(|W|) / (6 * 448)                (ModelOpt `weight_scale_2`)
    block_scale  = fp8(clamp(amax(|block|) / (6 * global_scale), 2^-9, 448))
                   (an all-zero block gets 1.0 before the cast)    (ModelOpt `weight_scale`)
    e2m1[i]      = RNE-to-E2M1(x[i] / (float(block_scale) * global_scale)), saturating at +-6
Two codes per byte, element 2k in the low nibble: weight [out, in] -> uint8 [out, in / 2].
TensorRT-LLM 1.2.x names the same tensors `weights_block_scaling_factor` and
`weights_global_scaling_factor`.

Divergence from ModelOpt, on purpose: an all-zero tensor gets global scale 1.0 (ModelOpt divides
0 by 0 and stores NaN block scales); its codes are all zero either way.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_trt.errors import InputError
from dflash_trt.quant._checks import (
    FLOAT_DTYPES,
    amax_tensor,
    check_dtype,
    check_finite,
    check_min_ndim,
    scalar_scale,
)
from dflash_trt.quant.e2m1 import E2M1_MAX, decode_e2m1, encode_e2m1, pack_nibbles, unpack_nibbles
from dflash_trt.quant.fp8 import E4M3_MAX, FP8_DTYPE

BLOCK_SIZE = 16
MIN_BLOCK_SCALE = 2.0**-9  # smallest positive E4M3 value (a subnormal)


@dataclass(frozen=True, eq=False)
class NVFP4Weight:
    """A packed NVFP4 tensor.

    packed:       [..., in / 2]  uint8, two E2M1 codes per byte (even element in the low nibble)
    block_scale:  [..., in / 16] float8_e4m3fn, one per 16 consecutive elements of the last dim
    global_scale: (1,)           float32
    """

    packed: torch.Tensor  # [..., in / 2] uint8
    block_scale: torch.Tensor  # [..., in / 16] float8_e4m3fn
    global_scale: torch.Tensor  # (1,) float32

    def __post_init__(self) -> None:
        check_dtype("NVFP4Weight.packed", self.packed, (torch.uint8,))
        check_dtype("NVFP4Weight.block_scale", self.block_scale, (FP8_DTYPE,))
        scalar_scale("NVFP4Weight.global_scale", self.global_scale)
        check_min_ndim("NVFP4Weight.packed", self.packed, 1, "[..., in / 2]")
        lead, half = tuple(self.packed.shape[:-1]), self.packed.shape[-1]
        expected = (*lead, half * 2 // BLOCK_SIZE)
        if half % (BLOCK_SIZE // 2) != 0 or tuple(self.block_scale.shape) != expected:
            raise InputError(
                f"NVFP4Weight: packed [..., in/2] with in % {BLOCK_SIZE} == 0 and block_scale "
                f"[..., in/{BLOCK_SIZE}] expected; got packed {tuple(self.packed.shape)}, "
                f"block_scale {tuple(self.block_scale.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        """Shape of the unpacked tensor [..., in]."""
        return torch.Size((*self.packed.shape[:-1], self.packed.shape[-1] * 2))


def global_scale_from_amax(amax: torch.Tensor | float) -> torch.Tensor:
    """Global (second-level) scale amax / (6 * 448) as fp32 (1,); amax must be > 0.

    Use it for weights with a shared amax (fused QKV: the max over q, k, v) and for activations
    (`input_scale` of an NVFP4 layer, from the calibration amax).
    """
    return amax_tensor("amax", amax) / (E2M1_MAX * E4M3_MAX)


def _weight_global_scale(x: torch.Tensor) -> torch.Tensor:
    """amax / (6 * 448) of a finite tensor, (1,) fp32; 1.0 for an all-zero (or all-underflowing) one."""
    scale = x.abs().amax().float().reshape(1) / (E2M1_MAX * E4M3_MAX)
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def _block_scales(blocks: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """FP8 block scales [..., nblocks] for fp32 blocks [..., nblocks, 16]."""
    block_amax = blocks.abs().amax(dim=-1)
    scale = block_amax / (global_scale * E2M1_MAX)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return scale.clamp(MIN_BLOCK_SCALE, E4M3_MAX).to(FP8_DTYPE)


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor | None = None,
                   export_dtype: torch.dtype | None = None) -> NVFP4Weight:
    """Quantize x [..., in] (fp32/fp16/bf16, in % 16 == 0, finite) to NVFP4.

    global_scale: (1,) fp32 to use instead of amax(|x|) / (6 * 448) (shared scale of fused
    layers, or an activation's calibrated `input_scale`); block scales then saturate at 448.
    export_dtype: the checkpoint dtype of a weight export. As in ModelOpt 0.47's HF export
    (`unified_export_hf.py::_export_quantized_weight` passes `weight.to(dtype)` to
    `quant_utils.to_quantized_weight`, while `NVFP4QTensor.get_weights_scaling_factor` takes the
    block amax of the weight as the model holds it), the elements are rounded to it before they are
    encoded, and the scales come from x unrounded. The division itself runs in fp32 (its divisor is
    an fp32 tensor), so there is no second rounding as with FP8.
    """
    check_dtype("x", x, FLOAT_DTYPES)
    check_min_ndim("x", x, 1, "[..., in]")
    if x.shape[-1] % BLOCK_SIZE != 0:
        raise InputError(
            f"NVFP4 needs the last (input) dim to be a multiple of {BLOCK_SIZE}, got shape {tuple(x.shape)}"
        )
    check_finite("x", x)
    if global_scale is None:
        global_scale = _weight_global_scale(x)
    else:
        scalar_scale("global_scale", global_scale)
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK_SIZE)  # [..., nblocks, 16]
    block_scale = _block_scales(blocks, global_scale)  # [..., nblocks] e4m3
    step = block_scale.float() * global_scale  # [..., nblocks] fp32
    if export_dtype is not None:
        blocks = x.to(export_dtype).float().reshape(*x.shape[:-1], -1, BLOCK_SIZE)
    codes = encode_e2m1((blocks / step.unsqueeze(-1)).reshape(x.shape))
    return NVFP4Weight(packed=pack_nibbles(codes), block_scale=block_scale, global_scale=global_scale)


def dequantize_nvfp4(q: NVFP4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NVFP4Weight -> [..., in] in `dtype` (products formed in fp32, then cast once)."""
    values = decode_e2m1(unpack_nibbles(q.packed))  # [..., in] fp32
    step = q.block_scale.float() * q.global_scale  # [..., nblocks]
    blocks = values.reshape(*values.shape[:-1], -1, BLOCK_SIZE) * step.unsqueeze(-1)
    return blocks.reshape(q.shape).to(dtype)


def fake_quant_nvfp4(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize activations x [..., in] with a static global scale (1,) fp32.

    Block scales are dynamic (per 16 elements of each token), as in NVFP4 activation quantization.
    """
    return dequantize_nvfp4(quantize_nvfp4(x, global_scale), x.dtype)


__all__ = [
    "BLOCK_SIZE",
    "MIN_BLOCK_SCALE",
    "NVFP4Weight",
    "dequantize_nvfp4",
    "fake_quant_nvfp4",
    "global_scale_from_amax",
    "quantize_nvfp4",
]
