"""Training data, step 2: target features and the anchored blocks a training step sees.

`compute_features` runs the frozen target once over whole sequences (fresh cache, no grad) and
returns the tapped hidden states; regeneration already records the same taps on the fly
(regen.TapRecorder), so this pass is the reference and the route for token-only data.

`make_batch` draws the DFlash training blocks (paper Sec. 3; FACTS.md "Training"): for each chosen
sequence, random anchors s inside the response; the block at s is [tok[s], mask x (bs-1)] at
positions s..s+bs-1, it sees the context features of positions < s only, and slot j predicts
tok[s+j] -- exactly what the drafter sees at inference when the block starts at s.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_trt.errors import InputError
from dflash_trt.train.regen import FEATURE_DTYPE, Sample

IGNORE = -100  # target id of slots past the end of a sequence


@torch.no_grad()
def compute_features(target, sequences: list[torch.Tensor], target_layer_ids: tuple[int, ...],
                     batch_size: int = 8) -> list[torch.Tensor]:
    """Taps of positions 0..L-2 of every sequence ([L] int64 each) -> [L-1, n_taps*H] float16 each."""
    out: list[torch.Tensor] = []
    for start in range(0, len(sequences), batch_size):
        chunk = [s[:-1] for s in sequences[start:start + batch_size]]
        if any(c.numel() == 0 for c in chunk):
            raise InputError("every sequence needs at least 2 tokens")
        width = max(c.shape[0] for c in chunk)
        cache = target.new_cache(len(chunk), width)
        rows = cache.add_rows(len(chunk))
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        pos = torch.full((len(chunk), width), cache.dead_slot, dtype=torch.long)
        for i, c in enumerate(chunk):
            ids[i, : c.shape[0]] = c
            pos[i, : c.shape[0]] = torch.arange(c.shape[0])
        dev = target.device
        res = target.forward(cache, slice(rows.start, rows.stop), ids.to(dev), pos.to(dev), tuple(target_layer_ids),
                             logit_index=torch.zeros(len(chunk), 1, dtype=torch.long, device=dev))
        out.extend(res.target_hidden[i, : c.shape[0]].to(device="cpu", dtype=FEATURE_DTYPE) for i, c in enumerate(chunk))
    return out


@dataclass(frozen=True)
class Batch:
    """Anchored blocks for one training step (B sequences x A anchors, padded)."""

    ctx_hidden: torch.Tensor  # [B, C, n_taps * H] features of positions 0..C-1 (zeros past a row's end)
    ctx_valid: torch.Tensor  # [B, C] bool
    anchors: torch.Tensor  # [B, A] int64 block start positions s
    anchor_valid: torch.Tensor  # [B, A] bool (False: padding anchor, no loss)
    block_ids: torch.Tensor  # [B, A, bs] [tok[s], mask, ..., mask]
    targets: torch.Tensor  # [B, A, bs - 1] tok[s + 1 .. s + bs - 1], IGNORE past the end
    # the target's own distribution at each supervised slot (None when the data has none)
    teacher_ids: torch.Tensor | None = None  # [B, A, bs - 1, k] int64
    teacher_logprobs: torch.Tensor | None = None  # [B, A, bs - 1, k] float32 (-inf past the end)

    @property
    def block_size(self) -> int:
        return self.block_ids.shape[-1]


def anchor_range(sample: Sample) -> tuple[int, int]:
    """Valid anchors [lo, hi): inside the response, with at least one token after the anchor."""
    return sample.prompt_len, sample.tokens.shape[0] - 1


def make_batch(samples: list[Sample], anchors_per_seq: int, block_size: int, mask_token_id: int,
               generator: torch.Generator) -> Batch:
    """Draw up to `anchors_per_seq` distinct anchors per sample (uniform over anchor_range)."""
    if block_size < 2 or anchors_per_seq < 1:
        raise InputError(f"need block_size >= 2 and anchors_per_seq >= 1, got {block_size}, {anchors_per_seq}")
    chosen: list[torch.Tensor] = []
    for s in samples:
        lo, hi = anchor_range(s)
        if hi <= lo:
            raise InputError(f"sample {s.index} has no response token to anchor on")
        perm = torch.randperm(hi - lo, generator=generator)[:anchors_per_seq]
        chosen.append(torch.sort(perm).values + lo)
    b, a = len(samples), max(c.shape[0] for c in chosen)
    width = max(int(c.max()) for c in chosen)  # context needed: positions < the last anchor
    feat = samples[0].target_hidden.shape[-1]
    ctx = torch.zeros(b, max(width, 1), feat, dtype=FEATURE_DTYPE)
    ctx_valid = torch.zeros(b, max(width, 1), dtype=torch.bool)
    anchors = torch.zeros(b, a, dtype=torch.long)
    anchor_valid = torch.zeros(b, a, dtype=torch.bool)
    block_ids = torch.full((b, a, block_size), mask_token_id, dtype=torch.long)
    targets = torch.full((b, a, block_size - 1), IGNORE, dtype=torch.long)
    with_teacher = all(s.topk_ids is not None for s in samples)
    if with_teacher:
        k = samples[0].topk_ids.shape[1]
        t_ids = torch.zeros(b, a, block_size - 1, k, dtype=torch.long)
        t_lp = torch.full((b, a, block_size - 1, k), float("-inf"))
    for i, (s, c) in enumerate(zip(samples, chosen)):
        n = int(c.max())
        ctx[i, :n] = s.target_hidden[:n]
        ctx_valid[i, :n] = True
        anchors[i, : c.shape[0]] = c
        anchor_valid[i, : c.shape[0]] = True
        length = s.tokens.shape[0]
        block_ids[i, : c.shape[0], 0] = s.tokens[c]
        for j in range(1, block_size):
            idx = c + j
            ok = idx < length
            targets[i, : c.shape[0], j - 1][ok] = s.tokens[idx[ok]]
            if with_teacher:  # token idx was chosen from the distribution at response index idx - prompt_len
                r = idx[ok] - s.prompt_len
                t_ids[i, : c.shape[0], j - 1][ok] = s.topk_ids[r].long()
                t_lp[i, : c.shape[0], j - 1][ok] = s.topk_logprobs[r].float()
    if with_teacher:
        return Batch(ctx, ctx_valid, anchors, anchor_valid, block_ids, targets, t_ids, t_lp)
    return Batch(ctx, ctx_valid, anchors, anchor_valid, block_ids, targets)
