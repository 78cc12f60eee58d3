"""Triton kernel: pack the verify forward's tapped hidden states of the committed positions.

Imported lazily (needs `triton`). Argument order: inputs, int32 scalars, outputs (TensorRT AOT).
Grid: (B * T, n_taps, cdiv(H, BLOCK_H)); each program copies one [BLOCK_H] slice of one tap.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .contracts import PackedTaps
from .grid import cdiv, next_pow2


@triton.jit
def pack_taps_kernel(
    taps_ptr,  # [n_taps, B, T, H] float, contiguous
    accepted_ptr,  # [B] int64
    n_rows,  # i32: B
    n_slots,  # i32: T
    hidden,  # i32: H
    packed_ptr,  # [B, T, n_taps * H] float out
    counts_ptr,  # [B] int64 out
    BLOCK_H: tl.constexpr,
):
    bt = tl.program_id(0).to(tl.int64)
    tap = tl.program_id(1).to(tl.int64)
    hb = tl.program_id(2)
    n_taps = tl.num_programs(1)
    row = bt // n_slots
    slot = bt % n_slots
    count = tl.load(accepted_ptr + row) + 1
    offs = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = offs < hidden
    src = taps_ptr + ((tap * n_rows + row) * n_slots + slot) * hidden + offs
    keep = (tl.zeros([BLOCK_H], dtype=tl.int64) + slot) < count  # slot committed, as a vector
    x = tl.load(src, mask=in_h & keep, other=0.0)
    dst = packed_ptr + bt * (n_taps * hidden) + tap * hidden + offs
    tl.store(dst, x, mask=in_h)
    tl.store(counts_ptr + row, count, mask=(slot == 0) & (tap == 0) & (hb == 0))


def block_h_for(hidden: int) -> int:
    """Feature slice per program: up to 1024 elements."""
    return min(next_pow2(hidden), 1024)


def launch_pack_taps(
    taps: torch.Tensor,  # [n_taps, B, T, H] float
    accepted: torch.Tensor,  # [B] int64
    out: PackedTaps | None = None,  # preallocated outputs (TensorRT plugin buffers)
) -> PackedTaps:
    """Run `pack_taps_kernel`; inputs are assumed validated (see contracts.check_pack_inputs)."""
    n_taps, batch, t, hidden = taps.shape
    if out is None:
        out = PackedTaps(
            packed=torch.empty(batch, t, n_taps * hidden, dtype=taps.dtype, device=taps.device),
            counts=torch.empty(batch, dtype=torch.int64, device=taps.device),
        )
    block_h = block_h_for(hidden)
    grid = (batch * t, n_taps, cdiv(hidden, block_h))
    pack_taps_kernel[grid](
        taps.contiguous(), accepted.contiguous(), batch, t, hidden, out.packed, out.counts,
        BLOCK_H=block_h,
    )
    return out
