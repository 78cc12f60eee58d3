"""The native target (Llama / Qwen3 / gpt-oss over a ragged KV cache) against transformers."""
from __future__ import annotations

import pytest
import torch

from dflash_trt.errors import CheckpointError, ConfigError, InputError
from dflash_trt.models.target import HFTarget, load_native_target, native_from_hf, native_from_state_dict
from dflash_trt.models.tiny import TINY_ARCHS, build_tiny_target, save_tiny_target

TAPS = (0, 2, 5)


@pytest.fixture(scope="module", params=TINY_ARCHS)
def pair(request):
    hf = build_tiny_target(request.param, seed=1, dtype=torch.float64)
    return hf, native_from_hf(hf)


def _hf_reference(hf, ids):
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    return out.logits, torch.cat([out.hidden_states[i + 1] for i in TAPS], dim=-1)


def test_logits_and_taps_match_transformers_in_chunks(pair):
    """Prefill then two incremental chunks (prompt longer than gpt-oss's sliding window 8)."""
    hf, native = pair
    ids = torch.randint(5, 250, (2, 23), generator=torch.Generator().manual_seed(0))
    ref_logits, ref_taps = _hf_reference(hf, ids)
    cache = native.new_cache(2, 64)
    cache.add_rows(2)
    pos = torch.arange(23)[None].repeat(2, 1)
    logits, taps = [], []
    for lo, hi in ((0, 11), (11, 12), (12, 23)):
        out = native.forward(cache, slice(0, 2), ids[:, lo:hi], pos[:, lo:hi], TAPS)
        logits.append(out.logits)
        taps.append(out.target_hidden)
    torch.testing.assert_close(torch.cat(logits, 1), ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(taps, 1), ref_taps, atol=1e-5, rtol=1e-5)


def test_ragged_rows_and_crop_equal_separate_runs(pair):
    """Rows of different lengths padded into one forward, then a crop that drops rejected tokens,
    give each row exactly what it gets alone."""
    hf, native = pair
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 250, (n,), generator=g) for n in (4, 13)]
    cache = native.new_cache(2, 64)
    cache.add_rows(2)
    dead = cache.dead_slot
    ids = torch.zeros(2, 13, dtype=torch.long)
    pos = torch.full((2, 13), dead)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
        pos[i, : len(p)] = torch.arange(len(p))
    native.forward(cache, slice(0, 2), ids, pos)
    cache.crop(torch.tensor([4, 13]))
    # speculative block of 3 garbage tokens, then keep only the first (as after a rejection)
    junk = torch.randint(5, 250, (2, 3), generator=g)
    block_pos = torch.tensor([[4, 5, 6], [13, 14, 15]])
    native.forward(cache, slice(0, 2), junk, block_pos)
    cache.crop(torch.tensor([5, 14]))
    nxt = torch.randint(5, 250, (2, 2), generator=g)
    out = native.forward(cache, slice(0, 2), nxt, torch.tensor([[5, 6], [14, 15]]))
    for i, p in enumerate(prompts):
        full = torch.cat([p, junk[i, :1], nxt[i]])[None]
        ref_logits, _ = _hf_reference(hf, full)
        torch.testing.assert_close(out.logits[i], ref_logits[0, -2:], atol=1e-5, rtol=1e-5)


def test_hf_adapter_matches_transformers(pair):
    hf, _ = pair
    target = HFTarget(hf)
    ids = torch.randint(5, 250, (1, 12), generator=torch.Generator().manual_seed(2))
    cache = target.new_cache(1, 64)
    cache.add_rows(1)
    out = target.forward(cache, slice(0, 1), ids, torch.arange(12)[None], TAPS)
    ref_logits, ref_taps = _hf_reference(hf, ids)
    torch.testing.assert_close(out.logits, ref_logits)
    torch.testing.assert_close(out.target_hidden, ref_taps)
    cache.crop(torch.tensor([7]))
    out2 = target.forward(cache, slice(0, 1), ids[:, 7:9], torch.tensor([[7, 8]]), TAPS)
    torch.testing.assert_close(out2.logits, ref_logits[:, 7:9], atol=1e-6, rtol=1e-6)
    with pytest.raises(InputError):
        target.new_cache(2, 64)


def test_load_from_directory(tmp_path):
    hf = build_tiny_target("qwen3", seed=3)
    save_tiny_target(hf, tmp_path / "t")
    native = load_native_target(tmp_path / "t")
    assert native.info.num_hidden_layers == hf.config.num_hidden_layers
    torch.testing.assert_close(native.lm_head.weight, hf.lm_head.weight)


def test_checkpoint_errors(tmp_path):
    hf = build_tiny_target("llama", seed=4)
    state = hf.state_dict()
    missing = {k: v for k, v in state.items() if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(CheckpointError, match="missing"):
        native_from_state_dict(hf.config, missing, torch.float32)
    extra = dict(state, **{"model.layers.0.bogus.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="unexpected"):
        native_from_state_dict(hf.config, extra, torch.float32)
    bad = dict(state)
    bad["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(CheckpointError, match="shape"):
        native_from_state_dict(hf.config, bad, torch.float32)
    with pytest.raises(CheckpointError, match="config.json"):
        load_native_target(tmp_path / "nowhere")


def test_unsupported_architecture_is_a_config_error():
    from transformers import GPT2Config

    with pytest.raises(ConfigError, match="not supported"):
        native_from_state_dict(GPT2Config(n_layer=1, n_embd=8, n_head=2), {}, torch.float32)


def test_bad_token_ids_are_rejected(pair):
    _, native = pair
    cache = native.new_cache(1, 16)
    cache.add_rows(1)
    with pytest.raises(InputError, match="token ids"):
        native.forward(cache, slice(0, 1), torch.tensor([[10_000]]), torch.tensor([[0]]))


def test_gpt_oss_mxfp4_experts_load_dequantized():
    """A gpt-oss state dict with experts in the release format (MXFP4 `*_blocks` + `*_scales`,
    [E, out, G, 16]) loads and gives the logits of the same model holding the dequantized weights."""
    from dflash_trt.quant.mxfp4 import dequantize_mxfp4

    hf = build_tiny_target("gpt_oss", seed=5)
    state = dict(hf.state_dict())
    g = torch.Generator().manual_seed(0)
    for layer in range(hf.config.num_hidden_layers):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            e, n_in, n_out = state[name].shape  # HF layout [E, in, out]
            blocks = torch.randint(0, 256, (e, n_out, n_in // 32, 16), dtype=torch.uint8, generator=g)
            scales = torch.randint(120, 125, (e, n_out, n_in // 32), dtype=torch.uint8, generator=g)
            state[name] = dequantize_mxfp4(blocks, scales, torch.float32).transpose(-1, -2).contiguous()
            state[name + "_blocks"], state[name + "_scales"] = blocks, scales
    plain = native_from_state_dict(hf.config, {k: v for k, v in state.items() if not k.endswith(("_blocks", "_scales"))},
                                   torch.float32)
    packed = native_from_state_dict(hf.config, {k: v for k, v in state.items()
                                                if not (k.endswith(("gate_up_proj", "down_proj")))}, torch.float32)
    ids = torch.randint(5, 250, (1, 10), generator=g)
    outs = []
    for model in (plain, packed):
        cache = model.new_cache(1, 32)
        cache.add_rows(1)
        outs.append(model.forward(cache, slice(0, 1), ids, torch.arange(10)[None]).logits)
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    with pytest.raises(CheckpointError, match="_scales"):
        native_from_state_dict(hf.config, {k: v for k, v in state.items() if not k.endswith("down_proj_scales")},
                               torch.float32)
