"""Drafter training: the block-sparse training forward equals the inference drafter, regenerated
data and its taps are right and cached, a tiny end-to-end run raises tau, resume continues the
run exactly, Ctrl-C keeps a good checkpoint, and the CLI's prompts exclude the eval sets."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from dflash_trt.errors import ConfigError
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.models.target import load_native_target, native_from_hf
from dflash_trt.models.tiny import build_tiny_drafter, build_tiny_target, random_prompts, save_tiny_target
from dflash_trt.engine import EngineConfig, SamplingParams
from dflash_trt.speculative.decoder import DFlashEngine
from dflash_trt.train.features import IGNORE, compute_features, make_batch
from dflash_trt.train.loss import block_visibility, default_gamma, position_weights, train_forward
from dflash_trt.train.regen import Sample, regenerate
from dflash_trt.train.state import read_latest
from dflash_trt.train.trainer import TrainConfig, Trainer, cpu_has_native_bf16, evaluate_tau, new_drafter

VOCAB = 32  # a small vocabulary makes the random target's greedy text learnable in a few hundred steps


def _prompts(n: int, seed: int) -> list[list[int]]:
    return random_prompts(n, seed, VOCAB)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    hf = build_tiny_target("llama", seed=0, vocab_size=VOCAB, num_layers=4, hidden_size=64)
    return save_tiny_target(hf, tmp_path_factory.mktemp("tiny") / "target")


def _config(target_dir: Path, root: Path, **kw) -> TrainConfig:
    base = dict(target=target_dir, output=root / "out", work_dir=root / "work", data_dir=root.parent / "data",
                num_layers=1, target_layer_ids=(1, 2, 3), block_size=8, steps=300, batch_size=8, anchors_per_seq=8,
                max_new_tokens=40, regen_batch_size=64, eval_every=0, save_every=100, lr=3e-3, progress=False)
    base.update(kw)
    return TrainConfig(**base)


# ---- pure pieces ------------------------------------------------------------------------------

def test_gamma_follows_the_paper_and_weights_decay():
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    assert 5.0 < default_gamma(12) < 7.0 and default_gamma(4) >= 1.0
    w = position_weights(8, 4.0)
    assert w.shape == (7,) and w[0] == 1.0 and torch.allclose(w[1], torch.exp(torch.tensor(-0.25)))
    assert bool((w[1:] < w[:-1]).all())


def test_block_visibility_sees_only_earlier_context_and_its_own_block():
    anchors = torch.tensor([[2, 4]])
    ctx_valid = torch.tensor([[True, True, True, True, False]])
    mask = block_visibility(anchors, ctx_valid, 3, causal=False, sliding_window=None)[0, 0]  # [6, 5 + 6]
    ctx, blk = mask[:, :5], mask[:, 5:]
    assert ctx[:3].tolist() == [[True, True, False, False, False]] * 3  # block at 2: positions 0, 1
    assert ctx[3:].tolist() == [[True, True, True, True, False]] * 3  # block at 4: 0..3 (4 is padding)
    expected = torch.block_diag(torch.ones(3, 3), torch.ones(3, 3)).bool()
    assert torch.equal(blk, expected)
    causal = block_visibility(anchors, ctx_valid, 3, causal=True, sliding_window=None)[0, 0, :, 5:]
    assert torch.equal(causal, expected & torch.ones(6, 6).tril().bool())


def test_train_forward_equals_the_inference_drafter_per_block():
    hf = build_tiny_target("llama", dtype=torch.float64)
    target = native_from_hf(hf)
    drafter = build_tiny_drafter(hf.config, dtype=torch.float64, num_layers=2, block_size=6)
    tokens = torch.randint(5, 256, (40,), generator=torch.Generator().manual_seed(0))
    taps = compute_features(target, [tokens], drafter.cfg.target_layer_ids)[0].double()
    sample = Sample(0, 10, tokens, taps)
    batch = make_batch([sample], 7, 6, drafter.mask_token_id, torch.Generator().manual_seed(0))
    ctx = batch.ctx_hidden.double()
    hidden = train_forward(drafter, ctx, batch.ctx_valid, target.embed(batch.block_ids.view(1, -1)),
                           batch.anchors).view(1, 7, 6, -1)
    for a in range(7):
        s = int(batch.anchors[0, a])
        assert 10 <= s <= 38 and batch.block_ids[0, a, 0] == tokens[s]
        n_targets = min(5, 39 - s)
        assert torch.equal(batch.targets[0, a, :n_targets], tokens[s + 1: s + 1 + n_targets])
        assert bool((batch.targets[0, a, n_targets:] == IGNORE).all())
        cache = drafter.new_cache(1, 64)
        cache.add_rows(1)
        ref = drafter(cache, slice(0, 1), ctx[:, :s], torch.arange(s)[None], target.embed(batch.block_ids[:, a]),
                      (s + torch.arange(6))[None])
        torch.testing.assert_close(hidden[:, a], ref, rtol=0, atol=1e-10)


def test_regenerated_taps_equal_a_prefill_pass_and_are_cached(tmp_path):
    hf = build_tiny_target("llama", seed=1, dtype=torch.float64, vocab_size=VOCAB, num_layers=4)
    target = native_from_hf(hf)
    prompts = _prompts(6, seed=5)
    kw = dict(key="k", max_new_tokens=12, batch_size=4, max_seq_len=64, shard_size=4, progress=False)
    samples = regenerate(target, prompts, (1, 3), tmp_path / "cache", **kw)
    engine = DFlashEngine(target, None, EngineConfig(speculative=False, max_batch_size=1, max_seq_len=64))
    for p, s in zip(prompts, samples):
        greedy = engine.generate([p], SamplingParams(max_new_tokens=12))[0].tokens
        assert s.tokens.tolist() == p + greedy and s.prompt_len == len(p)
    reference = compute_features(target, [s.tokens for s in samples], (1, 3))
    for s, ref in zip(samples, reference):
        torch.testing.assert_close(s.target_hidden.float(), ref.float(), rtol=2e-3, atol=2e-3)
    assert len(list((tmp_path / "cache").glob("shard-*.safetensors"))) == 2
    again = regenerate(None, prompts, (1, 3), tmp_path / "cache", **kw)  # no target: all from disk
    assert all(torch.equal(a.tokens, b.tokens) and torch.equal(a.target_hidden, b.target_hidden) for a, b in zip(samples, again))
    shuffled = regenerate(None, prompts[::-1][:4], (1, 3), tmp_path / "cache", **kw)  # matched by prompt
    assert [s.index for s in shuffled] == [0, 1, 2, 3]
    assert [s.tokens.tolist() for s in shuffled] == [s.tokens.tolist() for s in samples[::-1][:4]]


# ---- end to end ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(target_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("run") / "e2e"
    prompts = _prompts(136, seed=1)
    trainer = Trainer(_config(target_dir, root), prompts[:128], prompts[128:], {"source": "random ids"})
    trainer.prepare_data()
    untrained = evaluate_tau(trainer.target, new_drafter(trainer.drafter_cfg, 0).eval(), prompts[128:], 64)
    drafter = trainer.run().eval()
    return trainer, untrained, drafter, prompts[128:]


def test_evaluate_tau_verifies_whole_blocks(trained):
    """Training's tau is the paper's (every draft verified), not the CPU's confidence-cut default."""
    trainer, _, drafter, held_out = trained
    prompts = held_out[:4]
    tau = evaluate_tau(trainer.target, drafter, prompts, 32)
    for confidence, same in ((0.0, True), (0.9, False)):
        engine = DFlashEngine(trainer.target, drafter, EngineConfig(max_batch_size=4, max_seq_len=128,
                                                                    draft_confidence=confidence))
        steps = [st for r in engine.generate(prompts, SamplingParams(max_new_tokens=32)) for st in r.steps]
        assert (sum(st.accepted + 1 for st in steps) / len(steps) == tau) == same, confidence


def test_training_raises_tau_on_held_out_prompts(trained):
    trainer, untrained, drafter, held_out = trained
    tau = evaluate_tau(trainer.target, drafter, held_out, 64)
    print(f"tau untrained {untrained:.2f} trained {tau:.2f}")
    assert tau > untrained + 0.3, (untrained, tau)
    losses = [loss for _, loss in trainer.state.losses]
    assert sum(losses[-20:]) / 20 < 0.7 * sum(losses[:20]) / 20


def test_output_is_a_loadable_drafter_and_decoding_stays_lossless(trained):
    trainer, _, drafter, held_out = trained
    out = trainer.config.output
    loaded = DFlashDrafter.from_pretrained(out)
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor)
    upstream = pytest.importorskip("dflash.model")  # the reference package reads the same directory
    ref = upstream.DFlashDraftModel.from_pretrained(str(out))
    assert (ref.target_layer_ids, ref.block_size, ref.mask_token_id) == ([1, 2, 3], 8, VOCAB - 1)
    assert all(torch.equal(ref.state_dict()[k], v) for k, v in loaded.state_dict().items())
    doc = yaml.safe_load((out / "training_config.yaml").read_text())
    assert doc["results"]["steps"] == 300 and doc["data"]["recipe"] == {"source": "random ids"}
    target = load_native_target(trainer.config.target, torch.float64)  # float64: no near-tie flips
    params = SamplingParams(max_new_tokens=32)
    ar = DFlashEngine(target, None, EngineConfig(speculative=False, max_seq_len=256)).generate(held_out, params)
    spec = DFlashEngine(target, loaded.to(torch.float64), EngineConfig(max_batch_size=8, max_seq_len=256)).generate(held_out, params)
    assert [r.tokens for r in spec] == [r.tokens for r in ar]


def test_resume_after_ctrl_c_equals_an_uninterrupted_run(target_dir, tmp_path):
    prompts = _prompts(40, seed=3)
    kw = dict(steps=8, save_every=3, batch_size=4, anchors_per_seq=4, max_new_tokens=16, eval_every=4, eval_tokens=8)
    straight = Trainer(_config(target_dir, tmp_path / "a", **kw), prompts[:36], prompts[36:])
    reference = straight.run()

    def interrupt(step: int, loss: float) -> None:
        if step == 5:
            raise KeyboardInterrupt

    first = Trainer(_config(target_dir, tmp_path / "b", **kw), prompts[:36], prompts[36:])
    with pytest.raises(KeyboardInterrupt):
        first.run(on_step=interrupt)
    latest = read_latest(tmp_path / "b" / "work" / "checkpoints")
    assert latest is not None and latest.name == "step-0000005"  # saved on Ctrl-C
    assert not (tmp_path / "b" / "out").exists()
    with pytest.raises(ConfigError, match="--resume"):
        Trainer(_config(target_dir, tmp_path / "b", **kw), prompts[:36], prompts[36:]).run()
    resumed = Trainer(_config(target_dir, tmp_path / "b", resume=True, **kw), prompts[:36], prompts[36:])
    final = resumed.run()
    assert resumed.state.step == 8
    assert [s for s, _ in resumed.state.losses] == list(range(1, 9))
    torch.testing.assert_close(resumed.state.losses, straight.state.losses, rtol=1e-5, atol=1e-6)
    assert [s for s, _ in resumed.state.evals] == [0, 4, 8]
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(final.state_dict()[name], tensor, rtol=1e-5, atol=1e-6)


def test_bf16_autocast_trains_like_fp32_and_keeps_fp32_weights(target_dir, tmp_path, caplog):
    """--bf16: the same run under bf16 autocast gives losses within bf16 rounding of the fp32 run's
    (and not bit-equal: autocast is in effect), and the trained drafter's weights stay fp32. On a CPU
    without native bf16 matmul (this machine's oneDNN probe) the run warns that it will be slow."""
    prompts = _prompts(24, seed=4)
    losses = {}
    for bf16 in (False, True):
        kw = dict(steps=4, batch_size=4, anchors_per_seq=4, max_new_tokens=16, bf16=bf16)
        trainer = Trainer(_config(target_dir, tmp_path / str(bf16), **kw), prompts, [])
        caplog.clear()
        with caplog.at_level("WARNING", logger="dflash_trt.train.trainer"):
            drafter = trainer.run()
        warned = any("without native bf16" in r.getMessage() for r in caplog.records)
        assert warned == (bf16 and not cpu_has_native_bf16())
        assert {p.dtype for p in drafter.parameters()} == {torch.float32}
        losses[bf16] = [loss for _, loss in trainer.state.losses]
    assert losses[True] != losses[False]
    torch.testing.assert_close(losses[True], losses[False], rtol=0.03, atol=0.0)


def test_cli_training_prompts_exclude_the_eval_sets():
    from dflash_trt.bench.datasets import humaneval_entry_points, load_humaneval, load_mtbench
    from dflash_trt.commands.train import training_prompts
    from dflash_trt.models.tiny import build_tiny_tokenizer
    from dflash_trt.train.data import DataRecipe, function_names, ngrams

    tok = build_tiny_tokenizer()
    ids, prompt_set = training_prompts(tok, DataRecipe(seed=0), max_prompt_tokens=10**6)
    assert len(ids) == len(prompt_set.prompts) > 500
    texts = [tok.decode(x) for x in ids]
    evals = load_humaneval() + load_mtbench()
    banned = set().union(*(ngrams(p.text, prompt_set.recipe.ngram_n) for p in evals))
    names = humaneval_entry_points()
    for text in texts:
        assert ngrams(text, prompt_set.recipe.ngram_n).isdisjoint(banned)
        assert function_names(text).isdisjoint(names)
    assert not any(p.text in t for p in evals for t in texts)


def test_continue_from_carries_weights_and_adam_moments_into_a_new_schedule(target_dir, tmp_path):
    """--continue-from: a new run starts from another run's checkpoint with its float32 weights AND its
    AdamW moments (a --drafter-init start has zero moments), under the new run's own steps and schedule."""
    from dflash_trt.train.loss import cosine_schedule

    prompts = _prompts(24, seed=5)
    kw = dict(batch_size=4, anchors_per_seq=4, max_new_tokens=16)
    first = Trainer(_config(target_dir, tmp_path / "a", steps=6, save_every=3, **kw), prompts, [])
    trained = first.run()
    saved = torch.load(tmp_path / "a" / "work" / "checkpoints" / "step-0000006" / "trainer_state.pt", weights_only=True)

    cfg = _config(target_dir, tmp_path / "b", steps=5, lr=1e-3, continue_from=tmp_path / "a" / "work", **kw)
    second = Trainer(cfg, prompts, [])
    assert second.carried.step == 6 and second.carried.path.name == "step-0000006"
    drafter, opt, sched, _ = second._build()
    for name, tensor in trained.state_dict().items():
        assert torch.equal(drafter.state_dict()[name], tensor)
    moments = opt.state_dict()["state"]
    assert set(moments) == set(saved["optimizer"]["state"]) and moments
    for i, st in saved["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(moments[i][key], st[key])
    # the new run's learning rate and schedule, not the old run's (which had decayed to its end)
    warmup = max(1, round(cfg.warmup_ratio * cfg.steps))
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * cosine_schedule(0, 5, warmup))
    second.run()
    assert second.state.step == 5 and [s for s, _ in second.state.losses] == [1, 2, 3, 4, 5]
    doc = yaml.safe_load((cfg.output / "training_config.yaml").read_text())
    assert doc["continued_from"] == {"checkpoint": str(second.carried.path), "step": 6}
    assert doc["train_config"]["continue_from"] == str(tmp_path / "a" / "work")

    # the same start through --drafter-init restarts AdamW from zero moments
    fresh = Trainer(_config(target_dir, tmp_path / "c", steps=5, lr=1e-3, drafter_init=cfg.output, **kw), prompts, [])
    _, fresh_opt, _, _ = fresh._build()
    assert fresh_opt.state_dict()["state"] == {}


def test_continue_from_refuses_bad_starts_before_any_data_work(target_dir, tmp_path):
    with pytest.raises(ConfigError, match="give one"):
        _config(target_dir, tmp_path, continue_from=tmp_path / "x", drafter_init=tmp_path / "y")
    with pytest.raises(ConfigError, match="no optimizer state"):
        _config(target_dir, tmp_path, continue_from=tmp_path / "x", grow_layers=1)
    from dflash_trt.errors import CheckpointError

    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no training checkpoint"):
        Trainer(_config(target_dir, tmp_path / "r", continue_from=tmp_path / "empty"), _prompts(4, seed=6), [])
    assert not (tmp_path / "data").exists()  # nothing regenerated


def test_wsd_schedule_warms_up_holds_then_cools_down_to_zero():
    from dflash_trt.train.loss import wsd_schedule

    total, warmup, decay = 100, 10, 20
    lrs = [wsd_schedule(s, total, warmup, decay) for s in range(total + 1)]
    assert lrs[:warmup] == pytest.approx([(s + 1) / warmup for s in range(warmup)])
    assert lrs[warmup:81] == [1.0] * 71  # constant through the last step before the cooldown
    assert lrs[90] == pytest.approx(1 - 0.5 ** 0.5) and lrs[100] == 0.0
    assert all(a > b for a, b in zip(lrs[81:], lrs[82:]))  # strictly decreasing in the cooldown


def test_schedule_settings_are_checked(target_dir, tmp_path):
    with pytest.raises(ConfigError, match="lr_schedule"):
        _config(target_dir, tmp_path, lr_schedule="linear")
    with pytest.raises(ConfigError, match="decay_ratio"):
        _config(target_dir, tmp_path, lr_schedule="wsd", decay_ratio=0.0)
    with pytest.raises(ConfigError, match="decay_ratio"):
        _config(target_dir, tmp_path, lr_schedule="wsd", decay_ratio=0.97, warmup_ratio=0.04)
    assert _config(target_dir, tmp_path).stable_step is None  # cosine keeps no stable state
    assert _config(target_dir, tmp_path, lr_schedule="wsd", decay_ratio=1.0, warmup_ratio=0.0).stable_step is None


def test_wsd_keeps_the_last_full_lr_state_and_a_later_run_continues_it_without_rewarming(target_dir, tmp_path):
    prompts = _prompts(28, seed=7)
    kw = dict(batch_size=4, anchors_per_seq=4, max_new_tokens=16, lr_schedule="wsd", heldout_every=0)
    cfg = _config(target_dir, tmp_path / "a", steps=6, decay_ratio=0.5, warmup_ratio=0.2, save_every=4, **kw)
    assert cfg.stable_step == 3
    first = Trainer(cfg, prompts[:24], [], heldout_prompts=prompts[24:])
    trained = first.run()
    stable = read_latest(tmp_path / "a" / "work" / "stable")
    assert stable is not None and stable.name == "step-0000003"
    from dflash_trt.train.state import load_checkpoint

    weights, extra = load_checkpoint(stable)
    assert extra["state"]["step"] == 3
    assert [h[0] for h in extra["state"]["heldout"]] == [3]  # measured where it was kept (heldout_every is off)
    doc = yaml.safe_load((cfg.output / "training_config.yaml").read_text())
    assert doc["results"]["stable_checkpoint"] == {"dir": str(tmp_path / "a" / "work" / "stable"), "step": 3}
    assert not all(torch.equal(weights[k], v) for k, v in trained.state_dict().items())  # 3 more steps since

    cont = _config(target_dir, tmp_path / "b", steps=4, warmup_ratio=0.0, continue_from=tmp_path / "a" / "work" / "stable", **kw)
    second = Trainer(cont, prompts[:24], [])
    assert second.carried.step == 3
    drafter, opt, _, _ = second._build()
    for name, tensor in weights.items():
        assert torch.equal(drafter.state_dict()[name], tensor)
    assert opt.param_groups[0]["lr"] == cont.lr  # the full learning rate from its first step


def test_train_vocab_from_init_keeps_the_starting_drafters_vocabulary(target_dir, tmp_path):
    """train_vocab_from 'init': the loss (and so the output's draft vocabulary) is the starting drafter's
    draft vocabulary, not a recount on the run's data; refused before any data work without one."""
    prompts = _prompts(16, seed=9)
    first = Trainer(_config(target_dir, tmp_path / "a", steps=2, batch_size=4, anchors_per_seq=4, max_new_tokens=16,
                            train_vocab=40), prompts, [])
    start = first.run()
    kept = torch.tensor(sorted(set(start.draft_vocab.tolist()) ^ {0, 1, 2}))  # not a count of any data
    start.set_draft_vocab(kept)
    start.save_pretrained(tmp_path / "init")
    kw = dict(steps=2, batch_size=4, anchors_per_seq=4, max_new_tokens=16, drafter_init=tmp_path / "init")
    run = Trainer(_config(target_dir, tmp_path / "b", train_vocab_from="init", **kw), _prompts(16, seed=10), [])
    assert torch.equal(run.run().draft_vocab, kept)
    recount = Trainer(_config(target_dir, tmp_path / "c", train_vocab=40, **kw), _prompts(16, seed=10), []).run()
    assert not torch.equal(recount.draft_vocab, kept)
    # refused: no starting drafter, both choices, a starting drafter without a vocabulary
    with pytest.raises(ConfigError, match="set drafter_init or continue_from"):
        _config(target_dir, tmp_path / "d", train_vocab_from="init")
    with pytest.raises(ConfigError, match="give one"):
        _config(target_dir, tmp_path / "d", train_vocab_from="init", train_vocab=40, **kw)
    start.set_draft_vocab(None)
    start.save_pretrained(tmp_path / "plain")
    data = tmp_path / "fresh-data"
    with pytest.raises(ConfigError, match="no draft vocabulary"):
        Trainer(_config(target_dir, tmp_path / "e", train_vocab_from="init", data_dir=data,
                        **dict(kw, drafter_init=tmp_path / "plain")), prompts, [])
    assert not data.exists()
