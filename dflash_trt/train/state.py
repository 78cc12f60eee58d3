"""Training checkpoints: one directory per saved step, published by a pointer file.

    checkpoints/step-0000200/drafter/{config.json, model.safetensors}   (float32, loadable as is)
    checkpoints/step-0000200/trainer_state.pt  optimizer, scheduler, step, RNG states, config, recipe
    checkpoints/latest.json                    {"step": 200, "dir": "step-0000200"}

A step directory is fully written in a temporary sibling and renamed into place; only then is
`latest.json` replaced (atomically). An interrupt at any moment therefore leaves `latest.json`
pointing at a complete checkpoint. Older step directories beyond `keep` are removed afterwards.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from dflash_trt.fileio import atomic_directory, read_state_dict, write_json
from dflash_trt.errors import CheckpointError

LATEST = "latest.json"
STATE_FILE = "trainer_state.pt"


def read_latest(root: Path) -> Path | None:
    """The directory `latest.json` points at, or None when there is no checkpoint."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    try:
        name = json.loads(pointer.read_text())["dir"]
    except (json.JSONDecodeError, KeyError) as exc:
        raise CheckpointError(f"{pointer} is damaged ({exc}); remove it to start over") from exc
    path = Path(root) / name
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"{pointer} points at {path}, which is incomplete; remove it to start over")
    return path


def save_checkpoint(root: Path, step: int, drafter, extra: dict, keep: int) -> Path:
    root = Path(root)
    name = f"step-{step:07d}"
    with atomic_directory(root / name) as tmp:
        drafter.save_pretrained(tmp / "drafter", dtype=torch.float32)
        torch.save(extra, tmp / STATE_FILE)
    write_json(root / LATEST, {"step": step, "dir": name})
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in steps[:-keep]:
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    return root / name


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(drafter weights, trainer state dict) of one step directory."""
    path = Path(path)
    try:
        extra = torch.load(path / STATE_FILE, weights_only=True)
    except (OSError, RuntimeError) as exc:
        raise CheckpointError(f"cannot read {path / STATE_FILE}: {exc}") from exc
    return read_state_dict(path / "drafter"), extra
