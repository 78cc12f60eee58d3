"""Tensor-parallel (TP) and expert-parallel (EP) split and merge rules on HF-named tensors.

One rule per parameter of the native target (models/transformer.py, HF names), applied the way
Megatron-LM / TensorRT-LLM shard a decoder:
- column-parallel (split the output dim 0): q/k/v projections by whole heads, gate/up projections
  by the intermediate dim, with their biases; gpt-oss attention sinks split with the q heads;
- row-parallel (split the input dim 1, then all-reduce): o_proj and down_proj; their biases are
  kept whole on every rank and added once, after the all-reduce;
- k/v heads are duplicated when tp > num_key_value_heads (each rank holds the one kv head its q
  heads read);
- vocab-parallel embed_tokens and lm_head (dim 0), padded to ceil(vocab / tp) rows per rank;
- MoE experts [E, ...]: expert-parallel over `moe_ep_size` groups (dim 0) and MoE-TP over
  `moe_tp_size` ranks on the intermediate dim (gate_up_proj [E, H, 2I] keeps its gate/up
  interleaving: a contiguous slice of 2I/moe_tp columns at an even offset holds whole pairs);
  TP rank r has moe_tp_rank = r % moe_tp_size and moe_ep_rank = r // moe_tp_size;
- everything else (norms, router, q_norm/k_norm) is replicated.

`load_rank_state` reads only this rank's slices from a HF safetensors checkpoint;
`write_tp_shards` writes pre-sharded `rank{N}.safetensors` plus a config.json (the HF config with a
`mapping` section, the field names of TensorRT-LLM's legacy checkpoint); `merge_shards` inverts
the split (tests, and converting back).
"""
from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dflash_trt.errors import CheckpointError, ConfigError
from dflash_trt.models.transformer import head_dim_of

RANK_FILE = "rank{}.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class TPMapping:
    """How a target is split over `tp_size` ranks. MoE layers split over moe_tp x moe_ep == tp."""

    tp_size: int
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

    def as_dict(self) -> dict:
        return {"world_size": self.tp_size, "tp_size": self.tp_size, "pp_size": 1,
                "moe_tp_size": self.moe_tp_size, "moe_ep_size": self.moe_ep_size}

    @classmethod
    def from_dict(cls, raw: dict) -> "TPMapping":
        for key in ("tp_size", "moe_tp_size", "moe_ep_size"):
            if key not in raw:
                raise CheckpointError(f"checkpoint mapping lacks '{key}': {raw}")
        if raw.get("pp_size", 1) != 1:
            raise CheckpointError(f"pipeline parallel checkpoints (pp_size={raw['pp_size']}) are not supported")
        return cls(int(raw["tp_size"]), int(raw["moe_tp_size"]), int(raw["moe_ep_size"]))


@dataclass(frozen=True)
class Dims:
    """The model sizes the rules need, read from a transformers config."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_experts: int  # 0 for dense models

    @classmethod
    def of(cls, config) -> "Dims":
        heads = config.num_attention_heads
        head_dim = head_dim_of(config)
        experts = config.num_local_experts if hasattr(config, "num_local_experts") else 0
        return cls(heads, config.num_key_value_heads, head_dim, config.intermediate_size, config.vocab_size, experts)


def check_mapping(config, mapping: TPMapping) -> None:
    """Raise ConfigError when `mapping` cannot split this model evenly."""
    d, tp = Dims.of(config), mapping.tp_size
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


# rule kinds per dim: q (q heads), kv (kv heads, duplicated past num_kv_heads), vocab (padded),
# ffn (dense intermediate), ep (experts), mtp (MoE intermediate; size from the tensor)
_RULES: list[tuple[re.Pattern, dict[int, str]]] = [
    (re.compile(r"model\.embed_tokens\.weight|lm_head\.weight"), {0: "vocab"}),
    (re.compile(r".*\.self_attn\.q_proj\.(weight|bias)"), {0: "q"}),
    (re.compile(r".*\.self_attn\.[kv]_proj\.(weight|bias)"), {0: "kv"}),
    (re.compile(r".*\.self_attn\.o_proj\.weight"), {1: "q"}),
    (re.compile(r".*\.self_attn\.sinks"), {0: "q"}),
    (re.compile(r".*\.mlp\.(gate|up)_proj\.(weight|bias)"), {0: "ffn"}),
    (re.compile(r".*\.mlp\.down_proj\.weight"), {1: "ffn"}),
    (re.compile(r".*\.mlp\.experts\.gate_up_proj(_bias)?"), {0: "ep", -1: "mtp"}),
    (re.compile(r".*\.mlp\.experts\.down_proj"), {0: "ep", 1: "mtp"}),
    (re.compile(r".*\.mlp\.experts\.down_proj_bias"), {0: "ep"}),
    (re.compile(r".*\.self_attn\.o_proj\.bias|.*\.mlp\.down_proj\.bias|.*\.mlp\.router\.(weight|bias)"
                r"|.*norm\.weight|.*layernorm\.weight"), {}),
]


def rule_for(name: str) -> dict[int, str]:
    """{dim: kind} for a tensor name; {} means replicated. Unknown names are errors."""
    for pattern, rule in _RULES:
        if pattern.fullmatch(name):
            return rule
    raise CheckpointError(f"no tensor-parallel rule for tensor '{name}': this architecture's weights are not "
                          "supported by the TP runtime")


def _range(kind: str, size: int, d: Dims, m: TPMapping, rank: int) -> tuple[int, int, int]:
    """(start, stop, pad) of rank `rank` along one dim of length `size`."""
    tp = m.tp_size
    if kind == "q":
        per = size // tp
        return rank * per, (rank + 1) * per, 0
    if kind == "kv":
        if tp <= d.num_kv_heads:
            per = size // tp
            return rank * per, (rank + 1) * per, 0
        head = rank // (tp // d.num_kv_heads)
        return head * d.head_dim, (head + 1) * d.head_dim, 0
    if kind == "vocab":
        per = math.ceil(size / tp)
        start = min(rank * per, size)
        stop = min(start + per, size)
        return start, stop, per - (stop - start)
    if kind == "ffn":
        per = size // tp
        return rank * per, (rank + 1) * per, 0
    if kind == "ep":
        per, r = size // m.moe_ep_size, rank // m.moe_tp_size
        return r * per, (r + 1) * per, 0
    if kind == "mtp":
        per, r = size // m.moe_tp_size, rank % m.moe_tp_size
        return r * per, (r + 1) * per, 0
    raise AssertionError(f"unknown rule kind {kind}")


def shard_slices(name: str, shape: tuple[int, ...], config, mapping: TPMapping, rank: int
                 ) -> tuple[tuple[slice, ...], int]:
    """Index of rank `rank`'s part of tensor `name` of full `shape`, and the rows of zero padding
    appended on dim 0 (vocab-parallel tensors only)."""
    if not 0 <= rank < mapping.tp_size:
        raise ConfigError(f"rank {rank} outside tp_size {mapping.tp_size}")
    d = Dims.of(config)
    index = [slice(None)] * len(shape)
    pad = 0
    for dim, kind in rule_for(name).items():
        dim = dim % len(shape)
        start, stop, extra = _range(kind, shape[dim], d, mapping, rank)
        index[dim] = slice(start, stop)
        pad = pad or extra
    return tuple(index), pad


def shard_tensor(name: str, tensor: torch.Tensor, config, mapping: TPMapping, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of a full tensor."""
    index, pad = shard_slices(name, tuple(tensor.shape), config, mapping, rank)
    return _pad(tensor[index], pad)


def _pad(part: torch.Tensor, pad: int) -> torch.Tensor:
    if not pad:
        return part.contiguous()
    return torch.cat([part, part.new_zeros((pad, *part.shape[1:]))], dim=0)


def local_shape(name: str, shape: tuple[int, ...], config, mapping: TPMapping, rank: int) -> tuple[int, ...]:
    index, pad = shard_slices(name, shape, config, mapping, rank)
    out = [len(range(*s.indices(n))) for s, n in zip(index, shape)]
    out[0] += pad
    return tuple(out)


def merge_shards(name: str, shards: list[torch.Tensor], shape: tuple[int, ...], config, mapping: TPMapping
                 ) -> torch.Tensor:
    """The full tensor of `shape` from every rank's part (inverse of shard_tensor). Duplicated
    parts (replicated tensors, kv heads past num_kv_heads) must agree."""
    if len(shards) != mapping.tp_size:
        raise CheckpointError(f"{name}: {len(shards)} shards for tp_size {mapping.tp_size}")
    full = shards[0].new_zeros(shape)
    filled = torch.zeros(shape, dtype=torch.bool)
    for rank, part in enumerate(shards):
        index, pad = shard_slices(name, shape, config, mapping, rank)
        part = part[: part.shape[0] - pad] if pad else part
        if bool(filled[index].all()) and not torch.equal(full[index], part):
            raise CheckpointError(f"{name}: rank {rank}'s copy differs from an earlier rank's")
        full[index] = part
        filled[index] = True
    if not bool(filled.all()):
        raise CheckpointError(f"{name}: the shards do not cover the whole tensor")
    return full


# ---- reading and writing checkpoints ---------------------------------------------------------
def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a HF checkpoint directory (indexed shards or one file)."""
    directory = Path(directory)
    index = directory / INDEX_NAME
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from exc
    elif (directory / SINGLE_NAME).is_file():
        names = [SINGLE_NAME]
    else:
        names = sorted(p.name for p in directory.glob("*.safetensors") if not p.name.startswith("rank"))
    if not names:
        raise CheckpointError(f"no safetensors weights in {directory} (expected {SINGLE_NAME} or {INDEX_NAME})")
    missing = [n for n in names if not (directory / n).is_file()]
    if missing:
        raise CheckpointError(f"{directory}: weight files {missing} are missing")
    return [directory / n for n in names]


def load_rank_state(directory: Path, config, mapping: TPMapping, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors of a HF checkpoint, reading only its slices from disk."""
    from safetensors import SafetensorError, safe_open

    check_mapping(config, mapping)
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    view = f.get_slice(name)
                    index, pad = shard_slices(name, tuple(view.get_shape()), config, mapping, rank)
                    state[name] = _pad(view[index], pad)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from exc
    return state


def is_presharded(directory: Path) -> bool:
    directory = Path(directory)
    config = directory / "config.json"
    return config.is_file() and (directory / RANK_FILE.format(0)).is_file() and "mapping" in json.loads(config.read_text())


def read_mapping(directory: Path) -> TPMapping:
    raw = json.loads((Path(directory) / "config.json").read_text())
    if "mapping" not in raw:
        raise CheckpointError(f"{directory}/config.json has no 'mapping': it is not a pre-sharded checkpoint")
    return TPMapping.from_dict(raw["mapping"])


def load_presharded_rank(directory: Path, rank: int) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(directory) / RANK_FILE.format(rank)
    if not path.is_file():
        raise CheckpointError(f"pre-sharded checkpoint {directory} has no {path.name}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc


def write_tp_shards(hf_dir: Path, out_dir: Path, mapping: TPMapping | int) -> Path:
    """Write `rank{N}.safetensors` for every rank of `mapping` plus config.json (the HF config and
    a `mapping` section) and the tokenizer files. Atomic: out_dir appears complete or not at all."""
    from dflash_trt.checkpoint.hf import atomic_directory, write_json, write_safetensors
    from dflash_trt.models.target import load_hf_config

    mapping = TPMapping(mapping) if isinstance(mapping, int) else mapping
    hf_dir = Path(hf_dir)
    config = load_hf_config(hf_dir)
    check_mapping(config, mapping)
    raw = json.loads((hf_dir / "config.json").read_text())
    raw["mapping"] = mapping.as_dict()
    with atomic_directory(Path(out_dir)) as tmp:
        for rank in range(mapping.tp_size):
            state = load_rank_state(hf_dir, config, mapping, rank)
            write_safetensors(tmp / RANK_FILE.format(rank), state, metadata={"rank": str(rank), **{
                k: str(v) for k, v in asdict(mapping).items()}})
        write_json(tmp / "config.json", raw)
        for extra in hf_dir.iterdir():
            if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in ("config.json", INDEX_NAME):
                shutil.copy2(extra, tmp / extra.name)
    return Path(out_dir)
