"""A ragged KV cache: one row per sequence, slot index == absolute position.

K and V are single buffers `[layers, rows, kv_heads, capacity + 1, head_dim]` (so fused kernels can
write every layer at once); `k[layer]` is one layer's view. A token at absolute
position p of row b lives at slot p, so "cropping" a row after a partial acceptance only lowers its
length: slots at or beyond the length hold stale values that are rewritten before any query can
attend to them (a query at position p only sees slots <= p, and every slot between the committed
length and p is written by the same forward). Slot `capacity` is a dead slot: padding tokens
(ragged prefill, padded drafter context) are written there and no query ever sees it.

Rows are kept compact (active rows are 0..num_rows-1) so that a forward over the batch works on
views, without gathers. Removing a row moves the last row into its place.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_trt.errors import ContextLengthError, InputError


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    capacity: int  # usable slots per row (max positions); one more dead slot is allocated
    dtype: torch.dtype
    device: torch.device


class RaggedKVCache:
    """KV buffers for up to `max_rows` sequences with per-row lengths."""

    def __init__(self, shape: CacheShape, max_rows: int) -> None:
        if max_rows < 1 or shape.capacity < 1:
            raise InputError(f"cache needs max_rows >= 1 and capacity >= 1, got {max_rows}, {shape.capacity}")
        self.shape = shape
        self.max_rows = max_rows
        dims = (shape.num_layers, max_rows, shape.num_kv_heads, shape.capacity + 1, shape.head_dim)
        self.k = torch.zeros(dims, dtype=shape.dtype, device=shape.device)  # [L, rows, kvH, cap + 1, D]
        self.v = torch.zeros(dims, dtype=shape.dtype, device=shape.device)
        self.lengths = torch.zeros(max_rows, dtype=torch.long, device=shape.device)  # [max_rows]
        self.num_rows = 0

    @property
    def capacity(self) -> int:
        return self.shape.capacity

    @property
    def dead_slot(self) -> int:
        return self.shape.capacity

    def add_rows(self, count: int) -> range:
        """Reserve `count` empty rows at the end; returns their indices."""
        if self.num_rows + count > self.max_rows:
            raise InputError(f"cache is full: {self.num_rows} rows in use, {count} more asked, max {self.max_rows}")
        start = self.num_rows
        self.num_rows += count
        self.lengths[start:self.num_rows] = 0
        return range(start, self.num_rows)

    def remove_row(self, row: int) -> int | None:
        """Free `row` at once. The last row moves into its place; returns the index it moved from
        (None if `row` was the last one), so callers can renumber their own per-row state."""
        if not 0 <= row < self.num_rows:
            raise InputError(f"row {row} is not in use (rows in use: {self.num_rows})")
        last = self.num_rows - 1
        moved = None
        if row != last:
            for buf in (self.k, self.v):
                buf[:, row].copy_(buf[:, last])
            self.lengths[row] = self.lengths[last]
            moved = last
        self.lengths[last] = 0
        self.num_rows = last
        return moved

    def reset(self) -> None:
        self.num_rows = 0
        self.lengths.zero_()

    def crop(self, lengths: torch.Tensor, rows: slice | None = None) -> None:
        """Set the committed length of the rows in `rows` (default: all active rows).
        lengths: [len(rows)]."""
        rows = slice(0, self.num_rows) if rows is None else rows
        count = len(range(*rows.indices(self.num_rows)))
        if lengths.shape != (count,):
            raise InputError(f"crop lengths must be [{count}], got {tuple(lengths.shape)}")
        if bool((lengths < 0).any()) or bool((lengths > self.capacity).any()):
            raise ContextLengthError(f"cache lengths {lengths.tolist()} outside [0, {self.capacity}]")
        self.lengths[rows] = lengths.to(self.lengths.device)

    def write(self, layer: int, rows: slice, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Scatter new keys/values of one layer.

        slots: [B, T] slot index of each token (its position, or the dead slot for padding);
        k, v:  [B, kv_heads, T, head_dim].
        """
        batch = torch.arange(slots.shape[0], device=slots.device)[:, None]  # [B, 1]
        self.k[layer][rows][batch, :, slots] = k.transpose(1, 2).to(self.shape.dtype)
        self.v[layer][rows][batch, :, slots] = v.transpose(1, 2).to(self.shape.dtype)

    def read(self, layer: int, rows: slice, kv_end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of slots [0, kv_end) of one layer: two [B, kv_heads, kv_end, head_dim]."""
        return self.k[layer][rows, :, :kv_end], self.v[layer][rows, :, :kv_end]
