"""Statistical exactness of DFlash sampling: the output distribution is the target's own.

A tiny-vocabulary float64 target (vocab 16). The exact distribution of the first three generated
tokens is computed analytically from the target's logits over every 1- and 2-token continuation
(one batched transformers forward), processed with `processed_probs` (temperature, top-k, top-p).
DFlash runs thousands of seeded sequences (64+ per batch) and a chi-square test compares the
counts of (t1, t2, t3) with the analytic joint, for temperature 0.7 and 1.0, with and without
top-k / top-p, in both acceptance modes ("exact": one-hot q; "rejection": the drafter's soft q).

To exercise acceptance, the drafter's logits are replaced by an oracle-ish proposer: the target's
own logits at the drafted prefix plus fixed noise (so drafts are often, not always, accepted and
q != p in rejection mode). Negative controls break the acceptance rule and must fail the test.
Everything is seeded: the tests are deterministic.
"""
from __future__ import annotations

import math

import pytest
import torch

from dflash_trt.models.target import native_from_hf
from dflash_trt.models.tiny import build_tiny_drafter, build_tiny_target
from dflash_trt.speculative import decoder, verify
from dflash_trt.engine import EngineConfig, SamplingParams
from dflash_trt.speculative.decoder import DFlashEngine
from dflash_trt.speculative.sampling import inverse_cdf, processed_probs
from dflash_trt.speculative.verify import Acceptance, accept_prefix, accept_rejection

VOCAB = 16
PROMPT = [5, 9, 3, 11, 7, 1]
NEW = 3  # tokens compared: t1 from the prefill, t2 and t3 from verified blocks
RUNS = 2000
ALPHA = 1e-3


# ---- chi-square ------------------------------------------------------------------------------
def chi2_critical(df: int, alpha: float = ALPHA) -> float:
    """Upper-alpha critical value of chi-square(df): scipy when installed, else the
    Wilson-Hilferty approximation (within ~1% for df >= 3)."""
    try:
        from scipy.stats import chi2
    except ImportError:
        z = {1e-3: 3.090232, 1e-2: 2.326348}[alpha]
        return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return float(chi2.isf(alpha, df))


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, float]:
    """Pearson statistic and its critical value; cells expected < min_expected are pooled.
    counts, probs: [cells]. A count in a zero-probability cell fails at once (infinite statistic)."""
    n = float(counts.sum())
    expected = probs.to(torch.float64) * n
    if bool((counts[probs == 0] > 0).any()):
        return math.inf, 0.0
    big = expected >= min_expected
    obs = torch.cat([counts[big].to(torch.float64), counts[~big].sum().to(torch.float64)[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    return stat, chi2_critical(int(keep.sum()) - 1)


# ---- the target's exact distribution ---------------------------------------------------------------
class TargetTable:
    """Target logits after PROMPT + every continuation of up to 2 tokens."""

    def __init__(self, hf) -> None:
        v, p = VOCAB, len(PROMPT)
        grid = torch.cartesian_prod(torch.arange(v), torch.arange(v))  # [V*V, 2]
        ids = torch.cat([torch.tensor(PROMPT).expand(v * v, p), grid], dim=1)
        with torch.inference_mode():
            logits = hf(ids).logits  # [V*V, P+2, V]
        self.l1 = logits[0, p - 1]  # [V]
        self.l2 = logits[:, p].reshape(v, v, v)[:, 0]  # [V(t1), V]
        self.l3 = logits[:, p + 1].reshape(v, v, v)  # [V(t1), V(t2), V]

    def logits(self, generated: list[int]) -> torch.Tensor | None:
        """Next-token logits after PROMPT + generated (None past the table)."""
        if len(generated) == 0:
            return self.l1
        if len(generated) == 1:
            return self.l2[generated[0]]
        if len(generated) == 2:
            return self.l3[generated[0], generated[1]]
        return None

    def joint(self, params: SamplingParams) -> torch.Tensor:
        """Exact P(t1, t2, t3) under the processed distribution, flattened: [V^3]."""
        def proc(logits):
            flat = logits.reshape(-1, 1, VOCAB)
            n = flat.shape[0]
            probs = processed_probs(flat, torch.full((n,), params.temperature, dtype=torch.float64),
                                    torch.full((n,), params.top_k), torch.full((n,), params.top_p, dtype=torch.float64))
            return probs.reshape(logits.shape)

        p1, p2, p3 = proc(self.l1), proc(self.l2), proc(self.l3)
        return (p1[:, None, None] * p2[:, :, None] * p3).reshape(-1)


class TableProposer(DFlashEngine):
    """Draft logits = the target's own logits at the drafted prefix + fixed noise. In exact mode
    the drafts are their argmax (often the target's sample); in rejection mode the engine samples
    drafts from their processed distribution q (close to, but not, p)."""

    def __init__(self, *args, table: TargetTable, noise: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.table = table
        g = torch.Generator().manual_seed(1234)
        self.noise = {n: noise * torch.randn((VOCAB,) * n + (VOCAB,), generator=g, dtype=torch.float64)
                      for n in range(3)}
        self.accepted: list[int] = []
        self.drafted: list[int] = []

    def _propose(self, draft_logits, seqs):
        oracle = torch.zeros_like(draft_logits)  # [B, K, V]; zeros (uniform q) past the table
        for i, s in enumerate(seqs):
            ctx = list(s.tokens)
            for j in range(draft_logits.shape[1]):
                logits = self.table.logits(ctx)
                if logits is None:
                    break
                oracle[i, j] = logits + self.noise[len(ctx)][tuple(ctx)]
                ctx.append(int(oracle[i, j].argmax()))
        self.oracle = oracle
        return super()._propose(oracle, seqs)

    def _draft_lengths(self, draft_logits, cap):
        return super()._draft_lengths(self.oracle, cap)  # confidence of the drafts actually proposed

    def step(self):
        outs = super().step()
        self.accepted.extend(o.sequence.steps[-1].accepted for o in outs)
        self.drafted.extend(o.sequence.steps[-1].draft_tokens for o in outs)
        return outs


@pytest.fixture(scope="module")
def models():
    hf = build_tiny_target("llama", seed=3, dtype=torch.float64, vocab_size=VOCAB, num_layers=2, hidden_size=32)
    with torch.no_grad():
        hf.lm_head.weight.mul_(3.0)  # peaked enough that drafts are often accepted
    drafter = build_tiny_drafter(hf.config, seed=4, dtype=torch.float64, block_size=3)
    return native_from_hf(hf), drafter, TargetTable(hf)


def sample_counts(models, params: SamplingParams, acceptance: str, runs: int = RUNS, seed0: int = 0,
                  **config_kw):
    """Counts of (t1, t2, t3) over `runs` seeded DFlash runs, and the mean acceptance per step."""
    target, drafter, table = models
    config = EngineConfig(max_batch_size=256, max_seq_len=16, acceptance=acceptance, **config_kw)
    engine = TableProposer(target, drafter, config, table=table, noise=1.0)
    plist = [SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                            seed=seed0 + i, max_new_tokens=NEW, ignore_eos=True) for i in range(runs)]
    results = engine.generate([PROMPT] * runs, plist)
    idx = torch.tensor([(r.tokens[0] * VOCAB + r.tokens[1]) * VOCAB + r.tokens[2] for r in results])
    counts = torch.bincount(idx, minlength=VOCAB ** NEW)
    accepted = torch.tensor(engine.accepted, dtype=torch.float64)
    sample_counts.drafted = engine.drafted  # draft lengths of the last call, for tests that check them
    return counts, accepted


SETTINGS = [
    pytest.param(0.7, 0, 1.0, id="t0.7"),
    pytest.param(1.0, 0, 1.0, id="t1.0"),
    pytest.param(0.7, 4, 1.0, id="t0.7-topk4"),
    pytest.param(1.0, 5, 0.8, id="t1.0-topk5-topp0.8"),
]


@pytest.mark.parametrize("acceptance", ["exact", "rejection"])
@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_dflash_sampling_matches_target_distribution(models, acceptance, temperature, top_k, top_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    counts, accepted = sample_counts(models, params, acceptance, draft_confidence=0.0)  # whole blocks
    stat, critical = chi_square(counts, models[2].joint(params))
    assert stat < critical, f"chi-square {stat:.1f} >= critical {critical:.1f}: DFlash sampling is not the target's"
    # acceptance was exercised: both full and partial acceptance happened, often
    assert accepted.mean() > 0.5 and bool((accepted == 0).any()) and bool((accepted == 2).any())


@pytest.mark.parametrize("acceptance", ["exact", "rejection"])
def test_sampling_with_truncated_drafts_matches_target_distribution(models, acceptance):
    """Verifying a confidence-truncated prefix (speculative/draft_len.py) keeps the distribution."""
    params = SamplingParams(temperature=1.0)
    counts, accepted = sample_counts(models, params, acceptance, draft_confidence=0.3)
    stat, critical = chi_square(counts, models[2].joint(params))
    assert stat < critical, f"chi-square {stat:.1f} >= critical {critical:.1f} with truncated drafts"
    assert bool((accepted == 0).any()) and bool((accepted >= 1).any())
    assert set(sample_counts.drafted) == {0, 1, 2}  # every truncation length occurred


class VocabProposer(TableProposer):
    """The table proposer drafting over a draft vocabulary only (speculative/draft_head.py): logits
    -inf outside it, so in rejection mode q is zero there."""

    VOCAB_IDS = torch.tensor([0, 1, 2, 4, 6, 8, 9, 12, 13, 15])

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        outside = torch.ones(VOCAB, dtype=torch.bool)
        outside[self.VOCAB_IDS] = False
        for n, noise in self.noise.items():
            noise[..., outside] = -math.inf


@pytest.mark.parametrize("acceptance", ["exact", "rejection"])
def test_sampling_with_a_draft_vocabulary_matches_target_distribution(models, acceptance):
    """Drafts from a draft vocabulary (q zero outside it) keep the target's distribution."""
    params = SamplingParams(temperature=1.0, top_k=5, top_p=0.9)
    target, drafter, table = models
    config = EngineConfig(max_batch_size=256, max_seq_len=16, acceptance=acceptance)
    engine = VocabProposer(target, drafter, config, table=table, noise=1.0)
    plist = [SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=i, max_new_tokens=NEW, ignore_eos=True)
             for i in range(RUNS)]
    results = engine.generate([PROMPT] * RUNS, plist)
    idx = torch.tensor([(r.tokens[0] * VOCAB + r.tokens[1]) * VOCAB + r.tokens[2] for r in results])
    stat, critical = chi_square(torch.bincount(idx, minlength=VOCAB ** NEW), table.joint(params))
    assert stat < critical, f"chi-square {stat:.1f} >= critical {critical:.1f} with a draft vocabulary"
    accepted = torch.tensor(engine.accepted)
    assert bool((accepted == 0).any()) and bool((accepted >= 1).any())
    outside = set(range(VOCAB)) - set(VocabProposer.VOCAB_IDS.tolist())
    assert any(t in outside for r in results for t in r.tokens[1:])  # the target still says what was never drafted


def _accept_first_always(draft, target_tokens, draft_lens):
    acc = accept_prefix(draft, target_tokens, draft_lens)
    accepted = acc.accepted.clamp(min=1)  # BROKEN: the first draft is always accepted
    return Acceptance(accepted=accepted, bonus=target_tokens.gather(1, accepted[:, None]).squeeze(1))


def _ignore_q(draft, draft_probs, target_probs, draft_lens, accept_uniforms, resample_uniforms):
    # BROKEN: q is ignored (taken to equal p), so every sampled draft is accepted
    k = draft.shape[1]
    return accept_rejection(draft, target_probs[:, :k], target_probs, draft_lens, accept_uniforms, resample_uniforms)


@pytest.mark.parametrize("acceptance,module,name,broken", [
    # the engine reaches accept_prefix through the acceptance kernel's CPU reference (accept_tokens_ref)
    ("exact", verify, "accept_prefix", _accept_first_always),
    ("rejection", decoder, "accept_rejection", _ignore_q),
])
def test_broken_acceptance_fails_chi_square(models, monkeypatch, acceptance, module, name, broken):
    """Negative control: the same test detects a wrong acceptance rule."""
    monkeypatch.setattr(module, name, broken)
    params = SamplingParams(temperature=1.0)
    counts, _ = sample_counts(models, params, acceptance, draft_confidence=0.0)
    stat, critical = chi_square(counts, models[2].joint(params))
    assert stat > critical, f"a broken {name} went undetected (chi-square {stat:.1f} < {critical:.1f})"


# ---- the acceptance functions alone, on hand-built distributions --------------------------------
@pytest.mark.parametrize("k", [1, 3])
def test_accept_rejection_first_token_is_p(k):
    """One slot of Leviathan rejection sampling: draft x ~ q, accept w.p. min(1, p/q), else draw
    from norm(max(0, p - q)): the committed token at slot 1 is distributed as p exactly."""
    g = torch.Generator().manual_seed(5)
    v, n = 6, 60_000
    p = torch.softmax(2 * torch.randn(k + 1, v, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(2 * torch.randn(k, v, generator=g, dtype=torch.float64), -1)
    q[0, 0] = 0.0  # a token the draft never proposes but the target may emit
    q = q / q.sum(-1, keepdim=True)
    drafts = inverse_cdf(q.expand(n, k, v), torch.rand(n, k, generator=g, dtype=torch.float64))
    acc = accept_rejection(drafts, q.expand(n, k, v), p.expand(n, k + 1, v), torch.full((n,), k),
                           torch.rand(n, k, generator=g, dtype=torch.float64), torch.rand(n, generator=g, dtype=torch.float64))
    first = torch.where(acc.accepted > 0, drafts[:, 0], acc.bonus)
    stat, critical = chi_square(torch.bincount(first, minlength=v), p[0])
    assert stat < critical
    assert 0 < float((acc.accepted > 0).double().mean()) < 1


def test_accept_prefix_with_sampled_target_is_p():
    """One-hot q: a fixed draft is accepted exactly when the target's sample equals it, so the
    committed token is the target's sample whatever the draft."""
    g = torch.Generator().manual_seed(6)
    v, n = 6, 60_000
    p = torch.softmax(torch.randn(2, v, generator=g, dtype=torch.float64), -1)
    samples = inverse_cdf(p.expand(n, 2, v), torch.rand(n, 2, generator=g, dtype=torch.float64))
    drafts = torch.full((n, 1), int(p[0].argmax()))
    acc = accept_prefix(drafts, samples, torch.ones(n, dtype=torch.long))
    first = torch.where(acc.accepted > 0, drafts[:, 0], acc.bonus)
    stat, critical = chi_square(torch.bincount(first, minlength=v), p[0])
    assert stat < critical
    assert torch.equal(first, samples[:, 0])
