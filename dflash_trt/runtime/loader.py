"""Load a target, its DFlash drafter and the tokenizer for the torch backend.

The one place that turns paths into models; the CLI, the OpenAI server and the Triton model all
go through it, so they decode identically.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_trt.config import check_drafter_matches_target
from dflash_trt.errors import CheckpointError, ConfigError
from dflash_trt.models.drafter import DTYPES, DFlashDrafter
from dflash_trt.models.target import TARGET_BACKENDS, load_target
from dflash_trt.speculative.decoder import DFlashEngine, EngineConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    target: Path
    drafter: Path | None  # None: autoregressive only
    target_backend: str = "native"  # "native" | "hf"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.target_backend not in TARGET_BACKENDS:
            raise ConfigError(f"target_backend must be one of {TARGET_BACKENDS}, got '{self.target_backend}'")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got '{self.dtype}'")


@dataclass
class LoadedModels:
    spec: ModelSpec
    target: object  # NativeCausalLM | HFTarget
    drafter: DFlashDrafter | None
    tokenizer: object | None  # a transformers tokenizer when the target directory has one

    def engine(self, config: EngineConfig) -> DFlashEngine:
        return DFlashEngine(self.target, self.drafter if config.spec else None, config, self.detokenize)

    def detokenize(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise ConfigError("this target has no tokenizer")
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def load_tokenizer(directory: Path):
    """The target's tokenizer, or None when its directory has no tokenizer files."""
    directory = Path(directory)
    if not any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def load_models(spec: ModelSpec) -> LoadedModels:
    if not Path(spec.target).is_dir():
        raise CheckpointError(f"target directory {spec.target} does not exist")
    dtype: torch.dtype = DTYPES[spec.dtype]
    from dflash_trt.checkpoint import modelopt_hf

    if modelopt_hf.is_modelopt_dir(Path(spec.target)):
        if spec.target_backend != "native":
            raise ConfigError("quantized (ModelOpt) targets load on the native backend only: drop --target-backend hf")
        log.info("target %s is a ModelOpt-quantized checkpoint (emulated on the torch backend)", spec.target)
        target = modelopt_hf.load_target(Path(spec.target), dtype)
    else:
        target = load_target(Path(spec.target), spec.target_backend, dtype)
    drafter = None
    if spec.drafter is not None:
        if not Path(spec.drafter).is_dir():
            raise CheckpointError(f"drafter directory {spec.drafter} does not exist")
        if modelopt_hf.is_modelopt_dir(Path(spec.drafter)):
            drafter = modelopt_hf.load_drafter(Path(spec.drafter), dtype)
        else:
            drafter = DFlashDrafter.from_pretrained(Path(spec.drafter), dtype)
        check_drafter_matches_target(drafter.cfg, target.info)
    return LoadedModels(spec=spec, target=target, drafter=drafter, tokenizer=load_tokenizer(Path(spec.target)))
