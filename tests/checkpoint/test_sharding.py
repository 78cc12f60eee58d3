"""TP/EP split rules on HF-named tensors: shards merge back exactly, slices are the right heads /
experts / columns, files round-trip, and impossible splits are ConfigErrors."""
from __future__ import annotations

import math

import pytest
import torch

from dflash_trt.checkpoint.sharding import (
    TPMapping, check_mapping, is_presharded, load_presharded_rank, load_rank_state, local_shape, merge_shards,
    read_mapping, rule_for, shard_tensor, write_tp_shards,
)
from dflash_trt.errors import CheckpointError, ConfigError
from dflash_trt.models.tiny import build_tiny_target, save_tiny_target

MAPPINGS = [TPMapping(2), TPMapping(2, moe_tp_size=2), TPMapping(4), TPMapping(4, moe_tp_size=2)]


@pytest.fixture(scope="module")
def targets():
    return {arch: build_tiny_target(arch, vocab_size=261) for arch in ("llama", "qwen3", "gpt_oss")}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_oss"])
@pytest.mark.parametrize("mapping", MAPPINGS, ids=lambda m: f"tp{m.tp_size}-moetp{m.moe_tp_size}")
def test_shards_merge_back_to_the_original(targets, arch, mapping):
    model = targets[arch]
    for name, full in model.state_dict().items():
        shards = [shard_tensor(name, full, model.config, mapping, r) for r in range(mapping.tp_size)]
        for r, part in enumerate(shards):
            assert tuple(part.shape) == local_shape(name, tuple(full.shape), model.config, mapping, r)
        assert torch.equal(merge_shards(name, shards, tuple(full.shape), model.config, mapping), full), name


def test_heads_are_split_whole_and_kv_heads_duplicated_past_their_count(targets):
    model = targets["llama"]  # 4 q heads, 2 kv heads, head_dim 16
    k = model.state_dict()["model.layers.0.self_attn.k_proj.weight"]
    q = model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    tp4 = [shard_tensor("model.layers.0.self_attn.k_proj.weight", k, model.config, TPMapping(4), r) for r in range(4)]
    assert torch.equal(tp4[0], tp4[1]) and torch.equal(tp4[2], tp4[3])  # q heads 0,1 share kv head 0
    assert torch.equal(tp4[0], k[:16]) and torch.equal(tp4[2], k[16:])
    assert torch.equal(shard_tensor("model.layers.0.self_attn.q_proj.weight", q, model.config, TPMapping(4), 3), q[48:])
    o = model.state_dict()["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(shard_tensor("model.layers.0.self_attn.o_proj.weight", o, model.config, TPMapping(2), 1),
                       o[:, 32:])


def test_gpt_oss_sinks_biases_and_experts(targets):
    model = targets["gpt_oss"]  # 8 experts, intermediate 128
    sd, cfg = model.state_dict(), model.config
    sinks = sd["model.layers.0.self_attn.sinks"]
    assert torch.equal(shard_tensor("model.layers.0.self_attn.sinks", sinks, cfg, TPMapping(2), 1), sinks[2:])
    ob = sd["model.layers.0.self_attn.o_proj.bias"]
    assert torch.equal(shard_tensor("model.layers.0.self_attn.o_proj.bias", ob, cfg, TPMapping(2), 1), ob)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    gate_up = sd[name]  # [E, H, 2I], gate/up interleaved
    ep = shard_tensor(name, gate_up, cfg, TPMapping(2), 1)
    assert torch.equal(ep, gate_up[4:])
    part = shard_tensor(name, gate_up, cfg, TPMapping(2, moe_tp_size=2), 1)  # MoE-TP: second half of I
    assert torch.equal(part[..., ::2], gate_up[..., ::2][..., 64:])
    assert torch.equal(part[..., 1::2], gate_up[..., 1::2][..., 64:])
    down = sd["model.layers.0.mlp.experts.down_proj"]  # [E, I, H]
    mixed = TPMapping(4, moe_tp_size=2)  # rank 3: experts 4..7, intermediate half 1
    assert torch.equal(shard_tensor("model.layers.0.mlp.experts.down_proj", down, cfg, mixed, 3), down[4:, 64:])


def test_vocab_is_padded_to_equal_rows(targets):
    model = targets["qwen3"]
    emb = model.state_dict()["model.embed_tokens.weight"]  # 261 rows
    parts = [shard_tensor("model.embed_tokens.weight", emb, model.config, TPMapping(4), r) for r in range(4)]
    per = math.ceil(261 / 4)
    assert all(p.shape[0] == per for p in parts)
    assert torch.equal(parts[3][: 261 - 3 * per], emb[3 * per:]) and not parts[3][261 - 3 * per:].any()


def test_impossible_splits_are_config_errors(targets):
    cfg = targets["llama"].config
    with pytest.raises(ConfigError, match="attention heads"):
        check_mapping(cfg, TPMapping(3))
    with pytest.raises(ConfigError, match="attention heads"):
        check_mapping(cfg, TPMapping(8))
    with pytest.raises(ConfigError, match="moe_tp_size"):
        TPMapping(4, moe_tp_size=3)
    oss = build_tiny_target("gpt_oss", num_local_experts=6).config
    with pytest.raises(ConfigError, match="experts"):
        check_mapping(oss, TPMapping(4))
    check_mapping(oss, TPMapping(4, moe_tp_size=2))  # 2 expert groups of 3 experts: fine
    with pytest.raises(CheckpointError, match="no tensor-parallel rule"):
        rule_for("model.layers.0.self_attn.rotary_emb.weight")


def test_sliced_reads_and_written_shards_match_in_memory_shards(targets, tmp_path):
    model = targets["gpt_oss"]
    hf = save_tiny_target(model, tmp_path / "hf")
    mapping = TPMapping(2, moe_tp_size=2)
    out = write_tp_shards(hf, tmp_path / "tp2", mapping)
    assert is_presharded(out) and not is_presharded(hf)
    assert read_mapping(out) == mapping
    full = model.state_dict()
    for rank in range(2):
        sliced = load_rank_state(hf, model.config, mapping, rank)
        stored = load_presharded_rank(out, rank)
        assert set(sliced) == set(stored) == set(full)
        for name, tensor in full.items():
            expect = shard_tensor(name, tensor, model.config, mapping, rank)
            assert torch.equal(sliced[name], expect) and torch.equal(stored[name], expect), name
    with pytest.raises(ConfigError):
        write_tp_shards(hf, tmp_path / "tp3", 3)
    assert not (tmp_path / "tp3").exists()
