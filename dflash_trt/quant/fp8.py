"""FP8 E4M3 quantization: weights (per-tensor or per-channel), activations, KV cache.

Format: E4M3 from Micikevicius et al., "FP8 Formats for Deep Learning" (arXiv 2209.05433), in
its "fn" variant (`torch.float8_e4m3fn`): 1 sign, 4 exponent (bias 7), 3 mantissa bits, no
infinities, one NaN pattern, largest finite value 448, smallest subnormal 2^-9. A value x is
stored as q = fp8(x / scale) and read back as q * scale, with an fp32 scale chosen so that the
tensor's (or channel's) absolute maximum maps onto 448:

    scale = amax / 448

This is the convention of NVIDIA ModelOpt exports and TensorRT-LLM checkpoints (`weight_scale`,
`input_scale`, `k_scale`/`v_scale`, legacy `weights_scaling_factor`). Every cast here clamps to
[-448, 448] first, so it saturates instead of producing NaN on any device. Rounding is the cast's
round-to-nearest-even; the relative error of a value in the normal range (|x / scale| >= 2^-6)
is at most 2^-4.

Divergence from ModelOpt, on purpose: an all-zero weight tensor (or an all-zero row, per-channel)
gets scale 1.0 instead of 0 (which would make 0/0 = NaN); its codes are zeros either way.
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

E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True, eq=False)
class FP8Weight:
    """An FP8 E4M3 weight with its fp32 dequantization scale.

    data:  [..., out, in] float8_e4m3fn
    scale: (1,) fp32 for a per-tensor scale, or [..., out] fp32 for one scale per output channel
           (row); dequantized weight = data * scale (broadcast over `in`).
    """

    data: torch.Tensor  # [..., out, in] float8_e4m3fn
    scale: torch.Tensor  # (1,) or [..., out], float32

    def __post_init__(self) -> None:
        check_dtype("FP8Weight.data", self.data, (FP8_DTYPE,))
        check_min_ndim("FP8Weight.data", self.data, 2, "[..., out, in]")
        check_dtype("FP8Weight.scale", self.scale, (torch.float32,))
        if tuple(self.scale.shape) not in ((1,), tuple(self.data.shape[:-1])):
            raise InputError(
                f"FP8Weight.scale must have shape (1,) (per-tensor) or {tuple(self.data.shape[:-1])} "
                f"(per-channel) for data of shape {tuple(self.data.shape)}, got {tuple(self.scale.shape)}"
            )

    @property
    def per_channel(self) -> bool:
        return tuple(self.scale.shape) != (1,)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


def cast_to_fp8(scaled: torch.Tensor) -> torch.Tensor:
    """Saturating cast of already-scaled values to float8_e4m3fn (clamp to +-448, then RNE)."""
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def export_codes(weight: torch.Tensor, scale: torch.Tensor, export_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 codes of `weight` [..., out, in] for a per-tensor `scale` (1,) fp32, rounded as NVIDIA
    ModelOpt 0.47's Hugging Face export rounds them (`modelopt/torch/export/quant_utils.py`,
    `to_quantized_weight`, FP8 branch, called with `weight.to(dtype)` from
    `unified_export_hf.py::_export_quantized_weight`): the weight is first rounded to the export
    dtype, divided by the fp32 scale in fp32, the quotient rounded to the export dtype (torch keeps a
    bf16 / fp16 result when the divisor is a 0-d fp32 tensor), then cast to E4M3 (RNE, saturating).

    export_dtype float32 rounds once; bfloat16 / float16 round twice, e.g. w / s = 53.91 -> bf16
    54.0 -> a tie between 52 and 56 -> 56 (single rounding gives 52). Checked bit for bit against
    ModelOpt's CPU export (tests/checkpoint/test_modelopt_hf.py); its CUDA path was not run here.
    """
    check_dtype("weight", weight, FLOAT_DTYPES)
    if export_dtype not in FLOAT_DTYPES:
        raise InputError(f"export_dtype must be one of {FLOAT_DTYPES}, got {export_dtype}")
    scalar_scale("scale", scale)
    quotient = weight.to(export_dtype).float() / scale
    return cast_to_fp8(quotient.to(export_dtype))


def weight_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """fp32 scale = amax / 448 for weights; a zero amax (all-zero tensor/row) gives scale 1.0."""
    scale = amax.float() / E4M3_MAX
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def quantize_fp8_weight(weight: torch.Tensor, per_channel: bool = False) -> FP8Weight:
    """Quantize a weight [..., out, in] (fp32/fp16/bf16) to FP8 E4M3.

    per_channel=False: one scale for the whole tensor, shape (1,) (ModelOpt `FP8`).
    per_channel=True:  one scale per output row, shape [..., out] (ModelOpt `FP8_PC_PT`,
                       TensorRT-LLM `FP8_PER_CHANNEL_PER_TOKEN`).
    """
    check_dtype("weight", weight, FLOAT_DTYPES)
    check_min_ndim("weight", weight, 2, "[..., out, in]")
    check_finite("weight", weight)
    w = weight.float()
    if per_channel:
        scale = weight_scale_from_amax(w.abs().amax(dim=-1))  # [..., out]
        data = cast_to_fp8(w / scale.unsqueeze(-1))
    else:
        scale = weight_scale_from_amax(w.abs().amax().reshape(1))  # (1,)
        data = cast_to_fp8(w / scale)
    return FP8Weight(data=data, scale=scale)


def dequantize_fp8_weight(weight: FP8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8Weight -> [..., out, in] in `dtype` (product formed in fp32, then cast once)."""
    scale = weight.scale.unsqueeze(-1) if weight.per_channel else weight.scale
    return (weight.data.float() * scale).to(dtype)


def activation_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """Static per-tensor activation scale (`input_scale`) from a calibration amax: (1,) fp32."""
    return amax_tensor("activation amax", amax) / E4M3_MAX


def fake_quant_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize x [...] with a per-tensor scale (1,) fp32; returns x's dtype and shape."""
    check_dtype("x", x, FLOAT_DTYPES)
    scalar_scale("scale", scale)
    return (cast_to_fp8(x.float() / scale).float() * scale).to(x.dtype)


def fake_quant_fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token quantize-dequantize of x [..., hidden]: one scale amax/448 per row."""
    check_dtype("x", x, FLOAT_DTYPES)
    check_min_ndim("x", x, 1, "[..., hidden]")
    xf = x.float()
    scale = weight_scale_from_amax(xf.abs().amax(dim=-1, keepdim=True))  # [..., 1]
    return (cast_to_fp8(xf / scale).float() * scale).to(x.dtype)


@dataclass(frozen=True, eq=False)
class KVCacheScales:
    """FP8 KV-cache scales: stored K = fp8(K / k_scale), V = fp8(V / v_scale)."""

    k_scale: torch.Tensor  # (1,) float32
    v_scale: torch.Tensor  # (1,) float32

    def __post_init__(self) -> None:
        scalar_scale("k_scale", self.k_scale)
        scalar_scale("v_scale", self.v_scale)

    @property
    def combined(self) -> torch.Tensor:
        """One scale for K and V (TensorRT-LLM 1.2.x `kv_cache_scaling_factor`): the max, (1,)."""
        return torch.maximum(self.k_scale, self.v_scale)


def kv_cache_scales(
    k_amax: torch.Tensor | float, v_amax: torch.Tensor | float, min_scale: float = 1.0
) -> KVCacheScales:
    """KV-cache scales amax / 448 from calibrated K and V amax, floored at `min_scale`.

    ModelOpt floors FP8 KV scales at 1.0 by default (amax below 448 is then stored unscaled);
    pass min_scale=0.0 for the raw amax / 448.
    """
    if not min_scale >= 0.0:
        raise InputError(f"min_scale must be >= 0, got {min_scale}")
    floor = torch.tensor([min_scale], dtype=torch.float32)
    k = torch.maximum(amax_tensor("k_amax", k_amax) / E4M3_MAX, floor)
    v = torch.maximum(amax_tensor("v_amax", v_amax) / E4M3_MAX, floor)
    return KVCacheScales(k_scale=k, v_scale=v)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Store K or V [...] (fp32/fp16/bf16) as float8_e4m3fn with a per-tensor scale (1,)."""
    check_dtype("kv", x, FLOAT_DTYPES)
    scalar_scale("scale", scale)
    return cast_to_fp8(x.float() / scale)


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Read back K or V stored by `quantize_kv`."""
    check_dtype("kv", q, (FP8_DTYPE,))
    scalar_scale("scale", scale)
    return (q.float() * scale).to(dtype)


__all__ = [
    "E4M3_MAX",
    "FP8_DTYPE",
    "FP8Weight",
    "KVCacheScales",
    "activation_scale",
    "cast_to_fp8",
    "dequantize_fp8_weight",
    "dequantize_kv",
    "export_codes",
    "fake_quant_fp8",
    "fake_quant_fp8_per_token",
    "kv_cache_scales",
    "quantize_fp8_weight",
    "quantize_kv",
    "weight_scale_from_amax",
]
