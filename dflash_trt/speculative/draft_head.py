"""Draft logits from the target's lm_head: over the whole vocabulary, or over the drafter's draft
vocabulary only.

A drafter may ship a draft vocabulary (`draft_vocab.json`, models/drafter.py): the token ids it was
trained to propose, the most frequent ones of its training data (FR-Spec, arXiv 2502.14856). On a
small target the drafter's lm_head GEMM (block_size - 1 positions x the whole vocabulary) is the
largest part of a draft forward; over the draft vocabulary's rows it shrinks by vocab / K.

The restricted logits are placed in a full-vocabulary tensor with -inf elsewhere, so the argmax
proposal, the confidence truncation (draft_len.py) and rejection sampling's q (zero outside the
set, which keeps Leviathan et al.'s acceptance exact) need no change. Verification never uses this
head, so output is unchanged.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from dflash_trt.engine import Target
from dflash_trt.errors import ConfigError
from dflash_trt.models.cpu_linear import any_packed, prepack

log = logging.getLogger(__name__)


class DraftHead:
    """Callable: final-normed drafter hidden states [B, K, H] -> draft logits [B, K, vocab]."""

    def __init__(self, target: Target, vocab_ids: torch.Tensor | None) -> None:
        self.target = target
        self.ids: torch.Tensor | None = None  # [K] int64 on the target's device
        self.weight: torch.Tensor | None = None  # [K, H] the lm_head rows of `ids`
        self._linear: nn.Linear | None = None  # over `weight`: prepacked like the target's linears when those are
        self.vocab_size = target.info.vocab_size
        if vocab_ids is None:
            return
        weight = target.head_weight()
        if weight is None:
            log.info("draft vocabulary not used: the target's lm_head is not one local matrix (vocab-parallel); "
                     "drafting over the whole vocabulary")
            return
        if int(vocab_ids.max()) >= weight.shape[0]:
            raise ConfigError(f"the draft vocabulary names token id {int(vocab_ids.max())} but the target's lm_head "
                              f"has {weight.shape[0]} rows")
        self.ids = vocab_ids.to(device=weight.device, dtype=torch.long)
        self.weight = weight.detach()[self.ids].contiguous()
        self._linear = nn.Linear(weight.shape[1], self.ids.numel(), bias=False, device="meta")
        self._linear.weight = nn.Parameter(self.weight, requires_grad=False)
        if any_packed(target):  # --cpu-kernels (models/cpu_linear.py): the same packed forward
            prepack(self._linear)
        log.info("drafting over a %d-token draft vocabulary (of %d)", self.ids.numel(), self.vocab_size)

    @property
    def restricted(self) -> bool:
        return self.weight is not None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._linear is None:
            return self.target.head(hidden)
        sub = self._linear(hidden)  # [B, K, len(ids)]
        logits = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))
        logits[..., self.ids] = sub
        return logits
