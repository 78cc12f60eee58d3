"""Triton kernel: batched acceptance (longest matching draft prefix, bonus token, next position).

Imported lazily (needs `triton`). Kernel arguments are ordered inputs, int32 scalars, outputs,
so the same kernel serves the TensorRT AOT plugin (see plugins/trt/aot.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .contracts import AcceptResult
from .grid import cdiv, next_pow2

BLOCK_B = 16  # rows per program


@triton.jit
def accept_kernel(
    draft_ptr,  # [B, K] int64
    target_ptr,  # [B, K + 1] int64
    draft_lens_ptr,  # [B] int64
    start_pos_ptr,  # [B] int64
    n_rows,  # i32: B
    k,  # i32: K
    accepted_ptr,  # [B] int64 out
    bonus_ptr,  # [B] int64 out
    new_pos_ptr,  # [B] int64 out
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    in_block = row_ok[:, None] & (cols[None, :] < k)
    draft = tl.load(draft_ptr + rows64[:, None] * k + cols[None, :], mask=in_block, other=-1)
    target = tl.load(target_ptr + rows64[:, None] * (k + 1) + cols[None, :], mask=in_block,
                     other=-2)
    dlen = tl.load(draft_lens_ptr + rows64, mask=row_ok, other=0)
    ok = (draft == target) & in_block & (cols[None, :].to(tl.int64) < dlen[:, None])
    # index of the first slot that is not accepted; slots >= dlen never are, so it is <= dlen
    first_bad = tl.min(tl.where(ok, BLOCK_K, cols[None, :]), axis=1)
    accepted = tl.minimum(first_bad.to(tl.int64), dlen)
    bonus = tl.load(target_ptr + rows64 * (k + 1) + accepted, mask=row_ok, other=0)
    start = tl.load(start_pos_ptr + rows64, mask=row_ok, other=0)
    tl.store(accepted_ptr + rows64, accepted, mask=row_ok)
    tl.store(bonus_ptr + rows64, bonus, mask=row_ok)
    tl.store(new_pos_ptr + rows64, start + accepted + 1, mask=row_ok)


def block_k_for(k: int) -> int:
    """Power-of-two tile width covering K draft slots (at least 1)."""
    return next_pow2(max(k, 1))


def launch_accept(
    draft_tokens: torch.Tensor,  # [B, K] int64
    target_tokens: torch.Tensor,  # [B, K + 1] int64
    draft_lens: torch.Tensor,  # [B] int64
    start_pos: torch.Tensor,  # [B] int64
    out: AcceptResult | None = None,  # preallocated [B] int64 outputs (TensorRT plugin buffers)
) -> AcceptResult:
    """Run `accept_kernel`; inputs are assumed validated (see contracts.check_accept_inputs)."""
    batch, k = draft_tokens.shape
    if out is None:
        out = AcceptResult(*(torch.empty(batch, dtype=torch.int64, device=draft_tokens.device)
                             for _ in range(3)))
    draft = draft_tokens.contiguous()
    if draft.numel() == 0:  # K == 0: every load is masked, but give the kernel a real buffer
        draft = torch.zeros(1, dtype=torch.int64, device=draft_tokens.device)
    grid = (cdiv(batch, BLOCK_B),)
    accept_kernel[grid](
        draft, target_tokens.contiguous(), draft_lens.contiguous(), start_pos.contiguous(),
        batch, k, out.accepted, out.bonus, out.new_pos,
        BLOCK_B=BLOCK_B, BLOCK_K=block_k_for(k),
    )
    return out
