"""The `trtllm` backend: TensorRT-LLM's LLM API (PyTorch backend) with DFlash speculative decoding.

TensorRT-LLM implements DFlash in its PyTorch backend (`DFlashDecodingConfig`, `decoding_type:
DFlash`: `max_draft_len`, `speculative_model`, `mask_token_id`, `target_layer_ids`, ...). This
module maps our model spec onto the LLM-API arguments (a pure function, tested everywhere) and,
where `tensorrt_llm` and a CUDA GPU are present, runs generation through `tensorrt_llm.LLM`.

NOT EXECUTED in this project's CI or development machines: TensorRT-LLM cannot be installed
there. The argument mapping is tested; the LLM calls are exercised only by tests/gpu/.
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.config import DrafterConfig
from dflash_trt.errors import BackendUnavailableError, ConfigError
from dflash_trt.speculative.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrtllmSpec:
    target: Path
    drafter: Path | None
    max_draft_len: int | None = None  # None: the drafter's block_size - 1
    tensor_parallel_size: int = 1
    moe_expert_parallel_size: int | None = None
    max_batch_size: int = 8
    max_seq_len: int = 4096
    use_rejection_sampling: bool = False
    attention_backend: str = "TRTLLM"  # DFlash drafter attention: VANILLA | TRTLLM | FA4

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.attention_backend not in ("VANILLA", "TRTLLM", "FA4"):
            raise ConfigError(f"attention_backend must be VANILLA, TRTLLM or FA4, got '{self.attention_backend}'")


def speculative_config(spec: TrtllmSpec) -> dict | None:
    """The `speculative_config` mapping TensorRT-LLM reads (also the YAML for `trtllm-serve --config`)."""
    if spec.drafter is None:
        return None
    drafter = DrafterConfig.load(Path(spec.drafter))
    draft_len = spec.max_draft_len if spec.max_draft_len is not None else drafter.block_size - 1
    if not 1 <= draft_len <= 63:
        raise ConfigError(f"max_draft_len must be in [1, 63], got {draft_len}")
    return {
        "decoding_type": "DFlash",
        "max_draft_len": draft_len,
        "speculative_model": str(Path(spec.drafter).resolve()),
        "mask_token_id": drafter.mask_token_id,
        "target_layer_ids": list(drafter.target_layer_ids),
        "use_rejection_sampling": spec.use_rejection_sampling,
        "attention_backend": spec.attention_backend,
    }


def llm_kwargs(spec: TrtllmSpec) -> dict:
    """Keyword arguments for `tensorrt_llm.LLM` (speculative_config still a plain mapping)."""
    kwargs = {
        "model": str(Path(spec.target).resolve()),
        "tensor_parallel_size": spec.tensor_parallel_size,
        "max_batch_size": spec.max_batch_size,
        "max_seq_len": spec.max_seq_len,
    }
    if spec.moe_expert_parallel_size is not None:
        kwargs["moe_expert_parallel_size"] = spec.moe_expert_parallel_size
    spec_cfg = speculative_config(spec)
    if spec_cfg is not None:
        kwargs["speculative_config"] = spec_cfg
    return kwargs


def _import_tensorrt_llm():
    try:
        return importlib.import_module("tensorrt_llm")
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the trtllm backend needs TensorRT-LLM (import failed: {exc}); install it on a CUDA machine "
            "(e.g. the nvcr.io/nvidia/tensorrt-llm/release image, see docker/Dockerfile) or use --backend torch"
        ) from exc


@dataclass(frozen=True)
class TrtllmResult:
    tokens: list[int]
    text: str
    finish_reason: str


class TrtllmEngine:
    """Generation through `tensorrt_llm.LLM` with DFlash (GPU only)."""

    def __init__(self, spec: TrtllmSpec) -> None:
        trtllm = _import_tensorrt_llm()
        import torch

        if not torch.cuda.is_available():
            raise BackendUnavailableError("the trtllm backend needs a CUDA GPU; none is visible")
        kwargs = llm_kwargs(spec)
        spec_cfg = kwargs.pop("speculative_config", None)
        if spec_cfg is not None:
            llmapi = importlib.import_module("tensorrt_llm.llmapi")
            decoding = {k: v for k, v in spec_cfg.items() if k != "decoding_type"}
            kwargs["speculative_config"] = llmapi.DFlashDecodingConfig(**decoding)
        log.info("starting tensorrt_llm.LLM with %s", kwargs)
        self._trtllm = trtllm
        self.llm = trtllm.LLM(**kwargs)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[TrtllmResult]:
        sp = self._trtllm.SamplingParams(
            max_tokens=params.max_new_tokens or 256, temperature=params.temperature,
            top_k=params.top_k or None, top_p=params.top_p, seed=params.seed,
            stop_token_ids=list(params.stop_token_ids) or None, stop=list(params.stop) or None,
            ignore_eos=params.ignore_eos,
        )
        outputs = self.llm.generate(prompts, sampling_params=sp)
        return [TrtllmResult(list(o.outputs[0].token_ids), o.outputs[0].text, str(o.outputs[0].finish_reason))
                for o in outputs]

    def shutdown(self) -> None:
        self.llm.shutdown()
