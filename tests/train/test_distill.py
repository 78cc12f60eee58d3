"""Training levers of the scaled drafter recipe: recorded teacher distributions, the distillation
loss, the training-vocabulary subset, the warm start from target layers, lazy samples and
continuing from a drafter."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from dflash_trt.errors import ConfigError
from dflash_trt.models.target import native_from_hf
from dflash_trt.models.tiny import build_tiny_drafter, build_tiny_target, random_prompts
from dflash_trt.train.features import IGNORE, compute_features, make_batch
from dflash_trt.train.loss import TrainVocab, block_loss, distill_ce, position_weights, prefix_weights, train_forward
from dflash_trt.train.regen import Sample, SampleRef, regenerate
from dflash_trt.train.warm_start import default_source_layers, warm_start_from_target

VOCAB = 48


def _prompts(n: int, seed: int) -> list[list[int]]:
    return random_prompts(n, seed, VOCAB, max_len=10)


@pytest.fixture(scope="module")
def tiny():
    hf = build_tiny_target("llama", seed=2, dtype=torch.float64, vocab_size=VOCAB, num_layers=4)
    return hf, native_from_hf(hf)


@pytest.fixture(scope="module")
def regenerated(tiny, tmp_path_factory):
    _, target = tiny
    prompts = _prompts(5, seed=3)
    root = tmp_path_factory.mktemp("regen")
    kw = dict(key="k", max_new_tokens=10, batch_size=3, max_seq_len=48, shard_size=2, progress=False, topk=6)
    return prompts, regenerate(target, prompts, (1, 3), root, **kw), root, kw


# ---- recorded teacher distributions -------------------------------------------------------------

def test_recorded_topk_equals_a_fresh_target_forward(tiny, regenerated):
    _, target = tiny
    _, samples, _, _ = regenerated
    for s in samples:
        cache = target.new_cache(1, 64)
        rows = cache.add_rows(1)
        ids = s.tokens[None, :-1]
        pos = torch.arange(ids.shape[1])[None]
        out = target.forward(cache, slice(rows.start, rows.stop), ids, pos,
                             logit_index=torch.arange(s.prompt_len - 1, ids.shape[1])[None])
        logp = torch.log_softmax(out.logits[0].float(), -1)  # [R, V]: the distribution of each response token
        vals, idx = logp.topk(6, -1)
        assert s.topk_ids.shape == (s.response_len, 6)
        assert torch.equal(s.topk_ids[:, 0].long(), s.tokens[s.prompt_len:])  # greedy = the top-1
        assert torch.equal(s.topk_ids.long(), idx)
        torch.testing.assert_close(s.topk_logprobs.float(), vals, rtol=0, atol=2e-3)


def test_lazy_refs_load_what_was_written(tiny, regenerated):
    prompts, samples, root, kw = regenerated
    refs = regenerate(None, prompts, (1, 3), root, **{**kw, "lazy": True})
    assert all(isinstance(r, SampleRef) for r in refs)
    for r, s in zip(refs, samples):
        loaded = r.load()
        assert torch.equal(loaded.tokens, s.tokens) and torch.equal(loaded.target_hidden, s.target_hidden)
        assert torch.equal(loaded.topk_ids, s.topk_ids) and torch.equal(loaded.topk_logprobs, s.topk_logprobs)


def test_batch_teacher_is_the_distribution_of_each_target_token(regenerated):
    _, samples, _, _ = regenerated
    batch = make_batch(samples, 4, 4, VOCAB - 1, torch.Generator().manual_seed(0))
    valid = batch.targets != IGNORE
    assert bool(valid.any())
    # wherever a slot has a target token, the teacher's top-1 is that token (greedy data)
    assert torch.equal(batch.teacher_ids[..., 0][valid], batch.targets[valid])
    assert bool(torch.isinf(batch.teacher_logprobs[~valid]).all())


# ---- losses -----------------------------------------------------------------------------------

def test_distillation_reduces_to_cross_entropy_for_a_one_hot_teacher():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 30, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 30, (7,), generator=g)
    ids = torch.stack([labels, (labels + 1) % 30, (labels + 2) % 30], -1)
    lp = torch.tensor([0.0, float("-inf"), float("-inf")], dtype=torch.float64).expand(7, 3)
    kd = distill_ce(torch.log_softmax(logits, -1), ids, lp)
    torch.testing.assert_close(kd, F.cross_entropy(logits, labels, reduction="none"))
    soft = torch.log_softmax(torch.randn(7, 3, generator=g, dtype=torch.float64), -1)
    logq = torch.log_softmax(logits, -1)
    expected = -(soft.exp() * logq.gather(-1, ids)).sum(-1)
    torch.testing.assert_close(distill_ce(logq, ids, soft), expected)


def _drafter_for(hf, **kw):
    c = hf.config
    shape = dict(intermediate_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
                 num_key_value_heads=c.num_key_value_heads, head_dim=c.hidden_size // c.num_attention_heads)
    return build_tiny_drafter(c, dtype=torch.float64, num_layers=2, block_size=4, target_layer_ids=[1, 3], **{**shape, **kw})


def test_kd_weight_and_full_train_vocab(tiny, regenerated):
    hf, target = tiny
    _, samples, _, _ = regenerated
    drafter = _drafter_for(hf)
    batch = make_batch(samples, 4, 4, VOCAB - 1, torch.Generator().manual_seed(1))
    ce = block_loss(drafter, target, batch, 4.0, 0.0)
    kd0 = block_loss(drafter, target, batch, 4.0, 0.0, TrainVocab.build(target.lm_head.weight, torch.arange(VOCAB)))
    torch.testing.assert_close(ce.loss, kd0.loss)  # the whole vocabulary as the subset changes nothing
    half = block_loss(drafter, target, batch, 4.0, 0.5)
    full = block_loss(drafter, target, batch, 4.0, 1.0)
    torch.testing.assert_close(half.loss, 0.5 * ce.loss + 0.5 * full.loss)
    assert not torch.isclose(ce.loss, full.loss)
    ids = torch.arange(0, VOCAB, 2)  # half the vocabulary: slots with odd target ids drop out
    sub = block_loss(drafter, target, batch, 4.0, 0.0, TrainVocab.build(target.lm_head.weight, ids))
    assert sub.tokens == int(((batch.targets % 2 == 0) & (batch.targets != IGNORE) & batch.anchor_valid[..., None]).sum())


def test_prefix_weights_multiply_the_earlier_slots_hit_probabilities():
    hit = torch.tensor([[0.5, 0.4, 1.0, 0.0, 0.9], [1.0, 1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    expected = torch.tensor([[1.0, 0.5, 0.2, 0.2, 0.0], [1.0] * 5], dtype=torch.float64)
    torch.testing.assert_close(prefix_weights(hit), expected)


def test_prefix_weighting_is_the_paper_loss_times_the_detached_prefix_probability(tiny, regenerated):
    hf, target = tiny
    _, samples, _, _ = regenerated
    drafter = _drafter_for(hf)
    batch = make_batch(samples, 4, 4, VOCAB - 1, torch.Generator().manual_seed(1))
    out = block_loss(drafter, target, batch, 4.0, weighting="prefix")
    # the same loss written out from the drafter's logits
    b, a, bs = batch.block_ids.shape
    hidden = train_forward(drafter, batch.ctx_hidden, batch.ctx_valid,
                           target.embed(batch.block_ids.reshape(b, a * bs)), batch.anchors)
    logits = target.head(hidden.view(b, a, bs, -1)[:, :, 1:]).float()  # [B, A, bs-1, V]
    targets = batch.targets.masked_fill(~batch.anchor_valid[:, :, None], IGNORE)
    valid = targets != IGNORE
    ce = F.cross_entropy(logits.flatten(0, 2), targets.clamp_min(0).flatten(), reduction="none").view_as(targets)
    ce = ce.masked_fill(~valid, 0.0)
    hit = torch.exp(-ce.detach()).masked_fill(~valid, 0.0)
    w = position_weights(bs, 4.0) * valid * torch.cumprod(torch.cat([torch.ones_like(hit[..., :1]), hit[..., :-1]], -1), -1)
    expected = (ce * w).sum() / w.sum()
    torch.testing.assert_close(out.loss, expected)
    paper = block_loss(drafter, target, batch, 4.0)
    assert not torch.isclose(out.loss, paper.loss)
    assert (out.accept_len, out.tokens) == (paper.accept_len, paper.tokens)  # only the weights differ
    # the prefix factor carries no gradient: the loss's gradient is that of sum(w * ce) / sum(w) at fixed w
    drafter.zero_grad()
    out.loss.backward()
    got = drafter.fc.weight.grad.clone()
    drafter.zero_grad()
    expected.backward()
    torch.testing.assert_close(got, drafter.fc.weight.grad)
    with pytest.raises(ValueError, match="weighting"):
        block_loss(drafter, target, batch, 4.0, weighting="acceptance")


def test_prefix_weighting_ignores_the_slots_after_a_certain_miss(tiny, regenerated):
    """A slot whose target is outside the loss vocabulary ends the block's acceptance, so with prefix
    weights the targets after it do not matter; with the paper's weights they do."""
    hf, target = tiny
    _, samples, _, _ = regenerated
    drafter = _drafter_for(hf)
    batch = make_batch(samples, 4, 4, VOCAB - 1, torch.Generator().manual_seed(1))
    vocab = TrainVocab.build(target.lm_head.weight, torch.arange(0, VOCAB, 2))  # even ids only
    first = batch.targets.clone()
    first[..., 0] = 2 * torch.arange(first[..., 0].numel()).view_as(first[..., 0]) % VOCAB  # in the vocabulary
    first[..., 1] = 1  # odd: outside it, a certain miss
    first[..., 2] = 4
    second = first.clone()
    second[..., 2] = 10  # another in-vocabulary token after the miss
    loss = {}
    for name, targets in (("first", first), ("second", second)):
        b = replace(batch, targets=targets.masked_fill(batch.targets == IGNORE, IGNORE))
        loss[name] = [block_loss(drafter, target, b, 4.0, vocab=vocab, weighting=w).loss for w in ("prefix", "paper")]
    torch.testing.assert_close(loss["first"][0], loss["second"][0])
    assert not torch.isclose(loss["first"][1], loss["second"][1])


def test_kd_without_teacher_data_is_an_error(tiny):
    hf, target = tiny
    tokens = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(0))
    taps = compute_features(target, [tokens], (1, 3))[0]
    batch = make_batch([Sample(0, 5, tokens, taps)], 3, 4, VOCAB - 1, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="teacher"):
        block_loss(_drafter_for(hf), target, batch, 4.0, 0.5)


# ---- warm start -------------------------------------------------------------------------------

def test_warm_start_feeds_the_first_copied_layer_its_own_input(tiny):
    hf, target = tiny
    drafter = _drafter_for(hf)
    used = warm_start_from_target(drafter, target)
    assert used == default_source_layers(4, 3, 2) == [2, 3]  # too few layers after tap 3: the last two
    tokens = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(0))
    taps = compute_features(target, [tokens], (1, 3))[0].double()  # [L-1, 2 H]
    h = hf.config.hidden_size
    deepest = taps[:, h:]  # output of layer 3
    # the fused context is exactly what target layer `used[0]` normalizes its input to
    ctx = drafter.fuse(taps[None])[0]
    ref = target.model.layers[used[0]].input_layernorm(deepest)
    torch.testing.assert_close(ctx, ref, rtol=1e-12, atol=1e-12)
    for i, src in enumerate(used):
        t_layer, d_layer = target.model.layers[src], drafter.layers[i]
        x = torch.randn(3, h, dtype=torch.float64)
        torch.testing.assert_close(d_layer.mlp(x), t_layer.mlp(x))
        torch.testing.assert_close(d_layer.self_attn.k_proj(ctx), t_layer.self_attn.k_proj(ref))
    torch.testing.assert_close(drafter.norm.weight, target.model.norm.weight)


def test_warm_start_rejects_a_drafter_of_another_shape(tiny):
    hf, target = tiny
    narrow = _drafter_for(hf, intermediate_size=hf.config.intermediate_size // 2)
    with pytest.raises(ConfigError, match="target's width"):
        warm_start_from_target(narrow, target)
    with pytest.raises(ConfigError):
        warm_start_from_target(narrow, target, [9])


# ---- the CLI drives the scaled recipe -----------------------------------------------------------

def _cli(*args: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "dflash_trt.cli", "train", *args], capture_output=True, text=True,
                          timeout=600)


def test_train_cli_on_prompt_files_with_the_levers(tmp_path):
    """`dflash-trt train --prompts/--heldout-prompts` with warm start, distillation, a vocabulary subset
    and held-out selection: the drafter, its recorded config and the held-out best all come out."""
    import yaml

    from dflash_trt.models.tiny import save_tiny_checkpoint
    from dflash_trt.train.mix import EncodedPrompt, write_prompts

    target, _ = save_tiny_checkpoint(tmp_path / "ckpt", num_layers=4)
    train = [EncodedPrompt(f"t{i}", "code", "raw", tuple(p)) for i, p in enumerate(_prompts(6, seed=5))]
    held = [EncodedPrompt(f"h{i}", "code", "raw", tuple(p)) for i, p in enumerate(_prompts(2, seed=6))]
    write_prompts(tmp_path / "train.jsonl", train)
    write_prompts(tmp_path / "held.jsonl", held)
    out = tmp_path / "drafter"
    common = ["--target", str(target), "--output", str(out), "--prompts", str(tmp_path / "train.jsonl"),
              "--layers", "1", "--target-layer-ids", "1,2", "--block-size", "4", "--max-new-tokens", "8",
              "--max-seq-len", "64", "--batch-size", "2", "--anchors", "2", "--no-progress"]
    proc = _cli(*common, "--heldout-prompts", str(tmp_path / "held.jsonl"), "--heldout-every", "2", "--steps", "4",
                "--init", "target", "--kd-weight", "0.5", "--topk", "4", "--train-vocab", "40",
                "--loss-weighting", "prefix")
    assert proc.returncode == 0, proc.stderr
    assert "best held-out accept length" in proc.stderr
    cfg = yaml.safe_load((out / "training_config.yaml").read_text())["train_config"]
    assert (cfg["init"], cfg["kd_weight"], cfg["topk"], cfg["train_vocab"], cfg["heldout_every"],
            cfg["loss_weighting"]) == ("target", 0.5, 4, 40, 2, "prefix")
    assert (out / "model.safetensors").is_file() and (tmp_path / "drafter.work" / "best" / "config.json").is_file()
    # the drafter proposes what it was trained on: its draft vocabulary is the loss's 40 tokens
    from dflash_trt.models.drafter import DFlashDrafter

    for where in (out, tmp_path / "drafter.work" / "best"):
        vocab = DFlashDrafter.from_pretrained(where).draft_vocab
        assert vocab is not None and 0 < vocab.numel() <= 40

    # the ablation table and the training curves of that run
    import subprocess
    import sys

    report = subprocess.run([sys.executable, "-m", "dflash_trt.cli", "train-report", str(out), "--label", "levers",
                             "--plot", str(tmp_path / "curves.png")], capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr
    record = yaml.safe_load((out / "training_config.yaml").read_text())["results"]
    table = [line for line in report.stdout.splitlines() if line.startswith("| levers |")]
    cells = [c.strip() for c in table[0].strip("|").split("|")]
    best_step, best = record["best"]
    assert [h[0] for h in record["heldout"]] == [0, 2, 4]  # the starting point, then every --heldout-every steps
    assert cells[1:8] == ["target", "0.5", "1", "4", "40", "4", f"{4 * 2 * 2:,}"]
    assert cells[9] == f"{best:.3f} ({best_step})" and cells[10] == f"{record['heldout'][-1][2]:.3f}"
    assert cells[12] == "prefix"
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([sys.executable, "-m", "dflash_trt.cli", "train-report", str(tmp_path)], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "no training_config.yaml" in bad.stderr

    # cheap mistakes are refused before any model loads, in one line
    for extra, message in [(["--heldout-every", "2"], "--heldout-every needs --heldout-prompts"),
                           (["--heldout-prompts", str(tmp_path / "train.jsonl"), "--steps", "1"], "disjoint"),
                           (["--prompts", str(tmp_path / "missing.jsonl")], "does not exist"),
                           (["--self-prompts", "4"], "--self-prompts")]:
        bad = _cli(*common, "--work-dir", str(tmp_path / "w2"), *extra)
        assert bad.returncode == 2 and message in bad.stderr and "Traceback" not in bad.stderr, (extra, bad.stderr)
