"""DFlash decode-hot-path kernels: one dispatch API over a torch reference and Triton kernels.

- acceptance (longest matching draft prefix per row, bonus token, next block position): the Triton
  kernel is `triton_accept.launch_accept`; its reference and its dispatch, `accept_tokens`, live
  with the acceptance rule in dflash_trt/speculative/verify.py (this package never imports upward);
- `pack_taps`: the verify forward's tapped hidden states of the committed slots, tap-major.
- `write_context_kv`: fc + hidden_norm, then every draft layer's k_norm/RoPE'd K and V written
  into the draft caches at (row, pos).

CUDA tensors take the Triton kernels; CPU tensors take the torch reference (`reference.py`);
`use_triton` makes that choice for every op, the acceptance dispatch included.
`force_triton=True` runs the Triton kernels on any device (on CPU that needs Triton's
interpreter, enabled by the caller with TRITON_INTERPRET=1 before triton is imported: the tests
do this). Which path ran is logged once per (op, path). `triton` is imported only when a Triton
path is taken, so `import plugins.kernels` works without it.
"""
from __future__ import annotations

import importlib.util
import logging

import torch

from dflash_trt.errors import BackendUnavailableError

from .contracts import (
    AcceptResult,
    ContextKVWeights,
    PackedTaps,
    check_accept_inputs,
    check_context_kv_inputs,
    check_pack_inputs,
)
from .reference import pack_taps_ref, write_context_kv_ref

__all__ = [
    "AcceptResult",
    "ContextKVWeights",
    "PackedTaps",
    "check_accept_inputs",
    "pack_taps",
    "triton_available",
    "triton_interpreting",
    "use_triton",
    "write_context_kv",
]

logger = logging.getLogger(__name__)
_logged: set[tuple[str, str]] = set()


def triton_available() -> bool:
    """True when the `triton` package can be imported here."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    """True when triton was imported in interpreter mode (kernels then run on CPU tensors).

    Imports triton; call only when it is available. Interpreter mode is fixed when triton is
    first imported (TRITON_INTERPRET=1 must be set before that).
    """
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.sum, InterpretedFunction)


def _log_once(op: str, path: str, message: str, level: int = logging.INFO) -> None:
    if (op, path) not in _logged:
        _logged.add((op, path))
        logger.log(level, "%s: %s", op, message)


def use_triton(op: str, device: torch.device, force_triton: bool) -> bool:
    """Decide the path for one call: Triton on CUDA (or when forced), torch otherwise."""
    if force_triton:
        if not triton_available():
            raise BackendUnavailableError(
                f"{op}(force_triton=True) needs the `triton` package: pip install 'triton>=3.0' "
                "(on CPU also set TRITON_INTERPRET=1 before importing triton)"
            )
        if device.type != "cuda" and not triton_interpreting():
            raise BackendUnavailableError(
                f"{op}(force_triton=True) on {device.type} tensors needs Triton's interpreter, "
                "but triton was imported in compiled mode: set TRITON_INTERPRET=1 before triton "
                "is first imported, or pass CUDA tensors"
            )
        _log_once(op, "triton", f"Triton kernel (forced) on {device.type}")
        return True
    if device.type == "cuda":
        if triton_available():
            _log_once(op, "triton", "Triton kernel on cuda")
            return True
        _log_once(op, "torch-fallback",
                  "triton is not installed: falling back to the torch reference on cuda "
                  "(pip install 'triton>=3.0' for the fused kernels)", logging.WARNING)
        return False
    _log_once(op, "torch", f"torch reference on {device.type}")
    return False


def pack_taps(
    taps: torch.Tensor,  # [n_taps, batch, T, hidden] float: tapped hidden states of the verify
    accepted: torch.Tensor,  # [batch] int64
    *,
    force_triton: bool = False,
) -> PackedTaps:
    """packed [batch, T, n_taps*hidden] (zero past accepted+1 slots) and counts [batch]."""
    check_pack_inputs(taps, accepted)
    if not use_triton("pack_taps", taps.device, force_triton):
        return pack_taps_ref(taps, accepted)
    from .triton_pack import launch_pack_taps

    return launch_pack_taps(taps, accepted)


def write_context_kv(
    feats: torch.Tensor,  # [N, n_taps * hidden] float: packed taps of committed positions
    rows: torch.Tensor,  # [N] int64: cache row of each position
    pos: torch.Tensor,  # [N] int64: absolute position = cache slot of each position
    weights: ContextKVWeights,
    inv_freq: torch.Tensor,  # [head_dim / 2] float32
    k_cache: torch.Tensor,  # [n_layers, S, kv_heads, Lmax, head_dim], written in place
    v_cache: torch.Tensor,  # [n_layers, S, kv_heads, Lmax, head_dim], written in place
    *,
    attention_scaling: float = 1.0,
    force_triton: bool = False,
) -> None:
    """Precompute and store every draft layer's context K (k_norm + RoPE) and V."""
    check_context_kv_inputs(feats, rows, pos, weights, inv_freq, k_cache, v_cache)
    if not use_triton("write_context_kv", feats.device, force_triton):
        write_context_kv_ref(feats, rows, pos, weights, inv_freq, k_cache, v_cache,
                             attention_scaling)
        return
    from .triton_context_kv import launch_context_kv

    launch_context_kv(feats, rows, pos, weights, inv_freq, k_cache, v_cache, attention_scaling)
