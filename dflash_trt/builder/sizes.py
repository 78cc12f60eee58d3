"""What each tensor group of a build becomes, and how many bytes the build writes.

The input is the source checkpoint's tensor list: read from its safetensors headers when it is on
this machine (exact), otherwise synthesized from the build config's sizes (`target.dtype`,
`tie_word_embeddings`, the gpt-oss MXFP4 release layout for `quantization: mxfp4`; see
dflash_trt.checkpoint.layout). Each tensor is mapped to what the stage writes for it:
- copied unchanged (target `none` / `mxfp4`, a drafter already in the deployment dtype);
- FP8: the linear weights of the decoder layers become e4m3 codes + an fp32 `weight_scale` and
  `input_scale`; NVFP4: packed uint8 [out, in/2] + e4m3 block scales [out, in/16] + fp32
  `weight_scale_2` and `input_scale` (dflash_trt.checkpoint.quantized); every other tensor keeps
  the source dtype;
- cast to BF16 (a drafter for TensorRT-LLM).
Bytes = tensor bytes + safetensors headers + the non-weight files the stage copies (when the source
is on disk). The per-rank shards of the torch TP runtime use the same split rules as the writer
(dflash_trt.checkpoint.mapping), so replicated tensors and vocabulary padding are counted.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_trt.builder.config import BuildConfig
from dflash_trt.checkpoint.layout import (
    GROUP_ORDER,
    TensorSpec,
    drafter_specs,
    group_of,
    header_bytes,
    read_specs,
    target_specs,
)

ASSUMED_DRAFTER_LAYERS = 5  # when neither the drafter config nor drafter.num_hidden_layers is known
# the linears dflash_trt.checkpoint.quantized.plan_for quantizes (every nn.Linear but lm_head / fc)
QUANTIZED_WEIGHT = re.compile(r"(model\.)?layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
QUANT_LABEL = {"fp8": "FP8 (per-tensor scale, static input scale)",
               "nvfp4": "NVFP4 (e4m3 scale per 16, static input scale)"}


@dataclass(frozen=True)
class GroupSize:
    """One tensor group of one stage's output."""

    group: str
    tensors: int
    params: int  # weight elements (an MXFP4 byte holds two)
    source: str  # formats in the source, e.g. "MXFP4 + BF16"
    output: str  # what the stage writes, e.g. "MXFP4 (copied)"
    est_bytes: int

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SizeEstimate:
    groups: tuple[GroupSize, ...]
    other_bytes: int  # safetensors headers + copied non-weight files (the latter when the source is here)
    basis: str  # where the tensor list came from

    @property
    def total(self) -> int:
        return sum(g.est_bytes for g in self.groups) + self.other_bytes

    def as_dict(self) -> dict:
        return {"est_bytes": self.total, "basis": self.basis, "other_bytes": self.other_bytes,
                "groups": [g.as_dict() for g in self.groups]}


def _params(spec: TensorSpec) -> int:
    if spec.fmt == "MXFP4":
        return 0 if spec.name.endswith("_scales") else spec.numel * 2
    return spec.numel


def _quantized(spec: TensorSpec, fmt: str) -> list[TensorSpec]:
    base = spec.name.removesuffix(".weight")
    out, inp = spec.shape
    scalars = [TensorSpec(base + ".input_scale", (), "F32")]
    if fmt == "fp8":
        return [TensorSpec(spec.name, spec.shape, "F8_E4M3"), TensorSpec(base + ".weight_scale", (), "F32"), *scalars]
    return [TensorSpec(spec.name, (out, inp // 2), "U8"), TensorSpec(base + ".weight_scale", (out, inp // 16), "F8_E4M3"),
            TensorSpec(base + ".weight_scale_2", (), "F32"), *scalars]


def transform(specs: list[TensorSpec], mode: str) -> list[tuple[TensorSpec, list[TensorSpec], str]]:
    """[(source tensor, what is written for it, label)] for a stage mode: "copy", "fp8", "nvfp4"
    or "bf16" (cast every float tensor to BF16)."""
    rows = []
    for s in specs:
        if mode in ("fp8", "nvfp4") and QUANTIZED_WEIGHT.fullmatch(s.name):
            rows.append((s, _quantized(s, mode), QUANT_LABEL[mode]))
        elif mode == "bf16" and s.dtype in ("F32", "F16"):
            rows.append((s, [TensorSpec(s.name, s.shape, "BF16")], f"BF16 (cast from {s.fmt})"))
        else:
            rows.append((s, [s], f"{s.fmt} (copied)" if mode in ("copy", "bf16") else f"{s.fmt} (kept)"))
    return rows


def _formats(specs: list[TensorSpec], key) -> str:
    by_bytes: dict[str, int] = {}
    for s in specs:
        by_bytes[key(s)] = by_bytes.get(key(s), 0) + s.nbytes
    return " + ".join(sorted(by_bytes, key=lambda f: -by_bytes[f]))


def estimate(specs: list[TensorSpec], mode: str, other_files: int, basis: str) -> SizeEstimate:
    rows = transform(specs, mode)
    groups = []
    for name in GROUP_ORDER:
        mine = [r for r in rows if group_of(r[0].name) == name]
        if not mine:
            continue
        labels: dict[str, int] = {}
        for _src, outs, label in mine:
            labels[label] = labels.get(label, 0) + sum(o.nbytes for o in outs)
        source = _formats([r[0] for r in mine], lambda s: s.fmt)
        if all(label.endswith(" (copied)") for label in labels):
            output = f"{source} (copied)"
        else:
            output = " + ".join(sorted(labels, key=lambda k: -labels[k]))
        groups.append(GroupSize(name, len(mine), sum(_params(r[0]) for r in mine), source, output,
                                sum(o.nbytes for r in mine for o in r[1])))
    written = [o for r in rows for o in r[1]]
    return SizeEstimate(tuple(groups), header_bytes(written) + other_files, basis)


def written_specs(specs: list[TensorSpec], mode: str) -> list[TensorSpec]:
    return [o for r in transform(specs, mode) for o in r[1]]


def other_files_bytes(directory: Path | None, names: tuple[str, ...] | None = None) -> int:
    """Bytes of the non-safetensors files a stage copies from `directory` (all, or `names`)."""
    if directory is None or not Path(directory).is_dir():
        return 0
    return sum(p.stat().st_size for p in Path(directory).iterdir()
               if p.is_file() and not p.name.startswith(".") and p.suffix != ".safetensors"
               and not p.name.endswith(".safetensors.index.json") and (names is None or p.name in names))


def target_source_specs(cfg: BuildConfig, tensors: tuple[TensorSpec, ...] | None, path: Path
                        ) -> tuple[list[TensorSpec], str]:
    """The target's tensors: its headers when on disk (`tensors`), else from the build config."""
    if tensors is not None:
        return list(tensors), f"safetensors headers of {path}"
    t = cfg.target
    return target_specs(t.architecture, layers=t.num_hidden_layers, hidden=t.hidden_size,
                        heads=t.num_attention_heads, kv_heads=t.num_key_value_heads, head_dim=t.head_dim,
                        intermediate=t.intermediate_size, vocab=t.vocab_size, experts=t.num_experts,
                        tied=t.tie_word_embeddings, dtype=t.dtype,
                        expert_format="mxfp4" if t.quantization == "mxfp4" else "float"), \
        "the build config's target section (checkpoint not on this machine)"


def drafter_source_specs(cfg: BuildConfig, tensors: tuple[TensorSpec, ...] | None, path: Path
                         ) -> tuple[list[TensorSpec], str]:
    """The drafter's tensors: its headers when on disk, else Qwen3 layers of the target's sizes."""
    if tensors is not None:
        return list(tensors), f"safetensors headers of {path}"
    t = cfg.target
    layers = cfg.drafter.num_hidden_layers or ASSUMED_DRAFTER_LAYERS
    how = "drafter.num_hidden_layers" if cfg.drafter.num_hidden_layers else f"an assumed {layers} layers"
    return drafter_specs(layers=layers, hidden=t.hidden_size, heads=t.num_attention_heads,
                         kv_heads=t.num_key_value_heads, head_dim=t.head_dim, intermediate=t.intermediate_size,
                         num_taps=assumed_taps(layers), dtype=t.dtype), \
        f"the target's sizes and {how} (drafter not on this machine)"


def assumed_taps(layers: int) -> int:
    """Target layers a drafter of `layers` layers taps, when its config is not here: as many as it
    has layers, at least 2 and at most 5 (z-lab's published drafters; the 8-layer gpt-oss-120b one
    taps 5)."""
    return max(2, min(layers, 5))


def target_mode(cfg: BuildConfig) -> str:
    q = cfg.target.quantization
    return q if q in ("fp8", "nvfp4") else "copy"


def drafter_mode(cfg: BuildConfig) -> str:
    if cfg.drafter.quantization == "fp8":
        return "fp8"
    return "bf16" if cfg.backend.startswith("trtllm") else "copy"


def shard_bytes(cfg: BuildConfig, written: list[TensorSpec]) -> int:
    """Bytes of every rank{N}.safetensors of the torch TP shards of `written` (the target stage's
    tensors), split by dflash_trt.checkpoint.mapping's rules."""
    from dflash_trt.checkpoint.mapping import Dims, Mapping, local_shape

    t, p = cfg.target, cfg.parallel
    dims = Dims(t.num_attention_heads, t.num_key_value_heads, t.head_dim, t.intermediate_size, t.vocab_size,
                t.num_experts)
    mapping = Mapping.for_sizes(p.tp, p.ep if cfg.is_moe else 1)
    total = 0
    for rank in range(p.tp):
        local = [TensorSpec(s.name, local_shape(s.name, s.shape, dims, mapping, rank), s.dtype) for s in written]
        total += sum(s.nbytes for s in local) + header_bytes(local)
    return total


def dir_bytes(path: Path) -> int:
    """Bytes of a file, or of every non-hidden file under a directory."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))


def measure(directory: Path) -> dict[str, int]:
    """Bytes per tensor group in a written checkpoint directory (from its headers)."""
    out: dict[str, int] = {}
    for s in read_specs(directory):
        out[group_of(s.name)] = out.get(group_of(s.name), 0) + s.nbytes
    return out


__all__ = ["GroupSize", "SizeEstimate", "dir_bytes", "drafter_mode", "drafter_source_specs", "estimate", "measure",
           "other_files_bytes", "shard_bytes", "target_mode", "target_source_specs", "transform", "written_specs"]
