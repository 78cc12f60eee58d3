"""QuantLinear: a linear layer holding FP8 or NVFP4 weights, with an emulated (dequantizing) forward.

The buffers use the tensor names of ModelOpt Hugging Face exports, which TensorRT-LLM loads, so
`state_dict()` of a model made of QuantLinear layers is a ModelOpt-format quantized checkpoint:

    algo                        weight                  weight_scale             weight_scale_2  input_scale
    FP8                         [out, in] e4m3          (1,) fp32                -               (1,) fp32 (opt.)
    FP8_PER_CHANNEL_PER_TOKEN   [out, in] e4m3          (out,) fp32              -               -
    NVFP4                       [out, in / 2] uint8     [out, in / 16] e4m3      (1,) fp32       (1,) fp32 (opt.)

forward(x) dequantizes the weight to x's dtype and calls F.linear, so it equals a plain Linear with
the dequantized weight. When an input scale is present (FP8, NVFP4) or the algo is per-token FP8,
x is first quantize-dequantized the way the deployed kernel quantizes activations. Against the
unquantized layer, outputs differ by the quantization error. Measured relative Frobenius error of
the output on Gaussian weights and inputs (the tests' bounds in brackets): FP8 weight-only 2.6%,
with input quantization 3.8% [5%]; NVFP4 weight-only 9.5% [12%], with input quantization 13.5% [16%].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.errors import ConfigError, InputError
from dflash_trt.quant._checks import FLOAT_DTYPES, check_dtype, scalar_scale
from dflash_trt.quant.algo import QuantAlgo, parse_quant_algo
from dflash_trt.quant.fp8 import (
    FP8_DTYPE,
    FP8Weight,
    activation_scale,
    dequantize_fp8_weight,
    fake_quant_fp8,
    fake_quant_fp8_per_token,
    quantize_fp8_weight,
)
from dflash_trt.quant.nvfp4 import (
    BLOCK_SIZE,
    NVFP4Weight,
    dequantize_nvfp4,
    fake_quant_nvfp4,
    global_scale_from_amax,
    quantize_nvfp4,
)


class QuantLinear(nn.Module):
    """y = x @ dequant(W).T + b with W stored as FP8 or NVFP4 (see the module docstring).

    `.to(device)` moves every tensor; dtype casts of the module (`.to(torch.bfloat16)`, `.half()`)
    change only the bias: codes and scales keep the fixed dtypes of their format.
    """

    _QUANTIZED_BUFFERS = ("weight", "weight_scale", "weight_scale_2", "input_scale")

    weight: torch.Tensor  # [out, in] e4m3 (FP8) or [out, in / 2] uint8 (NVFP4)
    weight_scale: torch.Tensor  # (1,) / (out,) fp32 (FP8) or [out, in / 16] e4m3 (NVFP4)
    weight_scale_2: torch.Tensor | None  # (1,) fp32, NVFP4 only
    input_scale: torch.Tensor | None  # (1,) fp32, static activation scale
    bias: torch.Tensor | None  # [out]

    def __init__(
        self,
        in_features: int,
        out_features: int,
        algo: str | QuantAlgo,
        *,
        bias: bool = False,
        static_input_scale: bool = False,
        bias_dtype: torch.dtype = torch.float32,
    ) -> None:
        """An empty layer (zero weight, unit scales) to be filled by `load_state_dict`."""
        super().__init__()
        self.algo = parse_quant_algo(algo)
        if in_features < 1 or out_features < 1:
            raise InputError(f"QuantLinear needs positive sizes, got in={in_features}, out={out_features}")
        if self.algo is QuantAlgo.NVFP4 and in_features % BLOCK_SIZE != 0:
            raise InputError(f"NVFP4 needs in_features % {BLOCK_SIZE} == 0, got in_features={in_features}")
        if self.algo is QuantAlgo.FP8_PER_CHANNEL_PER_TOKEN and static_input_scale:
            raise ConfigError(
                "FP8_PER_CHANNEL_PER_TOKEN quantizes activations per token at run time; "
                "it takes no static input scale (drop the calibration amax, or use FP8)"
            )
        self.in_features = in_features
        self.out_features = out_features
        if self.algo is QuantAlgo.NVFP4:
            self.register_buffer("weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
            scale = torch.ones(out_features, in_features // BLOCK_SIZE).to(FP8_DTYPE)
            self.register_buffer("weight_scale", scale)
            self.register_buffer("weight_scale_2", torch.ones(1))
        else:
            self.register_buffer("weight", torch.zeros(out_features, in_features).to(FP8_DTYPE))
            per_channel = self.algo is QuantAlgo.FP8_PER_CHANNEL_PER_TOKEN
            self.register_buffer("weight_scale", torch.ones(out_features if per_channel else 1))
            self.register_buffer("weight_scale_2", None)
        self.register_buffer("input_scale", torch.ones(1) if static_input_scale else None)
        self.register_buffer("bias", torch.zeros(out_features, dtype=bias_dtype) if bias else None)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 (nn.Module's signature)
        originals = {name: self._buffers[name] for name in self._QUANTIZED_BUFFERS}
        super()._apply(fn, recurse)
        for name, original in originals.items():
            converted = self._buffers[name]
            if original is not None and converted is not None and converted.dtype != original.dtype:
                self._buffers[name] = original.to(device=converted.device)
        return self

    @classmethod
    def from_quantized(
        cls,
        weight: FP8Weight | NVFP4Weight,
        bias: torch.Tensor | None = None,  # [out]
        input_scale: torch.Tensor | None = None,  # (1,) fp32
    ) -> QuantLinear:
        """Wrap already-quantized tensors. A per-channel FP8Weight means FP8_PER_CHANNEL_PER_TOKEN."""
        if isinstance(weight, NVFP4Weight):
            algo = QuantAlgo.NVFP4
        elif weight.per_channel:
            algo = QuantAlgo.FP8_PER_CHANNEL_PER_TOKEN
        else:
            algo = QuantAlgo.FP8
        if len(weight.shape) != 2:
            raise InputError(f"QuantLinear needs a 2-D weight [out, in], got shape {tuple(weight.shape)}")
        out_features, in_features = weight.shape
        if bias is not None:
            check_dtype("bias", bias, FLOAT_DTYPES)
            if tuple(bias.shape) != (out_features,):
                raise InputError(f"bias must have shape ({out_features},), got {tuple(bias.shape)}")
        if input_scale is not None:
            scalar_scale("input_scale", input_scale)
        layer = cls(
            in_features,
            out_features,
            algo,
            bias=bias is not None,
            static_input_scale=input_scale is not None,
            bias_dtype=bias.dtype if bias is not None else torch.float32,
        )
        if isinstance(weight, NVFP4Weight):
            layer.weight.copy_(weight.packed)
            layer.weight_scale.copy_(weight.block_scale)
            layer.weight_scale_2.copy_(weight.global_scale)
        else:
            layer.weight.copy_(weight.data)
            layer.weight_scale.copy_(weight.scale)
        if input_scale is not None:
            layer.input_scale.copy_(input_scale)
        if bias is not None:
            layer.bias.copy_(bias)
        return layer

    @classmethod
    def from_float(
        cls,
        linear: nn.Linear,
        algo: str | QuantAlgo,
        input_amax: torch.Tensor | float | None = None,
    ) -> QuantLinear:
        """Quantize an nn.Linear. `input_amax` (calibrated |x| max) adds a static input scale."""
        algo = parse_quant_algo(algo)
        if input_amax is not None and algo is QuantAlgo.FP8_PER_CHANNEL_PER_TOKEN:
            raise ConfigError(
                "FP8_PER_CHANNEL_PER_TOKEN quantizes activations per token at run time; do not pass input_amax"
            )
        with torch.no_grad():
            w = linear.weight.detach()
            if algo is QuantAlgo.NVFP4:
                qweight: FP8Weight | NVFP4Weight = quantize_nvfp4(w)
                input_scale = None if input_amax is None else global_scale_from_amax(input_amax)
            else:
                qweight = quantize_fp8_weight(w, per_channel=algo is QuantAlgo.FP8_PER_CHANNEL_PER_TOKEN)
                input_scale = None if input_amax is None else activation_scale(input_amax)
            bias = None if linear.bias is None else linear.bias.detach()
            return cls.from_quantized(qweight, bias=bias, input_scale=input_scale)

    def quantized_weight(self) -> FP8Weight | NVFP4Weight:
        """The stored weight as a typed (validated) value."""
        if self.algo is QuantAlgo.NVFP4:
            return NVFP4Weight(packed=self.weight, block_scale=self.weight_scale, global_scale=self.weight_scale_2)
        return FP8Weight(data=self.weight, scale=self.weight_scale)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[out, in] in `dtype`."""
        qweight = self.quantized_weight()
        if isinstance(qweight, NVFP4Weight):
            return dequantize_nvfp4(qweight, dtype)
        return dequantize_fp8_weight(qweight, dtype)

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] as the deployed kernel sees it (unchanged when activations stay unquantized)."""
        if self.algo is QuantAlgo.FP8_PER_CHANNEL_PER_TOKEN:
            return fake_quant_fp8_per_token(x)
        if self.input_scale is None:
            return x
        if self.algo is QuantAlgo.NVFP4:
            return fake_quant_nvfp4(x, self.input_scale)
        return fake_quant_fp8(x, self.input_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        check_dtype("x", x, FLOAT_DTYPES)
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise InputError(f"QuantLinear expects x [..., {self.in_features}], got shape {tuple(x.shape)}")
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(self.quantize_input(x), self.dequantized_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, algo={self.algo.value}, "
            f"bias={self.bias is not None}, input_scale={self.input_scale is not None}"
        )


__all__ = ["QuantLinear"]
