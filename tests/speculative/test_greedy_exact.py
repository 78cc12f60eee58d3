"""DFlash greedy decoding is token-identical to the target's own greedy decoding, and the drafts it
proposes at every step equal the upstream reference implementation's."""
from __future__ import annotations

import pytest
import torch

from dflash_trt.errors import ConfigError, ContextLengthError, InputError
from dflash_trt.models.target import HFTarget, native_from_hf
from dflash_trt.models.tiny import TINY_ARCHS, build_tiny_drafter, build_tiny_target
from dflash_trt.engine import EngineConfig, SamplingParams
from dflash_trt.speculative.decoder import DFlashEngine

NEW = 24
PROMPTS = [[7, 9, 11, 200], list(range(20, 39))]  # the second is longer than gpt-oss's window (8)


@pytest.fixture(scope="module", params=TINY_ARCHS)
def arch_models(request):
    hf = build_tiny_target(request.param, seed=11, dtype=torch.float64)
    ref = []
    for p in PROMPTS:
        out = hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        ref.append(out[0, len(p):].tolist())
    return hf, native_from_hf(hf), ref


# (block size, drafter layers, target_layer_ids)
CASES = [(2, 1, [2]), (4, 2, [0, 3]), (8, 1, [1, 3, 5]), (16, 3, [5]), (5, 2, [1, 2])]


@pytest.mark.parametrize("block,layers,target_layer_ids", CASES)
def test_dflash_equals_target_greedy(arch_models, block, layers, target_layer_ids):
    hf, native, ref = arch_models
    drafter = build_tiny_drafter(hf.config, seed=block, dtype=torch.float64, num_layers=layers,
                                 target_layer_ids=target_layer_ids, block_size=block)
    engine = DFlashEngine(native, drafter, EngineConfig(max_seq_len=128, max_batch_size=2, draft_confidence=0.0))
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [r.tokens for r in results] == ref
    for r in results:
        assert sum(s.accepted + 1 for s in r.steps) + 1 >= NEW  # prefill token + committed per step
        assert all(s.draft_tokens == block - 1 for s in r.steps)  # draft_confidence 0: whole blocks


def test_smaller_block_than_trained_and_autoregressive_baseline(arch_models):
    hf, native, ref = arch_models
    drafter = build_tiny_drafter(hf.config, seed=3, dtype=torch.float64, num_layers=1, block_size=16)
    run = DFlashEngine(native, drafter, EngineConfig(block_size=8, max_seq_len=128, max_batch_size=2))
    assert run.block_size == 8
    assert [r.tokens for r in run.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))] == ref
    ar = DFlashEngine(native, None, EngineConfig(speculative=False, max_seq_len=128))
    results = ar.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [r.tokens for r in results] == ref
    assert all(s.draft_tokens == 0 and s.accepted == 0 for r in results for s in r.steps)


def test_hf_adapter_engine_equals_native(arch_models):
    hf, _, ref = arch_models
    drafter = build_tiny_drafter(hf.config, seed=4, dtype=torch.float64, num_layers=1, block_size=4)
    engine = DFlashEngine(HFTarget(hf), drafter, EngineConfig(max_seq_len=128, max_batch_size=1))
    assert [r.tokens for r in engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))] == ref


def test_drafts_match_upstream_reference_step_by_step(arch_models):
    """Same target, same drafter weights: the upstream `dflash` loop and ours propose the same
    draft tokens at every step, which checks context positions and hidden-state taps in the loop."""
    upstream = pytest.importorskip("dflash.model")
    from transformers import Qwen3Config

    hf, native, _ = arch_models
    block = 6
    drafter = build_tiny_drafter(hf.config, seed=5, dtype=torch.float64, num_layers=2, target_layer_ids=[1, 4], block_size=block)
    fields = {k: v for k, v in drafter.cfg.raw.items() if k != "architectures"}
    ref_model = upstream.DFlashDraftModel(Qwen3Config(**fields)).to(torch.float64).eval()
    ref_model.load_state_dict(drafter.state_dict(), strict=True)
    theirs: list[list[int]] = []
    compute = ref_model.compute_logits

    def record(hidden, head):
        logits = compute(hidden, head)
        theirs.append(logits.argmax(-1)[0].tolist())
        return logits

    ref_model.compute_logits = record
    prompt = PROMPTS[1]
    upstream.dflash_generate(ref_model, hf, torch.tensor([prompt]), max_new_tokens=NEW + 3 * block, stop_token_ids=None)

    ours: list[list[int]] = []
    engine = DFlashEngine(native, drafter, EngineConfig(max_seq_len=128, max_batch_size=1))
    propose = engine._propose

    def spy(draft_logits, seqs):
        drafts, q = propose(draft_logits, seqs)
        ours.append(drafts[0].tolist())
        return drafts, q

    engine._propose = spy
    engine.generate([prompt], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert len(ours) >= 5
    assert ours == theirs[: len(ours)]


def test_stops_on_eos_and_respects_max_new_tokens(arch_models):
    hf, native, ref = arch_models
    drafter = build_tiny_drafter(hf.config, seed=6, dtype=torch.float64, num_layers=1, block_size=8)
    engine = DFlashEngine(native, drafter, EngineConfig(max_seq_len=128, max_batch_size=2))
    stop_tok = ref[1][5]
    out = engine.generate(PROMPTS[1:], SamplingParams(max_new_tokens=NEW, stop_token_ids=(stop_tok,)))[0]
    assert out.tokens == ref[1][: ref[1].index(stop_tok) + 1] and out.finish_reason == "stop"
    out = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    assert out.tokens == ref[0][:5] and out.finish_reason == "length"


def test_bad_requests_are_clear_errors(arch_models):
    hf, native, _ = arch_models
    drafter = build_tiny_drafter(hf.config, seed=7, dtype=torch.float64, num_layers=1, block_size=4)
    engine = DFlashEngine(native, drafter, EngineConfig(max_seq_len=32, max_batch_size=1))
    with pytest.raises(InputError, match="empty"):
        engine.make_sequence([], SamplingParams())
    with pytest.raises(InputError, match="vocabulary"):
        engine.make_sequence([1, 99_999], SamplingParams())
    with pytest.raises(ContextLengthError, match="max_new_tokens"):
        engine.make_sequence([1, 2, 3], SamplingParams(max_new_tokens=40))
    with pytest.raises(ContextLengthError, match="prompt has 40 tokens"):
        engine.make_sequence([1] * 40, SamplingParams())
    # without max_new_tokens a sequence stops when the context is full, with reason "length"
    out = engine.generate([[5, 6, 7]], SamplingParams(ignore_eos=True))[0]
    assert len(out.tokens) == 29 and out.finish_reason == "length"
    with pytest.raises(ConfigError, match="exceeds the target's context"):
        DFlashEngine(native, drafter, EngineConfig(max_seq_len=5000))


# ---- verifying fewer drafts (speculative/draft_len.py) never changes the output ------------------

@pytest.mark.parametrize("confidence,schedule", [
    (0.0, ((1, 7), (2, 0))),  # two rows in flight: no drafts at all (plain decoding steps)
    (0.0, ((1, 7), (2, 3))),
    (0.02, None),
    (0.3, None),
    (0.9, ((1, 7), (2, 5))),
])
def test_truncated_drafts_keep_greedy_output(arch_models, confidence, schedule):
    hf, native, ref = arch_models
    drafter = build_tiny_drafter(hf.config, seed=8, dtype=torch.float64, num_layers=1, block_size=8)
    with torch.no_grad():
        for layer in drafter.layers:  # a more peaked drafter: confidences spread over (0, 1)
            layer.mlp.down_proj.weight.mul_(8.0)
    config = EngineConfig(max_seq_len=128, max_batch_size=2, draft_confidence=confidence, draft_len_schedule=schedule)
    results = DFlashEngine(native, drafter, config).generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [r.tokens for r in results] == ref
    lens = [s.draft_tokens for r in results for s in r.steps]
    assert all(s.accepted <= s.draft_tokens for r in results for s in r.steps)
    if schedule == ((1, 7), (2, 0)):  # both rows start together: the first steps draft nothing
        assert lens[0] == 0 and results[0].steps[0].accepted == 0
    if schedule == ((1, 7), (2, 3)):
        assert max(lens) <= 7 and lens[0] <= 3
    if confidence > 0:
        assert min(lens) < 7  # something was cut


def test_bad_draft_len_schedules_are_config_errors(arch_models):
    hf, native, _ = arch_models
    drafter = build_tiny_drafter(hf.config, seed=8, dtype=torch.float64, num_layers=1, block_size=4)
    for bad in (((2, 3),), ((1, 3), (1, 2)), ((1, 4),), ((1, 3), (4, -1))):
        with pytest.raises(ConfigError, match="draft_len_schedule"):
            DFlashEngine(native, drafter, EngineConfig(max_seq_len=64, draft_len_schedule=bad))
    with pytest.raises(ConfigError, match="draft_confidence"):
        EngineConfig(draft_confidence=1.0)


def test_draft_vocabulary_restricts_drafts_not_output(arch_models):
    """A drafter with a draft vocabulary (speculative/draft_head.py): draft logits equal the full
    head's on its rows and are -inf elsewhere; greedy output is unchanged; draft_vocab=False and a
    target without one local lm_head matrix draft over the whole vocabulary."""
    hf, native, ref = arch_models
    drafter = build_tiny_drafter(hf.config, seed=6, dtype=torch.float64, num_layers=1, block_size=4)
    vocab = torch.arange(0, hf.config.vocab_size, 3)
    drafter.set_draft_vocab(vocab)
    for target in (native, HFTarget(hf)):
        engine = DFlashEngine(target, drafter, EngineConfig(max_seq_len=128, max_batch_size=1))
        assert engine.draft_head.restricted
        seen = []
        head = engine.draft_head
        engine.draft_head = lambda h: seen.append((h, head(h))) or seen[-1][1]
        results = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
        assert [r.tokens for r in results] == ref[:1]
        hidden, logits = seen[0]
        outside = torch.ones(hf.config.vocab_size, dtype=torch.bool)
        outside[vocab] = False
        with torch.inference_mode():
            full = target.head(hidden)
        torch.testing.assert_close(logits[..., vocab], full[..., vocab])
        assert bool(torch.isneginf(logits[..., outside]).all())
        assert all(int(i) % 3 == 0 for _, lg in seen for i in lg.argmax(-1).flatten())
    assert not DFlashEngine(native, drafter, EngineConfig(max_seq_len=128, draft_vocab=False)).draft_head.restricted
    from dflash_trt.runtime.tp import VocabParallelHead

    native.lm_head.__class__ = VocabParallelHead  # what the TP runtime does to the head (runtime/tp.py)
    try:
        assert native.head_weight() is None
        assert not DFlashEngine(native, drafter, EngineConfig(max_seq_len=128)).draft_head.restricted
    finally:
        native.lm_head.__class__ = torch.nn.Linear
