"""The Triton model's settings: `model.yaml` next to `model.py` in the model repository.

`dflash-trt triton-repo` writes it (resolved: absolute paths, every field explicit); the Python
backend model reads it in `auto_complete_config()` and `initialize()`. The same schema is accepted
by `triton-repo --config`, where relative paths are taken from the YAML file's folder. As in
TensorRT-LLM's LLM-API model (triton_backend/all_models/llmapi/tensorrt_llm/1/model.yaml
@0ebb1536ac12bbe27201185de960df3ab00bcecc), `triton_config` holds what Triton itself needs:
`max_batch_size: 0` (one prompt per request; requests are batched by our scheduler, not by
Triton) and `decoupled: false` (unary requests) by default; `decoupled: true` streams.

    model_name: dflash
    backend: torch            # torch: our runtime; trtllm: TensorRT-LLM's LLM API (GPU machines)
    target: /abs/target       # HF checkpoint directory with a tokenizer
    drafter: /abs/drafter     # DFlash drafter directory; null = autoregressive
    target_backend: native    # native | hf (torch backend only)
    dtype: float32
    chat: false               # wrap text_input in the tokenizer's chat template
    default_max_tokens: 128   # when a request has no sampling_param_max_tokens
    torch_threads: null       # torch intra-op threads in the model process (null = torch's default)
    engine: {block_size: null, max_batch_size: 8, max_seq_len: null, speculative: true, acceptance: exact,
             draft_confidence: null, draft_len_schedule: null, draft_vocab: true,
             ngram_lookup: 0}
    scheduler: {max_queue: 256, token_budget: 4096}
    trtllm_llm_args: {}       # extra tensorrt_llm.LLM arguments (backend trtllm only; runtime/trtllm.py)
    mpi: spawn                # backend trtllm: spawn (one tritonserver, TensorRT-LLM spawns its TP workers)
                              # or world (tritonserver on every MPI rank; rank 0 leads, the others serve it)
    triton_config: {max_batch_size: 0, decoupled: false, cancellation_check_period_ms: 100}
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from dflash_trt.config import DrafterConfig, check_block_size, load_yaml_file, validate_model
from dflash_trt.errors import ConfigError
from dflash_trt.runtime.factory import LoadConfig
from dflash_trt.runtime.scheduler import SchedulerConfig
from dflash_trt.engine import NGRAM_MAX_MATCH, EngineConfig

MODEL_YAML = "model.yaml"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class EngineSection(_Strict):
    block_size: int | None = Field(default=None, ge=1, le=64)
    max_batch_size: int = Field(default=8, ge=1)
    max_seq_len: int | None = Field(default=None, ge=2)  # None: the target's context (EngineConfig.for_models)
    speculative: bool = True
    acceptance: Literal["exact", "rejection"] = "exact"
    # speed settings of the torch engine (output unchanged): speculative/draft_len.py, draft_head.py
    # 0: the whole block; null: by device (CPU_DRAFT_CONFIDENCE on CPU, the whole block on a GPU; EngineConfig.on_device)
    draft_confidence: float | None = Field(default=None, ge=0.0, lt=1.0)
    draft_len_schedule: list[Annotated[list[int], Field(min_length=2, max_length=2)]] | None = None  # [[B, K], ...]
    draft_vocab: bool = True
    ngram_lookup: int = Field(default=0, ge=0, le=NGRAM_MAX_MATCH)  # n-gram lookup drafts (speculative/ngram.py)


class SchedulerSection(_Strict):
    max_queue: int = Field(default=256, ge=0)
    token_budget: int = Field(default=4096, ge=1)


class TritonConfigSection(_Strict):
    max_batch_size: Literal[0] = 0  # Triton does not batch here (upstream's model: batching is not supported)
    decoupled: bool = False  # False: one response per request (unary); True: streaming responses
    cancellation_check_period_ms: int = Field(default=100, ge=1, le=60_000)


class TritonSettings(_Strict):
    model_name: str = Field(default="dflash", pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
    backend: Literal["torch", "trtllm"] = "torch"
    target: str = Field(min_length=1)
    drafter: str | None = None
    target_backend: Literal["native", "hf"] = "native"
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"
    cpu_kernels: Literal["auto", "onednn", "torch"] = "auto"  # float32 linears on CPU (models/cpu_linear.py)
    chat: bool = False
    default_max_tokens: int = Field(default=128, ge=1)
    torch_threads: int | None = Field(default=None, ge=1)
    engine: EngineSection = EngineSection()
    scheduler: SchedulerSection = SchedulerSection()
    trtllm_llm_args: dict[str, Any] = Field(default_factory=dict)
    mpi: Literal["spawn", "world"] = "spawn"
    triton_config: TritonConfigSection = TritonConfigSection()

    # ---- views the runtime uses ---------------------------------------------------------------
    def load_config(self) -> LoadConfig:
        drafter = Path(self.drafter) if self.drafter is not None and self.engine.speculative else None
        return LoadConfig(target=Path(self.target), drafter=drafter, target_backend=self.target_backend, dtype=self.dtype,
                          cpu_kernels=self.cpu_kernels)

    def engine_config(self) -> EngineConfig:
        values = self.engine.model_dump()
        schedule = values["draft_len_schedule"]
        values["draft_len_schedule"] = None if schedule is None else tuple((b, k) for b, k in schedule)
        return EngineConfig(**values)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(**self.scheduler.model_dump())

    def trtllm_options(self, mpi_session: object | None = None):
        """runtime.factory.TrtllmOptions for backend trtllm (None for torch, which takes no LLM arguments);
        `mpi_session`: the leader's session over the MPI world (mpi: world)."""
        if self.backend != "trtllm":
            return None
        from dflash_trt.runtime.factory import TrtllmOptions

        return TrtllmOptions(llm_args=dict(self.trtllm_llm_args), mpi_session=mpi_session)

    def check_backend_options(self) -> None:
        if self.backend != "trtllm" and self.trtllm_llm_args:
            raise ConfigError("trtllm_llm_args is set but backend is torch: remove it or set backend: trtllm")
        if self.backend != "trtllm" and self.mpi != "spawn":
            raise ConfigError("mpi: world runs TensorRT-LLM over an MPI world and needs backend: trtllm "
                              "(the torch backend's tensor parallelism is `dflash-trt serve --tp`)")
        if self.trtllm_llm_args:
            from dflash_trt.trtllm_release import pinned

            pinned().check(self.trtllm_llm_args, "trtllm_llm_args")

    # ---- checks and I/O -------------------------------------------------------------------------
    def resolved(self, base: Path) -> "TritonSettings":
        """Paths made absolute (relative ones are taken from `base`)."""
        def absolute(p: str | None) -> str | None:
            return None if p is None else str((base / Path(p).expanduser()).resolve())

        return self.model_copy(update={"target": absolute(self.target), "drafter": absolute(self.drafter)})

    def check_paths(self) -> None:
        """The checkpoints exist and the target has a tokenizer (text_input needs one)."""
        target = Path(self.target)
        if not target.is_dir():
            raise ConfigError(f"target directory {target} does not exist")
        if not any((target / name).is_file() for name in TOKENIZER_FILES):
            raise ConfigError(f"target {target} has no tokenizer ({', '.join(TOKENIZER_FILES)}): "
                              "the Triton model takes text, so the target directory needs its tokenizer")
        if self.engine.speculative and self.drafter is None:
            raise ConfigError("engine.speculative is true but no drafter is given: set drafter or engine.speculative: false")
        if self.drafter is not None and not (Path(self.drafter) / "config.json").is_file():
            raise ConfigError(f"drafter directory {self.drafter} has no config.json")
        engine = self.engine_config()  # EngineConfig's own cross-field checks
        if self.drafter is not None and engine.speculative and engine.block_size is not None:
            check_block_size(engine.block_size, DrafterConfig.load(Path(self.drafter)).block_size, self.drafter)

    def to_yaml(self) -> str:
        header = "# dflash-trt Triton model settings (see dflash_trt/serve/triton/settings.py)\n"
        return header + yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    @classmethod
    def from_dict(cls, raw: Any, where: str) -> "TritonSettings":
        settings = validate_model(cls, raw, where)
        settings.check_backend_options()
        return settings

    @classmethod
    def load(cls, path: Path) -> "TritonSettings":
        return cls.from_dict(load_yaml_file(path, "model settings"), str(Path(path)))
