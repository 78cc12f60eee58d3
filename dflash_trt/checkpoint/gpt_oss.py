"""gpt-oss release checkpoints: MXFP4 experts, everything else BF16, the layout TensorRT-LLM serves
as is. A gpt-oss build copies these bytes unchanged; it writes no hf_quant_config.json and no
exclusion list of its own.

What upstream TensorRT-LLM (PyTorch backend) loads, read in its source (NVIDIA/TensorRT-LLM):
- `tensorrt_llm/_torch/models/modeling_gpt_oss.py` @ 050b6cb92871a4ed73486c5e5a573d4198d1a6d9,
  `GptOssForCausalLM.load_hf_weights`: experts as BF16 (`gate_up_proj`, `down_proj` + biases) or
  as MXFP4 (`gate_up_proj_blocks|scales`, `down_proj_blocks|scales` + biases), nothing else.
  `__post_init__` maps only the last component of each `exclude_modules` entry (qkv -> qkv_proj,
  out -> o_proj, unembedding -> lm_head), prefixes `model.` and matches the result against the
  runtime module names (`model.block.N.attn.qkv_proj`, `model.block.N.mlp.gate`,
  `model.block.N.mlp.experts`, `model.embedding`), so Hugging Face names (`model.layers.*`) never
  match; it does not call the per-layer (mixed precision) quantization setup.
- `tensorrt_llm/_torch/model_config.py` @ 008e0af8980fc560003631ba4ac37828836a91c8: config.json's
  `quantization_config.quant_method: mxfp4` selects the MXFP4 MoE path (activation format chosen at
  run time from the GPU and MoE backend) and excludes attention, router and embeddings.
So FP8 or NVFP4 attention next to MXFP4 experts has no load path there, and ModelOpt exclusions
named as in Hugging Face would not apply (see `RUNTIME_EXCLUDES` for names that do).

`write_mxfp4_release` writes a model in this layout (tests' tiny stand-in of gpt-oss-120b).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash_trt.checkpoint.layout import expert_format_of, read_specs
from dflash_trt.errors import CheckpointError
from dflash_trt.fileio import atomic_directory, write_json, write_safetensors

# config.json `quantization_config` of the openai/gpt-oss-* releases
RELEASE_QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                               "lm_head"],
}
# ModelOpt `exclude_modules` that TensorRT-LLM's gpt-oss model matches (runtime module names)
RUNTIME_EXCLUDES = ("lm_head", "model.embedding", "model.block.*.mlp.gate", "model.block.*.mlp.experts")
EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")


def check_mxfp4_release(directory: Path) -> None:
    """CheckpointError unless `directory` holds gpt-oss with MXFP4 experts and the release's
    `quantization_config` (what upstream loads as MXFP4)."""
    directory = Path(directory)
    fmt = expert_format_of(read_specs(directory))
    if fmt != "mxfp4":
        raise CheckpointError(f"{directory} has {'no' if fmt is None else 'float'} experts, not the MXFP4 release "
                              "layout (*_blocks / *_scales): point target.path at the MXFP4 release, or set "
                              "target.quantization none to ship these experts unchanged")
    raw = json.loads((directory / "config.json").read_text())
    quant = raw["quantization_config"] if "quantization_config" in raw else {}  # optional in HF configs
    if not isinstance(quant, dict) or "quant_method" not in quant or quant["quant_method"] != "mxfp4":
        raise CheckpointError(f"{directory}/config.json lacks quantization_config.quant_method mxfp4, which "
                              "TensorRT-LLM needs to load MXFP4 experts: use the release's config.json")


def write_mxfp4_release(model, directory: Path) -> Path:
    """Write a transformers GptOssForCausalLM in the release layout: experts MXFP4 (from the model's
    float experts, `quant.mxfp4.quantize_mxfp4`), every other tensor BF16, config.json with the
    release's quantization_config. Returns `directory` (written atomically)."""
    from dflash_trt.quant.mxfp4 import quantize_mxfp4

    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        base = name.rsplit(".", 1)[-1]
        if ".mlp.experts." in name and base in EXPERT_PROJECTIONS:
            blocks, scales = quantize_mxfp4(tensor.detach().transpose(-1, -2))  # HF [E, in, out] -> [E, out, in]
            state[name + "_blocks"], state[name + "_scales"] = blocks, scales
        else:
            state[name] = tensor.detach().to(torch.bfloat16)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    config = model.config.to_dict()
    config.update(dtype="bfloat16", quantization_config=dict(RELEASE_QUANTIZATION_CONFIG))
    with atomic_directory(Path(directory)) as tmp:
        write_json(tmp / "config.json", config)
        write_safetensors(tmp / "model.safetensors", state, metadata={"format": "pt"})
    return Path(directory)


__all__ = ["EXPERT_PROJECTIONS", "RELEASE_QUANTIZATION_CONFIG", "RUNTIME_EXCLUDES", "check_mxfp4_release",
           "write_mxfp4_release"]
