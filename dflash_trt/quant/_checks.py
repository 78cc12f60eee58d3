"""Shape/dtype checks shared by the quantization numerics (module boundaries raise InputError)."""
from __future__ import annotations

import torch

from dflash_trt.errors import InputError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise InputError(f"{name} must have dtype in ({names}), got {str(tensor.dtype).removeprefix('torch.')}")


def check_min_ndim(name: str, tensor: torch.Tensor, ndim: int, layout: str) -> None:
    if tensor.dim() < ndim:
        raise InputError(f"{name} must have at least {ndim} dims {layout}, got shape {tuple(tensor.shape)}")


def check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise InputError(f"{name} must have shape {tuple(expected)}, got {tuple(tensor.shape)}")


def check_finite(name: str, tensor: torch.Tensor) -> None:
    if not bool(torch.isfinite(tensor).all()):
        raise InputError(f"{name} contains inf or NaN values; quantization needs finite values")


def scalar_scale(name: str, scale: torch.Tensor) -> torch.Tensor:
    """Validate a per-tensor scale: fp32, shape (1,), finite and > 0. Returns it unchanged."""
    check_dtype(name, scale, (torch.float32,))
    check_shape(name, scale, (1,))
    if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        raise InputError(f"{name} must be finite and > 0, got {scale.tolist()}")
    return scale


def amax_tensor(name: str, amax: torch.Tensor | float) -> torch.Tensor:
    """A calibration amax as an fp32 tensor of shape (1,); must be finite and > 0."""
    value = torch.as_tensor(amax, dtype=torch.float32).reshape(-1)
    if value.numel() != 1:
        raise InputError(f"{name} must be a single value (per-tensor amax), got shape {tuple(value.shape)}")
    if not bool(torch.isfinite(value).all()) or not bool((value > 0).all()):
        raise InputError(
            f"{name} must be finite and > 0, got {value.item()}; calibrate on data that reaches this layer"
        )
    return value
