"""What produced a checkpoint: tool version, source file hashes and the quantization config.

Every checkpoint this project writes carries the same record twice: as `provenance.json` next to
the weights, and flattened into the metadata of every safetensors file it writes (so one file
copied out of its directory still says where it came from).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflash_trt.errors import CheckpointError

PROVENANCE_FILE = "provenance.json"
METADATA_KEY = "dflash_trt_provenance"
_HASHED_SUFFIXES = (".safetensors", ".json", ".gguf", ".bin", ".model", ".jinja")
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def hash_source_dir(directory: Path) -> dict[str, str]:
    """sha256 of each weight/config file directly in `directory` (name -> hex digest)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"source directory {directory} does not exist")
    return {p.name: sha256_file(p) for p in sorted(directory.iterdir())
            if p.is_file() and p.name.endswith(_HASHED_SUFFIXES) and not p.name.startswith(".")}


@dataclass(frozen=True)
class Provenance:
    """Where a written checkpoint came from."""

    tool: str  # "dflash_trt"
    tool_version: str
    format: str  # "modelopt-hf" | "trtllm-legacy"
    quantization: dict[str, Any]  # quant_algo, kv_cache_quant_algo, group_size, exclude_modules, calibration
    sources: dict[str, dict[str, str]] = field(default_factory=dict)  # role -> {file: sha256}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def metadata(self) -> dict[str, str]:
        """safetensors metadata (str -> str)."""
        return {"format": "pt", METADATA_KEY: json.dumps(self.to_json(), sort_keys=True)}


def make_provenance(fmt: str, quantization: dict[str, Any], sources: dict[str, Path | None]) -> Provenance:
    from dflash_trt import __version__

    hashed = {role: hash_source_dir(path) for role, path in sources.items() if path is not None}
    return Provenance("dflash_trt", __version__, fmt, json.loads(json.dumps(quantization)), hashed)


def read_provenance(directory: Path) -> dict[str, Any]:
    path = Path(directory) / PROVENANCE_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {PROVENANCE_FILE}: it was not written by dflash_trt")
    return json.loads(path.read_text())
