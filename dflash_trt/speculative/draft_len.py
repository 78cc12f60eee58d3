"""How many of a block's drafts to verify: per row by drafter confidence, per step by batch size.

Verifying a shorter prefix of the draft is still exact (the target checks every token it keeps;
a row that verifies k drafts commits between 1 and k + 1 tokens), so both rules below only trade
speed, never output:

- confidence: the drafter's top-1 probability at draft position j, p_j, estimates the chance that
  draft j matches the target given drafts 1..j-1 did; the chance that drafts 1..j are all accepted
  is about prod_{i<=j} p_i. A row keeps its drafts while that product stays >= `threshold`
  (threshold 0 keeps the whole block). On hardware where a K-token verify costs much more than a
  1-token step (CPUs: ~2x at K = 8), not paying for drafts that will be rejected is most of the win
  (prompt-lookup decoding gets it for free by proposing nothing when it has nothing).
- batch size: with many rows in flight the target forward stops being memory-bound and extra
  verified tokens cost real compute, so speculation should shrink as concurrency grows.
  `draft_len_schedule` uses TensorRT-LLM's convention (`DecodingBaseConfig.draft_len_schedule` in
  tensorrt_llm/llmapi/llm_args.py): {batch-size threshold: draft length}; a batch of size b uses
  the entry with the largest threshold <= b; the entry at 1 must exist; 0 turns speculation off.
"""
from __future__ import annotations

import torch

from dflash_trt.errors import ConfigError


def check_schedule(schedule: tuple[tuple[int, int], ...], max_drafts: int) -> None:
    """Thresholds >= 1, unique, one at 1; lengths in [0, max_drafts]."""
    keys = [k for k, _ in schedule]
    if not schedule or 1 not in keys or len(set(keys)) != len(keys) or min(keys) < 1:
        raise ConfigError(f"draft_len_schedule needs unique batch-size thresholds >= 1 including 1, got {dict(schedule)}")
    bad = [v for _, v in schedule if not 0 <= v <= max_drafts]
    if bad:
        raise ConfigError(f"draft_len_schedule lengths must be in [0, {max_drafts}] (block size - 1), got {bad}")


def scheduled_drafts(schedule: tuple[tuple[int, int], ...] | None, batch: int, max_drafts: int) -> int:
    """Drafts per row allowed at this batch size (max_drafts without a schedule)."""
    if not schedule:
        return max_drafts
    return min([v for k, v in sorted(schedule) if k <= batch][-1], max_drafts)


def confident_lengths(draft_logits: torch.Tensor, threshold: float, cap: int) -> torch.Tensor:
    """draft_logits: [B, K, V] -> [B] int64 drafts to verify per row (<= cap): the longest prefix
    whose cumulative product of top-1 probabilities stays >= threshold."""
    b, k = draft_logits.shape[:2]
    cap = min(cap, k)
    if threshold <= 0.0:
        return torch.full((b,), cap, dtype=torch.long, device=draft_logits.device)
    top = torch.softmax(draft_logits[:, :cap].float(), dim=-1).amax(-1)  # [B, cap]
    keep = torch.cumprod(top, dim=-1) >= threshold  # monotone: once False, stays False
    return keep.long().sum(-1)
