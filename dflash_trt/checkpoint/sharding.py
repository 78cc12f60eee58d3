"""Pre-sharded Hugging Face checkpoints for our TP runtime: read only this rank's slices of a HF
checkpoint (`load_rank_state`), or write `rank{N}.safetensors` for every rank once
(`write_tp_shards`, config.json gets a `mapping` section with TensorRT-LLM's field names) and read
them back (`load_presharded_rank`). The split rules and the rank convention are in mapping.py.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from dflash_trt.checkpoint.mapping import Dims, Mapping, check_mapping, pad_rows, shard_slices
from dflash_trt.errors import CheckpointError
from dflash_trt.fileio import INDEX_NAME, atomic_directory, weight_files, write_json, write_safetensors
from dflash_trt.models.target import load_hf_config

RANK_FILE = "rank{}.safetensors"


def load_rank_state(directory: Path, config, mapping: Mapping, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors of a HF checkpoint, reading only its slices from disk."""
    from safetensors import SafetensorError, safe_open

    dims = Dims.of(config)
    check_mapping(dims, mapping)
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    view = f.get_slice(name)
                    index, pad = shard_slices(name, tuple(view.get_shape()), dims, mapping, rank)
                    state[name] = pad_rows(view[index], pad)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from exc
    return state


def is_presharded(directory: Path) -> bool:
    directory = Path(directory)
    config = directory / "config.json"
    return config.is_file() and (directory / RANK_FILE.format(0)).is_file() and "mapping" in json.loads(config.read_text())


def read_mapping(directory: Path) -> Mapping:
    raw = json.loads((Path(directory) / "config.json").read_text())
    if "mapping" not in raw:
        raise CheckpointError(f"{directory}/config.json has no 'mapping': it is not a pre-sharded checkpoint")
    return Mapping.from_json(raw["mapping"])


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


def write_tp_shards(hf_dir: Path, out_dir: Path, mapping: Mapping | int) -> Path:
    """Write `rank{N}.safetensors` for every rank of `mapping` plus config.json (the HF config and
    a `mapping` section) and the tokenizer files. Atomic: out_dir appears complete or not at all."""
    mapping = Mapping(mapping) if isinstance(mapping, int) else mapping
    hf_dir = Path(hf_dir)
    config = load_hf_config(hf_dir)
    check_mapping(Dims.of(config), mapping)
    raw = json.loads((hf_dir / "config.json").read_text())
    raw["mapping"] = mapping.to_json()
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
