"""The pure functions that turn logits into token draws (the parameters: engine.SamplingParams).

Randomness is explicit: callers draw uniforms from each request's own seeded generator and pass
them in, so every function here is deterministic and testable with hand-built inputs, and a
request's output depends only on its own seed (never on which other requests share its batch).
Tokens are drawn by inverse-CDF sampling in float64.
"""
from __future__ import annotations

import torch


def new_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one request (seeded, or from fresh OS entropy)."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def processed_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor) -> torch.Tensor:
    """Target/drafter distribution after temperature, top-k, then top-p (nucleus) filtering.

    logits: [B, T, V]; temperature, top_k, top_p: [B] (temperature > 0 for every row here).
    Returns float64 probabilities [B, T, V].
    top-k keeps the k largest logits; top-p keeps the smallest set of most probable tokens whose
    mass reaches top_p (the token that crosses top_p is kept).
    """
    scores = logits.to(torch.float64) / temperature.to(torch.float64)[:, None, None]
    vocab = scores.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))  # [B]
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
    rank = torch.arange(vocab, device=scores.device)
    keep = rank[None, None, :] < k[:, None, None]  # top-k in sorted order
    sorted_scores = sorted_scores.masked_fill(~keep, float("-inf"))
    sorted_probs = torch.softmax(sorted_scores, dim=-1)
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly before each token
    keep = keep & (before < top_p.to(torch.float64)[:, None, None])  # [B, T, V] (keep was [B, 1, V])
    sorted_probs = sorted_probs * keep
    sorted_probs = sorted_probs / sorted_probs.sum(-1, keepdim=True)
    return torch.zeros_like(sorted_probs).scatter(-1, order, sorted_probs)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one token per distribution. probs: [..., V] (rows sum to 1); uniforms: [...] in [0, 1).
    Returns int64 [...]. Tokens of zero probability are never drawn."""
    cdf = probs.to(torch.float64).cumsum(-1)
    u = uniforms.to(torch.float64)[..., None] * cdf[..., -1:]
    idx = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    idx = idx.clamp(max=probs.shape[-1] - 1)
    # Guard against landing on a zero-probability token through rounding at the top of the cdf.
    last_nonzero = (probs > 0).to(torch.int64).cumsum(-1).argmax(-1)
    return torch.minimum(idx, last_nonzero)
