"""Pure-torch references for the DFlash decode-hot-path kernels (the numerical oracle), and the
primitives they share with the models (rms_norm, rope_cos_sin, rotate_half: models/layers.py uses
these). The acceptance rule's reference is dflash_trt/speculative/verify.py (accept_prefix), which
also dispatches the acceptance kernel.

Glossary (DFlash paper, arXiv 2602.06036): a block has K + 1 slots; slot 0 holds the last
committed token, slots 1..K the drafter's proposals. The target verifies the block and picks a
token at every slot; the longest prefix of drafts that matches is accepted (tau = accepted + 1
tokens are committed per step, the +1 being the target's bonus token at slot `accepted`).
"""
from __future__ import annotations

import torch

from .contracts import ContextKVWeights, PackedTaps, check_context_kv_inputs, check_pack_inputs


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D]; weight: [D]. Computed in float32 like the HF reference, cast back."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [B, T] -> cos, sin: [B, T, D] (frequencies duplicated over both halves)."""
    freqs = positions[..., None].to(torch.float32) * inv_freq.to(torch.float32)  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def pack_taps_ref(
    taps: torch.Tensor,  # [n_taps, batch, T, hidden] float: tapped hidden states of the verify
    accepted: torch.Tensor,  # [batch] int64
) -> PackedTaps:
    """Concatenate taps along features (tap-major) and zero every slot past accepted + 1."""
    n_taps, batch, t, hidden = check_pack_inputs(taps, accepted)
    counts = accepted + 1
    packed = taps.permute(1, 2, 0, 3).reshape(batch, t, n_taps * hidden)
    keep = torch.arange(t, device=taps.device)[None, :] < counts[:, None]  # [batch, T]
    packed = packed.masked_fill(~keep[:, :, None], 0)
    return PackedTaps(packed=packed, counts=counts)


def context_features(
    feats: torch.Tensor,  # [N, n_taps * hidden] float
    weights: ContextKVWeights,
) -> torch.Tensor:  # [N, hidden]
    """ctx = hidden_norm(fc(feats)), the drafter's view of the committed target states."""
    return rms_norm(feats @ weights.fc_weight.T, weights.hidden_norm_weight, weights.eps)


def project_context_kv(
    ctx: torch.Tensor,  # [N, hidden]
    weights: ContextKVWeights,
) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v of every draft layer from one matmul each: both [N, n_layers, kv_heads, head_dim]."""
    n, layers = ctx.shape[0], weights.n_layers
    shape = (n, layers, weights.num_kv_heads, weights.head_dim)
    k = ctx @ weights.k_proj_weight.reshape(-1, weights.hidden).T
    v = ctx @ weights.v_proj_weight.reshape(-1, weights.hidden).T
    return k.reshape(shape), v.reshape(shape)


def write_context_kv_ref(
    feats: torch.Tensor,  # [N, n_taps * hidden] float: packed taps of committed positions
    rows: torch.Tensor,  # [N] int64: cache row (sequence slot) of each position
    pos: torch.Tensor,  # [N] int64: absolute position = cache slot of each position
    weights: ContextKVWeights,
    inv_freq: torch.Tensor,  # [head_dim / 2] float32
    k_cache: torch.Tensor,  # [n_layers, S, kv_heads, Lmax, head_dim] float, written in place
    v_cache: torch.Tensor,  # [n_layers, S, kv_heads, Lmax, head_dim] float, written in place
    attention_scaling: float = 1.0,
) -> None:
    """Write k_norm + RoPE'd K and plain V of the context into every draft layer's cache."""
    check_context_kv_inputs(feats, rows, pos, weights, inv_freq, k_cache, v_cache)
    k, v = project_context_kv(context_features(feats, weights), weights)
    cos, sin = rope_cos_sin(pos, inv_freq, attention_scaling, k.dtype)  # [N, head_dim]
    for layer in range(weights.n_layers):
        k_l = rms_norm(k[:, layer], weights.k_norm_weight[layer], weights.eps)  # [N, kvH, D]
        k_l = k_l * cos[:, None, :] + rotate_half(k_l) * sin[:, None, :]
        k_cache[layer, rows, :, pos] = k_l.to(k_cache.dtype)
        v_cache[layer, rows, :, pos] = v[:, layer].to(v_cache.dtype)
