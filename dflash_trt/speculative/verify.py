"""Acceptance math for DFlash verification: pure tensor functions, no model inside, and the
dispatch of the batched acceptance kernel (`accept_tokens`: Triton on CUDA, `accept_prefix` here).

Glossary (DFlash paper, arXiv 2602.06036, and Leviathan et al. 2023, arXiv 2211.17192):
- block_size (T): slots drafted per step. Slot 0 holds the last committed token (the previous
  step's bonus), slots 1..T-1 the drafter's proposals; K = T - 1 draft tokens per step.
- target_tokens [B, K+1]: the target's own choice at each verified slot: its argmax (greedy) or a
  sample from its processed distribution (exact sampling).
- accepted (a): length of the longest draft prefix equal to the target's choices, 0..K.
- bonus: the target's choice right after the accepted prefix; always committed, so every step
  commits a + 1 tokens.
- acceptance length tau: mean of a + 1 over steps (tokens per target forward).
- exact sampling: the target samples every slot and a draft is accepted only while it equals the
  sample; this is rejection sampling with a one-hot proposal q, and the output distribution is
  the target's exactly. Rejection sampling with the drafter's soft q (accept with min(1, p/q),
  resample from norm(max(0, p - q))) is also exact and offered as an option.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_trt.errors import InputError
from dflash_trt.speculative.sampling import inverse_cdf
from plugins.kernels import AcceptResult, check_accept_inputs, use_triton


@dataclass(frozen=True)
class Acceptance:
    accepted: torch.Tensor  # [B] int64, 0..K
    bonus: torch.Tensor  # [B] int64, the token committed after the accepted prefix


def _check(draft: torch.Tensor, target_tokens: torch.Tensor, draft_lens: torch.Tensor) -> None:
    if draft.dim() != 2 or target_tokens.dim() != 2:
        raise InputError(f"draft [B, K] and target_tokens [B, K+1] must be 2-D, got {tuple(draft.shape)}, {tuple(target_tokens.shape)}")
    if target_tokens.shape != (draft.shape[0], draft.shape[1] + 1):
        raise InputError(f"target_tokens must be [B, K+1] = [{draft.shape[0]}, {draft.shape[1] + 1}], got {tuple(target_tokens.shape)}")
    if draft_lens.shape != (draft.shape[0],):
        raise InputError(f"draft_lens must be [B] = [{draft.shape[0]}], got {tuple(draft_lens.shape)}")


def accept_prefix(draft: torch.Tensor, target_tokens: torch.Tensor, draft_lens: torch.Tensor) -> Acceptance:
    """Greedy / exact-sampling acceptance.

    draft: [B, K] proposals for slots 1..K; target_tokens: [B, K+1] target choices at slots 0..K
    (the choice at slot i predicts slot i+1); draft_lens: [B] valid drafts per row (0..K).
    """
    _check(draft, target_tokens, draft_lens)
    k = draft.shape[1]
    valid = torch.arange(k, device=draft.device)[None, :] < draft_lens[:, None]  # [B, K]
    match = (draft == target_tokens[:, :k]) & valid
    accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
    bonus = target_tokens.gather(1, accepted[:, None]).squeeze(1)
    return Acceptance(accepted=accepted, bonus=bonus)


def accept_tokens_ref(
    draft_tokens: torch.Tensor,  # [batch, K] int64: proposals for block slots 1..K
    target_tokens: torch.Tensor,  # [batch, K + 1] int64: target's token at slots 0..K
    draft_lens: torch.Tensor,  # [batch] int64: valid drafts per row, 0..K
    start_pos: torch.Tensor,  # [batch] int64: position of block slot 0
) -> AcceptResult:
    """The acceptance kernel's torch reference: accept_prefix plus the next block's position."""
    check_accept_inputs(draft_tokens, target_tokens, draft_lens, start_pos)
    acc = accept_prefix(draft_tokens, target_tokens, draft_lens)
    return AcceptResult(accepted=acc.accepted, bonus=acc.bonus, new_pos=start_pos + acc.accepted + 1)


def accept_tokens(
    draft_tokens: torch.Tensor,  # [batch, K] int64
    target_tokens: torch.Tensor,  # [batch, K + 1] int64
    draft_lens: torch.Tensor,  # [batch] int64
    start_pos: torch.Tensor,  # [batch] int64
    *,
    force_triton: bool = False,
) -> AcceptResult:
    """Batched greedy / exact-sampling acceptance: the Triton kernel (plugins/kernels/triton_accept.py)
    on CUDA or when forced, `accept_tokens_ref` otherwise (plugins.kernels.use_triton decides and
    logs the path once). Inputs are validated before either path runs."""
    check_accept_inputs(draft_tokens, target_tokens, draft_lens, start_pos)
    if not use_triton("accept_tokens", draft_tokens.device, force_triton):
        return accept_tokens_ref(draft_tokens, target_tokens, draft_lens, start_pos)
    from plugins.kernels.triton_accept import launch_accept

    return launch_accept(draft_tokens, target_tokens, draft_lens, start_pos)


def accept_rejection(
    draft: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    draft_lens: torch.Tensor,
    accept_uniforms: torch.Tensor,
    resample_uniforms: torch.Tensor,
) -> Acceptance:
    """Standard speculative rejection sampling with the drafter's soft distribution.

    draft: [B, K] tokens sampled from draft_probs; draft_probs q: [B, K, V]; target_probs p:
    [B, K+1, V]; accept_uniforms: [B, K]; resample_uniforms: [B]. Draft i is accepted while
    u_i * q(x_i) < p(x_i); at the first rejection the bonus is drawn from norm(max(0, p - q)); if
    all valid drafts are accepted it is drawn from p at the next slot.
    """
    _check(draft, target_probs[..., 0].to(torch.int64), draft_lens)
    b, k = draft.shape
    p_x = target_probs[:, :k].gather(-1, draft[..., None]).squeeze(-1)  # [B, K]
    q_x = draft_probs.gather(-1, draft[..., None]).squeeze(-1)  # [B, K]
    valid = torch.arange(k, device=draft.device)[None, :] < draft_lens[:, None]
    ok = (accept_uniforms.to(p_x.dtype) * q_x < p_x) & valid
    accepted = ok.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
    rows = torch.arange(b, device=draft.device)
    p_next = target_probs[rows, accepted]  # [B, V]
    rejected = accepted < draft_lens
    pad = draft_probs.new_zeros(b, 1, target_probs.shape[-1])
    q_pad = torch.cat([draft_probs, pad], dim=1)  # [B, K+1, V]
    residual = (p_next - q_pad[rows, accepted]).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(residual.dtype).tiny), p_next)
    dist = torch.where(rejected[:, None], residual, p_next)
    return Acceptance(accepted=accepted, bonus=inverse_cdf(dist, resample_uniforms))
