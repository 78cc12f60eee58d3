"""The `--config` YAML of `dflash-trt serve`: the keys `trtllm-serve --config` takes, strictly parsed.

TensorRT-LLM reads DFlash settings from `speculative_config` (its `DFlashDecodingConfig`,
`decoding_type: DFlash`) and engine limits from top-level LLM-API keys (`TorchLlmArgs`). The same
file works here, on the torch backend:

- keys we honour: `speculative_config.{decoding_type, max_draft_len, speculative_model,
  mask_token_id, target_layer_ids, use_rejection_sampling}`, `max_batch_size`, `max_seq_len`,
  `max_num_tokens` (the scheduler's per-step token budget), `max_input_len`, `dtype`,
  `tensor_parallel_size` (must match `--tp`);
- keys TensorRT-LLM knows that tune its CUDA runtime (`kv_cache_config`, `cuda_graph_config`,
  `attention_backend`, ...) are parsed and listed in ONE warning: they have no effect here;
- keys whose ignoring would change results (beam search, LoRA, pipeline parallelism, a quantized
  KV cache, tree drafting) are ConfigErrors; any other key is a ConfigError naming it.

`max_draft_len` is the number of drafted tokens per step, so `block_size = max_draft_len + 1`
(slot 0 of a DFlash block holds the last committed token).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dflash_trt.config import DrafterConfig, load_yaml_file, validate_model
from dflash_trt.errors import ConfigError

log = logging.getLogger(__name__)

_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)


class DFlashSpeculativeConfig(BaseModel):
    """`speculative_config` with the field names of TensorRT-LLM's DFlashDecodingConfig."""

    model_config = _STRICT
    decoding_type: str
    max_draft_len: int | None = Field(None, ge=0, le=63)
    max_total_draft_tokens: int | None = Field(None, ge=0)
    speculative_model: str | None = None  # the drafter directory (Hub ids cannot be fetched here)
    mask_token_id: int | None = Field(None, ge=0)
    target_layer_ids: list[int] | None = None
    use_rejection_sampling: bool = False
    # parsed, no effect on the torch backend (listed in a warning when set to a non-default value)
    attention_backend: Literal["VANILLA", "TRTLLM", "FA4"] = "VANILLA"
    draft_len_schedule: dict[int, int] | None = None
    max_concurrency: int | None = Field(None, gt=0)
    load_format: str | None = None
    acceptance_rate_window_size: int | None = Field(None, ge=0)
    acceptance_rate_threshold: float | None = Field(None, ge=0.0, le=1.0)
    allow_advanced_sampling: bool = False
    advanced_sampling_mode: str | None = None
    enable_penalty: bool = False
    context_recompute_tail: int | None = None
    skip_ctx_buffer_budget_check: bool = False
    moe_backend: str | None = None
    spec_dec_variant: int | None = None


_SPEC_NO_EFFECT = {
    "attention_backend": "VANILLA", "draft_len_schedule": None, "max_concurrency": None, "load_format": None,
    "acceptance_rate_window_size": None, "acceptance_rate_threshold": None, "advanced_sampling_mode": None,
    "enable_penalty": False, "context_recompute_tail": None, "skip_ctx_buffer_budget_check": False,
    "moe_backend": None, "spec_dec_variant": None,
    # we always honour per-request sampling params (TensorRT-LLM needs this flag for that)
    "allow_advanced_sampling": False,
}


class LlmApiConfig(BaseModel):
    """The top level of a trtllm-serve `--config` file (the subset of TorchLlmArgs we know)."""

    model_config = _STRICT
    speculative_config: DFlashSpeculativeConfig | None = None
    max_batch_size: int | None = Field(None, ge=1)
    max_seq_len: int | None = Field(None, ge=2)
    max_num_tokens: int | None = Field(None, ge=1)
    max_input_len: int | None = Field(None, ge=1)
    dtype: Literal["auto", "float32", "float16", "bfloat16", "float64"] = "auto"
    tensor_parallel_size: int | None = Field(None, ge=1)
    # changes results unless left at the default: errors when set otherwise
    pipeline_parallel_size: int = Field(1, ge=1)
    max_beam_width: int = Field(1, ge=1)
    enable_lora: bool = False
    # parsed, no effect on the torch backend (listed in a warning when present)
    backend: Literal["pytorch", "_autodeploy", "tensorrt"] | None = None
    kv_cache_config: dict[str, Any] | None = None
    cuda_graph_config: dict[str, Any] | None = None
    attention_backend: str | None = None
    enable_chunked_prefill: bool | None = None
    disable_overlap_scheduler: bool | None = None
    moe_config: dict[str, Any] | None = None
    scheduler_config: dict[str, Any] | None = None
    moe_expert_parallel_size: int | None = None
    moe_tensor_parallel_size: int | None = None
    enable_attention_dp: bool | None = None
    gpus_per_node: int | None = None
    allreduce_strategy: str | None = None
    print_iter_log: bool | None = None
    enable_iter_perf_stats: bool | None = None
    return_perf_metrics: bool | None = None
    stream_interval: int | None = None
    num_postprocess_workers: int | None = None
    trust_remote_code: bool | None = None
    load_format: str | None = None
    sampler_type: str | None = None
    enable_autotuner: bool | None = None
    torch_compile_config: dict[str, Any] | None = None
    guided_decoding_backend: str | None = None
    batch_wait_timeout_ms: float | None = None


_TOP_NO_EFFECT = (
    "backend", "kv_cache_config", "cuda_graph_config", "attention_backend", "enable_chunked_prefill",
    "disable_overlap_scheduler", "moe_config", "scheduler_config", "moe_expert_parallel_size",
    "moe_tensor_parallel_size", "enable_attention_dp", "gpus_per_node", "allreduce_strategy", "print_iter_log",
    "enable_iter_perf_stats", "return_perf_metrics", "stream_interval", "num_postprocess_workers",
    "trust_remote_code", "load_format", "sampler_type", "enable_autotuner", "torch_compile_config",
    "guided_decoding_backend", "batch_wait_timeout_ms",
)
_QUANTIZED_KV = ("fp8", "nvfp4", "int8", "fp4")


@dataclass(frozen=True)
class ServeOverrides:
    """What a `--config` file sets, in the terms of our flags (None = not set by the file)."""

    drafter: Path | None = None
    block_size: int | None = None
    no_spec: bool | None = None  # max_draft_len: 0 means autoregressive
    acceptance: str | None = None
    max_batch_size: int | None = None
    max_seq_len: int | None = None
    max_num_tokens: int | None = None
    max_input_len: int | None = None
    dtype: str | None = None
    tensor_parallel_size: int | None = None
    mask_token_id: int | None = None
    target_layer_ids: tuple[int, ...] | None = None
    ignored: tuple[str, ...] = ()  # keys parsed that have no effect on the torch backend
    trtllm_args: dict[str, Any] = field(default_factory=dict)  # top-level keys that tune TensorRT-LLM, as given


def parse_llm_api_config(raw: Any, where: str = "--config") -> LlmApiConfig:
    return validate_model(LlmApiConfig, {} if raw is None else raw, where,  # an empty file sets nothing
                          unknown_key_hint="not a trtllm-serve --config key this server supports")


def load_llm_api_config(path: Path) -> LlmApiConfig:
    return parse_llm_api_config(load_yaml_file(path, "--config file"), where=str(Path(path)))


def resolve_overrides(cfg: LlmApiConfig) -> ServeOverrides:
    """Map a parsed file onto our settings; raise on keys whose ignoring would change results and
    log one warning listing the keys that have no effect here."""
    if cfg.pipeline_parallel_size != 1:
        raise ConfigError("pipeline_parallel_size > 1 is not supported: use tensor_parallel_size (with --tp)")
    if cfg.max_beam_width != 1:
        raise ConfigError("max_beam_width > 1 (beam search) is not supported with DFlash: remove it")
    if cfg.enable_lora:
        raise ConfigError("enable_lora is not supported by this server: remove it")
    kv_dtype = (cfg.kv_cache_config or {}).get("dtype")  # a TRT-LLM sub-config: we only inspect its dtype
    if isinstance(kv_dtype, str) and kv_dtype.lower() in _QUANTIZED_KV:
        raise ConfigError(f"kv_cache_config.dtype '{kv_dtype}' (a quantized KV cache) is not supported on the "
                          "torch backend and would change results: remove it")
    ignored = [k for k in _TOP_NO_EFFECT if k in cfg.model_fields_set]
    trtllm_args = {k: getattr(cfg, k) for k in ignored}
    kw: dict[str, Any] = dict(
        max_batch_size=cfg.max_batch_size, max_seq_len=cfg.max_seq_len, max_num_tokens=cfg.max_num_tokens,
        max_input_len=cfg.max_input_len, dtype=None if cfg.dtype == "auto" else cfg.dtype,
        tensor_parallel_size=cfg.tensor_parallel_size,
    )
    spec = cfg.speculative_config
    if spec is not None:
        if spec.decoding_type != "DFlash":
            raise ConfigError(f"speculative_config.decoding_type is '{spec.decoding_type}': this server runs "
                              "DFlash only (decoding_type: DFlash)")
        if spec.max_total_draft_tokens is not None and spec.max_draft_len is not None \
                and spec.max_total_draft_tokens != spec.max_draft_len:
            raise ConfigError("speculative_config.max_total_draft_tokens != max_draft_len means tree drafting, "
                              "which DFlash does not do: remove max_total_draft_tokens")
        ignored += [f"speculative_config.{k}" for k, default in _SPEC_NO_EFFECT.items()
                    if k in spec.model_fields_set and getattr(spec, k) != default]
        if spec.max_draft_len is not None:
            kw["block_size"] = spec.max_draft_len + 1
            kw["no_spec"] = spec.max_draft_len == 0
        kw["drafter"] = Path(spec.speculative_model) if spec.speculative_model else None
        kw["acceptance"] = "rejection" if spec.use_rejection_sampling else "exact"
        kw["mask_token_id"] = spec.mask_token_id
        kw["target_layer_ids"] = tuple(spec.target_layer_ids) if spec.target_layer_ids is not None else None
    if ignored:
        log.warning("--config keys with no effect on the torch backend (ignored there; top-level ones go to "
                    "TensorRT-LLM with --backend trtllm): %s", ", ".join(ignored))
    return ServeOverrides(ignored=tuple(ignored), trtllm_args=trtllm_args, **kw)


def check_against_drafter(over: ServeOverrides, drafter: DrafterConfig, where: str) -> None:
    """mask_token_id / target_layer_ids in the file must be the drafter's own (they are trained in)."""
    if over.mask_token_id is not None and over.mask_token_id != drafter.mask_token_id:
        raise ConfigError(f"speculative_config.mask_token_id is {over.mask_token_id} but the drafter at {where} "
                          f"was trained with {drafter.mask_token_id}: fix the file or drop the key")
    if over.target_layer_ids is not None and tuple(over.target_layer_ids) != tuple(drafter.target_layer_ids):
        raise ConfigError(f"speculative_config.target_layer_ids is {list(over.target_layer_ids)} but the drafter "
                          f"at {where} reads layers {list(drafter.target_layer_ids)}: fix the file or drop the key")
    if over.block_size is not None and over.block_size > drafter.block_size:
        log.warning("max_draft_len %d exceeds what the drafter at %s was trained for (%d): acceptance will be low",
                    over.block_size - 1, where, drafter.block_size - 1)


@dataclass(frozen=True)
class OpenAIServerConfig:
    """HTTP-level settings of the OpenAI server."""

    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_input_len: int | None = None  # prompts longer than this are refused with 400
    retry_after_s: int = 1  # Retry-After on 429 (queue full)
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if not self.served_model_name:
            raise ConfigError("served_model_name must be a non-empty string")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("--api-key must not be empty")
        if self.max_input_len is not None and self.max_input_len < 1:
            raise ConfigError(f"max_input_len must be >= 1, got {self.max_input_len}")
