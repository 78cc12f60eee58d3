"""TensorRT-LLM 1.2.x legacy checkpoints: TP/EP shards merge back exactly, names, errors."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_trt.checkpoint import trtllm_legacy as tl
from dflash_trt.errors import CheckpointError, ConfigError
from dflash_trt.models.target import native_from_hf
from dflash_trt.models.tiny import build_tiny_drafter, build_tiny_target


@pytest.fixture(scope="module")
def models():
    out = {}
    for arch in ("llama", "qwen3", "gpt_oss"):
        hf = build_tiny_target(arch, num_layers=2)
        out[arch] = (native_from_hf(hf), build_tiny_drafter(hf.config))
    return out


@pytest.mark.parametrize("arch,tp,ep", [("llama", 2, 1), ("qwen3", 4, 1), ("gpt_oss", 4, 2), ("gpt_oss", 2, 2)])
def test_unquantized_shards_merge_back_to_the_original(tmp_path, models, arch, tp, ep):
    target, drafter = models[arch]
    out = tl.write_checkpoint(target, tmp_path / "t", None, tp=tp, ep=ep, dtype="float32")
    merged = tl.load_merged(out)
    for name, tensor in target.state_dict().items():
        assert torch.equal(merged.state_dict()[name], tensor), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["mapping"] == {"world_size": tp, "tp_size": tp, "pp_size": 1, "moe_tp_size": tp // ep if
                              arch == "gpt_oss" else tp, "moe_ep_size": ep}
    assert cfg["architecture"] == tl.ARCHITECTURES[arch]
    dout = tl.write_checkpoint(drafter, tmp_path / "d", None, tp=tp, dtype="float32")
    dmerged = tl.load_merged(dout)
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(dmerged.state_dict()[name], tensor), name


def test_qkv_heads_split_and_kv_duplicated_when_tp_exceeds_kv_heads(tmp_path, models):
    target, _ = models["qwen3"]  # 4 q heads, 2 kv heads, head_dim 16
    out = tl.write_checkpoint(target, tmp_path / "t", None, tp=4, dtype="float32")
    ranks = [load_file(out / f"rank{r}.safetensors") for r in range(4)]
    attn = target.model.layers[0].self_attn
    for r, tensors in enumerate(ranks):
        qkv = tensors["transformer.layers.0.attention.qkv.weight"]
        assert qkv.shape == (16 * 3, 64)
        kv_head = r // 2
        assert torch.equal(qkv[:16], attn.q_proj.weight[16 * r:16 * (r + 1)])
        assert torch.equal(qkv[16:32], attn.k_proj.weight[16 * kv_head:16 * (kv_head + 1)])
        assert tensors["transformer.vocab_embedding.weight"].shape == (64, 64)  # vocab 256 / 4
        assert "transformer.layers.0.attention.q_layernorm.weight" in tensors
    gpt = tl.write_checkpoint(models["gpt_oss"][0], tmp_path / "g", None, tp=2, ep=2, dtype="float32")
    r1 = load_file(gpt / "rank1.safetensors")
    assert r1["transformer.layers.0.mlp.fc.weight"].shape == (4, 2 * 128, 64)  # experts 4..7, full intermediate
    assert r1["transformer.layers.0.attention.sinks"].shape == (2,)


@pytest.mark.parametrize("algo", ["FP8", "NVFP4"])
def test_quantized_shards_merge_to_one_shared_scale_per_fused_group(tmp_path, models, algo):
    target, _ = models["llama"]
    out = tl.write_checkpoint(target, tmp_path / "q", algo, tp=2, dtype="float16")
    rank0 = load_file(out / "rank0.safetensors")
    suffix = "weights_scaling_factor" if algo == "FP8" else "weights_scaling_factor_2"
    assert f"transformer.layers.0.attention.qkv.{suffix}" in rank0
    merged = tl.load_merged(out)
    attn = merged.model.layers[0].self_attn
    scale = "weight_scale" if algo == "FP8" else "weight_scale_2"
    assert torch.equal(getattr(attn.q_proj, scale), getattr(attn.v_proj, scale))
    bound = 0.08 if algo == "FP8" else 0.2
    for name in ("q_proj", "k_proj", "o_proj"):
        ref = getattr(target.model.layers[0].self_attn, name).weight
        err = (getattr(attn, name).dequantized_weight() - ref).norm() / ref.norm()
        assert err < bound, (name, float(err))


def test_bad_sizes_and_broken_checkpoints(tmp_path, models):
    target, _ = models["llama"]
    with pytest.raises(ConfigError, match="tp 3 does not divide"):
        tl.write_checkpoint(target, tmp_path / "x", None, tp=3)
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        tl.write_checkpoint(target, tmp_path / "x", None, tp=2, ep=2)
    with pytest.raises(ConfigError, match="must divide"):
        tl.write_checkpoint(models["gpt_oss"][0], tmp_path / "x", None, tp=4, ep=3)
    odd = native_from_hf(build_tiny_target("llama", num_layers=1, intermediate_size=96))
    tl.write_checkpoint(odd, tmp_path / "fp8", "FP8", tp=4)  # FP8 splits any width
    with pytest.raises(ConfigError, match="NVFP4 row-parallel mlp down input width 96/4"):
        tl.write_checkpoint(odd, tmp_path / "x", "NVFP4", tp=4)
    out = tl.write_checkpoint(target, tmp_path / "ok", None, tp=2, dtype="float32")
    r1 = load_file(out / "rank1.safetensors")
    r1.pop("transformer.layers.1.mlp.proj.weight")
    r1["transformer.layers.0.extra.weight"] = torch.zeros(2)
    save_file(r1, str(out / "rank1.safetensors"))
    with pytest.raises(CheckpointError, match=r"layers.1.mlp.proj.weight is missing from rank\(s\) \[1\]"):
        tl.load_merged(out)
    (out / "rank1.safetensors").unlink()
    with pytest.raises(CheckpointError, match="rank1.safetensors"):
        tl.load_merged(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["architecture"] = "BloomForCausalLM"
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="supported"):
        tl.load_merged(out)


def test_merged_tensors_that_do_not_fit_the_config_are_a_checkpoint_error(tmp_path, models):
    """The one strict state-dict check (fileio.check_state_dict) also guards the legacy loader."""
    out = tl.write_checkpoint(models["llama"][0], tmp_path / "t", None, tp=1, dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    cfg["dflash_trt"]["source_config"]["intermediate_size"] //= 2
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"legacy checkpoint .* tensor model.layers.0.mlp.\w+_proj.weight has shape"):
        tl.load_merged(out)
