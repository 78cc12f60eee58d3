"""What a checkpoint holds, tensor by tensor, without reading its weights: names, shapes and
dtypes from safetensors headers (`read_specs`), or synthesized from a model's sizes when the
checkpoint is not on this machine (`target_specs`, `drafter_specs`), and the tensor groups a build
reports them in (`group_of`).

Synthesized layouts are the Hugging Face ones this project reads and writes:
- Llama / Qwen3: `model.embed_tokens`, per layer `self_attn.{q,k,v,o}_proj.weight` (Qwen3 adds
  `q_norm` / `k_norm`), `mlp.{gate,up,down}_proj.weight`, two norms; `model.norm`; `lm_head`
  (absent when tied to the embedding).
- gpt-oss: biased attention projections and per-head `sinks`, `mlp.router.{weight,bias}`, experts
  either float (`gate_up_proj` [E, H, 2I], `down_proj` [E, I, H] + biases, the HF module layout) or
  MXFP4 as released (`*_blocks` [E, out, in/32, 16] uint8 + `*_scales` [E, out, in/32] uint8 E8M0 +
  bf16 biases; see dflash_trt.checkpoint.gpt_oss).
- DFlash drafter: `fc`, `hidden_norm`, `norm`, `layers.{i}.*` Qwen3 layers (no embedding, no lm_head).
"""
from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.errors import CheckpointError
from dflash_trt.fileio import weight_files

# safetensors dtype names -> bytes per element
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "U8": 1, "I8": 1,
               "I16": 2, "I32": 4, "I64": 8, "BOOL": 1}
TORCH_TO_ST = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
ST_NAMES = {"F32": "FP32", "F16": "FP16", "BF16": "BF16", "F8_E4M3": "FP8", "U8": "U8", "F64": "FP64"}
MXFP4_SUFFIXES = ("_blocks", "_scales")
HEADER_BYTES_PER_TENSOR = 64  # safetensors JSON header: dtype, shape, offsets around each name


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors name: BF16, F32, U8, F8_E4M3, ...

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def fmt(self) -> str:
        """The number format the tensor stores: MXFP4 for gpt-oss expert blocks and scales."""
        if self.name.endswith(MXFP4_SUFFIXES) and self.dtype == "U8":
            return "MXFP4"
        return ST_NAMES.get(self.dtype, self.dtype)


def header_bytes(specs: list[TensorSpec]) -> int:
    """About the size of a safetensors header for these tensors (8-byte length + JSON)."""
    return 8 + sum(len(s.name) + HEADER_BYTES_PER_TENSOR for s in specs)


def _read_header(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            return json.loads(fh.read(length))
    except (OSError, struct.error, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read the safetensors header of {path}: {exc}") from exc


def read_specs(directory: Path, files: list[Path] | None = None) -> list[TensorSpec]:
    """Every tensor of a checkpoint directory (or of `files`), from the headers only."""
    specs = []
    for path in files if files is not None else weight_files(directory):
        for name, info in _read_header(path).items():
            if name != "__metadata__":
                specs.append(TensorSpec(name, tuple(info["shape"]), info["dtype"]))
    return specs


QUANT_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale")  # ModelOpt FP8 / NVFP4 scales
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")


def quantized_names(specs: list[TensorSpec]) -> list[str]:
    """Tensors only a quantized (ModelOpt FP8 / NVFP4) checkpoint holds: scales and FP8 codes."""
    return [s.name for s in specs if s.name.endswith(QUANT_SCALE_SUFFIXES) or s.dtype in FP8_DTYPES]


def check_unscaled_drafter(directory: Path, specs: list[TensorSpec] | None = None) -> None:
    """CheckpointError (one line) when the DFlash drafter in `directory` is quantized: TensorRT-LLM's
    DFlash draft model cannot run it.

    Checked in upstream NVIDIA/TensorRT-LLM `tensorrt_llm/_torch/models/modeling_dflash.py` @
    009d8fa431bd3de92245aab80f8b57dc70da1ac4: `DFlashForCausalLM._build_fused_kv_buffers` slices
    the K/V rows of every layer's raw `qkv_proj.weight` into one fused context-K/V weight and
    `precompute_context_kv` multiplies by it (`F.linear`) with no weight scale, so FP8 / NVFP4 codes
    would be used as if they were the weights. Casting such a checkpoint to BF16 does not help
    either (the codes stay codes): the deployment needs the float drafter it was quantized from.
    `specs`: the drafter's tensors when the caller has read them (else its headers are read)."""
    directory = Path(directory)
    marker = directory / "hf_quant_config.json"
    names = quantized_names(read_specs(directory) if specs is None else specs)
    if marker.is_file() or names:
        what = f"{marker.name}" if marker.is_file() else f"{len(names)} quantization tensors such as {names[0]}"
        raise CheckpointError(
            f"drafter {directory} is quantized ({what}): TensorRT-LLM's DFlash draft model multiplies the raw "
            "q/k/v weights with no scale, so it needs the BF16 (unquantized) drafter this one was made from; "
            "FP8 drafters run on the torch backend only")


_GROUPS = [  # (group, pattern on the HF name), first match wins
    ("experts", re.compile(r".*\.mlp\.experts\..*")),
    ("router", re.compile(r".*\.mlp\.router\..*")),
    ("attention", re.compile(r".*self_attn\.[qkvo]_proj\.(weight|weight_scale|weight_scale_2|input_scale)")),
    ("mlp", re.compile(r".*\.mlp\.(gate|up|down)_proj\.(weight|weight_scale|weight_scale_2|input_scale)")),
    ("embedding", re.compile(r"model\.embed_tokens\.weight")),
    ("lm_head", re.compile(r"lm_head\.weight")),
    ("fc", re.compile(r"fc\.weight")),
]
GROUP_ORDER = ("experts", "attention", "mlp", "router", "embedding", "lm_head", "fc", "norms, biases, sinks")


def group_of(name: str) -> str:
    """The tensor group a build reports `name` in (norms, biases and attention sinks are one group)."""
    for group, pattern in _GROUPS:
        if pattern.fullmatch(name):
            return group
    return "norms, biases, sinks"


def target_specs(arch: str, *, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, vocab: int, experts: int, tied: bool, dtype: str,
                 expert_format: str) -> list[TensorSpec]:
    """The HF tensors of a target of these sizes. dtype: torch name of the float tensors;
    expert_format: "mxfp4" (gpt-oss release) or "float" (experts in `dtype`)."""
    f = TORCH_TO_ST[dtype]
    q, kv = heads * head_dim, kv_heads * head_dim
    moe = arch == "gpt_oss"
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, hidden), f),
             TensorSpec("model.norm.weight", (hidden,), f)]
    if not tied:
        specs.append(TensorSpec("lm_head.weight", (vocab, hidden), f))
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [TensorSpec(p + "input_layernorm.weight", (hidden,), f),
                  TensorSpec(p + "post_attention_layernorm.weight", (hidden,), f)]
        for proj, rows, cols in (("q", q, hidden), ("k", kv, hidden), ("v", kv, hidden), ("o", hidden, q)):
            specs.append(TensorSpec(f"{p}self_attn.{proj}_proj.weight", (rows, cols), f))
            if moe:
                specs.append(TensorSpec(f"{p}self_attn.{proj}_proj.bias", (rows,), f))
        if arch == "qwen3":
            specs += [TensorSpec(p + "self_attn.q_norm.weight", (head_dim,), f),
                      TensorSpec(p + "self_attn.k_norm.weight", (head_dim,), f)]
        if moe:
            specs += [TensorSpec(p + "self_attn.sinks", (heads,), f),
                      TensorSpec(p + "mlp.router.weight", (experts, hidden), f),
                      TensorSpec(p + "mlp.router.bias", (experts,), f),
                      *_expert_specs(p + "mlp.experts.", experts, hidden, intermediate, f, expert_format)]
        else:
            specs += [TensorSpec(p + "mlp.gate_proj.weight", (intermediate, hidden), f),
                      TensorSpec(p + "mlp.up_proj.weight", (intermediate, hidden), f),
                      TensorSpec(p + "mlp.down_proj.weight", (hidden, intermediate), f)]
    return specs


def _expert_specs(p: str, e: int, h: int, i: int, f: str, expert_format: str) -> list[TensorSpec]:
    biases = [TensorSpec(p + "gate_up_proj_bias", (e, 2 * i), f), TensorSpec(p + "down_proj_bias", (e, h), f)]
    if expert_format == "float":
        return [TensorSpec(p + "gate_up_proj", (e, h, 2 * i), f), TensorSpec(p + "down_proj", (e, i, h), f), *biases]
    if expert_format != "mxfp4":
        raise CheckpointError(f"unknown expert format '{expert_format}' (mxfp4 or float)")
    return [TensorSpec(p + "gate_up_proj_blocks", (e, 2 * i, h // 32, 16), "U8"),
            TensorSpec(p + "gate_up_proj_scales", (e, 2 * i, h // 32), "U8"),
            TensorSpec(p + "down_proj_blocks", (e, h, i // 32, 16), "U8"),
            TensorSpec(p + "down_proj_scales", (e, h, i // 32), "U8"), *biases]


def drafter_specs(*, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                  num_taps: int, dtype: str) -> list[TensorSpec]:
    """The tensors of a DFlash drafter of these sizes (Qwen3 layers, fc over the tapped features)."""
    f = TORCH_TO_ST[dtype]
    q, kv = heads * head_dim, kv_heads * head_dim
    specs = [TensorSpec("fc.weight", (hidden, num_taps * hidden), f), TensorSpec("hidden_norm.weight", (hidden,), f),
             TensorSpec("norm.weight", (hidden,), f)]
    for i in range(layers):
        p = f"layers.{i}."
        specs += [TensorSpec(p + "input_layernorm.weight", (hidden,), f),
                  TensorSpec(p + "post_attention_layernorm.weight", (hidden,), f),
                  TensorSpec(p + "self_attn.q_norm.weight", (head_dim,), f),
                  TensorSpec(p + "self_attn.k_norm.weight", (head_dim,), f)]
        for proj, rows, cols in (("q", q, hidden), ("k", kv, hidden), ("v", kv, hidden), ("o", hidden, q)):
            specs.append(TensorSpec(f"{p}self_attn.{proj}_proj.weight", (rows, cols), f))
        specs += [TensorSpec(p + "mlp.gate_proj.weight", (intermediate, hidden), f),
                  TensorSpec(p + "mlp.up_proj.weight", (intermediate, hidden), f),
                  TensorSpec(p + "mlp.down_proj.weight", (hidden, intermediate), f)]
    return specs


def float_dtype_of(specs: list[TensorSpec]) -> str:
    """The torch name of the float dtype holding most bytes (the checkpoint's dtype)."""
    totals: dict[str, int] = {}
    for s in specs:
        if s.dtype in ("F32", "F16", "BF16"):
            totals[s.dtype] = totals.get(s.dtype, 0) + s.nbytes
    if not totals:
        raise CheckpointError("the checkpoint holds no float tensors")
    best = max(totals, key=totals.__getitem__)
    return {v: k for k, v in TORCH_TO_ST.items()}[best]


def expert_format_of(specs: list[TensorSpec]) -> str | None:
    """"mxfp4" (release `*_blocks` / `*_scales`), "float", or None for a dense model."""
    names = [s.name for s in specs if group_of(s.name) == "experts"]
    if not names:
        return None
    return "mxfp4" if any(n.endswith("_blocks") for n in names) else "float"


__all__ = ["DTYPE_BYTES", "GROUP_ORDER", "TensorSpec", "check_unscaled_drafter", "drafter_specs", "expert_format_of",
           "float_dtype_of", "group_of", "header_bytes", "quantized_names", "read_specs", "target_specs"]
