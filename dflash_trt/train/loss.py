"""Training forward and loss of the DFlash drafter (paper Sec. 3; FACTS.md "Training").

Many blocks of one sequence go through the drafter in ONE forward: the queries are all blocks'
slots, the keys are the sequence's fused context (computed once) followed by all blocks' slots,
and a block-sparse boolean mask gives each block what it would see at inference -- the context of
positions strictly before its anchor, and its own slots bidirectionally (the drafter's causal /
sliding-window options are honoured the same way `layers.attention_mask` does at inference).
The forward reuses the drafter's own modules and weights; it replaces only the ragged KV cache.

Loss: cross-entropy of the target's (frozen) lm_head on the bs-1 mask slots, slot k weighted by
w_k = exp(-(k-1)/gamma) (gamma 7 for block 16, 5 for block 10, 4 for block 8), so the early
slots -- which decide the acceptance length -- dominate. With `kd_weight` > 0 and teacher data
in the batch, the per-slot loss mixes in knowledge distillation (Hinton et al., 2015; for
drafters, DistillSpec arXiv 2310.08461): the cross-entropy against the target's own top-k
probabilities, -sum_k p_k log q_k, with p_k the target's full-vocabulary probabilities of its
top-k tokens (the small mass outside the top-k is left out). For a one-hot teacher it equals the
hard-label cross-entropy.

Slot weights, `weighting`:
- "paper": w_k = exp(-(k-1)/gamma) as above.
- "prefix": w_k = exp(-(k-1)/gamma) * prod_{j<k} q_j(y_j), the paper's weight times the drafter's own
  (detached) probability of getting every earlier slot of its block right. Verification accepts slot k
  only after slots 1..k-1 matched, so a slot behind a likely miss buys little acceptance; the factor moves
  the loss onto the slots that decide the acceptance length of this block. sum_k prod_{j<=k} q_j is the
  block's expected number of accepted drafts under the drafter's own probabilities; its gradient weights
  log q_k by prod_{j<=k} q_j (1 + q_{k+1} + q_{k+1} q_{k+2} + ...). The prefix weight keeps the factor
  prod_{j<k} q_j, the chance that slot k is reached at all, and leaves q_k to the cross-entropy, which
  (unlike the expected count) still pushes a slot the drafter gets wrong. A slot whose target lies
  outside the loss vocabulary counts as a certain miss (the draft vocabulary cannot propose it), so the
  slots after it get weight 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.models.layers import apply_rope, attend, rope_cos_sin
from dflash_trt.train.features import IGNORE, Batch

GAMMA_POINTS = ((8, 4.0), (10, 5.0), (16, 7.0))  # (block_size, gamma) from the paper
WEIGHTINGS = ("paper", "prefix")  # slot weights of the loss (module docstring)


def default_gamma(block_size: int) -> float:
    """The paper's gamma at 8/10/16, linear in between and extrapolated beyond (at least 1)."""
    pts = GAMMA_POINTS
    if block_size <= pts[1][0]:
        (x0, y0), (x1, y1) = pts[0], pts[1]
    else:
        (x0, y0), (x1, y1) = pts[1], pts[2]
    return max(1.0, y0 + (block_size - x0) * (y1 - y0) / (x1 - x0))


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[bs - 1] weights of slots k = 1..bs-1: exp(-(k-1)/gamma)."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def block_visibility(anchors: torch.Tensor, ctx_valid: torch.Tensor, block_size: int, causal: bool,
                     sliding_window: int | None) -> torch.Tensor:
    """anchors: [B, A]; ctx_valid: [B, C] -> mask [B, 1, A*bs, C + A*bs] (True = may attend)."""
    b, a = anchors.shape
    c = ctx_valid.shape[1]
    offs = torch.arange(block_size)
    q_pos = (anchors[:, :, None] + offs).reshape(b, a * block_size)  # [B, Q]
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, Q]
    ctx_pos = torch.arange(c)
    ctx_vis = (ctx_pos[None, None, :] < q_anchor[:, :, None]) & ctx_valid[:, None, :]  # [B, Q, C]
    blk = torch.arange(a).repeat_interleave(block_size)  # [Q] block of each slot
    blk_vis = (blk[:, None] == blk[None, :]).expand(b, -1, -1)  # [B, Q, Q]
    k_pos = q_pos[:, None, :]  # [B, 1, Q] positions of the block keys
    if causal:
        blk_vis = blk_vis & (k_pos <= q_pos[:, :, None])
    if sliding_window is not None:
        ctx_vis = ctx_vis & ((q_pos[:, :, None] - ctx_pos[None, None, :]) < sliding_window)
        blk_vis = blk_vis & ((q_pos[:, :, None] - k_pos) < sliding_window)
        if not causal:
            blk_vis = blk_vis & ((k_pos - q_pos[:, :, None]) < sliding_window)
    return torch.cat([ctx_vis, blk_vis], dim=-1)[:, None]


def train_forward(drafter: DFlashDrafter, ctx_hidden: torch.Tensor, ctx_valid: torch.Tensor,
                  block_embeds: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """The drafter over many blocks at once.

    ctx_hidden: [B, C, n_taps*H] features of positions 0..C-1; ctx_valid: [B, C];
    block_embeds: [B, A*bs, H] target embeddings of every block's slots; anchors: [B, A].
    Returns final-normed hidden states [B, A*bs, H] (apply the target's lm_head).
    """
    dtype = drafter.fc.weight.dtype
    b, q_len, _ = block_embeds.shape
    bs = q_len // anchors.shape[1]
    c = ctx_hidden.shape[1]
    q_pos = (anchors[:, :, None] + torch.arange(bs)).reshape(b, q_len)  # [B, Q]
    ctx_pos = torch.arange(c).expand(b, c)  # [B, C]
    rope_block = rope_cos_sin(q_pos, drafter.inv_freq, drafter.rope_scaling, dtype)
    rope_ctx = rope_cos_sin(ctx_pos, drafter.inv_freq, drafter.rope_scaling, dtype)
    ctx = drafter.fuse(ctx_hidden)
    x = block_embeds.to(dtype)
    for layer in drafter.layers:
        attn = layer.self_attn
        mask = block_visibility(anchors, ctx_valid, bs, attn.causal, attn.sliding_window)
        h = layer.input_layernorm(x)
        q = attn.q_norm(attn.q_proj(h).view(b, q_len, attn.num_heads, attn.head_dim)).transpose(1, 2)
        q = apply_rope(q, *rope_block)
        k_ctx, v_ctx = attn.kv(ctx, *rope_ctx)
        k_blk, v_blk = attn.kv(h, *rope_block)
        out = attend(q, torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2), mask,
                     attn.head_dim ** -0.5)
        x = x + attn.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)


@dataclass(frozen=True)
class LossOutput:
    loss: torch.Tensor  # [] weighted mean cross-entropy (differentiable)
    accuracy: float  # top-1 accuracy of slot 1 (the first draft)
    accept_len: float  # mean (leading correct drafts + 1) per block: tau if drafts were verified as-is
    tokens: int  # supervised slots


def distill_ce(logq: torch.Tensor, teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """logq: [N, V] student log-probs; teacher_ids, teacher_logprobs: [N, k] -> [N] -sum_k p_k logq[id_k]."""
    p = teacher_logprobs.exp()  # -inf (no teacher entry) -> 0
    return -(p * logq.gather(-1, teacher_ids)).sum(-1)


@dataclass(frozen=True)
class TrainVocab:
    """A vocabulary subset for the training loss (FR-Spec, arXiv 2502.14856, drafts over the most
    frequent tokens; here only the loss is restricted, to cut the lm_head GEMM and softmax on CPU).
    Tokens outside it are dropped from the hard-label loss and from the teacher's top-k."""

    ids: torch.Tensor  # [K] int64 token ids, sorted
    weight: torch.Tensor  # [K, H] the frozen lm_head rows of `ids`
    index: torch.Tensor  # [V] int64: position of each token in `ids`, -1 outside

    @classmethod
    def build(cls, head_weight: torch.Tensor, ids: torch.Tensor) -> "TrainVocab":
        ids = torch.unique(ids.long())
        index = torch.full((head_weight.shape[0],), -1, dtype=torch.long)
        index[ids] = torch.arange(ids.numel())
        return cls(ids, head_weight[ids].detach().contiguous(), index)


def prefix_weights(hit_prob: torch.Tensor) -> torch.Tensor:
    """hit_prob: [..., S] probability of each slot's target token -> [..., S] product of the
    probabilities of the slots before each one (1 for the first slot)."""
    ones = torch.ones_like(hit_prob[..., :1])
    return torch.cumprod(torch.cat([ones, hit_prob[..., :-1]], dim=-1), dim=-1)


def block_loss(drafter: DFlashDrafter, target, batch: Batch, gamma: float, kd_weight: float = 0.0,
               vocab: TrainVocab | None = None, weighting: str = "paper") -> LossOutput:
    """Weighted (CE + KD) loss of one Batch. `target` provides frozen `embed` and `head`.

    With `vocab`, logits and log-probs are over that subset only (training speed); metrics then
    count a slot correct when the subset's argmax is the target token. `weighting`: the slot
    weights (module docstring)."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    b, a, bs = batch.block_ids.shape
    with torch.no_grad():
        embeds = target.embed(batch.block_ids.reshape(b, a * bs))  # [B, A*bs, H]
    hidden = train_forward(drafter, batch.ctx_hidden, batch.ctx_valid, embeds, batch.anchors)
    # mask slots only, as one contiguous [N, H] matrix: the lm_head is then a single GEMM
    # (a strided 4-D input sends F.linear down a batched path ~8x slower on CPU)
    hidden = hidden.view(b, a, bs, -1)[:, :, 1:].reshape(b * a * (bs - 1), -1)  # [N, H]
    targets = batch.targets.masked_fill(~batch.anchor_valid[:, :, None], IGNORE).reshape(-1)  # [N]
    t_ids, t_lp = batch.teacher_ids, batch.teacher_logprobs
    if vocab is None:
        logits = target.head(hidden).float()  # [N, V]
    else:
        logits = F.linear(hidden, vocab.weight.to(hidden.dtype)).float()  # [N, K]
        mapped = vocab.index[targets.clamp_min(0)]
        targets = torch.where((targets == IGNORE) | (mapped < 0), IGNORE, mapped)
        if t_ids is not None:
            t_map = vocab.index[t_ids]
            t_lp = t_lp.masked_fill(t_map < 0, float("-inf"))
            t_ids = t_map.clamp_min(0)
    logq = torch.log_softmax(logits, dim=-1)  # [N, V or K], shared by CE and KD
    ignore = targets == IGNORE
    loss_n = -logq.gather(-1, targets.clamp_min(0)[:, None])[:, 0].masked_fill(ignore, 0.0)  # [N]
    # prefix weights: q(target) of the hard label (before KD mixes in), 0 where the target is unpredictable
    hit_prob = torch.exp(-loss_n.detach()).masked_fill(ignore, 0.0) if weighting == "prefix" else None  # [N]
    if kd_weight > 0:
        if t_ids is None:
            raise ValueError("kd_weight > 0 needs teacher distributions in the data (regenerate with topk)")
        k = t_ids.shape[-1]
        kd = distill_ce(logq, t_ids.reshape(-1, k), t_lp.reshape(-1, k)).masked_fill(ignore, 0.0)
        loss_n = (1 - kd_weight) * loss_n + kd_weight * kd
    valid = (~ignore).float().view(b, a, bs - 1)
    weights = position_weights(bs, gamma)[None, None, :] * valid
    if hit_prob is not None:
        weights = weights * prefix_weights(hit_prob.view(b, a, bs - 1))
    loss = (loss_n.view(b, a, bs - 1) * weights).sum() / weights.sum().clamp_min(1e-9)
    with torch.no_grad():
        correct = ((logits.argmax(-1) == targets) & ~ignore).view(b, a, bs - 1)
        blocks = batch.anchor_valid
        lead = torch.cumprod(correct.long(), dim=-1).sum(-1)  # [B, A]
        n_blocks = max(int(blocks.sum()), 1)
        accuracy = float(correct[:, :, 0][blocks].float().sum()) / n_blocks
        accept_len = float((lead[blocks] + 1).float().sum()) / n_blocks
    return LossOutput(loss=loss, accuracy=accuracy, accept_len=accept_len, tokens=int(valid.sum()))


def cosine_schedule(step: int, total: int, warmup: int) -> float:
    """LR multiplier: linear warmup over `warmup` steps, then cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def wsd_schedule(step: int, total: int, warmup: int, decay: int) -> float:
    """LR multiplier, warmup-stable-decay: linear warmup over `warmup` steps, then constant, then a
    (1 - sqrt) cooldown over the last `decay` steps to 0 at `total` (Hägele et al., "Scaling Laws and
    Compute-Optimal Training Beyond Fixed Training Durations", arXiv 2405.18392: constant LR plus a
    cooldown matches cosine, and training can go on from any point of the constant phase)."""
    if step < warmup:
        return (step + 1) / warmup
    start = total - decay
    if step <= start:
        return 1.0
    return 1.0 - math.sqrt(min((step - start) / max(decay, 1), 1.0))
