"""The Triton model's tensors and the pure request/response logic (no Triton import here).

The tensors follow TensorRT-LLM's LLM-API Triton model
(`triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt`) with the same names, types and
shapes, so clients written for it work unchanged:
  inputs  text_input STRING [-1] (one prompt), streaming BOOL [1], sampling_param_temperature FP32,
          sampling_param_top_k INT32, sampling_param_top_p FP32, sampling_param_max_tokens INT32,
          sampling_param_seed UINT64 (all [1]), sampling_param_stop STRING [-1] (stop strings),
          stop BOOL [1] (cancel the running requests that carry this request id);
  outputs text_output STRING [-1], finish_reason STRING [-1], acceptance_rate FP32 [1],
          total_accepted_draft_tokens INT32 [1], total_draft_tokens INT32 [1].
Streaming responses carry the text decoded since the previous response (clients concatenate);
the last response (flag FINAL) carries the rest plus finish_reason and the acceptance counts.
A non-streaming request gets exactly one response with the whole text (so HTTP /generate works).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dflash_trt.errors import InputError
from dflash_trt.engine import SamplingParams


@dataclass(frozen=True)
class TritonTensor:
    name: str
    triton_type: str  # TYPE_* in config.pbtxt
    dims: tuple[int, ...]
    optional: bool = False

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(NUMPY_TYPES[self.triton_type])


NUMPY_TYPES = {"TYPE_STRING": np.object_, "TYPE_BOOL": np.bool_, "TYPE_FP32": np.float32,
               "TYPE_INT32": np.int32, "TYPE_UINT64": np.uint64}

INPUTS = (
    TritonTensor("text_input", "TYPE_STRING", (-1,)),
    TritonTensor("streaming", "TYPE_BOOL", (1,), optional=True),
    TritonTensor("sampling_param_temperature", "TYPE_FP32", (1,), optional=True),
    TritonTensor("sampling_param_top_k", "TYPE_INT32", (1,), optional=True),
    TritonTensor("sampling_param_top_p", "TYPE_FP32", (1,), optional=True),
    TritonTensor("sampling_param_max_tokens", "TYPE_INT32", (1,), optional=True),
    TritonTensor("sampling_param_seed", "TYPE_UINT64", (1,), optional=True),
    TritonTensor("sampling_param_stop", "TYPE_STRING", (-1,), optional=True),
    TritonTensor("stop", "TYPE_BOOL", (1,), optional=True),
)
OUTPUTS = (
    TritonTensor("text_output", "TYPE_STRING", (-1,)),
    TritonTensor("finish_reason", "TYPE_STRING", (-1,)),
    TritonTensor("acceptance_rate", "TYPE_FP32", (1,)),
    TritonTensor("total_accepted_draft_tokens", "TYPE_INT32", (1,)),
    TritonTensor("total_draft_tokens", "TYPE_INT32", (1,)),
)
INPUT_BY_NAME = {t.name: t for t in INPUTS}


@dataclass(frozen=True)
class ParsedRequest:
    prompt: str
    params: SamplingParams
    streaming: bool
    stop: bool  # a cancel request for the running requests with the same request id


def _checked(name: str, value: np.ndarray) -> np.ndarray:
    spec = INPUT_BY_NAME.get(name)
    if spec is None:
        raise InputError(f"unknown input '{name}'; this model takes {', '.join(INPUT_BY_NAME)}")
    if value.dtype != spec.numpy_dtype and not (spec.triton_type == "TYPE_STRING" and value.dtype.kind in "OSU"):
        raise InputError(f"input '{name}' must be {spec.triton_type} ({spec.numpy_dtype}), got {value.dtype}")
    if spec.dims == (1,) and value.size != 1:
        raise InputError(f"input '{name}' must hold exactly one value, got shape {list(value.shape)}")
    return value


def _text(name: str, item) -> str:
    if isinstance(item, (bytes, np.bytes_)):
        try:
            return bytes(item).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"input '{name}' is not valid UTF-8: {exc}") from exc
    if isinstance(item, str):
        return item
    raise InputError(f"input '{name}' must hold strings, got {type(item).__name__}")


def parse_request(inputs: dict[str, np.ndarray], default_max_tokens: int) -> ParsedRequest:
    """Validate one request's tensors (name -> array) into a prompt and sampling params.
    Raises InputError with a message for the client."""
    values = {name: _checked(name, np.asarray(v)) for name, v in inputs.items()}

    def scalar(name: str):
        return values[name].reshape(-1)[0].item() if name in values else None

    stop = bool(scalar("stop"))
    if "text_input" not in values:
        if stop:
            return ParsedRequest(prompt="", params=SamplingParams(), streaming=False, stop=True)
        raise InputError("input 'text_input' is required (one prompt string)")
    text = values["text_input"].reshape(-1)
    if text.size != 1:
        raise InputError(f"input 'text_input' must hold exactly one prompt, got {text.size}")
    prompt = _text("text_input", text[0])
    if not prompt:
        raise InputError("input 'text_input' is empty")
    temperature = scalar("sampling_param_temperature")
    top_p = scalar("sampling_param_top_p")
    for name, value in (("sampling_param_temperature", temperature), ("sampling_param_top_p", top_p)):
        if value is not None and not math.isfinite(value):
            raise InputError(f"input '{name}' must be a finite number, got {value}")
    stops = values.get("sampling_param_stop")
    params = SamplingParams(  # validates ranges: raises InputError
        temperature=0.0 if temperature is None else float(temperature),
        top_k=0 if scalar("sampling_param_top_k") is None else int(scalar("sampling_param_top_k")),
        top_p=1.0 if top_p is None else float(top_p),
        seed=scalar("sampling_param_seed"),
        max_new_tokens=default_max_tokens if scalar("sampling_param_max_tokens") is None
        else int(scalar("sampling_param_max_tokens")),
        stop=() if stops is None else tuple(_text("sampling_param_stop", s) for s in stops.reshape(-1)),
    )
    return ParsedRequest(prompt=prompt, params=params, streaming=bool(scalar("streaming")), stop=stop)


@dataclass(frozen=True)
class FinalStats:
    finish_reason: str
    total_draft_tokens: int
    total_accepted_draft_tokens: int

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / verified drafts (0 when nothing was drafted), as TensorRT-LLM reports it."""
        if self.total_draft_tokens == 0:
            return 0.0
        return self.total_accepted_draft_tokens / self.total_draft_tokens


def output_arrays(text: str, stats: FinalStats | None) -> dict[str, np.ndarray]:
    """The response tensors: text only for a streaming chunk, everything for the final response."""
    out = {"text_output": np.array([text.encode("utf-8")], dtype=np.object_)}
    if stats is not None:
        out["finish_reason"] = np.array([stats.finish_reason.encode("utf-8")], dtype=np.object_)
        out["acceptance_rate"] = np.array([stats.acceptance_rate], dtype=np.float32)
        out["total_accepted_draft_tokens"] = np.array([stats.total_accepted_draft_tokens], dtype=np.int32)
        out["total_draft_tokens"] = np.array([stats.total_draft_tokens], dtype=np.int32)
    return out
