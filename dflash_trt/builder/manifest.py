"""manifest.json: what a build directory holds and how it was made.

Keys: format/format_version, versions (dflash_trt, python, torch, transformers, tensorrt_llm),
created, name, config (the full build config), config_sha256, sources (paths + fingerprints),
stages ([{name, status, seconds, bytes, key, facts}]), dflash (block size, draft length, mask id,
the target layers tapped and how their hidden states reach the drafter), outputs, launch,
tensor_groups (per stage: what each tensor group became, the plan's estimate and the bytes written).
"""
from __future__ import annotations

import importlib.metadata
import json
import platform
from datetime import datetime, timezone
from pathlib import Path

from dflash_trt.builder.config import config_to_dict
from dflash_trt.builder.plan import BuildPlan
from dflash_trt.builder.sources import json_digest

MANIFEST = "manifest.json"
FORMAT = "dflash_trt-build"
FORMAT_VERSION = 1


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def hidden_state_exposure(plan: BuildPlan) -> dict:
    """How the target's tapped hidden states reach the drafter on this backend."""
    layer_ids = list(plan.sources.drafter_config.target_layer_ids)
    backend = plan.config.backend
    if backend == "trtllm-pytorch":
        how = ("TensorRT-LLM's DFlash mode (speculative_config.decoding_type DFlash) captures the outputs of "
               "target_layer_ids inside the target forward and feeds the drafter in-process; nothing is exported")
        return {"backend": backend, "target_layer_ids": layer_ids, "mechanism": how, "outputs": []}
    how = ("dflash_trt's torch target adapter returns the concatenated outputs of the tapped decoder layers "
           "(HF hidden_states[id + 1]) with every target forward")
    return {"backend": backend, "target_layer_ids": layer_ids, "mechanism": how, "outputs": []}


def build_manifest(plan: BuildPlan, fingerprints: dict, stages: list[dict], launch: dict, extra: dict) -> dict:
    cfg, d = plan.config, plan.sources.drafter_config
    config = config_to_dict(cfg)
    from dflash_trt import __version__

    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "versions": {"dflash_trt": __version__, "python": platform.python_version(), "torch": _version("torch"),
                     "transformers": _version("transformers"), "tensorrt_llm": _version("tensorrt_llm"),
                     "nvidia-modelopt": _version("nvidia-modelopt")},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "name": cfg.name,
        "config": config,
        "config_sha256": json_digest(config),
        "sources": {"target": {"path": str(plan.sources.target_path), **fingerprints["target"]},
                    "drafter": {"path": str(plan.sources.drafter_path), **fingerprints["drafter"]}},
        "stages": stages,
        "dflash": {"block_size": d.block_size, "max_draft_len": cfg.max_draft_len, "mask_token_id": d.mask_token_id,
                   "num_target_layers": d.num_target_layers, "hidden_state_taps": hidden_state_exposure(plan)},
        "outputs": {s.name: s.output for s in plan.stages if s.output},
        "launch": launch,
        **extra,
    }


def tensor_group_report(plan: BuildPlan, out: Path) -> dict:
    """For target/ and drafter/ of the assembled directory `out`: the plan's per-group estimate
    (source format -> written format, bytes) next to the bytes each group takes on disk."""
    from dflash_trt.builder.sizes import dir_bytes, measure

    report = {}
    for stage in plan.stages:
        if stage.tensor_groups is None:
            continue
        written = measure(out / stage.output)
        groups = [dict(g.as_dict(), written_bytes=written.pop(g.group, 0)) for g in stage.tensor_groups.groups]
        if written:
            raise AssertionError(f"{stage.name}: groups {sorted(written)} were written but not planned")
        report[stage.name] = {**stage.tensor_groups.as_dict(), "groups": groups,
                              "written_bytes": dir_bytes(out / stage.output)}
    return report


def write_manifest(directory: Path, manifest: dict) -> None:
    (Path(directory) / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")


def read_manifest(directory: Path) -> dict:
    return json.loads((Path(directory) / MANIFEST).read_text())


def build_name(directory: Path) -> str | None:
    """The name of the build in `directory` (its manifest's), or None when `directory` holds no build
    (no manifest.json, or another tool's)."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    if not isinstance(manifest, dict) or "format" not in manifest or manifest["format"] != FORMAT:
        return None
    return manifest["name"]
