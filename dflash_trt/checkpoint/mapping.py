"""THE parallel mapping and THE split-rule table: how a model's tensors are cut over tensor-parallel
(TP) ranks, with expert parallelism (EP) and MoE tensor parallelism (MoE-TP) inside TP.

`Mapping` follows TensorRT-LLM's rank convention (NVIDIA/TensorRT-LLM tensorrt_llm/mapping.py,
checked at commit 05ebebb2: `moe_tp_rank = tp_rank // moe_ep_size`, `moe_ep_rank = tp_rank %
moe_ep_size`, so an expert group holds consecutive TP ranks' worth of experts spread round-robin and
the MoE-TP slices of one expert sit moe_ep_size ranks apart). The same class serves our TP runtime
(runtime/tp.py), pre-sharded HF checkpoints (sharding.py) and TensorRT-LLM legacy checkpoints
(trtllm_layout.py, which renames and fuses on top of these rules), and its `to_json` is the
`mapping` section of a legacy config.json.

The rules, one per parameter of the native target and the DFlash drafter (HF names), as Megatron-LM
and TensorRT-LLM shard a decoder:
- column-parallel (split dim 0): q/k/v projections by whole heads, gate/up projections by the
  intermediate dim, with their biases; gpt-oss attention sinks split with the q heads;
- row-parallel (split dim 1, then all-reduce): o_proj and down_proj; their biases are kept whole on
  every rank and added once, after the all-reduce;
- k/v heads are duplicated when tp > num_key_value_heads (each rank holds the kv head its q heads read);
- vocab-parallel embed_tokens and lm_head (dim 0), padded to ceil(vocab / tp) rows per rank;
- MoE experts [E, ...]: split over moe_ep_size groups (dim 0, "ep") and over moe_tp_size ranks on
  the intermediate dim ("mtp"); gate_up_proj [E, H, 2I] keeps its gate/up interleaving (a contiguous
  slice of 2I/moe_tp columns at an even offset holds whole pairs);
- everything else (norms, router, q_norm/k_norm, the drafter's fc) is replicated.
Quantized tensors follow their weight: block scales split like it, per-tensor scalars are replicated.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from dflash_trt.errors import CheckpointError, ConfigError
from dflash_trt.models.transformer import head_dim_of


@dataclass(frozen=True)
class Mapping:
    """A model split over `tp_size` ranks; MoE layers split over moe_tp_size x moe_ep_size == tp_size."""

    tp_size: int = 1
    moe_tp_size: int = 1
    moe_ep_size: int | None = None  # None: tp_size // moe_tp_size (the rest is expert parallel)

    def __post_init__(self) -> None:
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ConfigError(f"tp_size must be an integer >= 1, got {self.tp_size!r}")
        if self.moe_tp_size < 1 or self.tp_size % self.moe_tp_size:
            raise ConfigError(f"moe_tp_size {self.moe_tp_size} must be >= 1 and divide tp_size {self.tp_size}")
        if self.moe_ep_size is None:
            object.__setattr__(self, "moe_ep_size", self.tp_size // self.moe_tp_size)
        if self.moe_tp_size * self.moe_ep_size != self.tp_size:
            raise ConfigError(f"moe_tp_size ({self.moe_tp_size}) x moe_ep_size ({self.moe_ep_size}) must equal "
                              f"tp_size ({self.tp_size})")

    @classmethod
    def for_sizes(cls, tp: int, ep: int = 1) -> "Mapping":
        """From --tp and --ep (expert-parallel ways inside tp)."""
        if ep < 1 or tp % ep:
            raise ConfigError(f"--ep ({ep}) must divide --tp ({tp})")
        return cls(tp, tp // ep, ep)

    def moe_tp_rank(self, rank: int) -> int:
        return rank // self.moe_ep_size

    def moe_ep_rank(self, rank: int) -> int:
        return rank % self.moe_ep_size

    def to_json(self) -> dict:
        """The `mapping` section of a checkpoint config.json (TensorRT-LLM's field names)."""
        return {"world_size": self.tp_size, "tp_size": self.tp_size, "pp_size": 1,
                "moe_tp_size": self.moe_tp_size, "moe_ep_size": self.moe_ep_size}

    @classmethod
    def from_json(cls, raw: dict) -> "Mapping":
        for key in ("tp_size", "moe_tp_size", "moe_ep_size"):
            if key not in raw:
                raise CheckpointError(f"checkpoint mapping lacks '{key}': {raw}")
        if raw.get("pp_size", 1) != 1:
            raise CheckpointError(f"pipeline parallel checkpoints (pp_size={raw['pp_size']}) are not supported")
        return cls(int(raw["tp_size"]), int(raw["moe_tp_size"]), int(raw["moe_ep_size"]))


@dataclass(frozen=True)
class Dims:
    """The model sizes the rules need."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_experts: int  # 0 for dense models

    @classmethod
    def of(cls, config) -> "Dims":
        """From a transformers config (target) or a DrafterConfig (drafter: dense, same field names)."""
        experts = config.num_local_experts if hasattr(config, "num_local_experts") else 0
        return cls(config.num_attention_heads, config.num_key_value_heads, head_dim_of(config),
                   config.intermediate_size, config.vocab_size, experts)


def check_mapping(d: Dims, mapping: Mapping) -> None:
    """Raise ConfigError when `mapping` cannot split a model of these sizes evenly."""
    tp = mapping.tp_size
    if d.num_heads % tp:
        raise ConfigError(f"tp {tp} does not divide the {d.num_heads} attention heads: choose a tp that divides it")
    if d.num_kv_heads % tp and tp % d.num_kv_heads:
        raise ConfigError(f"tp {tp} and the {d.num_kv_heads} kv heads must divide one another "
                          "(kv heads are split, or duplicated when tp > kv heads)")
    if d.num_experts:
        if d.num_experts % mapping.moe_ep_size:
            raise ConfigError(f"moe_ep_size {mapping.moe_ep_size} does not divide the {d.num_experts} experts: "
                              "choose a smaller expert-parallel size or use MoE-TP (--moe-tp-size)")
        if d.intermediate_size % mapping.moe_tp_size:
            raise ConfigError(f"moe_tp_size {mapping.moe_tp_size} does not divide the expert intermediate size "
                              f"{d.intermediate_size}")
    elif d.intermediate_size % tp:
        raise ConfigError(f"tp {tp} does not divide the MLP intermediate size {d.intermediate_size}")


# THE split-rule table. Kinds per dim: q (q heads), kv (kv heads, duplicated past num_kv_heads),
# vocab (padded), ffn (dense intermediate), ep (experts), mtp (MoE intermediate).
_TENSOR = r"\.(weight|bias|weight_scale|weight_scale_2|input_scale)"
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale")  # per-tensor when they hold one value
RULES: list[tuple[re.Pattern, dict[int, str]]] = [
    (re.compile(r"model\.embed_tokens\.weight|lm_head\.weight"), {0: "vocab"}),
    (re.compile(r".*\.self_attn\.q_proj" + _TENSOR), {0: "q"}),
    (re.compile(r".*\.self_attn\.[kv]_proj" + _TENSOR), {0: "kv"}),
    (re.compile(r".*\.self_attn\.o_proj\.(weight|weight_scale|weight_scale_2|input_scale)"), {1: "q"}),
    (re.compile(r".*\.self_attn\.sinks"), {0: "q"}),
    (re.compile(r".*\.mlp\.(gate|up)_proj" + _TENSOR), {0: "ffn"}),
    (re.compile(r".*\.mlp\.down_proj\.(weight|weight_scale|weight_scale_2|input_scale)"), {1: "ffn"}),
    (re.compile(r".*\.mlp\.experts\.gate_up_proj(_bias)?"), {0: "ep", -1: "mtp"}),
    (re.compile(r".*\.mlp\.experts\.down_proj"), {0: "ep", 1: "mtp"}),
    (re.compile(r".*\.mlp\.experts\.down_proj_bias"), {0: "ep"}),
    # gpt-oss MXFP4 experts as released: [E, out, in/32, 16] blocks and [E, out, in/32] E8M0 scales
    # (rows of gate_up interleave gate and up, as the float layout's last dim does)
    (re.compile(r".*\.mlp\.experts\.gate_up_proj_(blocks|scales)"), {0: "ep", 1: "mtp"}),
    (re.compile(r".*\.mlp\.experts\.down_proj_(blocks|scales)"), {0: "ep", 2: "mtp"}),
    (re.compile(r".*\.self_attn\.o_proj\.bias|.*\.mlp\.down_proj\.bias|.*\.mlp\.router\.(weight|bias)"
                r"|.*norm\.weight|fc\.weight"), {}),
]


def rule_for(name: str) -> dict[int, str]:
    """{dim: kind} for a tensor name; {} means replicated. Unknown names are errors."""
    for pattern, rule in RULES:
        if pattern.fullmatch(name):
            return rule
    raise CheckpointError(f"no tensor-parallel rule for tensor '{name}': this architecture's weights are not "
                          "supported by the parallel layout")


def _range(kind: str, size: int, d: Dims, m: Mapping, rank: int) -> tuple[int, int, int]:
    """(start, stop, pad) of rank `rank` along one dim of length `size`."""
    tp = m.tp_size
    parts = {"q": tp, "ffn": tp, "ep": m.moe_ep_size, "mtp": m.moe_tp_size}.get(kind, 1)
    if size % parts:
        raise CheckpointError(f"a dim of {size} cannot be split into {parts} equal '{kind}' parts (MXFP4 experts "
                              "split MoE-TP by groups of 32): choose other tp / ep sizes")
    if kind in ("q", "ffn"):
        per = size // tp
        return rank * per, (rank + 1) * per, 0
    if kind == "kv":
        if tp <= d.num_kv_heads:
            per = size // tp
            return rank * per, (rank + 1) * per, 0
        head, rows = rank // (tp // d.num_kv_heads), size // d.num_kv_heads  # duplicated kv head
        return head * rows, (head + 1) * rows, 0
    if kind == "vocab":
        per = math.ceil(size / tp)
        start = min(rank * per, size)
        stop = min(start + per, size)
        return start, stop, per - (stop - start)
    if kind == "ep":
        per, r = size // m.moe_ep_size, m.moe_ep_rank(rank)
        return r * per, (r + 1) * per, 0
    if kind == "mtp":
        per, r = size // m.moe_tp_size, m.moe_tp_rank(rank)
        return r * per, (r + 1) * per, 0
    raise AssertionError(f"unknown rule kind {kind}")


def shard_slices(name: str, shape: tuple[int, ...], d: Dims, mapping: Mapping, rank: int
                 ) -> tuple[tuple[slice, ...], int]:
    """Index of rank `rank`'s part of tensor `name` of full `shape`, and the rows of zero padding
    appended on dim 0 (vocab-parallel tensors only). Per-tensor scalars are replicated."""
    if not 0 <= rank < mapping.tp_size:
        raise ConfigError(f"rank {rank} outside tp_size {mapping.tp_size}")
    index = [slice(None)] * len(shape)
    rule = rule_for(name)
    if is_scalar_scale(name, shape):
        return tuple(index), 0
    pad = 0
    for dim, kind in rule.items():
        dim = dim % len(shape)
        start, stop, extra = _range(kind, shape[dim], d, mapping, rank)
        index[dim] = slice(start, stop)
        pad = pad or extra
    return tuple(index), pad


def is_scalar_scale(name: str, shape: tuple[int, ...]) -> bool:
    """A per-tensor quantization scale (FP8 scales, NVFP4 global scales): replicated on every rank."""
    return name.endswith(SCALE_SUFFIXES) and math.prod(shape) == 1


def full_shape(name: str, local: tuple[int, ...], d: Dims, mapping: Mapping) -> tuple[int, ...]:
    """The whole tensor's shape from one rank's part (inverse of local_shape)."""
    if is_scalar_scale(name, local):
        return local
    out = list(local)
    tp = mapping.tp_size
    for dim, kind in rule_for(name).items():
        dim = dim % len(local)
        if kind == "vocab":
            out[dim] = d.vocab_size
        elif kind == "kv":
            out[dim] = local[dim] * (tp if tp <= d.num_kv_heads else d.num_kv_heads)
        else:
            out[dim] = local[dim] * {"q": tp, "ffn": tp, "ep": mapping.moe_ep_size, "mtp": mapping.moe_tp_size}[kind]
    return tuple(out)


def pad_rows(part: torch.Tensor, pad: int) -> torch.Tensor:
    if not pad:
        return part.contiguous()
    return torch.cat([part, part.new_zeros((pad, *part.shape[1:]))], dim=0)


def shard_tensor(name: str, tensor: torch.Tensor, d: Dims, mapping: Mapping, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of a full tensor."""
    index, pad = shard_slices(name, tuple(tensor.shape), d, mapping, rank)
    return pad_rows(tensor[index], pad)


def local_shape(name: str, shape: tuple[int, ...], d: Dims, mapping: Mapping, rank: int) -> tuple[int, ...]:
    index, pad = shard_slices(name, shape, d, mapping, rank)
    out = [len(range(*s.indices(n))) for s, n in zip(index, shape)]
    if out:
        out[0] += pad
    return tuple(out)


def merge_shards(name: str, shards: list[torch.Tensor], shape: tuple[int, ...], d: Dims, mapping: Mapping
                 ) -> torch.Tensor:
    """The full tensor of `shape` from every rank's part (inverse of shard_tensor). Duplicated
    parts (replicated tensors, kv heads past num_kv_heads) must agree bit for bit."""
    if len(shards) != mapping.tp_size:
        raise CheckpointError(f"{name}: {len(shards)} shards for tp_size {mapping.tp_size}")
    full = shards[0].new_zeros(shape)
    filled = torch.zeros(shape, dtype=torch.bool)
    for rank, part in enumerate(shards):
        index, pad = shard_slices(name, shape, d, mapping, rank)
        part = part[: part.shape[0] - pad] if pad else part
        if bool(filled[index].all()) and not torch.equal(full[index], part):
            raise CheckpointError(f"{name}: rank {rank}'s copy differs from an earlier rank's")
        full[index] = part
        filled[index] = True
    if not bool(filled.all()):
        raise CheckpointError(f"{name}: the shards do not cover the whole tensor")
    return full


__all__ = ["Dims", "Mapping", "RULES", "check_mapping", "full_shape", "is_scalar_scale", "local_shape", "merge_shards",
           "pad_rows", "rule_for", "shard_slices", "shard_tensor"]
