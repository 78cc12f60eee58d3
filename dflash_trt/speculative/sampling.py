"""Sampling parameters and the pure functions that turn logits into token draws.

Randomness is explicit: callers draw uniforms from each request's own seeded generator and pass
them in, so every function here is deterministic and testable with hand-built inputs, and a
request's output depends only on its own seed (never on which other requests share its batch).
Tokens are drawn by inverse-CDF sampling in float64.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dflash_trt.errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    max_new_tokens: int | None = None  # None = until EOS or the context is full
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings (need a tokenizer)
    ignore_eos: bool = False
    extra: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InputError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise InputError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.max_new_tokens is not None and (
            not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1
        ):
            raise InputError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise InputError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InputError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InputError(f"stop strings must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
