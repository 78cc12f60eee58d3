"""Numerical building blocks shared by the native target and the DFlash drafter.

RMSNorm (Zhang & Sennrich 2019) and rotary position embeddings in the rotate-half convention
(Su et al. 2021, as in Llama/Qwen3/gpt-oss checkpoints) are the kernels' torch references
(plugins/kernels/reference.py, one floor down, so the fused kernels and the models share one
implementation); here: applying RoPE to [B, H, T, D] heads, the attention mask, and masked
grouped-query attention with optional per-head attention sinks (gpt-oss).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from plugins.kernels.reference import rms_norm, rope_cos_sin, rotate_half  # the primitives, shared with the kernels

__all__ = ["apply_rope", "attend", "attention_mask", "rms_norm", "rope_cos_sin"]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos/sin: [B, T, D]."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


def attention_mask(
    q_pos: torch.Tensor,
    kv_end: int,
    row_end: torch.Tensor | None,
    causal: bool,
    sliding_window: int | None,
) -> torch.Tensor:
    """Boolean visibility [B, 1, T, kv_end] for queries at q_pos [B, T] over slots 0..kv_end-1.

    Slot index == absolute position (see kv_cache). causal: slot <= query position. row_end [B]
    (non-causal drafter): slot < row_end. sliding_window W: query - slot < W (and slot - query < W
    when non-causal), the HF convention.
    """
    slots = torch.arange(kv_end, device=q_pos.device)[None, None, :]  # [1, 1, S]
    qp = q_pos[:, :, None]  # [B, T, 1]
    visible = torch.ones(q_pos.shape[0], q_pos.shape[1], kv_end, dtype=torch.bool, device=q_pos.device)
    if causal:
        visible &= slots <= qp
    if row_end is not None:
        visible &= slots < row_end[:, None, None]
    if sliding_window is not None:
        visible &= (qp - slots) < sliding_window
        if not causal:
            visible &= (slots - qp) < sliding_window
    return visible[:, None]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped-query attention. q: [B, Hq, T, D]; k, v: [B, Hkv, S, D]; mask: [B, 1, T, S] bool;
    sinks: [Hq] learned per-head logits that join the softmax and are then dropped (gpt-oss).
    Returns [B, T, Hq * D]."""
    groups = q.shape[1] // k.shape[1]
    if sinks is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=groups > 1)
    else:
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, Hq, T, S]
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        logits = torch.cat([scores, sink], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        out = torch.matmul(probs.to(v.dtype), v)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)

