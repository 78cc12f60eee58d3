"""N-gram lookup drafts (speculative/ngram.py) and their use in the DFlash loop."""
from __future__ import annotations

import pytest
import torch

from dflash_trt.engine import EngineConfig, SamplingParams
from dflash_trt.errors import ConfigError
from dflash_trt.models.target import native_from_hf
from dflash_trt.models.tiny import build_tiny_drafter, build_tiny_target
from dflash_trt.speculative.decoder import DFlashEngine
from dflash_trt.speculative.ngram import lookup_continuation


def test_lookup_takes_the_longest_then_latest_match():
    #          0  1  2  3  4  5  6  7  8  9 10 11
    history = [5, 1, 2, 3, 9, 2, 3, 7, 8, 1, 2, 3]
    # suffix [.., 1, 2, 3]: "3" occurs at 3 (match 1,2,3 -> 3 tokens) and at 6 (match 2,3 -> 2): the longer wins
    assert lookup_continuation(history, 1, 4) == [9, 2, 3, 7]
    assert lookup_continuation(history, 3, 2) == [9, 2]
    assert lookup_continuation(history, 4, 2) == []  # no repeat of 4 tokens
    # equal matches: the most recent occurrence
    assert lookup_continuation([4, 6, 1, 4, 7, 4], 1, 3) == [7, 4]
    # the continuation may run into the suffix itself (a repeating pattern) and stops at the end
    assert lookup_continuation([1, 2, 1, 2, 1, 2], 2, 8) == [1, 2]  # the match at 3 (4 tokens) beats 1's (2)
    assert lookup_continuation([9, 1, 2, 1, 2], 2, 8) == [1, 2]
    assert lookup_continuation([3, 4, 5], 1, 4) == []  # the last token never occurred before
    assert lookup_continuation([3], 1, 4) == [] and lookup_continuation([3, 3], 1, 0) == []
    with pytest.raises(ValueError, match="min_match"):
        lookup_continuation([1, 1], 0, 4)


def test_lookup_caps_match_length_ranking():
    """Matches longer than NGRAM_MAX_MATCH rank equal, so the latest of them wins."""
    seg = list(range(10, 20))
    history = seg + [1] + seg + [2] + seg
    assert lookup_continuation(history, 8, 1) == [2]


NEW = 40
# the second prompt repeats a phrase, so lookups find matches from the first step
PROMPTS = [[7, 9, 11, 200], [30, 31, 32, 33, 34, 35, 36, 30, 31, 32, 33]]


@pytest.fixture(scope="module")
def models():
    hf = build_tiny_target("llama", seed=11, dtype=torch.float64)
    ref = []
    for p in PROMPTS:
        out = hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        ref.append(out[0, len(p):].tolist())
    drafter = build_tiny_drafter(hf.config, seed=5, dtype=torch.float64, num_layers=1, block_size=8)
    return hf, native_from_hf(hf), drafter, ref


@pytest.mark.parametrize("min_match", [1, 2, 3])
def test_lookup_drafts_keep_greedy_output_and_get_accepted(models, min_match):
    """The loop with n-gram lookup gives the target's greedy output; lookups happen (the tiny target's
    greedy text falls into loops), their drafts are accepted where the repeat continues, and they are
    never longer than the block allows."""
    hf, native, drafter, ref = models
    engine = DFlashEngine(native, drafter, EngineConfig(max_seq_len=128, max_batch_size=2, ngram_lookup=min_match))
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [r.tokens for r in results] == ref
    steps = [s for r in results for s in r.steps]
    lookups = [s for s in steps if s.lookup]
    assert lookups and sum(s.accepted for s in lookups) > 0
    assert all(1 <= s.draft_tokens <= 7 and s.accepted <= s.draft_tokens for s in lookups)
    # the same drafter without lookup accepts less on the same output
    plain = DFlashEngine(native, drafter, EngineConfig(max_seq_len=128, max_batch_size=2))
    base = plain.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [r.tokens for r in base] == ref and not any(s.lookup for r in base for s in r.steps)
    assert sum(len(r.steps) for r in results) < sum(len(r.steps) for r in base)


def test_lookup_only_steps_skip_the_drafter_and_keep_its_context(models):
    """A step where every row drafts by lookup runs no drafter forward; the context features it did not
    consume wait for the drafter's next forward: every forward's new context starts where the previous
    one ended (nothing skipped, nothing twice) and ends at the committed target cache length."""
    hf, native, drafter, ref = models
    engine = DFlashEngine(native, drafter, EngineConfig(max_seq_len=128, max_batch_size=1, ngram_lookup=2))
    calls = []
    forward = engine._draft_forward

    def spy(seqs, *args):
        calls.append((seqs[0].ctx_pos, seqs[0].ctx_pos + seqs[0].ctx_hidden.shape[0]))
        return forward(seqs, *args)

    engine._draft_forward = spy
    result = engine.generate(PROMPTS[1:], SamplingParams(max_new_tokens=NEW, ignore_eos=True))[0]
    assert result.tokens == ref[1]
    assert len(calls) < len(result.steps)  # some steps were lookup-only
    starts = [len(PROMPTS[1])]
    for s in result.steps:
        starts.append(starts[-1] + s.accepted + 1)
    drafter_steps = [i for i, s in enumerate(result.steps) if not s.lookup]
    assert [end for _, end in calls] == [starts[i] for i in drafter_steps]
    assert [begin for begin, _ in calls] == [0] + [end for _, end in calls[:-1]]
    assert any(result.steps[i - 1].lookup for i in drafter_steps if i > 0)  # a forward after a skipped one


def test_rejection_sampled_rows_keep_the_drafters_proposal(models):
    hf, native, drafter, _ = models
    config = EngineConfig(max_seq_len=128, max_batch_size=2, ngram_lookup=1, acceptance="rejection")
    engine = DFlashEngine(native, drafter, config)
    sampled, greedy = engine.generate(PROMPTS[1:] * 2, [SamplingParams(max_new_tokens=NEW, temperature=0.8, seed=3),
                                                        SamplingParams(max_new_tokens=NEW, ignore_eos=True)])
    assert not any(s.lookup for s in sampled.steps)
    assert any(s.lookup for s in greedy.steps)


def test_bad_ngram_settings_are_config_errors():
    for bad in (-1, 9):
        with pytest.raises(ConfigError, match="ngram_lookup"):
            EngineConfig(ngram_lookup=bad)
