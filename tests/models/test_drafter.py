"""The DFlash drafter: numerics against an independent computation and the upstream reference,
checkpoint round trip, and clear errors on bad checkpoints and configs."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_trt.config import DrafterConfig, TargetInfo, check_drafter_matches_target
from dflash_trt.errors import CheckpointError, ConfigError, InputError
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.models.tiny import build_tiny_drafter, tiny_drafter_config, tiny_target_config


def naive_drafter(drafter: DFlashDrafter, taps: torch.Tensor, block_embeds: torch.Tensor, start: int) -> torch.Tensor:
    """Straight-from-the-paper computation for one sequence: context at positions 0..start-1,
    block at start..start+T-1, full (non-causal) attention, no cache. taps [C, nH], block [T, H]."""
    cfg = drafter.cfg
    sd = {k: v.to(torch.float64) for k, v in drafter.state_dict().items()}
    eps, d, hq, hk = cfg.rms_norm_eps, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads

    def norm(x, w):
        return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))

    theta = cfg.raw["rope_theta"]
    inv = torch.tensor([1.0 / theta ** (2 * i / d) for i in range(d // 2)], dtype=torch.float64)

    def rope(x, pos):  # x [N, heads, d]
        ang = pos[:, None].to(torch.float64) * inv[None, :]
        c, s = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
        a, b = x[..., : d // 2], x[..., d // 2:]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)

    ctx = norm(taps.to(torch.float64) @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    x = block_embeds.to(torch.float64)
    c, t = ctx.shape[0], x.shape[0]
    pos_ctx, pos_blk = torch.arange(c), torch.arange(start, start + t)
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        h = norm(x, sd[p + "input_layernorm.weight"])
        q = norm((h @ sd[p + "self_attn.q_proj.weight"].T).view(t, hq, d), sd[p + "self_attn.q_norm.weight"])
        kin = torch.cat([ctx, h])
        k = norm((kin @ sd[p + "self_attn.k_proj.weight"].T).view(c + t, hk, d), sd[p + "self_attn.k_norm.weight"])
        v = (kin @ sd[p + "self_attn.v_proj.weight"].T).view(c + t, hk, d)
        q, k = rope(q, pos_blk), rope(k, torch.cat([pos_ctx, pos_blk]))
        k, v = k.repeat_interleave(hq // hk, dim=1), v.repeat_interleave(hq // hk, dim=1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d), dim=-1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(t, hq * d)
        x = x + o @ sd[p + "self_attn.o_proj.weight"].T
        h = norm(x, sd[p + "post_attention_layernorm.weight"])
        gate = h @ sd[p + "mlp.gate_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * (h @ sd[p + "mlp.up_proj.weight"].T)) @ sd[p + "mlp.down_proj.weight"].T
    return norm(x, sd["norm.weight"])


@pytest.fixture(scope="module")
def target_cfg():
    return tiny_target_config("qwen3", num_layers=6)


@pytest.mark.parametrize("layers,target_layer_ids", [(1, [1, 3]), (2, [0, 2, 5]), (3, [4])])
def test_cached_forward_matches_naive_computation(target_cfg, layers, target_layer_ids):
    """Context fed in two pieces through the cache (as the loop does) == one naive pass."""
    drafter = build_tiny_drafter(target_cfg, seed=layers, dtype=torch.float64, num_layers=layers,
                                 target_layer_ids=target_layer_ids)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(9, len(target_layer_ids) * 64, generator=g, dtype=torch.float64)
    blocks = [torch.randn(8, 64, generator=g, dtype=torch.float64) for _ in range(2)]
    cache = drafter.new_cache(1, 64)
    cache.add_rows(1)
    first = drafter(cache, slice(0, 1), feats[None, :5], torch.arange(5)[None], blocks[0][None], torch.arange(5, 13)[None])
    cache.crop(torch.tensor([5]))
    second = drafter(cache, slice(0, 1), feats[None, 5:], torch.arange(5, 9)[None], blocks[1][None], torch.arange(9, 17)[None])
    torch.testing.assert_close(first[0], naive_drafter(drafter, feats[:5], blocks[0], 5), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(second[0], naive_drafter(drafter, feats, blocks[1], 9), atol=2e-6, rtol=1e-5)


def test_matches_upstream_reference_package(target_cfg):
    """Same weights in the upstream `dflash` package's DFlashDraftModel give the same hidden states."""
    upstream = pytest.importorskip("dflash.model")
    from transformers import Qwen3Config

    drafter = build_tiny_drafter(target_cfg, seed=7, dtype=torch.float64, num_layers=2, target_layer_ids=[1, 4])
    fields = {k: v for k, v in drafter.cfg.raw.items() if k != "architectures"}
    ref = upstream.DFlashDraftModel(Qwen3Config(**fields)).to(torch.float64).eval()
    ref.load_state_dict(drafter.state_dict(), strict=True)
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(1, 6, 128, generator=g, dtype=torch.float64)
    block = torch.randn(1, 8, 64, generator=g, dtype=torch.float64)
    with torch.no_grad():
        theirs = ref(position_ids=torch.arange(14)[None], noise_embedding=block, target_hidden=feats)
    cache = drafter.new_cache(1, 32)
    cache.add_rows(1)
    ours = drafter(cache, slice(0, 1), feats, torch.arange(6)[None], block, torch.arange(6, 14)[None])
    torch.testing.assert_close(ours, theirs, atol=2e-6, rtol=1e-5)


def test_sliding_window_layers(target_cfg):
    raw = tiny_drafter_config(target_cfg, num_layers=2, target_layer_ids=[1, 3], layer_types=["sliding_attention", "full_attention"],
                              sliding_window=4)
    cfg = DrafterConfig.from_dict(raw)
    drafter = DFlashDrafter(cfg).to(torch.float64)
    assert drafter.layers[0].self_attn.sliding_window == 4 and drafter.layers[0].self_attn.causal
    assert drafter.layers[1].self_attn.sliding_window is None and not drafter.layers[1].self_attn.causal
    cache = drafter.new_cache(1, 32)
    cache.add_rows(1)
    out = drafter(cache, slice(0, 1), torch.randn(1, 10, 128, dtype=torch.float64), torch.arange(10)[None],
                  torch.randn(1, 4, 64, dtype=torch.float64), torch.arange(10, 14)[None])
    assert out.shape == (1, 4, 64) and torch.isfinite(out).all()


def test_checkpoint_round_trip_is_bit_exact(tmp_path, target_cfg):
    drafter = build_tiny_drafter(target_cfg, seed=5, num_layers=2, target_layer_ids=[1, 3])
    src = drafter.save_pretrained(tmp_path / "a", dtype=torch.bfloat16)
    loaded = DFlashDrafter.from_pretrained(src)  # computes in float32
    again = loaded.save_pretrained(tmp_path / "b")
    a, b = load_file(str(src / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype == torch.bfloat16
        assert torch.equal(a[name].view(torch.int16), b[name].view(torch.int16)), name
    assert json.loads((src / "config.json").read_text()) == json.loads((again / "config.json").read_text())
    names = set(a)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_norm.weight",
            "layers.0.mlp.gate_proj.weight", "layers.0.post_attention_layernorm.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)


def test_draft_vocabulary_round_trip_and_bad_files(tmp_path, target_cfg):
    drafter = build_tiny_drafter(target_cfg, seed=5, num_layers=1, target_layer_ids=[1, 3])
    assert drafter.draft_vocab is None
    assert not (drafter.save_pretrained(tmp_path / "none") / "draft_vocab.json").exists()
    drafter.set_draft_vocab([0, 3, 7, target_cfg.vocab_size - 1])
    src = drafter.save_pretrained(tmp_path / "a")
    assert DFlashDrafter.from_pretrained(src).draft_vocab.tolist() == [0, 3, 7, target_cfg.vocab_size - 1]
    for ids, message in [([3, 3], "sorted and unique"), ([5, 2], "sorted and unique"), ([], "at least one"),
                         ([0, target_cfg.vocab_size], "must be in"), ([-1, 2], "must be in")]:
        with pytest.raises(CheckpointError, match=message):
            drafter.set_draft_vocab(ids)
    vocab_file = src / "draft_vocab.json"
    for text, message in [("{", "not valid JSON"), ('{"token_ids": [1]}', "format"),
                          ('{"format": "dflash_trt.draft_vocab/1", "token_ids": [1.5]}', "list of integers"),
                          ('{"format": "dflash_trt.draft_vocab/1", "token_ids": [9, 1]}', "sorted")]:
        vocab_file.write_text(text)
        with pytest.raises(CheckpointError, match=message):
            DFlashDrafter.from_pretrained(src)


def test_bad_checkpoints_raise_checkpoint_errors(tmp_path, target_cfg):
    src = build_tiny_drafter(target_cfg, seed=6, num_layers=1, target_layer_ids=[1, 3]).save_pretrained(tmp_path / "d")
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing.*up_proj"):
        DFlashDrafter.from_pretrained(src)
    tensors["layers.0.mlp.up_proj.weight"] = torch.zeros(5, 5)
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match="shape"):
        DFlashDrafter.from_pretrained(src)
    (src / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        DFlashDrafter.from_pretrained(src)
    with pytest.raises(CheckpointError, match="missing does not exist"):
        DFlashDrafter.from_pretrained(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        DFlashDrafter.from_pretrained(tmp_path / "empty")


@pytest.mark.parametrize("change,match", [
    ({"dflash_config": {"mask_token_id": 10_000, "target_layer_ids": [1]}}, "mask_token_id"),
    ({"dflash_config": {"mask_token_id": 3, "target_layer_ids": [1, 6]}}, "outside the target"),
    ({"dflash_config": {"target_layer_ids": [1]}}, "mask_token_id is required"),
    ({"architectures": ["Qwen3ForCausalLM"]}, "DFlashDraftModel"),
    ({"block_size": 1}, "block_size"),
    ({"num_attention_heads": 3}, "multiple"),
    ({"hidden_size": "big"}, "hidden_size"),
])
def test_bad_configs_raise_config_errors(target_cfg, change, match):
    raw = tiny_drafter_config(target_cfg)
    raw.update(change)
    with pytest.raises(ConfigError, match=match):
        DrafterConfig.from_dict(raw)


def test_drafter_target_mismatch_errors(target_cfg):
    cfg = DrafterConfig.from_dict(tiny_drafter_config(target_cfg, target_layer_ids=[1, 5]))
    ok = TargetInfo("qwen3", 6, 64, 256, 1024, (2,), 2, 16)
    check_drafter_matches_target(cfg, ok)
    with pytest.raises(ConfigError, match="hidden_size"):
        check_drafter_matches_target(cfg, TargetInfo("qwen3", 6, 128, 256, 1024, (2,), 2, 16))
    with pytest.raises(ConfigError, match="6-layer target"):
        check_drafter_matches_target(cfg, TargetInfo("qwen3", 4, 64, 256, 1024, (2,), 2, 16))
    with pytest.raises(ConfigError, match="mask_token_id"):
        check_drafter_matches_target(cfg, TargetInfo("qwen3", 6, 64, 100, 1024, (2,), 2, 16))


def test_feature_width_mismatch_is_an_input_error(target_cfg):
    drafter = build_tiny_drafter(target_cfg, num_layers=1, target_layer_ids=[1, 3])
    cache = drafter.new_cache(1, 16)
    cache.add_rows(1)
    with pytest.raises(InputError, match="features have width"):
        drafter(cache, slice(0, 1), torch.randn(1, 2, 64), torch.arange(2)[None], torch.randn(1, 4, 64),
                torch.arange(2, 6)[None])



def test_fused_context_path_equals_module_path(target_cfg):
    """The fused context K/V op (plugins.kernels; its torch reference on CPU, Triton on CUDA)
    writes the same cache as the drafter's own layers, padding rows included."""
    drafter = build_tiny_drafter(target_cfg, seed=9, num_layers=2, target_layer_ids=[1, 3])
    g = torch.Generator().manual_seed(4)
    taps = torch.randn(2, 5, 128, generator=g)
    slots = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 16, 16]])  # row 1: two padding entries (dead slot 16)
    caches = []
    for fused in (False, True):
        cache = drafter.new_cache(2, 16)
        cache.add_rows(2)
        drafter.write_context(cache, slice(0, 2), taps, slots, fused=fused)
        caches.append(cache)
    torch.testing.assert_close(caches[0].k[:, :, :, :5], caches[1].k[:, :, :, :5], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[0].v[:, :, :, :5], caches[1].v[:, :, :, :5], atol=1e-5, rtol=1e-5)
    assert caches[1].k[:, 0, :, 4].abs().sum() > 0
