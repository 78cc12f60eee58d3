"""Growing a trained drafter by identity layers (train/grow.py, `train --grow-layers`)."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from dflash_trt.engine import EngineConfig, SamplingParams
from dflash_trt.errors import ConfigError
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.models.target import native_from_hf
from dflash_trt.models.tiny import build_tiny_drafter, build_tiny_target, random_prompts, save_tiny_target
from dflash_trt.speculative.decoder import DFlashEngine
from dflash_trt.train.grow import grow_drafter, grown_config
from dflash_trt.train.trainer import TrainConfig, Trainer

VOCAB = 96


def _prompts(n: int, seed: int) -> list[list[int]]:
    return random_prompts(n, seed, VOCAB)


@pytest.fixture(scope="module")
def tiny():
    hf = build_tiny_target("llama", seed=0, vocab_size=VOCAB, num_layers=4, hidden_size=64)
    drafter = build_tiny_drafter(hf.config, seed=1, num_layers=2, block_size=6, target_layer_ids=[1, 2, 3])
    return hf, drafter


def test_grown_drafter_drafts_exactly_what_the_trained_one_drafted(tiny):
    hf, drafter = tiny
    drafter.set_draft_vocab(list(range(3, VOCAB, 2)))
    try:
        grown = grow_drafter(drafter, 2)
    finally:
        drafter.set_draft_vocab(None)
    assert len(grown.layers) == 4 and grown.cfg.num_hidden_layers == 4 and len(drafter.layers) == 2
    assert torch.equal(grown.draft_vocab, torch.arange(3, VOCAB, 2))
    for i in (2, 3):  # new layers: copies of the last trained layer, residual branches closed
        assert not grown.layers[i].self_attn.o_proj.weight.any() and not grown.layers[i].mlp.down_proj.weight.any()
        assert torch.equal(grown.layers[i].self_attn.q_proj.weight, drafter.layers[1].self_attn.q_proj.weight)
        assert torch.equal(grown.layers[i].mlp.up_proj.weight, drafter.layers[1].mlp.up_proj.weight)
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(grown.state_dict()[name], tensor), name
    grown.set_draft_vocab(None)
    target = native_from_hf(hf).double()
    prompts = _prompts(6, seed=2)
    params = SamplingParams(max_new_tokens=24)
    config = EngineConfig(max_batch_size=6, max_seq_len=128, draft_confidence=0.0)  # whole blocks: every draft verified
    runs = [DFlashEngine(target, copy.deepcopy(d).double(), config).generate(prompts, params) for d in (drafter, grown)]
    # same drafts -> the same acceptance at every step (and the same, lossless, tokens)
    assert [[s.accepted for s in r.steps] for r in runs[0]] == [[s.accepted for s in r.steps] for r in runs[1]]
    assert [r.tokens for r in runs[0]] == [r.tokens for r in runs[1]]
    assert any(s.accepted > 0 for r in runs[1] for s in r.steps)  # the comparison sees real drafts


def test_grown_checkpoint_round_trips_and_loads_upstream(tiny, tmp_path):
    _, drafter = tiny
    grown = grow_drafter(drafter, 1)
    out = grown.save_pretrained(tmp_path / "grown")
    loaded = DFlashDrafter.from_pretrained(out)
    assert loaded.cfg.num_hidden_layers == 3
    for name, tensor in grown.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    upstream = pytest.importorskip("dflash.model")
    ref = upstream.DFlashDraftModel.from_pretrained(str(out))
    assert len(ref.layers) == 3


def test_grow_rejects_bad_requests(tiny, tmp_path):
    _, drafter = tiny
    for extra in (0, -1, 99):
        with pytest.raises(ConfigError, match="grow_layers"):
            grown_config(drafter.cfg, extra)
    with pytest.raises(ConfigError, match="drafter_init"):
        TrainConfig(target=tmp_path, output=tmp_path / "o", work_dir=tmp_path / "w", grow_layers=1)


def test_trainer_grows_the_init_drafter_and_starts_from_its_heldout_score(tiny, tmp_path):
    """`--drafter-init D --grow-layers 1`: the step-0 held-out metrics equal D's own (the grown drafter
    computes the same function), training then changes the new layer, and the output has one layer more."""
    hf, drafter = tiny
    target_dir = save_tiny_target(hf, tmp_path / "target")
    init = drafter.save_pretrained(tmp_path / "init")
    prompts = _prompts(28, seed=5)
    results = {}
    for grow in (0, 1):
        root = tmp_path / f"grow{grow}"
        config = TrainConfig(target=Path(target_dir), output=root / "out", work_dir=root / "work",
                             data_dir=tmp_path / "data", drafter_init=init, grow_layers=grow, steps=3, batch_size=4,
                             anchors_per_seq=4, max_new_tokens=16, eval_every=0, heldout_every=3, lr=3e-3,
                             progress=False)
        trainer = Trainer(config, prompts[:24], [], heldout_prompts=prompts[24:])
        results[grow] = (trainer, trainer.run())
    (plain, _), (grown_trainer, grown) = results[0], results[1]
    assert grown_trainer.state.heldout[0] == plain.state.heldout[0]  # step 0: the same function
    assert len(grown.layers) == 3
    assert DFlashDrafter.from_pretrained(grown_trainer.config.output).cfg.num_hidden_layers == 3
    assert grown.layers[2].self_attn.o_proj.weight.any() and grown.layers[2].mlp.down_proj.weight.any()
