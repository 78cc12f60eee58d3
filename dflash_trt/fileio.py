"""File helpers for checkpoints (floor 0): safetensors reads and atomic writes, and THE strict
state-dict check every loader runs (native target, drafter, quantized checkpoints, TP shards).

Hugging Face checkpoints are one `model.safetensors` or shards listed in
`model.safetensors.index.json`. Writes are atomic: files go to a temporary sibling (file or
directory) that is renamed into place, so an interrupted save never leaves a half-written checkpoint.
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


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a HF checkpoint directory (indexed shards, one file, or every
    *.safetensors except pre-sharded rank{N} files)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
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


def read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF checkpoint directory (model.safetensors or an indexed set of shards)."""
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        try:
            part = load_file(str(path))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from exc
        dup = set(part) & set(tensors)
        if dup:
            raise CheckpointError(f"{path}: tensors {sorted(dup)[:3]} appear in more than one shard")
        tensors.update(part)
    return tensors


def _few(names: list[str], n: int = 5) -> str:
    return f"{names[:n]}{'...' if len(names) > n else ''}"


def check_state_dict(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str,
                     *, exact_dtypes: bool = False) -> None:
    """The tensors read from disk match the model's: same names, same shapes and, with
    exact_dtypes, the same dtype for every non-float tensor (quantized codes and scales).
    CheckpointError names what is missing, unexpected or mis-shaped (`where` says which checkpoint)."""
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise CheckpointError(f"{where} does not match the model: missing {_few(missing)}, unexpected {_few(extra)}")
    for name, tensor in state.items():
        want = expected[name]
        if tuple(tensor.shape) != tuple(want.shape):
            raise CheckpointError(f"{where}: tensor {name} has shape {tuple(tensor.shape)}, the model expects "
                                  f"{tuple(want.shape)}")
        if exact_dtypes and tensor.dtype != want.dtype and not want.is_floating_point():
            raise CheckpointError(f"{where}: tensor {name} has dtype {tensor.dtype}, expected {want.dtype}")


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
