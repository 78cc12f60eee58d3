"""Quantization algorithms this project can produce, named as TensorRT-LLM's `quant_algo` names them."""
from __future__ import annotations

from enum import Enum

from dflash_trt.errors import ConfigError


class QuantAlgo(str, Enum):
    """Weight (and activation) quantization of a linear layer.

    FP8: FP8 E4M3 weights with one per-tensor scale; activations per-tensor with a static,
        calibrated `input_scale` (or unquantized when no calibration amax is given).
    FP8_PER_CHANNEL_PER_TOKEN: FP8 weights with one scale per output channel; activations
        quantized dynamically with one scale per token.
    NVFP4: NVFP4 weights (E2M1, FP8 scale per 16 inputs, fp32 global scale); activations NVFP4
        with a static global `input_scale` and dynamic block scales (when calibrated).
    """

    FP8 = "FP8"
    FP8_PER_CHANNEL_PER_TOKEN = "FP8_PER_CHANNEL_PER_TOKEN"
    NVFP4 = "NVFP4"

    @property
    def is_fp8(self) -> bool:
        return self in (QuantAlgo.FP8, QuantAlgo.FP8_PER_CHANNEL_PER_TOKEN)


SUPPORTED_ALGOS: tuple[str, ...] = tuple(a.value for a in QuantAlgo)


def parse_quant_algo(algo: str | QuantAlgo) -> QuantAlgo:
    """Map a `quant_algo` string (exact, upper case as in TensorRT-LLM configs) to QuantAlgo."""
    if isinstance(algo, QuantAlgo):
        return algo
    for candidate in QuantAlgo:
        if candidate.value == algo:
            return candidate
    raise ConfigError(f"unsupported quant_algo {algo!r}; supported: {', '.join(SUPPORTED_ALGOS)}")


__all__ = ["QuantAlgo", "SUPPORTED_ALGOS", "parse_quant_algo"]
