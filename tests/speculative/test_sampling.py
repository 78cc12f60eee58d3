"""Sampling: the pure functions on hand-built inputs, request validation, seeded determinism and
batch independence (a request's output depends only on its own seed, never on its neighbours).
"""
from __future__ import annotations

import math

import pytest
import torch

from dflash_trt.errors import ContextLengthError, InputError
from dflash_trt.models.target import native_from_hf
from dflash_trt.models.tiny import build_tiny_drafter, build_tiny_target
from dflash_trt.engine import EngineConfig, SamplingParams
from dflash_trt.speculative.decoder import DFlashEngine
from dflash_trt.speculative.sampling import inverse_cdf, processed_probs
from dflash_trt.speculative.verify import accept_prefix, accept_rejection

VOCAB = 32


def _proc(logits, temperature, top_k=0, top_p=1.0):
    """processed_probs for one parameter set over logits [B, T, V]."""
    b = logits.shape[0]
    return processed_probs(logits, torch.full((b,), float(temperature), dtype=torch.float64),
                           torch.full((b,), top_k), torch.full((b,), float(top_p), dtype=torch.float64))


# ---- processed_probs ---------------------------------------------------------------------------
def test_temperature_scales_logits():
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for t in (0.5, 1.0, 2.0):
        torch.testing.assert_close(_proc(logits, t), torch.softmax(logits / t, -1))


@pytest.mark.parametrize("top_k,top_p,kept", [
    (0, 1.0, [0.5, 0.3, 0.15, 0.05]),
    (2, 1.0, [0.5, 0.3, 0, 0]),
    (1, 1.0, [0.5, 0, 0, 0]),
    (9, 1.0, [0.5, 0.3, 0.15, 0.05]),  # k >= vocab: off
    (0, 0.79, [0.5, 0.3, 0, 0]),  # 0.5 + 0.3 reaches 0.79: the third token is not needed
    (0, 0.81, [0.5, 0.3, 0.15, 0]),  # the token that crosses top_p is kept
    (0, 0.5, [0.5, 0, 0, 0]),
    (0, 1e-9, [0.5, 0, 0, 0]),  # tiny top_p: the argmax alone
    (3, 0.7, [0.5, 0.3, 0, 0]),  # top-k first, then top-p over the renormalized top-k mass
])
def test_top_k_top_p(top_k, top_p, kept):
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3], dtype=torch.float64)
    order = [1, 3, 0, 2]  # kept[] is listed by descending probability
    expected = torch.zeros(4, dtype=torch.float64)
    for rank, tok in enumerate(order):
        expected[tok] = kept[rank]
    expected /= expected.sum()
    logits = probs.log().expand(1, 3, 4)  # T = 3 positions: filtering is per position
    torch.testing.assert_close(_proc(logits, 1.0, top_k, top_p), expected.expand(1, 3, 4))


def test_per_row_parameters_in_one_call():
    """Rows of one batch carry their own temperature / top-k / top-p, over several positions."""
    logits = torch.randn(3, 4, 10, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    temp = torch.tensor([0.7, 1.0, 1.3], dtype=torch.float64)
    top_k, top_p = torch.tensor([0, 3, 5]), torch.tensor([1.0, 1.0, 0.6], dtype=torch.float64)
    batched = processed_probs(logits, temp, top_k, top_p)
    for i in range(3):
        alone = _proc(logits[i: i + 1], float(temp[i]), int(top_k[i]), float(top_p[i]))
        torch.testing.assert_close(batched[i: i + 1], alone)
    assert ((batched[1] > 0).sum(-1) == 3).all()
    torch.testing.assert_close(batched.sum(-1), torch.ones(3, 4, dtype=torch.float64))


# ---- inverse_cdf -------------------------------------------------------------------------------
def test_inverse_cdf_boundaries_and_zero_mass():
    probs = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0], dtype=torch.float64)
    u = torch.tensor([0.0, 0.2499, 0.25, 0.9999999999999999, 0.5], dtype=torch.float64)
    assert inverse_cdf(probs.expand(5, 5), u).tolist() == [1, 1, 3, 3, 3]


def test_inverse_cdf_is_exact_on_a_uniform_grid():
    probs = torch.tensor([0.125, 0.0, 0.5, 0.375], dtype=torch.float64)
    n = 800
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    counts = torch.bincount(inverse_cdf(probs.expand(n, 4), u), minlength=4)
    assert counts.tolist() == [100, 0, 400, 300]


# ---- acceptance, table-driven ----------------------------------------------------------------------
@pytest.mark.parametrize("draft,target,lens,accepted,bonus", [
    ([5, 6, 7], [5, 6, 7, 8], 3, 3, 8),  # accept all, bonus from the last slot
    ([5, 6, 7], [5, 9, 7, 8], 3, 1, 9),  # reject at 1
    ([5, 6, 7], [4, 6, 7, 8], 3, 0, 4),  # reject at 0
    ([5, 6, 7], [5, 6, 7, 8], 0, 0, 5),  # empty draft: only the bonus
    ([5, 6, 7], [5, 6, 7, 8], 2, 2, 7),  # fewer valid drafts than slots
])
def test_accept_prefix_table(draft, target, lens, accepted, bonus):
    acc = accept_prefix(torch.tensor([draft]), torch.tensor([target]), torch.tensor([lens]))
    assert (int(acc.accepted[0]), int(acc.bonus[0])) == (accepted, bonus)


def test_accept_prefix_rows_are_independent():
    draft = torch.tensor([[1, 2], [1, 2], [3, 3]])
    target = torch.tensor([[1, 2, 9], [1, 0, 9], [0, 3, 3]])
    acc = accept_prefix(draft, target, torch.tensor([2, 2, 2]))
    assert acc.accepted.tolist() == [2, 1, 0] and acc.bonus.tolist() == [9, 0, 0]


def _onehot(idx, v=4):
    return torch.nn.functional.one_hot(torch.tensor(idx), v).to(torch.float64)


@pytest.mark.parametrize("case", ["q_equals_p", "p_zero", "empty_draft"])
def test_accept_rejection_table(case):
    v = 4
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.25] * 4], dtype=torch.float64)[None]
    draft = torch.tensor([[3, 0]])
    q = p[:, :2].clone()
    lens, u_acc, u_res = torch.tensor([2]), torch.tensor([[0.999, 0.999]], dtype=torch.float64), torch.tensor([0.0], dtype=torch.float64)
    if case == "q_equals_p":  # min(1, p/q) = 1: every draft accepted, bonus drawn from p at slot 2
        acc = accept_rejection(draft, q, p, lens, u_acc, u_res)
        assert (int(acc.accepted[0]), int(acc.bonus[0])) == (2, 0)
    elif case == "p_zero":  # the target gives the first draft no mass: rejected, residual max(0, p - q)
        p2 = p.clone()
        p2[0, 0] = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
        q2 = torch.stack([_onehot(3, v), _onehot(0, v)])[None]
        acc = accept_rejection(draft, q2, p2, lens, u_acc, torch.tensor([0.6], dtype=torch.float64))
        assert (int(acc.accepted[0]), int(acc.bonus[0])) == (0, 1)
    else:  # no valid draft: the bonus is the target's own draw at slot 0
        acc = accept_rejection(draft, q, p, torch.tensor([0]), u_acc, torch.tensor([0.95], dtype=torch.float64))
        assert (int(acc.accepted[0]), int(acc.bonus[0])) == (0, 3)


# ---- request validation --------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [
    dict(temperature=-0.1), dict(temperature=math.nan), dict(temperature=math.inf), dict(temperature="1"),
    dict(top_p=0.0), dict(top_p=1.5), dict(top_p=math.nan), dict(top_p=-0.2),
    dict(top_k=-1), dict(top_k=2.5), dict(max_new_tokens=0), dict(max_new_tokens=-3),
    dict(seed=1.5), dict(stop_token_ids=(-1,)), dict(stop=("",)),
])
def test_bad_sampling_params_rejected(kwargs):
    with pytest.raises(InputError):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def models():
    hf = build_tiny_target("llama", seed=5, dtype=torch.float64, vocab_size=VOCAB, num_layers=3, hidden_size=32)
    with torch.no_grad():
        hf.lm_head.weight.mul_(3.0)  # peaked: sampled continuations repeat, drafts get accepted
    return native_from_hf(hf), build_tiny_drafter(hf.config, seed=6, dtype=torch.float64, block_size=4)


def test_bad_requests_rejected_by_the_engine(models):
    target, drafter = models
    engine = DFlashEngine(target, drafter, EngineConfig(max_batch_size=2, max_seq_len=32))
    with pytest.raises(InputError, match="empty"):
        engine.make_sequence([], SamplingParams())
    for bad in ([3, VOCAB], [-1, 3]):
        with pytest.raises(InputError, match="outside the vocabulary"):
            engine.make_sequence(bad, SamplingParams())
    with pytest.raises(ContextLengthError, match="at most 22"):
        engine.make_sequence(list(range(10)), SamplingParams(max_new_tokens=23))
    with pytest.raises(ContextLengthError):
        engine.make_sequence([3] * 32, SamplingParams())
    with pytest.raises(InputError, match="tokenizer"):
        engine.make_sequence([3], SamplingParams(stop=("x",)))
    assert engine.make_sequence(list(range(10)), SamplingParams(max_new_tokens=22)).max_new_tokens == 22
    assert engine.tcache.num_rows == 0


# ---- determinism and batch independence ------------------------------------------------------------
class RepeatProposer(DFlashEngine):
    """Drafts = the last token repeated: tiny peaked models loop, so sampled drafts get accepted
    (the real random drafter almost never is)."""

    def _propose(self, draft_logits, seqs):
        drafts, q = super()._propose(draft_logits, seqs)
        if q is None:  # exact mode: one-hot q, any deterministic proposal is valid
            drafts[:] = torch.tensor([s.tokens[-1] for s in seqs])[:, None]
        return drafts, q


PROMPTS = [[5, 9, 3], [7, 7, 1, 12, 30, 4, 4, 8, 9, 10, 11], [20], [6, 6, 6, 2, 9]]


def _run(models, prompts, params, acceptance="exact", batch=4, cls=RepeatProposer, **config):
    target, drafter = models
    engine = cls(target, drafter, EngineConfig(max_batch_size=batch, max_seq_len=48, acceptance=acceptance, **config))
    return engine.generate(prompts, params)


SAMPLED = SamplingParams(temperature=0.9, top_k=12, top_p=0.95, seed=42, max_new_tokens=20, ignore_eos=True)


@pytest.mark.parametrize("acceptance", ["exact", "rejection"])
def test_same_seed_same_output_different_seeds_differ(models, acceptance):
    first = _run(models, [PROMPTS[0]], SAMPLED, acceptance)[0]
    again = _run(models, [PROMPTS[0]], SAMPLED, acceptance)[0]
    assert first.tokens == again.tokens and len(first.tokens) == 20
    others = [_run(models, [PROMPTS[0]], SamplingParams(**{**SAMPLED.__dict__, "seed": s}), acceptance)[0].tokens
              for s in (1, 2, 3)]
    assert len({tuple(t) for t in others + [first.tokens]}) == 4
    if acceptance == "exact":
        assert sum(s.accepted for s in first.steps) > 0, "drafts should sometimes be accepted"


@pytest.mark.parametrize("acceptance", ["exact", "rejection"])
@pytest.mark.parametrize("confidence", [0.0, 0.3])
def test_output_does_not_depend_on_the_batch(models, acceptance, confidence):
    """A seeded sampled request gives the same tokens alone and among neighbours that are greedy,
    sampled with other parameters, joining and leaving at different steps; also when each row verifies
    only its confident drafts, so the batch's verify width is set by the neighbours' drafts."""
    alone = _run(models, [PROMPTS[0]], SAMPLED, acceptance, batch=1, draft_confidence=confidence)[0]
    neighbours = [
        SamplingParams(max_new_tokens=7),
        SamplingParams(temperature=1.0, seed=7, max_new_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.6, top_p=0.5, seed=8, max_new_tokens=25, ignore_eos=True),
        SamplingParams(temperature=1.2, seed=9, max_new_tokens=11, ignore_eos=True),
    ]
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[3], PROMPTS[1]]
    params = [neighbours[0], neighbours[1], SAMPLED, neighbours[2], neighbours[3]]
    crowded = _run(models, prompts, params, acceptance, batch=3, draft_confidence=confidence)
    assert crowded[2].tokens == alone.tokens
    if confidence:  # the rows did verify different numbers of drafts
        assert len({s.draft_tokens for r in crowded for s in r.steps}) > 1
    # the greedy neighbour equals greedy alone too
    assert crowded[0].tokens == _run(models, [PROMPTS[1]], neighbours[0], acceptance, batch=1,
                                     draft_confidence=confidence)[0].tokens
