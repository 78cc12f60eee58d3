"""Greedy batched DFlash decoding equals unbatched decoding, row for row.

Tiny float64 Llama / Qwen3 / gpt-oss targets (float64 rules out near-tie flips), mixed prompt
lengths (some longer than gpt-oss's sliding window of 8), requests finishing at different steps
(different max_new_tokens, a stop token id, EOS) and max_batch_size smaller than the number of
requests, so rows join while others leave.

A random drafter accepts almost nothing, so it alone would not exercise the ragged commit. The
ORACLE engine below proposes the target's true greedy continuation (precomputed by autoregressive
decoding) corrupted at a random slot per row and step: every acceptance length 0..K occurs, rows
of one step accept different lengths, and the engine's accepted count must equal the first
corrupted slot exactly.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest
import torch

from dflash_trt.models.target import native_from_hf
from dflash_trt.models.tiny import build_tiny_drafter, build_tiny_target
from dflash_trt.engine import EngineConfig, SamplingParams
from dflash_trt.speculative.decoder import DFlashEngine

VOCAB = 64
MAX_SEQ = 96
PROMPT_LENS = (1, 3, 9, 13, 20, 6, 11)  # 9, 13, 20, 11 exceed gpt-oss's sliding window (8)
MAX_NEW = (12, 5, 1, 17, 9, 14, 7)  # rows finish at different steps


@dataclass
class Case:
    hf: object
    target: object
    drafter: object
    prompts: list[list[int]]
    truth: dict[tuple[int, ...], list[int]]
    params: list[SamplingParams]
    stopped: int  # index of the request that ends at a stop token id
    refs: list[list[int]]  # unbatched autoregressive output per request


@pytest.fixture(scope="module", params=["llama", "qwen3", "gpt_oss"])
def case(request) -> Case:
    hf = build_tiny_target(request.param, seed=1, dtype=torch.float64, vocab_size=VOCAB, num_layers=4,
                           hidden_size=32)
    target = native_from_hf(hf)
    drafter = build_tiny_drafter(hf.config, seed=2, dtype=torch.float64, block_size=5)
    prompts = _prompts()
    truth = _truth(target, prompts, max(MAX_NEW) + 8)
    params, stopped = _params(truth, prompts)
    refs = [_autoregressive(target, p, sp) for p, sp in zip(prompts, params)]
    return Case(hf, target, drafter, prompts, truth, params, stopped, refs)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(5, VOCAB - 1, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _autoregressive(target, prompt: list[int], params: SamplingParams) -> list[int]:
    """The unbatched reference: plain autoregressive decoding, one sequence alone."""
    engine = DFlashEngine(target, None, EngineConfig(speculative=False, max_batch_size=1, max_seq_len=MAX_SEQ))
    return engine.generate([prompt], params)[0].tokens


def _truth(target, prompts, horizon: int) -> dict[tuple[int, ...], list[int]]:
    """Greedy continuations past every limit (no EOS / stop), for the oracle proposer."""
    params = SamplingParams(max_new_tokens=horizon, ignore_eos=True)
    return {tuple(p): _autoregressive(target, p, params) for p in prompts}


def _params(truth, prompts) -> tuple[list[SamplingParams], int]:
    """Per-request limits: different max_new_tokens; one request (returned index) stops at a stop
    token id that first appears mid-way through its greedy continuation; the others stop at EOS
    (if ever) or at their limit."""
    out = [SamplingParams(max_new_tokens=n) for n in MAX_NEW]
    eos = 2
    for i in sorted(range(len(prompts)), key=lambda i: -MAX_NEW[i]):  # longest budgets first
        cont = truth[tuple(prompts[i])][: MAX_NEW[i] - 1]
        if eos in cont:
            continue
        new = [k for k in range(2, len(cont)) if cont[k] not in cont[:k]]
        if new:
            out[i] = SamplingParams(max_new_tokens=MAX_NEW[i], stop_token_ids=(cont[new[0]],))
            return out, i
    raise AssertionError("no continuation has a fresh token mid-way: change the seeds")


class OracleEngine(DFlashEngine):
    """Drafts = the true greedy continuation, corrupted from a random slot on; records the
    acceptance each row must get (the first corrupted slot, K when none)."""

    def __init__(self, target, drafter, config: EngineConfig, *, truth, seed: int) -> None:
        # every row verifies its whole block (no confidence cut: the random drafter's confidence says
        # nothing about the oracle's drafts), so acceptance is exactly the uncorrupted prefix
        super().__init__(target, drafter, replace(config, draft_confidence=0.0))
        self.truth, self.rng = truth, random.Random(seed)
        self.expected: list[list[int]] = []  # per step: the acceptance each row must get
        self.expected_by_seq: dict[int, list[int]] = {}  # id(sequence) -> per step

    def _propose(self, draft_logits, seqs):
        drafts, q = super()._propose(draft_logits, seqs)  # the real path, then overwrite the tokens
        k = drafts.shape[1]
        expected = []
        for i, s in enumerate(seqs):
            # s.tokens[-1] is the pending token (block slot 0); slot j predicts token len + j - 1
            true = self.truth[tuple(s.prompt)][len(s.tokens): len(s.tokens) + k]
            assert len(true) == k, "oracle horizon too short"
            cut = self.rng.randint(0, k)  # first corrupted slot; k = no corruption
            row = list(true)
            for j in range(cut, k):
                row[j] = (true[j] + self.rng.randint(1, VOCAB - 1)) % VOCAB  # != true[j]
            drafts[i] = torch.tensor(row)
            expected.append(cut)
            self.expected_by_seq.setdefault(id(s), []).append(cut)
        self.expected.append(expected)
        return drafts, q


def _check_rows(results, refs):
    for i, (res, ref) in enumerate(zip(results, refs)):
        assert res.tokens == ref, f"row {i}: batched {res.tokens} != unbatched {ref}"


def test_autoregressive_reference_matches_transformers(case):
    """Anchor: the unbatched reference equals a full-recompute transformers greedy loop."""
    hf, target = case.hf, case.target
    prompt = case.prompts[4]  # 20 tokens: past the sliding window
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(10):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    assert _autoregressive(target, prompt, SamplingParams(max_new_tokens=10, ignore_eos=True)) == ids[len(prompt):]


@pytest.mark.parametrize("spec", [False, True], ids=["autoregressive", "dflash-random-drafter"])
def test_greedy_batched_equals_unbatched(case, spec):
    target, drafter, prompts, params, stopped, refs = (
        case.target, case.drafter, case.prompts, case.params, case.stopped, case.refs)
    assert len({len(r) for r in refs}) > 3, "rows should finish at different steps"
    assert len(refs[stopped]) < MAX_NEW[stopped] and refs[stopped][-1] in params[stopped].stop_token_ids
    engine = DFlashEngine(target, drafter if spec else None, EngineConfig(speculative=spec, max_batch_size=3, max_seq_len=MAX_SEQ))
    results = engine.generate(prompts, params)
    _check_rows(results, refs)
    assert engine.tcache.num_rows == 0 and not engine.active
    assert results[stopped].finish_reason == "stop"


def test_greedy_oracle_drafts_ragged_acceptance(case):
    """Every acceptance length 0..K happens, rows of one step differ, output stays the target's."""
    target, drafter, prompts, params, truth, refs = (
        case.target, case.drafter, case.prompts, case.params, case.truth, case.refs)
    engine = OracleEngine(target, drafter, EngineConfig(max_batch_size=4, max_seq_len=MAX_SEQ), truth=truth, seed=3)
    k = engine.block_size - 1
    waiting = [engine.make_sequence(p, sp) for p, sp in zip(prompts, params)]
    seqs = list(waiting)
    while waiting or engine.active:
        if waiting and engine.free_rows:  # join one at a time, between steps
            engine.add([waiting.pop(0)])
        else:
            engine.step()
    _check_rows([s.result() for s in seqs], refs)
    for s in seqs:  # the engine accepted exactly the true prefix of every row's drafts
        assert [st.accepted for st in s.steps] == engine.expected_by_seq.get(id(s), [])
    seen = {a for step in engine.expected for a in step}
    assert seen == set(range(k + 1)), f"every acceptance length 0..{k} should occur, saw {seen}"
    assert any(len(set(step)) > 1 for step in engine.expected), "rows of one step should accept differently"
    assert max(s.result().mean_acceptance_length for s in seqs) > 1.5


def test_until_the_context_is_full(case):
    """No max_new_tokens: rows decode until prompt + output fill max_seq_len, the last blocks
    reaching past it, with ragged acceptance; output equals autoregressive decoding."""
    target, drafter = case.target, case.drafter
    prompts = case.prompts[2:5]  # 1, 9 and 13 tokens
    params = SamplingParams(ignore_eos=True)
    max_seq = 30
    ref_engine = DFlashEngine(target, None, EngineConfig(speculative=False, max_batch_size=1, max_seq_len=max_seq))
    refs = [ref_engine.generate([p], params)[0].tokens for p in prompts]
    assert [len(r) for r in refs] == [max_seq - len(p) for p in prompts]
    truth = {tuple(p): r + [0] * 8 for p, r in zip(prompts, refs)}  # drafts past the context: anything
    engine = OracleEngine(target, drafter, EngineConfig(max_batch_size=3, max_seq_len=max_seq), truth=truth, seed=5)
    results = engine.generate(prompts, params)
    _check_rows(results, refs)
    assert all(r.finish_reason == "length" for r in results)


@pytest.mark.parametrize("block_size", [2, 7])
def test_oracle_expected_acceptance_per_row(case, block_size):
    """Per row and step, the committed acceptance equals the oracle's first corrupted slot
    (block sizes other than the drafter's own, batch of 2 for 5 requests)."""
    target, drafter, truth = case.target, case.drafter, case.truth
    prompts = case.prompts[:5]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_NEW[:5]]
    engine = OracleEngine(target, drafter, EngineConfig(block_size=block_size, max_batch_size=2, max_seq_len=MAX_SEQ),
                          truth=truth, seed=11)
    waiting = [engine.make_sequence(p, sp) for p, sp in zip(prompts, params)]
    seqs = list(waiting)
    while waiting or engine.active:
        if waiting and engine.free_rows:
            engine.add([waiting.pop(0)])
        else:
            engine.step()
    for s, p in zip(seqs, prompts):
        assert s.tokens == truth[tuple(p)][: len(s.tokens)]
        assert [st.accepted for st in s.steps] == engine.expected_by_seq.get(id(s), [])


def test_throughput_helper_runs_both_modes_interleaved(case):
    """bench/throughput.measure: both modes run at each batch size; greedy outputs agree."""
    from dflash_trt.bench.throughput import measure

    def factory(spec: bool, batch: int) -> DFlashEngine:
        return DFlashEngine(case.target, case.drafter if spec else None,
                            EngineConfig(speculative=spec, max_batch_size=batch, max_seq_len=MAX_SEQ))

    report = measure(factory, case.prompts[:3], [1, 3], SamplingParams(max_new_tokens=6, ignore_eos=True), rounds=2)
    assert [r.batch_size for r in report.rows] == [1, 3]
    for row in report.rows:
        assert row.identical_outputs is True
        assert row.dflash.tokens == row.autoregressive.tokens == 2 * 6 * row.batch_size
        assert row.autoregressive.mean_acceptance_length == 1.0
        assert row.dflash.tokens_per_s > 0 and row.speedup > 0
    assert "| 3 |" in report.table()
