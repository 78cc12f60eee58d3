"""THE split-rule table and mapping (checkpoint/mapping.py): shards merge back exactly, slices are the
right heads / experts / columns with TensorRT-LLM's rank convention, and impossible splits are
ConfigErrors."""
from __future__ import annotations

import math

import pytest
import torch

from dflash_trt.checkpoint.mapping import (Dims, Mapping, check_mapping, full_shape, local_shape, merge_shards, rule_for,
                                           shard_tensor)
from dflash_trt.errors import CheckpointError, ConfigError
from dflash_trt.models.tiny import build_tiny_target

MAPPINGS = [Mapping(2), Mapping(2, moe_tp_size=2), Mapping(4), Mapping(4, moe_tp_size=2)]


@pytest.fixture(scope="module")
def targets():
    return {arch: build_tiny_target(arch, vocab_size=261) for arch in ("llama", "qwen3", "gpt_oss")}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_oss"])
@pytest.mark.parametrize("mapping", MAPPINGS, ids=lambda m: f"tp{m.tp_size}-moetp{m.moe_tp_size}")
def test_shards_merge_back_to_the_original(targets, arch, mapping):
    model = targets[arch]
    dims = Dims.of(model.config)
    for name, full in model.state_dict().items():
        shards = [shard_tensor(name, full, dims, mapping, r) for r in range(mapping.tp_size)]
        for r, part in enumerate(shards):
            assert tuple(part.shape) == local_shape(name, tuple(full.shape), dims, mapping, r)
        assert full_shape(name, tuple(shards[0].shape), dims, mapping) == tuple(full.shape), name
        assert torch.equal(merge_shards(name, shards, tuple(full.shape), dims, mapping), full), name


def test_heads_are_split_whole_and_kv_heads_duplicated_past_their_count(targets):
    model = targets["llama"]  # 4 q heads, 2 kv heads, head_dim 16
    k = model.state_dict()["model.layers.0.self_attn.k_proj.weight"]
    q = model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    tp4 = [shard_tensor("model.layers.0.self_attn.k_proj.weight", k, Dims.of(model.config), Mapping(4), r) for r in range(4)]
    assert torch.equal(tp4[0], tp4[1]) and torch.equal(tp4[2], tp4[3])  # q heads 0,1 share kv head 0
    assert torch.equal(tp4[0], k[:16]) and torch.equal(tp4[2], k[16:])
    assert torch.equal(shard_tensor("model.layers.0.self_attn.q_proj.weight", q, Dims.of(model.config), Mapping(4), 3), q[48:])
    o = model.state_dict()["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(shard_tensor("model.layers.0.self_attn.o_proj.weight", o, Dims.of(model.config), Mapping(2), 1),
                       o[:, 32:])


def test_gpt_oss_sinks_biases_and_experts(targets):
    model = targets["gpt_oss"]  # 8 experts, intermediate 128
    sd, cfg = model.state_dict(), model.config
    sinks = sd["model.layers.0.self_attn.sinks"]
    assert torch.equal(shard_tensor("model.layers.0.self_attn.sinks", sinks, Dims.of(cfg), Mapping(2), 1), sinks[2:])
    ob = sd["model.layers.0.self_attn.o_proj.bias"]
    assert torch.equal(shard_tensor("model.layers.0.self_attn.o_proj.bias", ob, Dims.of(cfg), Mapping(2), 1), ob)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    gate_up = sd[name]  # [E, H, 2I], gate/up interleaved
    ep = shard_tensor(name, gate_up, Dims.of(cfg), Mapping(2), 1)
    assert torch.equal(ep, gate_up[4:])
    part = shard_tensor(name, gate_up, Dims.of(cfg), Mapping(2, moe_tp_size=2), 1)  # MoE-TP: second half of I
    assert torch.equal(part[..., ::2], gate_up[..., ::2][..., 64:])
    assert torch.equal(part[..., 1::2], gate_up[..., 1::2][..., 64:])
    down = sd["model.layers.0.mlp.experts.down_proj"]  # [E, I, H]
    # TensorRT-LLM's rank convention (tensorrt_llm/mapping.py): moe_tp_rank = rank // moe_ep_size,
    # moe_ep_rank = rank % moe_ep_size; with tp 4 = moe_tp 2 x moe_ep 2:
    mixed = Mapping(4, moe_tp_size=2)
    assert [(mixed.moe_tp_rank(r), mixed.moe_ep_rank(r)) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    want = {0: down[:4, :64], 1: down[4:, :64], 2: down[:4, 64:], 3: down[4:, 64:]}
    for rank, expected in want.items():
        assert torch.equal(shard_tensor("model.layers.0.mlp.experts.down_proj", down, Dims.of(cfg), mixed, rank), expected)


def test_vocab_is_padded_to_equal_rows(targets):
    model = targets["qwen3"]
    emb = model.state_dict()["model.embed_tokens.weight"]  # 261 rows
    parts = [shard_tensor("model.embed_tokens.weight", emb, Dims.of(model.config), Mapping(4), r) for r in range(4)]
    per = math.ceil(261 / 4)
    assert all(p.shape[0] == per for p in parts)
    assert torch.equal(parts[3][: 261 - 3 * per], emb[3 * per:]) and not parts[3][261 - 3 * per:].any()


def test_impossible_splits_are_config_errors(targets):
    cfg = targets["llama"].config
    with pytest.raises(ConfigError, match="attention heads"):
        check_mapping(Dims.of(cfg), Mapping(3))
    with pytest.raises(ConfigError, match="attention heads"):
        check_mapping(Dims.of(cfg), Mapping(8))
    with pytest.raises(ConfigError, match="moe_tp_size"):
        Mapping(4, moe_tp_size=3)
    oss = build_tiny_target("gpt_oss", num_local_experts=6).config
    with pytest.raises(ConfigError, match="experts"):
        check_mapping(Dims.of(oss), Mapping(4))
    check_mapping(Dims.of(oss), Mapping(4, moe_tp_size=2))  # 2 expert groups of 3 experts: fine
    with pytest.raises(CheckpointError, match="no tensor-parallel rule"):
        rule_for("model.layers.0.self_attn.rotary_emb.weight")


def test_legacy_layout_is_names_and_fusing_on_the_same_rules(targets):
    """tp 4 = moe_tp 2 x ep 2: every legacy rank tensor is the rule table's HF shard renamed (and q/k/v,
    gate/up fused), and the legacy checkpoint merges back to the HF state bit for bit."""
    from dflash_trt.checkpoint.trtllm_layout import geometry_of, shard_state, unshard_state
    from dflash_trt.models.target import native_from_hf

    model = native_from_hf(targets["gpt_oss"], torch.float32)
    state, mapping = model.state_dict(), Mapping.for_sizes(4, ep=2)
    assert (mapping.moe_tp_size, mapping.moe_ep_size) == (2, 2)
    g = geometry_of(model, drafter=False)
    ranks = shard_state(state, g, mapping, torch.float32)
    dims = Dims.of(model.config)
    for r, legacy in enumerate(ranks):
        def hf(name: str) -> torch.Tensor:
            return shard_tensor(name, state[name], dims, mapping, r)
        qkv = torch.cat([hf(f"model.layers.1.self_attn.{p}_proj.weight") for p in "qkv"])
        assert torch.equal(legacy["transformer.layers.1.attention.qkv.weight"], qkv)
        gu = hf("model.layers.1.mlp.experts.gate_up_proj")  # [E/ep, H, 2I/moe_tp], gate/up interleaved
        fc = torch.cat([gu[..., 0::2], gu[..., 1::2]], dim=2).transpose(1, 2)
        assert torch.equal(legacy["transformer.layers.1.mlp.fc.weight"], fc)
        assert torch.equal(legacy["transformer.layers.1.mlp.proj.weight"],
                           hf("model.layers.1.mlp.experts.down_proj").transpose(1, 2))
    merged = unshard_state(ranks, g, mapping)
    assert set(merged) == set(state)
    assert all(torch.equal(merged[k], state[k]) for k in state)
    name = "transformer.layers.0.input_layernorm.weight"
    ranks[3][name] = ranks[3][name] + 1  # a replicated copy that disagrees
    with pytest.raises(CheckpointError, match="differs"):
        unshard_state(ranks, g, mapping)
