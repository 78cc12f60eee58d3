"""Training checkpoints: one directory per saved step, published by a pointer file.

    checkpoints/step-0000200/drafter/{config.json, model.safetensors}   (float32, loadable as is)
    checkpoints/step-0000200/trainer_state.pt  optimizer, scheduler, step, RNG states, config, recipe
    checkpoints/latest.json                    {"step": 200, "dir": "step-0000200"}

A step directory is fully written in a temporary sibling and renamed into place; only then is
`latest.json` replaced (atomically). An interrupt at any moment therefore leaves `latest.json`
pointing at a complete checkpoint. Older step directories beyond `keep` are removed afterwards.

A new run can start from another run's checkpoint (`load_continuation`, `carry_adam_moments`): the
float32 weights and AdamW's first and second moments carry over, nothing else (steps, schedule,
data and RNG are the new run's). Starting from a shipped drafter instead restarts AdamW from zero
moments, whose first updates are sign-like, the same size for every weight whatever its gradient
(Adam's bias correction; Kingma & Ba, arXiv 1412.6980, section 3).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_trt.fileio import atomic_directory, read_state_dict, write_json
from dflash_trt.errors import CheckpointError
from dflash_trt.models.drafter import DFlashDrafter

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
    return read_state_dict(Path(path) / "drafter"), load_trainer_state(path)


def load_trainer_state(path: Path) -> dict:
    """The trainer_state.pt of one step directory."""
    path = Path(path)
    try:
        return torch.load(path / STATE_FILE, weights_only=True)
    except (OSError, RuntimeError) as exc:
        raise CheckpointError(f"cannot read {path / STATE_FILE}: {exc}") from exc


@dataclass
class Continuation:
    """What a new run takes over from another run's checkpoint."""
    path: Path  # the step directory
    step: int  # the step the other run had reached
    drafter: DFlashDrafter  # float32, the checkpoint's weights
    moments: dict  # AdamW state by parameter index (the order of drafter.parameters())


def resolve_checkpoint(path: Path) -> Path:
    """A step directory, or the latest checkpoint under a folder with latest.json (a work dir's checkpoints/
    or stable/), or of a work dir's checkpoints/."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    for root in (path / "checkpoints", path):
        latest = read_latest(root)
        if latest is not None:
            return latest
    raise CheckpointError(f"{path} holds no training checkpoint: give a run's --work-dir or one of its "
                          f"checkpoints/step-* directories (with {STATE_FILE})")


def load_continuation(path: Path) -> Continuation:
    """Read and check a checkpoint to continue from: its drafter, and one AdamW state per parameter
    with the parameter's shape (anything else is a clear error, before any training work)."""
    step_dir = resolve_checkpoint(path)
    extra = load_trainer_state(step_dir)
    drafter = DFlashDrafter.from_pretrained(step_dir / "drafter", torch.float32)
    try:
        saved = extra["optimizer"]
        groups, state = saved["param_groups"], saved["state"]
        step = int(extra["state"]["step"])
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"{step_dir / STATE_FILE} has no optimizer state ({exc})") from exc
    params = list(drafter.parameters())
    count = sum(len(g["params"]) for g in groups)
    if len(groups) != 1 or count != len(params):
        raise CheckpointError(f"{step_dir}: the optimizer state covers {count} tensors in {len(groups)} group(s), "
                              f"the drafter has {len(params)} parameters")
    for i, p in enumerate(params):
        st = state.get(i)
        if st is None:
            continue  # never updated: AdamW starts it from zero, as it would anyway
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in st or tuple(st[key].shape) != tuple(p.shape):
                raise CheckpointError(f"{step_dir}: AdamW '{key}' of parameter {i} does not match its shape "
                                      f"{tuple(p.shape)}")
    return Continuation(step_dir, step, drafter, state)


def carry_adam_moments(opt: torch.optim.Optimizer, carried: Continuation) -> None:
    """Put the carried moments (and AdamW's per-parameter step counts) into `opt`, keeping `opt`'s own
    hyperparameters (learning rate, betas, weight decay) and parameters."""
    doc = opt.state_dict()
    if len(doc["param_groups"]) != 1 or len(doc["param_groups"][0]["params"]) != len(list(carried.drafter.parameters())):
        raise CheckpointError("the optimizer does not cover the carried drafter's parameters")
    doc["state"] = {i: {k: v.clone() for k, v in st.items()} for i, st in carried.moments.items()}
    opt.load_state_dict(doc)
