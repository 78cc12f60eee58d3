"""Tensor lists without the weights: synthesized layouts equal what the writers put on disk (tiny
Llama / Qwen3 / gpt-oss with float or MXFP4 experts, DFlash drafter), and the gpt-oss release check."""
from __future__ import annotations

import json

import pytest
import torch

from dflash_trt.checkpoint.gpt_oss import check_mxfp4_release
from dflash_trt.checkpoint.layout import (
    drafter_specs,
    expert_format_of,
    float_dtype_of,
    group_of,
    read_specs,
    target_specs,
)
from dflash_trt.errors import CheckpointError
from dflash_trt.models.tiny import save_tiny_checkpoint, save_tiny_gpt_oss_release


def _as_set(specs) -> set:
    return {(s.name, s.shape, s.dtype) for s in specs}


def _sizes(arch: str) -> dict:
    return dict(layers=6, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=261,
                experts=8 if arch == "gpt_oss" else 0, tied=False)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_oss"])
def test_synthesized_layouts_equal_saved_checkpoints(tmp_path, arch):
    target, drafter = save_tiny_checkpoint(tmp_path, arch)
    real = read_specs(target)
    assert _as_set(real) == _as_set(target_specs(arch, **_sizes(arch), dtype="float32", expert_format="float"))
    assert float_dtype_of(real) == "float32"
    assert expert_format_of(real) == ("float" if arch == "gpt_oss" else None)
    cfg = json.loads((drafter / "config.json").read_text())
    synth = drafter_specs(layers=1, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                          num_taps=len(cfg["dflash_config"]["target_layer_ids"]), dtype="float32")
    assert _as_set(read_specs(drafter)) == _as_set(synth)


def test_release_layout_and_its_check(tmp_path):
    target, drafter = save_tiny_gpt_oss_release(tmp_path / "rel")
    real = read_specs(target)
    assert _as_set(real) == _as_set(target_specs("gpt_oss", **_sizes("gpt_oss"), dtype="bfloat16",
                                                 expert_format="mxfp4"))
    assert expert_format_of(real) == "mxfp4" and float_dtype_of(real) == "bfloat16"
    assert {s.fmt for s in real if group_of(s.name) == "experts"} == {"MXFP4", "BF16"}
    assert float_dtype_of(read_specs(drafter)) == "bfloat16"
    check_mxfp4_release(target)
    config = json.loads((target / "config.json").read_text())
    del config["quantization_config"]
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quantization_config.quant_method mxfp4"):
        check_mxfp4_release(target)
    float_target, _ = save_tiny_checkpoint(tmp_path / "float", "gpt_oss")
    with pytest.raises(CheckpointError, match="has float experts"):
        check_mxfp4_release(float_target)


def test_release_stand_in_loads_as_its_dequantized_experts(tmp_path):
    """Our loader dequantizes the release's MXFP4 experts: the loaded expert weights are exactly the
    MXFP4 values, and every other tensor is the BF16 one."""
    from safetensors.torch import load_file

    from dflash_trt.models.target import load_native_target
    from dflash_trt.quant.mxfp4 import dequantize_mxfp4

    target, _ = save_tiny_gpt_oss_release(tmp_path)
    raw = load_file(target / "model.safetensors")
    model = load_native_target(target, torch.float32)
    state = model.state_dict()
    blocks, scales = raw["model.layers.3.mlp.experts.down_proj_blocks"], raw["model.layers.3.mlp.experts.down_proj_scales"]
    expected = dequantize_mxfp4(blocks, scales, torch.float32).transpose(-1, -2)
    assert torch.equal(state["model.layers.3.mlp.experts.down_proj"], expected)
    assert torch.equal(state["model.layers.3.self_attn.q_proj.weight"],
                       raw["model.layers.3.self_attn.q_proj.weight"].float())


def _upstream_rewrite(pattern: str) -> str:
    """TensorRT-LLM's GptOssForCausalLM.__post_init__ (modeling_gpt_oss.py @ 050b6cb): map the last
    component (qkv -> qkv_proj, out -> o_proj, unembedding -> lm_head), prefix `model.`."""
    names = pattern.split(".")
    names[-1] = {"qkv": "qkv_proj", "out": "o_proj", "unembedding": "lm_head"}.get(names[-1], names[-1])
    return ".".join(([] if names[0] == "model" else ["model"]) + names)


def test_gpt_oss_exclusions_match_tensorrt_llm_runtime_modules(tmp_path):
    """A gpt-oss ModelOpt export names its exclusions so that upstream's fnmatch over runtime module
    names keeps router and experts unquantized (HF names like model.layers.*.mlp.experts match none)."""
    from fnmatch import fnmatchcase

    from dflash_trt.checkpoint import modelopt_hf
    from dflash_trt.models.target import load_native_target

    target, _ = save_tiny_checkpoint(tmp_path, "gpt_oss")
    out = modelopt_hf.write_target(load_native_target(target), tmp_path / "q", "FP8")
    patterns = [_upstream_rewrite(p) for p in
                json.loads((out / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]]
    excluded = {m for m in ("model.block.0.mlp.experts", "model.block.0.mlp.gate", "model.embedding",
                            "model.block.0.attn.qkv_proj", "model.block.0.attn.o_proj")
                if any(fnmatchcase(m, p) for p in patterns)}
    assert excluded == {"model.block.0.mlp.experts", "model.block.0.mlp.gate", "model.embedding"}


def test_a_quantized_drafter_is_refused_for_tensorrt_llm(tmp_path):
    """TensorRT-LLM's DFlash draft model multiplies the raw q/k/v weights with no scale
    (_torch/models/modeling_dflash.py), so only a float drafter may be deployed there: an FP8
    drafter is refused by its hf_quant_config.json, and by its scale tensors when that file is gone."""
    from dflash_trt.checkpoint.layout import check_unscaled_drafter
    from dflash_trt.checkpoint.modelopt_hf import write_drafter
    from dflash_trt.models.drafter import DFlashDrafter

    _, drafter = save_tiny_checkpoint(tmp_path, "qwen3")
    check_unscaled_drafter(drafter)  # the float drafter passes
    fp8 = write_drafter(DFlashDrafter.from_pretrained(drafter), tmp_path / "fp8", "FP8")
    with pytest.raises(CheckpointError, match=r"is quantized \(hf_quant_config.json\).*no scale"):
        check_unscaled_drafter(fp8)
    (fp8 / "hf_quant_config.json").unlink()
    with pytest.raises(CheckpointError, match=r"quantization tensors such as .*weight_scale"):
        check_unscaled_drafter(fp8)
