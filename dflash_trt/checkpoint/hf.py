"""Read and write Hugging Face safetensors checkpoints (single file or sharded with an index).

Writes are atomic: files go to a temporary sibling directory that is renamed into place, so an
interrupted save never leaves a half-written checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dflash_trt.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF checkpoint directory (model.safetensors or an indexed set of shards)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    index = directory / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = sorted(set(weight_map.values()))
    elif (directory / SINGLE_NAME).is_file():
        files = [SINGLE_NAME]
    else:
        found = sorted(p.name for p in directory.glob("*.safetensors"))
        if not found:
            raise CheckpointError(f"no safetensors weights in {directory} (expected {SINGLE_NAME} or {INDEX_NAME})")
        files = found
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{directory}: index names {name}, which is missing")
        try:
            part = load_file(str(path))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from exc
        dup = set(part) & set(tensors)
        if dup:
            raise CheckpointError(f"{path}: tensors {sorted(dup)[:3]} appear in more than one shard")
        tensors.update(part)
    return tensors


@contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a temporary directory `.<name>.tmp-*` next to `final`; on success it replaces `final`
    atomically (an existing `final` is renamed aside to `.<name>.tmp-old-<pid>`, so sweeps of
    `.<name>.tmp-*` leftovers catch it too, and removed once the new one is in place).
    On any exception the temporary directory is removed and `final` is left untouched."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            old = final.parent / f".{final.name}.tmp-old-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json(path: Path, data: dict) -> None:
    """Write JSON atomically (temp file + rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write one safetensors file atomically; tensors are made contiguous and unshared."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)
