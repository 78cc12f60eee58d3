"""TensorRT plugin bindings for the DFlash kernels (`tensorrt.plugin`), imported lazily.

`register_plugins()` imports tensorrt and registers `dflash::accept_tokens` and
`dflash::pack_taps` (JIT and AOT implementations, both backed by the Triton kernels in
plugins.kernels). Without tensorrt or triton it raises BackendUnavailableError; `import
plugins.trt` itself never needs them. `plugins.trt.aot` (PTX compilation) needs only triton.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from dflash_trt.errors import BackendUnavailableError

__all__ = ["RegisteredPlugins", "register_plugins"]


@dataclass(frozen=True)
class RegisteredPlugins:
    """Plugin ids as registered with TensorRT's plugin registry."""

    accept_tokens: str  # "dflash::accept_tokens"
    pack_taps: str  # "dflash::pack_taps"


def _require_tensorrt() -> None:
    if importlib.util.find_spec("tensorrt") is None:
        raise BackendUnavailableError(
            "TensorRT plugins need the `tensorrt` package (>= 10.8, with tensorrt.plugin AOT "
            "support) and a CUDA GPU; install it from NVIDIA's index or use the NGC TensorRT-LLM "
            "container. The torch and Triton paths in plugins.kernels work without it."
        )
    try:
        import tensorrt.plugin  # noqa: F401  (libnvinfer is loaded here)
    except (ImportError, OSError) as exc:
        raise BackendUnavailableError(
            f"`tensorrt` is installed but cannot be loaded ({exc}); a placeholder wheel or a "
            "missing libnvinfer: install a working TensorRT >= 10.8"
        ) from exc
    if importlib.util.find_spec("triton") is None:
        raise BackendUnavailableError(
            "the DFlash TensorRT plugins run Triton kernels: pip install 'triton>=3.0'")


def register_plugins() -> RegisteredPlugins:
    """Register the DFlash plugins with TensorRT (idempotent) and return their ids."""
    _require_tensorrt()
    from . import qdp  # first import registers; later imports are cached

    return RegisteredPlugins(accept_tokens=qdp.ACCEPT_ID, pack_taps=qdp.PACK_ID)
