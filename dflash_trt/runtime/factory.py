"""THE backend factory: picks and loads `torch` or `trtllm` behind the engine seam (dflash_trt/engine.py).

    models = load_backend("torch", LoadConfig(target, drafter))   # or "trtllm" (GPU + TensorRT-LLM)
    engine = models.engine(EngineConfig(max_batch_size=8))          # an `Engine`
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=32))

Both loaded-model objects offer the same small surface: `backend`, `load` (the LoadConfig),
`info` (TargetInfo), `tokenizer` (None when the target directory has none), `detokenize(ids)`,
`engine(config)` and `shutdown()`. The CLI, the OpenAI server, the Triton model and the bench all
go through here, so they decode identically; training and calibration, which hold models in memory
already, build the torch engine with `torch_engine`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch

from dflash_trt.config import TargetInfo, check_drafter_matches_target, require_dir
from dflash_trt.engine import Engine, EngineConfig, Target
from dflash_trt.errors import ConfigError
from dflash_trt.models.cpu_linear import check_kind as check_cpu_kernels, prepack_if
from dflash_trt.models.drafter import DTYPES, DFlashDrafter
from dflash_trt.models.target import TARGET_BACKENDS, load_target
from dflash_trt.speculative.decoder import DFlashEngine

log = logging.getLogger(__name__)

BACKENDS = ("torch", "trtllm")


@dataclass(frozen=True)
class LoadConfig:
    """Which checkpoints to load and how."""

    target: Path
    drafter: Path | None  # None: autoregressive only
    target_backend: str = "native"  # torch backend: "native" (our engine) | "hf" (any transformers model, batch 1)
    dtype: str = "float32"
    cpu_kernels: str = "auto"  # float32 linears on CPU: "auto" | "onednn" (prepacked) | "torch" (models/cpu_linear.py)

    def __post_init__(self) -> None:
        check_cpu_kernels(self.cpu_kernels)
        if self.target_backend not in TARGET_BACKENDS:
            raise ConfigError(f"target_backend must be one of {TARGET_BACKENDS}, got '{self.target_backend}'")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got '{self.dtype}'")


@dataclass(frozen=True)
class TrtllmOptions:
    """What only the trtllm backend takes: extra `tensorrt_llm.LLM` arguments (tensor_parallel_size,
    kv_cache_config, moe_expert_parallel_size, ...; a partial `speculative_config` adds
    DFlashDecodingConfig keys such as attention_backend to the adapter's own mapping)."""

    llm_args: dict[str, Any] = field(default_factory=dict)
    mpi_session: object | None = field(default=None, compare=False)  # MpiCommSession over an MPI world (Triton)


def load_tokenizer(directory: Path):
    """The target's tokenizer, or None when its directory has no tokenizer files."""
    directory = Path(directory)
    if not any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def torch_engine(target: Target, drafter: DFlashDrafter | None, config: EngineConfig,
                 detokenize: Callable[[list[int]], str] | None = None) -> Engine:
    """The torch backend's engine over models already in memory (the drafter is dropped when
    config.speculative is False)."""
    return DFlashEngine(target, drafter if config.speculative else None, config, detokenize)


@dataclass
class TorchModels:
    """The torch backend, loaded: target, drafter and tokenizer in this process."""

    backend: ClassVar[str] = "torch"
    load: LoadConfig
    target: Target  # NativeCausalLM | HFTarget | a tensor-parallel shard
    drafter: DFlashDrafter | None
    tokenizer: object | None  # a transformers tokenizer when the target directory has one

    @property
    def info(self) -> TargetInfo:
        return self.target.info

    def engine(self, config: EngineConfig) -> Engine:
        """The engine for `config`, checked against these models first (EngineConfig.for_models)."""
        config = config.for_models(self.info, None if self.drafter is None else self.drafter.block_size,
                                   DTYPES[self.load.dtype].itemsize)
        return torch_engine(self.target, self.drafter, config, self.detokenize if self.tokenizer is not None else None)

    def detokenize(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise ConfigError("this target has no tokenizer")
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def shutdown(self) -> None:
        """Nothing to release: the models go with this object."""


def load_torch(load: LoadConfig) -> TorchModels:
    """Target (native, HF adapter, or a ModelOpt-quantized directory emulated on CPU), drafter, tokenizer."""
    require_dir(load.target, "target directory")
    if load.drafter is not None:
        require_dir(load.drafter, "drafter directory")
    dtype: torch.dtype = DTYPES[load.dtype]
    from dflash_trt.checkpoint import modelopt_hf

    if modelopt_hf.is_modelopt_dir(Path(load.target)):
        if load.target_backend != "native":
            raise ConfigError("quantized (ModelOpt) targets load on the native backend only: drop --target-backend hf")
        log.info("target %s is a ModelOpt-quantized checkpoint (emulated on the torch backend)", load.target)
        target = modelopt_hf.load_target(Path(load.target), dtype)
    else:
        target = load_target(Path(load.target), load.target_backend, dtype)
    drafter = None
    if load.drafter is not None:
        if modelopt_hf.is_modelopt_dir(Path(load.drafter)):
            drafter = modelopt_hf.load_drafter(Path(load.drafter), dtype)
        else:
            drafter = DFlashDrafter.from_pretrained(Path(load.drafter), dtype)
        check_drafter_matches_target(drafter.cfg, target.info)
    prepack_if(load.cpu_kernels, target, drafter)
    return TorchModels(load=load, target=target, drafter=drafter, tokenizer=load_tokenizer(Path(load.target)))


def check_backend(backend: str) -> None:
    """ConfigError for an unknown name; BackendUnavailableError (one line) when `trtllm` cannot run
    here (no tensorrt_llm package or no CUDA GPU). Cheap: nothing is loaded."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {BACKENDS}, got '{backend}'")
    if backend == "trtllm":
        from dflash_trt.runtime.trtllm import import_tensorrt_llm

        import_tensorrt_llm()


@dataclass(frozen=True)
class MpiRole:
    """Where this process stands for a trtllm model over MPI (runtime.trtllm, as TensorRT-LLM's
    LLM-API Triton model): `leads` is False on a rank that served the leader and is done."""

    leads: bool
    session: object | None  # the leader's MpiCommSession (mpi: world, rank 0), else None
    note: str


def join_trtllm_mpi(mode: str, environ) -> MpiRole:
    """mode "spawn": drop the MPI job variables this process inherited (TensorRT-LLM spawns its own
    workers); "world": rank 0 of COMM_WORLD leads with an MpiCommSession, every other rank serves it
    until it shuts down (this call returns then)."""
    from dflash_trt.runtime import trtllm

    if mode == "spawn":
        gone = trtllm.drop_inherited_mpi_job(environ)
        return MpiRole(True, None, f"dropped inherited MPI job variables {gone}" if gone else "")
    if mode != "world":
        raise ConfigError(f"mpi must be spawn or world, got '{mode}'")
    rank, size = trtllm.mpi_world()
    if rank != 0:
        trtllm.serve_mpi_leader()
        return MpiRole(False, None, f"MPI rank {rank} of {size} served the leader")
    return MpiRole(True, trtllm.leader_mpi_session(size), f"MPI rank 0 leads {size} ranks")


def load_backend(backend: str, load: LoadConfig, trtllm_options: TrtllmOptions | None = None):
    """The loaded backend (TorchModels, or runtime.trtllm.TrtllmModels); `trtllm_options` only for
    trtllm (None: its defaults)."""
    check_backend(backend)
    if backend == "torch":
        if trtllm_options is not None:
            raise ConfigError("TensorRT-LLM options were given for the torch backend: drop them or use --backend trtllm")
        return load_torch(load)
    from dflash_trt.runtime.trtllm import load_trtllm

    return load_trtllm(load, trtllm_options if trtllm_options is not None else TrtllmOptions())


__all__ = ["BACKENDS", "LoadConfig", "MpiRole", "join_trtllm_mpi", "TorchModels", "TrtllmOptions", "check_backend", "load_backend", "load_tokenizer", "load_torch",
           "torch_engine"]
