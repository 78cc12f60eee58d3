"""The build config: one strict YAML describes a deployment (models, quantization, parallel layout,
limits, backend, GPU) and is validated before any work starts.

Static rules live here (they need only the YAML): parallel layout arithmetic, quantization the GPU
can run, backend/architecture support. Rules that need the checkpoints on disk (drafter matches
target, the YAML's architecture expectations match the real config.json) live in
`dflash_trt.builder.sources`, run when the paths exist.

GPU architectures (CUDA compute capability -> name): sm_80 A100 (Ampere: no FP8, no FP4),
sm_89 L40S/RTX 4090 (Ada: FP8), sm_90 H100/H200 (Hopper: FP8, no FP4 tensor cores),
sm_100 B200/GB200 (Blackwell: FP8 + NVFP4), sm_103 B300/GB300 (Blackwell Ultra: FP8 + NVFP4),
sm_120 RTX PRO 6000 / RTX 5090 (Blackwell workstation: FP8 + NVFP4); `cpu` is the torch backend
on this project's CPU path (FP8/NVFP4 emulated). `mxfp4` is gpt-oss's release format (MXFP4
experts, BF16 elsewhere), shipped unchanged; TensorRT-LLM runs it with MXFP4 MoE kernels from
Hopper on (W4A16 on sm_90, MXFP8 or FP8 activations on Blackwell: a run-time choice,
`tensorrt_llm/_torch/model_config.py` @ 008e0af8980fc560003631ba4ac37828836a91c8).

Quantization per architecture (what upstream loaders take):
- Llama / Qwen3 targets: FP8 or NVFP4 in the ModelOpt HF format (their loaders match ModelOpt's
  Hugging Face-named exclusions, `model.layers.*`).
- gpt-oss targets: `mxfp4` (the release as is) or `none` (a BF16 checkpoint as is). TensorRT-LLM's
  gpt-oss loader takes BF16 or MXFP4 experts only and skips per-layer mixed precision
  (`_torch/models/modeling_gpt_oss.py` @ 050b6cb92871a4ed73486c5e5a573d4198d1a6d9), so FP8 / NVFP4
  gpt-oss builds are refused; `dflash-trt quantize` still writes them for the torch runtime.
- Drafters for TensorRT-LLM are BF16: its DFlash draft model slices the raw q/k/v weights into a
  fused context-K/V GEMM with no weight scale (`_torch/models/modeling_dflash.py` @
  009d8fa431bd3de92245aab80f8b57dc70da1ac4). FP8 drafters are a torch-backend feature.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dflash_trt.config import load_yaml_file, validate_model
from dflash_trt.errors import ConfigError
from dflash_trt.trtllm_release import pinned

GPU_ARCHS: dict[str, tuple[str, frozenset[str]]] = {
    # name -> (what it is, quantization formats its tensor cores run)
    "sm_80": ("Ampere A100", frozenset({"none"})),
    "sm_89": ("Ada L40S / RTX 4090", frozenset({"none", "fp8"})),
    "sm_90": ("Hopper H100 / H200", frozenset({"none", "fp8", "mxfp4"})),
    "sm_100": ("Blackwell B200 / GB200", frozenset({"none", "fp8", "nvfp4", "mxfp4"})),
    "sm_103": ("Blackwell Ultra B300 / GB300", frozenset({"none", "fp8", "nvfp4", "mxfp4"})),
    "sm_120": ("Blackwell RTX PRO 6000 / RTX 5090", frozenset({"none", "fp8", "nvfp4", "mxfp4"})),
    "cpu": ("CPU (torch backend, FP8/NVFP4 emulated)", frozenset({"none", "fp8", "nvfp4", "mxfp4"})),
}
GpuArch = Literal["sm_80", "sm_89", "sm_90", "sm_100", "sm_103", "sm_120", "cpu"]
Backend = Literal["trtllm-pytorch", "torch"]
# TensorRT-LLM runs DFlash only on its PyTorch backend: DFlashDecodingConfig.supports_backend(b) is
# b == "pytorch" (tensorrt_llm/llmapi/llm_args.py @0004396720054fd8e205cbf616f21f0b57c6b412), and
# trtllm-build left upstream after 1.3.0rc20 (docs/source/legacy/tensorrt-backend-removal.md
# @335107a7646f9682c5e24103b11fc2b3e2c8362f). A config asking for the old engine path gets this line.
ENGINE_BACKEND_REMOVED = ("backend trtllm-engine is not supported: TensorRT-LLM runs DFlash only on its PyTorch "
                          "backend (there is no DFlash on the trtllm-build engine path, which upstream removed after "
                          "1.3.0rc20): use backend: trtllm-pytorch")
TargetQuant = Literal["none", "fp8", "nvfp4", "mxfp4"]
CheckpointDtype = Literal["bfloat16", "float16", "float32"]
DrafterQuant = Literal["none", "fp8"]
KvDtype = Literal["auto", "fp8", "bfloat16", "float16", "float32"]
MoeBackend = Literal["CUTLASS", "TRTLLM", "TRITON", "DEEPGEMM", "CUTEDSL", "VANILLA"]
# the embedded SmolLM2 target / the shipped drafter / the tiny gpt-oss stand-in (MXFP4 release layout,
# written once into the cache) and its drafter
SOURCE_ALIASES = ("@default", "@shipped", "@tiny-gpt-oss", "@tiny-gpt-oss-drafter")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class TargetSection(_Strict):
    """The target checkpoint and what the YAML expects it to be. The expectations let a dry run
    size the build without the weights, and are checked against config.json when it exists."""

    path: str = Field(min_length=1, description="HF checkpoint directory, or @default (embedded SmolLM2)")
    architecture: str = Field(min_length=1, description="expected transformers model_type: llama, qwen3, gpt_oss")
    num_hidden_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    vocab_size: int = Field(ge=2)
    num_experts: int = Field(default=0, ge=0, description="0 for dense models")
    tie_word_embeddings: bool = False
    dtype: CheckpointDtype = Field(default="bfloat16", description="dtype of the checkpoint's float tensors")
    quantization: TargetQuant = "none"


class DrafterSection(_Strict):
    path: str = Field(min_length=1, description="DFlash drafter directory, or @shipped")
    num_hidden_layers: int | None = Field(default=None, ge=1, description="sizes a dry run without the drafter")
    quantization: DrafterQuant = "none"


class ParallelSection(_Strict):
    tp: int = Field(default=1, ge=1, le=64)
    ep: int = Field(default=1, ge=1, le=64, description="MoE expert parallel size; MoE TP is tp / ep")
    pp: int = Field(default=1, ge=1, le=16)
    ranks: int = Field(default=1, ge=1, description="total MPI ranks; must equal tp * pp")
    gpus_per_node: int = Field(default=1, ge=1, le=16)
    nodes: int = Field(default=1, ge=1)


class ServeSection(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    free_gpu_memory_fraction: float = Field(default=0.85, gt=0.0, le=1.0)
    # the pinned TensorRT-LLM release (dflash_trt/trtllm_release.py): the image trtllm-serve runs in, and
    # the image the Triton job runs in (docker/Dockerfile.triton: tritonserver + tensorrt_llm + dflash_trt)
    container_image: str = Field(default_factory=lambda: pinned().release_image)
    triton_image: str = Field(default_factory=lambda: f"dflash-trt-triton:{pinned().version}")
    triton_decoupled: bool = False  # Triton transaction policy: unary (upstream's default) or streaming
    triton: bool = True
    triton_model_name: str = Field(default="dflash", pattern=r"^[A-Za-z0-9_\-]+$")
    health_timeout_s: int = Field(default=1800, ge=10)


class BuildConfig(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]+$")
    target: TargetSection
    drafter: DrafterSection
    backend: Backend
    gpu_arch: GpuArch
    kv_cache_dtype: KvDtype = "auto"
    parallel: ParallelSection = ParallelSection()
    max_batch_size: int = Field(ge=1, le=4096)
    max_seq_len: int = Field(ge=16)
    max_num_tokens: int | None = Field(default=None, ge=16)
    max_draft_len: int = Field(ge=1, description="drafted tokens per step; max_draft_len + 1 <= the drafter's "
                               "block_size (checked against its config.json)")
    moe_backend: MoeBackend | None = None
    cuda_graph_batch_sizes: list[int] = Field(default_factory=list)
    calibration_samples: int = Field(default=512, ge=1, le=4096,
                                     description="prompts for FP8/NVFP4 activation scales; unused when "
                                                 "nothing is quantized")
    serve: ServeSection = ServeSection()

    @model_validator(mode="before")
    @classmethod
    def _removed_backend(cls, raw: object) -> object:
        if isinstance(raw, dict) and "backend" in raw and raw["backend"] == "trtllm-engine":
            raise ConfigError(ENGINE_BACKEND_REMOVED)
        return raw

    @model_validator(mode="after")
    def _check(self) -> "BuildConfig":
        check_static(self)
        return self

    @property
    def is_moe(self) -> bool:
        return self.target.num_experts > 0


def _parallel_rules(cfg: BuildConfig) -> None:
    p, t = cfg.parallel, cfg.target
    if p.ranks != p.tp * p.pp:
        raise ConfigError(f"parallel.ranks is {p.ranks} but tp * pp = {p.tp} * {p.pp} = {p.tp * p.pp}: "
                          "every rank holds one (tp, pp) shard, so set ranks to tp * pp")
    if p.ranks > p.nodes * p.gpus_per_node:
        raise ConfigError(f"{p.ranks} ranks do not fit on {p.nodes} node(s) x {p.gpus_per_node} GPUs: "
                          "raise nodes or gpus_per_node, or lower tp/pp")
    if p.nodes > 1 and p.ranks <= (p.nodes - 1) * p.gpus_per_node:
        raise ConfigError(f"{p.ranks} ranks fit on fewer than {p.nodes} nodes of {p.gpus_per_node} GPUs: lower nodes")
    if t.num_attention_heads % p.tp:
        raise ConfigError(f"tp={p.tp} does not divide the target's {t.num_attention_heads} attention heads: "
                          "choose a tp that divides it")
    kv = t.num_key_value_heads
    if kv % p.tp and p.tp % kv:
        raise ConfigError(f"tp={p.tp} and the target's {kv} kv heads: tp must divide kv heads, or be a multiple "
                          "of them (kv heads are then duplicated)")
    if t.num_attention_heads % kv:
        raise ConfigError(f"num_attention_heads {t.num_attention_heads} is not a multiple of num_key_value_heads {kv}")
    if t.num_hidden_layers % p.pp:
        raise ConfigError(f"pp={p.pp} does not divide the target's {t.num_hidden_layers} layers")
    if cfg.is_moe:
        if p.tp % p.ep:
            raise ConfigError(f"ep={p.ep} must divide tp={p.tp} (MoE layers use ep x moe_tp = tp)")
        if t.num_experts % p.ep:
            raise ConfigError(f"ep={p.ep} does not divide the target's {t.num_experts} experts")
        moe_tp = p.tp // p.ep
        if t.intermediate_size % moe_tp:
            raise ConfigError(f"MoE TP size {moe_tp} (tp/ep) does not divide the expert intermediate size "
                              f"{t.intermediate_size}: raise ep")
    elif p.ep != 1:
        raise ConfigError(f"ep={p.ep} is set but the target is dense (num_experts 0): set ep to 1")
    if cfg.moe_backend is not None and not cfg.is_moe:
        raise ConfigError("moe_backend is set but the target has no experts: remove moe_backend")


def _quant_rules(cfg: BuildConfig) -> None:
    desc, formats = GPU_ARCHS[cfg.gpu_arch]
    for what, fmt in (("target.quantization", cfg.target.quantization),
                      ("drafter.quantization", cfg.drafter.quantization)):
        if fmt not in formats:
            hint = " (Hopper has FP8 but no FP4 tensor cores: use fp8)" if fmt == "nvfp4" and cfg.gpu_arch == "sm_90" else ""
            raise ConfigError(f"{what}: {fmt} is not supported on {cfg.gpu_arch} ({desc}){hint}; "
                              f"supported there: {', '.join(sorted(formats))}")
    arch, tq = cfg.target.architecture, cfg.target.quantization
    if tq == "mxfp4" and arch != "gpt_oss":
        raise ConfigError(f"target.quantization mxfp4 keeps gpt-oss's released MXFP4 experts; a {arch} target has "
                          "none: use fp8 or nvfp4")
    if arch == "gpt_oss" and tq in ("fp8", "nvfp4"):
        raise ConfigError(f"target.quantization {tq} for gpt-oss: TensorRT-LLM's gpt-oss loader takes BF16 or "
                          "MXFP4 experts and no FP8/NVFP4 attention; use mxfp4 (the release as is) or none")
    if cfg.drafter.quantization == "fp8" and cfg.backend.startswith("trtllm"):
        raise ConfigError("drafter.quantization fp8 with a TensorRT-LLM backend: its DFlash drafter multiplies the "
                          "raw q/k/v weights with no scale, so it must be BF16; use none (FP8 drafters: backend torch)")
    if cfg.kv_cache_dtype == "fp8" and "fp8" not in formats:
        raise ConfigError(f"kv_cache_dtype fp8 needs FP8 support, which {cfg.gpu_arch} ({desc}) lacks: use auto")


def _backend_rules(cfg: BuildConfig) -> None:
    if cfg.backend.startswith("trtllm") and cfg.gpu_arch == "cpu":
        raise ConfigError(f"backend {cfg.backend} runs on NVIDIA GPUs only: set gpu_arch (e.g. sm_103 for B300) "
                          "or use backend torch for CPU")
    release = pinned()
    repo, _, tag = cfg.serve.container_image.rpartition(":")
    if repo == release.release_image.rpartition(":")[0] and tag != release.version:
        raise ConfigError(f"serve.container_image is TensorRT-LLM {tag}, but this build writes LLM-API options "
                          f"checked against {release.version} (the pinned release): use {release.release_image}")
    if cfg.backend == "torch" and cfg.parallel.pp != 1:
        raise ConfigError("the torch backend supports tensor parallelism only: set pp to 1")
    sizes = cfg.cuda_graph_batch_sizes
    if sizes and cfg.backend != "trtllm-pytorch":
        raise ConfigError("cuda_graph_batch_sizes applies to backend trtllm-pytorch only: remove it")
    if any(s < 1 or s > cfg.max_batch_size for s in sizes) or len(set(sizes)) != len(sizes):
        raise ConfigError(f"cuda_graph_batch_sizes {list(sizes)} must be distinct sizes in [1, max_batch_size="
                          f"{cfg.max_batch_size}]")
    if cfg.max_num_tokens is not None and cfg.max_num_tokens < cfg.max_batch_size * (cfg.max_draft_len + 1):
        raise ConfigError(f"max_num_tokens {cfg.max_num_tokens} cannot hold one verify block per sequence: "
                          f"needs >= max_batch_size * (max_draft_len + 1) = "
                          f"{cfg.max_batch_size * (cfg.max_draft_len + 1)}")
    if cfg.max_seq_len <= cfg.max_draft_len + 1:
        raise ConfigError(f"max_seq_len {cfg.max_seq_len} must exceed max_draft_len + 1")


def check_static(cfg: BuildConfig) -> None:
    """All rules that need only the YAML; raises ConfigError saying what to change."""
    _parallel_rules(cfg)
    _quant_rules(cfg)
    _backend_rules(cfg)


def parse_build_config(raw: object, where: str = "build config") -> BuildConfig:
    return validate_model(BuildConfig, raw, where, heading="invalid build config: ")


def load_build_config(path: Path) -> BuildConfig:
    return parse_build_config(load_yaml_file(path, "build config"), where=str(Path(path)))


def config_to_dict(cfg: BuildConfig) -> dict:
    return cfg.model_dump(mode="json")
