"""The `--config` YAML of `dflash-trt serve`: exactly the keys `trtllm-serve --config` accepts at the
pinned TensorRT-LLM release (dflash_trt/trtllm_release.py, one data file), strictly parsed.

TensorRT-LLM reads DFlash settings from `speculative_config` (its `DFlashDecodingConfig`,
`decoding_type: DFlash`) and engine limits from top-level `TorchLlmArgs` keys; its models forbid
unknown keys (`extra="forbid"`), and so does this parser: a key that is not a field of the pinned
release is a ConfigError naming it (a top-level `attention_backend`, say: upstream's field is
`attn_backend`). The same file works here, on the torch backend:

- keys we honour: `speculative_config.{decoding_type, max_draft_len, speculative_model (alias
  speculative_model_dir), mask_token_id, target_layer_ids, use_rejection_sampling}`,
  `max_batch_size`, `max_seq_len`, `max_num_tokens` (the scheduler's per-step token budget),
  `max_input_len`, `dtype`, `tensor_parallel_size` (must match `--tp`);
- keys whose ignoring would change results (beam search, LoRA, pipeline or context parallelism,
  a quantized KV cache, tree drafting, another decoding_type) are ConfigErrors;
- every other key of the release (`attn_backend`, `kv_cache_config`, `cuda_graph_config`,
  `speculative_config.attention_backend`, ...) tunes TensorRT-LLM's CUDA runtime: it is parsed,
  listed in ONE warning (no effect on the torch backend) and handed to TensorRT-LLM as given with
  `--backend trtllm` (`ServeOverrides.trtllm_args`, speculative keys under `speculative_config`).

`max_draft_len` is the number of drafted tokens per step, so `block_size = max_draft_len + 1`
(slot 0 of a DFlash block holds the last committed token); as upstream, it must fit the drafter:
`max_draft_len + 1 <= drafter block_size` (tensorrt_llm/_torch/speculative/dflash.py
@00679c66c3e38f6d2651ad0a5bef0f94d862e36c raises otherwise).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from dflash_trt.config import DrafterConfig, check_block_size, load_yaml_file, validate_model
from dflash_trt.errors import ConfigError
from dflash_trt.trtllm_release import DECODING_TYPE, pinned

log = logging.getLogger(__name__)

# extra="allow": unknown names never get here (TrtllmRelease.check refuses them first); the release's
# other keys are kept as extras, reported and handed to TensorRT-LLM
_KNOWN_EXTRAS = ConfigDict(extra="allow", strict=True, frozen=True)


class DFlashSpeculativeConfig(BaseModel):
    """`speculative_config`: the DFlashDecodingConfig keys this server reads, typed."""

    model_config = _KNOWN_EXTRAS
    decoding_type: str
    max_draft_len: int | None = Field(None, ge=0)
    max_total_draft_tokens: int | None = Field(None, ge=0)
    speculative_model: str | None = Field(None, validation_alias=AliasChoices("speculative_model",
                                                                              "speculative_model_dir"))
    mask_token_id: int | None = Field(None, ge=0)
    target_layer_ids: list[int] | None = None
    use_rejection_sampling: bool = False
    attention_backend: str | None = None  # TensorRT-LLM's drafter attention; value checked, no effect here


SPEC_HONOURED = ("decoding_type", "max_draft_len", "max_total_draft_tokens", "speculative_model", "mask_token_id",
                 "target_layer_ids", "use_rejection_sampling")


class LlmApiConfig(BaseModel):
    """The top level of a trtllm-serve `--config` file (TorchLlmArgs): the keys we read or check, typed."""

    model_config = _KNOWN_EXTRAS
    speculative_config: DFlashSpeculativeConfig | None = None
    max_batch_size: int | None = Field(None, ge=1)
    max_seq_len: int | None = Field(None, ge=2)
    max_num_tokens: int | None = Field(None, ge=1)
    max_input_len: int | None = Field(None, ge=1)
    dtype: Literal["auto", "float32", "float16", "bfloat16", "float64"] = "auto"
    tensor_parallel_size: int | None = Field(None, ge=1)
    # changes results unless left at the default: errors when set otherwise
    pipeline_parallel_size: int = Field(1, ge=1)
    context_parallel_size: int = Field(1, ge=1)
    max_beam_width: int = Field(1, ge=1)
    enable_lora: bool = False
    lora_config: dict[str, Any] | None = None
    # no effect on the torch backend (reported); values checked where upstream's are a closed set
    backend: str | None = None
    kv_cache_config: dict[str, Any] | None = None


TOP_HONOURED = ("speculative_config", "max_batch_size", "max_seq_len", "max_num_tokens", "max_input_len", "dtype",
                "tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size", "max_beam_width",
                "enable_lora", "lora_config")
_QUANTIZED_KV = ("fp8", "fp8_ds_mla", "nvfp4", "int8", "fp4")


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
    # what the file gives TensorRT-LLM beyond our settings, as given (speculative keys under speculative_config)
    trtllm_args: dict[str, Any] = field(default_factory=dict)


def parse_llm_api_config(raw: Any, where: str = "--config") -> LlmApiConfig:
    raw = {} if raw is None else raw  # an empty file sets nothing
    release = pinned()
    if isinstance(raw, dict):
        release.check(raw, where)
    cfg = validate_model(LlmApiConfig, raw, where)
    spec = cfg.speculative_config
    checks = [("backend", cfg.backend, "TorchLlmArgs.backend")]
    if spec is not None:
        checks.append(("speculative_config.attention_backend", spec.attention_backend,
                       "DFlashDecodingConfig.attention_backend"))
    for key, value, values in checks:
        if value is not None and value not in release.allowed(values):
            raise ConfigError(f"{where}: {key} is '{value}'; TensorRT-LLM {release.version} accepts "
                              f"{', '.join(release.allowed(values))}")
    return cfg


def load_llm_api_config(path: Path) -> LlmApiConfig:
    return parse_llm_api_config(load_yaml_file(path, "--config file"), where=str(Path(path)))


def _refuse_result_changes(cfg: LlmApiConfig) -> None:
    """Keys whose ignoring would change what the server returns."""
    if cfg.pipeline_parallel_size != 1 or cfg.context_parallel_size != 1:
        raise ConfigError("pipeline_parallel_size / context_parallel_size > 1 are not supported: use "
                          "tensor_parallel_size (with --tp)")
    if cfg.max_beam_width != 1:
        raise ConfigError("max_beam_width > 1 (beam search) is not supported with DFlash: remove it")
    if cfg.enable_lora or cfg.lora_config is not None:
        raise ConfigError("enable_lora / lora_config: LoRA is not supported by this server: remove them")
    kv = cfg.kv_cache_config or {}
    if "dtype" in kv and isinstance(kv["dtype"], str) and kv["dtype"].lower() in _QUANTIZED_KV:
        raise ConfigError(f"kv_cache_config.dtype '{kv['dtype']}' (a quantized KV cache) is not supported on the "
                          "torch backend and would change results: remove it")
    spec = cfg.speculative_config
    if spec is not None and spec.decoding_type != DECODING_TYPE:
        raise ConfigError(f"speculative_config.decoding_type is '{spec.decoding_type}': this server runs "
                          f"DFlash only (decoding_type: {DECODING_TYPE})")
    if spec is not None and spec.max_total_draft_tokens is not None and spec.max_draft_len is not None \
            and spec.max_total_draft_tokens != spec.max_draft_len:
        raise ConfigError("speculative_config.max_total_draft_tokens != max_draft_len means tree drafting, "
                          "which DFlash does not do: remove max_total_draft_tokens")


def resolve_overrides(cfg: LlmApiConfig) -> ServeOverrides:
    """Map a parsed file onto our settings; raise on keys whose ignoring would change results and
    log one warning listing the keys that have no effect here."""
    _refuse_result_changes(cfg)
    given = [k for k in LlmApiConfig.model_fields if k in cfg.model_fields_set] + list(cfg.model_extra)
    ignored = [k for k in given if k not in TOP_HONOURED]
    trtllm_args = {k: getattr(cfg, k) for k in ignored}
    kw: dict[str, Any] = dict(
        max_batch_size=cfg.max_batch_size, max_seq_len=cfg.max_seq_len, max_num_tokens=cfg.max_num_tokens,
        max_input_len=cfg.max_input_len, dtype=None if cfg.dtype == "auto" else cfg.dtype,
        tensor_parallel_size=cfg.tensor_parallel_size,
    )
    spec = cfg.speculative_config
    if spec is not None:
        tuned = {k: getattr(spec, k) for k in spec.model_fields_set if k not in SPEC_HONOURED} | spec.model_extra
        ignored += [f"speculative_config.{k}" for k in sorted(tuned)]
        if tuned:
            trtllm_args["speculative_config"] = tuned
        if spec.max_draft_len is not None:
            kw["block_size"] = spec.max_draft_len + 1
            kw["no_spec"] = spec.max_draft_len == 0
        kw["drafter"] = Path(spec.speculative_model) if spec.speculative_model else None
        kw["acceptance"] = "rejection" if spec.use_rejection_sampling else "exact"
        kw["mask_token_id"] = spec.mask_token_id
        kw["target_layer_ids"] = tuple(spec.target_layer_ids) if spec.target_layer_ids is not None else None
    if ignored:
        log.warning("--config keys with no effect on the torch backend (ignored there; they go to TensorRT-LLM "
                    "with --backend trtllm): %s", ", ".join(ignored))
    return ServeOverrides(ignored=tuple(ignored), trtllm_args=trtllm_args, **kw)


def check_against_drafter(over: ServeOverrides, drafter: DrafterConfig, where: str) -> None:
    """mask_token_id / target_layer_ids in the file must be the drafter's own (they are trained in)."""
    if over.mask_token_id is not None and over.mask_token_id != drafter.mask_token_id:
        raise ConfigError(f"speculative_config.mask_token_id is {over.mask_token_id} but the drafter at {where} "
                          f"was trained with {drafter.mask_token_id}: fix the file or drop the key")
    if over.target_layer_ids is not None and tuple(over.target_layer_ids) != tuple(drafter.target_layer_ids):
        raise ConfigError(f"speculative_config.target_layer_ids is {list(over.target_layer_ids)} but the drafter "
                          f"at {where} reads layers {list(drafter.target_layer_ids)}: fix the file or drop the key")
    if over.block_size is not None:
        check_block_size(over.block_size, drafter.block_size, where)


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
