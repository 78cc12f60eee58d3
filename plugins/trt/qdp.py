"""TensorRT Python plugins (`tensorrt.plugin`, "quickly deployable plugins") for DFlash.

- `dflash::accept_tokens`: inputs draft_tokens [B, K], target_tokens [B, K + 1], draft_lens [B],
  start_pos [B] (all int64); outputs accepted, bonus, new_pos [B] int64. Attribute `block_k`:
  a power of two >= K (the AOT kernel's tile width; K = block_size - 1 is fixed per engine).
- `dflash::pack_taps`: inputs taps [n_taps, B, T, H] float, accepted [B] int64; outputs packed
  [B, T, n_taps * H] (taps' dtype) and counts [B] int64. Attribute `block_h`: a power of two.

Both have a JIT implementation (`trtp.impl`: launches the Triton kernel from Python on TRT's
stream) and an AOT implementation (`trtp.aot_impl`: PTX compiled by plugins/trt/aot.py, embedded
in the engine, no Python at run time). Importing this module registers the plugins, so import it
through `plugins.trt.register_plugins()`, which checks that tensorrt and triton are present.
No `from __future__ import annotations` here: tensorrt.plugin inspects the real type hints.
"""
from typing import List, Tuple, Union

import tensorrt as trt
import tensorrt.plugin as trtp
import torch

from dflash_trt.errors import InputError
from plugins.kernels.contracts import AcceptResult, PackedTaps
from plugins.kernels.triton_accept import BLOCK_B, launch_accept
from plugins.kernels.triton_pack import launch_pack_taps

from .aot import compile_accept, compile_pack

ACCEPT_ID = "dflash::accept_tokens"
PACK_ID = "dflash::pack_taps"
_TRT_FLOAT_NAMES = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16"}


def _device_arch() -> int:
    """Compute capability of the current GPU as an int (9, 0) -> 90."""
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


# ---- dflash::accept_tokens -------------------------------------------------------------------

@trtp.register(ACCEPT_ID)
def _accept_desc(
    draft_tokens: trtp.TensorDesc,  # [B, K] int64
    target_tokens: trtp.TensorDesc,  # [B, K + 1] int64
    draft_lens: trtp.TensorDesc,  # [B] int64
    start_pos: trtp.TensorDesc,  # [B] int64
    block_k: int,
) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
    k = draft_tokens.shape_expr[1]
    if k.is_constant and k.constant_value > block_k:
        raise InputError(f"{ACCEPT_ID}: block_k={block_k} must be >= K={k.constant_value}")
    return draft_lens.like(), draft_lens.like(), draft_lens.like()


@trtp.autotune(ACCEPT_ID)
def _accept_autotune(draft_tokens, target_tokens, draft_lens, start_pos,
                     outputs) -> List[trtp.AutoTuneCombination]:
    return [trtp.AutoTuneCombination("INT64, INT64, INT64, INT64, INT64, INT64, INT64", "LINEAR")]


@trtp.impl(ACCEPT_ID)
def _accept_impl(
    draft_tokens: trtp.Tensor,
    target_tokens: trtp.Tensor,
    draft_lens: trtp.Tensor,
    start_pos: trtp.Tensor,
    outputs: Tuple[trtp.Tensor],
    stream: int,
) -> None:
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        inputs = [torch.as_tensor(t, device="cuda")
                  for t in (draft_tokens, target_tokens, draft_lens, start_pos)]
        out = AcceptResult(*(torch.as_tensor(o, device="cuda") for o in outputs))
        launch_accept(*inputs, out=out)


@trtp.aot_impl(ACCEPT_ID)
def _accept_aot(
    draft_tokens: trtp.TensorDesc,
    target_tokens: trtp.TensorDesc,
    draft_lens: trtp.TensorDesc,
    start_pos: trtp.TensorDesc,
    block_k: int,
    outputs: Tuple[trtp.TensorDesc],
    tactic: int,
) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
    kernel = compile_accept(block_k, _device_arch())
    batch, k = draft_tokens.shape_expr[0], draft_tokens.shape_expr[1]
    params = trtp.KernelLaunchParams()
    params.grid_x = trtp.cdiv(batch, BLOCK_B)
    params.block_x = kernel.block_threads
    params.shared_mem = kernel.shared_mem
    scalars = trtp.SymIntExprs.from_tuple([trtp.SymInt32(batch), trtp.SymInt32(k)])
    return kernel.name.encode(), kernel.ptx.encode(), params, scalars


# ---- dflash::pack_taps -----------------------------------------------------------------------

@trtp.register(PACK_ID)
def _pack_desc(
    taps: trtp.TensorDesc,  # [n_taps, B, T, H] float
    accepted: trtp.TensorDesc,  # [B] int64
    block_h: int,
) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
    n_taps, batch, slots, hidden = (taps.shape_expr[i] for i in range(4))
    packed = trtp.from_shape_expr((batch, slots, n_taps * hidden), dtype=taps.dtype)
    return packed, accepted.like()


@trtp.autotune(PACK_ID)
def _pack_autotune(taps, accepted, outputs) -> List[trtp.AutoTuneCombination]:
    return [trtp.AutoTuneCombination("FP32|FP16|BF16, INT64, FP32|FP16|BF16, INT64", "LINEAR")]


@trtp.impl(PACK_ID)
def _pack_impl(
    taps: trtp.Tensor,
    accepted: trtp.Tensor,
    outputs: Tuple[trtp.Tensor],
    stream: int,
) -> None:
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        out = PackedTaps(packed=torch.as_tensor(outputs[0], device="cuda"),
                         counts=torch.as_tensor(outputs[1], device="cuda"))
        launch_pack_taps(torch.as_tensor(taps, device="cuda"),
                         torch.as_tensor(accepted, device="cuda"), out=out)


@trtp.aot_impl(PACK_ID)
def _pack_aot(
    taps: trtp.TensorDesc,
    accepted: trtp.TensorDesc,
    block_h: int,
    outputs: Tuple[trtp.TensorDesc],
    tactic: int,
) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
    kernel = compile_pack(_TRT_FLOAT_NAMES[taps.dtype], block_h, _device_arch())
    n_taps, batch, slots, hidden = (taps.shape_expr[i] for i in range(4))
    params = trtp.KernelLaunchParams()
    params.grid_x = batch * slots
    params.grid_y = n_taps
    params.grid_z = trtp.cdiv(hidden, block_h)
    params.block_x = kernel.block_threads
    params.shared_mem = kernel.shared_mem
    scalars = trtp.SymIntExprs.from_tuple(
        [trtp.SymInt32(batch), trtp.SymInt32(slots), trtp.SymInt32(hidden)])
    return kernel.name.encode(), kernel.ptx.encode(), params, scalars


# ---- network helpers -------------------------------------------------------------------------

def add_accept_tokens(network: "trt.INetworkDefinition", draft_tokens: "trt.ITensor",
                      target_tokens: "trt.ITensor", draft_lens: "trt.ITensor",
                      start_pos: "trt.ITensor", block_k: int, aot: bool) -> "trt.ILayer":
    """Add a dflash::accept_tokens layer (outputs: accepted, bonus, new_pos)."""
    op = trtp.op.dflash.accept_tokens(draft_tokens, target_tokens, draft_lens, start_pos,
                                      block_k=block_k)
    return network.add_plugin(op, aot=aot)


def add_pack_taps(network: "trt.INetworkDefinition", taps: "trt.ITensor",
                  accepted: "trt.ITensor", block_h: int, aot: bool) -> "trt.ILayer":
    """Add a dflash::pack_taps layer (outputs: packed, counts)."""
    op = trtp.op.dflash.pack_taps(taps, accepted, block_h=block_h)
    return network.add_plugin(op, aot=aot)
