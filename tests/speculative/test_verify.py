"""Acceptance math on hand-built tokens and distributions (no model)."""
from __future__ import annotations

import pytest
import torch

from dflash_trt.errors import InputError
from dflash_trt.speculative.verify import accept_prefix, accept_rejection

T = torch.tensor


@pytest.mark.parametrize("draft,target,lens,accepted,bonus", [
    # accept all: bonus is the target's choice after the last draft
    ([[5, 6, 7]], [[5, 6, 7, 8]], [3], [3], [8]),
    # reject at i: accepted = i, bonus = target's choice at i
    ([[5, 9, 7]], [[5, 6, 7, 8]], [3], [1], [6]),
    ([[9, 6, 7]], [[5, 6, 7, 8]], [3], [0], [5]),
    # a later match after a mismatch does not count
    ([[5, 0, 7, 8]], [[5, 6, 7, 8, 1]], [4], [1], [6]),
    # empty draft (K = 0): the bonus is the target's first choice
    ([[]], [[4]], [0], [0], [4]),
    # ragged: fewer valid drafts than K
    ([[5, 6, 7]], [[5, 6, 7, 8]], [1], [1], [6]),
    ([[5, 6, 7]], [[5, 6, 7, 8]], [0], [0], [5]),
    # a batch of rows with different outcomes
    ([[1, 2], [1, 2], [3, 3]], [[1, 2, 9], [1, 5, 9], [4, 3, 9]], [2, 2, 2], [2, 1, 0], [9, 5, 4]),
])
def test_accept_prefix(draft, target, lens, accepted, bonus):
    d = T(draft, dtype=torch.long).reshape(len(draft), -1)
    acc = accept_prefix(d, T(target), T(lens))
    assert acc.accepted.tolist() == accepted
    assert acc.bonus.tolist() == bonus


@pytest.mark.parametrize("draft_shape,target_shape,lens_shape", [
    ((2, 3), (2, 3), (2,)),
    ((2, 3), (1, 4), (2,)),
    ((2, 3), (2, 4), (3,)),
    ((3,), (4,), (1,)),
])
def test_accept_prefix_shape_errors(draft_shape, target_shape, lens_shape):
    with pytest.raises(InputError):
        accept_prefix(torch.zeros(draft_shape, dtype=torch.long), torch.zeros(target_shape, dtype=torch.long),
                      torch.zeros(lens_shape, dtype=torch.long))


def _onehot(idx, vocab=4):
    return torch.nn.functional.one_hot(T(idx), vocab).to(torch.float64)


def test_rejection_accepts_when_target_agrees_and_resamples_residual():
    vocab = 4
    draft = T([[1, 2]])
    q = torch.stack([_onehot([1, 2], vocab)])  # drafter certain
    # target: certain of 1 at slot 0; at slot 1 puts 0.5 on token 2 and 0.5 on token 3
    p = torch.tensor([[[0, 1, 0, 0], [0, 0, 0.5, 0.5], [1, 0, 0, 0]]], dtype=torch.float64)
    # u * q < p: slot 0 always accepted; slot 1 accepted iff u < 0.5
    acc = accept_rejection(draft, q, p, T([2]), T([[0.3, 0.7]], dtype=torch.float64), T([0.1], dtype=torch.float64))
    assert acc.accepted.tolist() == [1]
    assert acc.bonus.tolist() == [3]  # residual max(0, p - q) at slot 1 puts all mass on token 3
    acc = accept_rejection(draft, q, p, T([2]), T([[0.3, 0.2]], dtype=torch.float64), T([0.99], dtype=torch.float64))
    assert acc.accepted.tolist() == [2]
    assert acc.bonus.tolist() == [0]  # all accepted: bonus drawn from p at the next slot


def test_rejection_with_empty_draft_draws_from_target():
    p = torch.tensor([[[0.0, 0.0, 1.0, 0.0]]], dtype=torch.float64)
    acc = accept_rejection(torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, 4, dtype=torch.float64), p,
                           T([0]), torch.zeros(1, 0, dtype=torch.float64), T([0.5], dtype=torch.float64))
    assert acc.accepted.tolist() == [0] and acc.bonus.tolist() == [2]


# ---- draft lengths (speculative/draft_len.py) -----------------------------------------------------

def test_confident_lengths_cut_at_the_cumulative_product():
    from dflash_trt.speculative.draft_len import confident_lengths

    probs = torch.tensor([[[0.9, 0.1], [0.8, 0.2], [0.6, 0.4]],    # cumulative 0.9, 0.72, 0.432
                          [[0.5, 0.5], [0.99, 0.01], [0.99, 0.01]],  # 0.5, ...
                          [[0.99, 0.01], [0.99, 0.01], [0.99, 0.01]]])
    logits = probs.log()
    assert confident_lengths(logits, 0.0, 3).tolist() == [3, 3, 3]
    assert confident_lengths(logits, 0.7, 3).tolist() == [2, 0, 3]
    assert confident_lengths(logits, 0.7, 1).tolist() == [1, 0, 1]
    assert confident_lengths(logits, 0.95, 3).tolist() == [0, 0, 3]


def test_scheduled_drafts_follow_tensorrt_llm_thresholds():
    from dflash_trt.speculative.draft_len import scheduled_drafts

    schedule = ((1, 7), (4, 3), (8, 0))
    assert [scheduled_drafts(schedule, b, 7) for b in (1, 3, 4, 7, 8, 64)] == [7, 7, 3, 3, 0, 0]
    assert scheduled_drafts(None, 5, 7) == 7
    assert scheduled_drafts(((1, 9),), 1, 7) == 7  # never beyond the block
