"""Triton kernel: fused k_norm + RoPE + cache write of the drafter's context K/V, all layers.

The projections (fc, hidden_norm, k_proj/v_proj of every layer as one matmul each) run in torch
(cuBLAS on GPU); this kernel then reads each (position, layer, kv head) row of K and V once,
normalises and rotates K in float32, and scatters K and V into the caches at (row, pos).
Imported lazily (needs `triton`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .contracts import ContextKVWeights
from .grid import next_pow2
from .reference import context_features, project_context_kv


@triton.jit
def context_kv_kernel(
    k_ptr,  # [N, L, KVH, D] projected K (pre-norm), contiguous
    v_ptr,  # [N, L, KVH, D] projected V, contiguous
    k_norm_ptr,  # [L, D] k_norm weights
    inv_freq_ptr,  # [D / 2] float32
    rows_ptr,  # [N] int64: cache row
    pos_ptr,  # [N] int64: absolute position = cache slot
    n_layers,  # i32: L
    kv_heads,  # i32: KVH
    n_seqs,  # i32: S
    max_len,  # i32: Lmax
    eps,  # f32
    attention_scaling,  # f32
    k_cache_ptr,  # [L, S, KVH, Lmax, D] out
    v_cache_ptr,  # [L, S, KVH, Lmax, D] out
    HALF: tl.constexpr,  # D / 2
    BLOCK_HALF: tl.constexpr,  # next power of two >= HALF
):
    n = tl.program_id(0).to(tl.int64)
    lh = tl.program_id(1).to(tl.int64)  # layer * KVH + head
    layer = lh // kv_heads
    head = lh % kv_heads
    d = 2 * HALF
    j = tl.arange(0, BLOCK_HALF)
    in_half = j < HALF
    src = (n * n_layers * kv_heads + lh) * d
    x1 = tl.load(k_ptr + src + j, mask=in_half, other=0.0).to(tl.float32)
    x2 = tl.load(k_ptr + src + HALF + j, mask=in_half, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / d + eps)
    w1 = tl.load(k_norm_ptr + layer * d + j, mask=in_half, other=0.0).to(tl.float32)
    w2 = tl.load(k_norm_ptr + layer * d + HALF + j, mask=in_half, other=0.0).to(tl.float32)
    y1 = x1 * rstd * w1
    y2 = x2 * rstd * w2
    p = tl.load(pos_ptr + n)
    theta = p.to(tl.float32) * tl.load(inv_freq_ptr + j, mask=in_half, other=0.0)
    c = tl.cos(theta) * attention_scaling
    s = tl.sin(theta) * attention_scaling
    row = tl.load(rows_ptr + n)
    dst = (((layer * n_seqs + row) * kv_heads + head) * max_len + p) * d
    out_ty = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + dst + j, (y1 * c - y2 * s).to(out_ty), mask=in_half)
    tl.store(k_cache_ptr + dst + HALF + j, (y2 * c + y1 * s).to(out_ty), mask=in_half)
    v1 = tl.load(v_ptr + src + j, mask=in_half, other=0.0)
    v2 = tl.load(v_ptr + src + HALF + j, mask=in_half, other=0.0)
    tl.store(v_cache_ptr + dst + j, v1.to(out_ty), mask=in_half)
    tl.store(v_cache_ptr + dst + HALF + j, v2.to(out_ty), mask=in_half)


def launch_context_kv(
    feats: torch.Tensor,  # [N, n_taps * hidden] float
    rows: torch.Tensor,  # [N] int64
    pos: torch.Tensor,  # [N] int64
    weights: ContextKVWeights,
    inv_freq: torch.Tensor,  # [head_dim / 2] float32
    k_cache: torch.Tensor,  # [n_layers, S, kv_heads, Lmax, head_dim], written in place
    v_cache: torch.Tensor,  # [n_layers, S, kv_heads, Lmax, head_dim], written in place
    attention_scaling: float = 1.0,
) -> None:
    """Projections in torch, then `context_kv_kernel`; inputs are assumed validated."""
    k, v = project_context_kv(context_features(feats, weights), weights)  # [N, L, KVH, D]
    n, layers, kv_heads, head_dim = k.shape
    half = head_dim // 2
    grid = (n, layers * kv_heads)
    context_kv_kernel[grid](
        k.contiguous(), v.contiguous(), weights.k_norm_weight.contiguous(),
        inv_freq.contiguous(), rows.contiguous(), pos.contiguous(),
        layers, kv_heads, k_cache.shape[1], k_cache.shape[3],
        float(weights.eps), float(attention_scaling), k_cache, v_cache,
        HALF=half, BLOCK_HALF=next_pow2(half),
    )
