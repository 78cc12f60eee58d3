"""Batched acceptance: hand-built cases for the reference, Triton (interpreted) vs reference."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import i64, needs_interpreter

from dflash_trt.errors import InputError
from dflash_trt.speculative.verify import accept_tokens, accept_tokens_ref  # the dispatch lives with the rule

# name, draft [B, K], target [B, K + 1], draft_lens [B], expected accepted [B]
CASES = [
    ("ragged", [[1, 2, 3, 4], [1, 9, 3, 4], [5, 6, 7, 8], [1, 2, 3, 4]],
     [[1, 2, 3, 4, 50], [1, 2, 3, 4, 51], [5, 6, 0, 8, 52], [1, 2, 3, 4, 53]],
     [4, 4, 4, 2], [4, 1, 2, 2]),
    ("zero_accepted", [[7, 2], [8, 3]], [[1, 2, 60], [2, 3, 61]], [2, 2], [0, 0]),
    ("all_accepted", [[1, 2, 3], [4, 5, 6]], [[1, 2, 3, 70], [4, 5, 6, 71]], [3, 3], [3, 3]),
    ("single_row", [[3, 1, 4, 1, 5]], [[3, 1, 4, 2, 5, 9]], [5], [3]),
    ("empty_drafts", [[1, 2], [1, 2]], [[1, 2, 80], [1, 2, 81]], [0, 1], [0, 1]),
    ("k_zero", [[], [], []], [[11], [12], [13]], [0, 0, 0], [0, 0, 0]),
]


def _inputs(draft, target, dlens):
    b = len(target)
    d = i64(draft).reshape(b, len(target[0]) - 1)
    return d, i64(target), i64(dlens), i64([10 * r for r in range(b)])


@pytest.mark.parametrize("name,draft,target,dlens,expected", CASES, ids=[c[0] for c in CASES])
def test_reference_cases(name, draft, target, dlens, expected):
    d, t, dl, sp = _inputs(draft, target, dlens)
    out = accept_tokens_ref(d, t, dl, sp)
    acc = i64(expected)
    assert torch.equal(out.accepted, acc)
    assert torch.equal(out.bonus, t.gather(1, acc[:, None]).squeeze(1))
    assert torch.equal(out.new_pos, sp + acc + 1)


@needs_interpreter
@pytest.mark.parametrize("name,draft,target,dlens,expected", CASES, ids=[c[0] for c in CASES])
def test_triton_matches_reference_cases(name, draft, target, dlens, expected):
    d, t, dl, sp = _inputs(draft, target, dlens)
    ref = accept_tokens(d, t, dl, sp)
    tri = accept_tokens(d, t, dl, sp, force_triton=True)
    for field in ("accepted", "bonus", "new_pos"):
        assert torch.equal(getattr(tri, field), getattr(ref, field)), field
    assert torch.equal(tri.accepted, i64(expected))


@needs_interpreter
@pytest.mark.parametrize("batch,k", [(19, 15), (3, 5)])
def test_triton_matches_reference_random(batch, k):
    g = torch.Generator().manual_seed(batch * 100 + k)
    target = torch.randint(0, 3, (batch, k + 1), generator=g)  # tiny vocab: long matches
    draft = torch.where(torch.rand(batch, k, generator=g) < 0.8, target[:, :k],
                        torch.randint(0, 3, (batch, k), generator=g))
    dlens = torch.randint(0, k + 1, (batch,), generator=g)
    start = torch.randint(0, 1000, (batch,), generator=g)
    ref = accept_tokens(draft, target, dlens, start)
    tri = accept_tokens(draft, target, dlens, start, force_triton=True)
    assert torch.equal(tri.accepted, ref.accepted)
    assert torch.equal(tri.bonus, ref.bonus)
    assert torch.equal(tri.new_pos, ref.new_pos)


BAD = [
    ("int32_draft", lambda d, t, dl, sp: (d.int(), t, dl, sp), "draft_tokens must have dtype"),
    ("target_width", lambda d, t, dl, sp: (d, t[:, :-1], dl, sp), "target_tokens must be"),
    ("lens_too_long", lambda d, t, dl, sp: (d, t, dl + 5, sp), "draft_lens must lie"),
    ("lens_negative", lambda d, t, dl, sp: (d, t, dl - 5, sp), "draft_lens must lie"),
    ("start_shape", lambda d, t, dl, sp: (d, t, dl, sp[:1]), "start_pos must be"),
    ("draft_1d", lambda d, t, dl, sp: (d[0], t, dl, sp), "draft_tokens must have 2 dims"),
    ("not_tensor", lambda d, t, dl, sp: (d.tolist(), t, dl, sp), "must be a torch.Tensor"),
]


@pytest.mark.parametrize("force_triton", [False, True])
@pytest.mark.parametrize("name,mutate,message", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_raise(name, mutate, message, force_triton):
    d, t, dl, sp = _inputs([[1, 2, 3], [1, 2, 3]], [[1, 2, 3, 4], [1, 2, 3, 4]], [3, 3])
    with pytest.raises(InputError, match=message):
        accept_tokens(*mutate(d, t, dl, sp), force_triton=force_triton)
