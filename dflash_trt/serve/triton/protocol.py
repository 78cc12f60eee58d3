"""The Triton model's tensors and the pure request/response logic (no Triton import here).

The tensors are those of TensorRT-LLM's LLM-API Triton model, same names, types and shapes, so a
client written for it works unchanged (triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt
@0a71057313ec0626527e164a8fc0205c5822e2f5; request handling in 1/model.py
@044a90d209e380c95e23e8ae42f3583fa05ada78 and 1/helpers.py @0df60f9ad779c4dc4f55da07e08b969fc4684e56):

inputs   text_input (one prompt), streaming, sampling_param_{temperature, top_k, top_p, max_tokens,
         seed, stop, best_of, frequency_penalty, presence_penalty, exclude_input_from_output,
         return_perf_metrics, logits_post_processor_name}, return_{finish_reason, stop_reason,
         cumulative_logprob}, stop (cancel the running requests with this request id), lora_{id,
         name, path, ckpt_source}, image_url. Every one is accepted; the ones this model cannot
         honour (best_of > 1, non-zero penalties, a logits post-processor, cumulative_logprob,
         LoRA, images) get a one-line error that says so.
outputs  text_output, finish_reason / stop_reason (when return_finish_reason / return_stop_reason;
         as upstream, str() of the value: stop_reason is the stop string that ended the text, or
         "None"), and with sampling_param_return_perf_metrics the per-request metrics we compute:
         arrival_time_ns, first_scheduled_time_ns, first_token_time_ns, last_token_time_ns
         (wall-clock ns), acceptance_rate, total_accepted_draft_tokens, total_draft_tokens, in the
         declared dtypes. cumulative_logprob and kv_cache_* are declared (upstream's schema) but
         never sent: the DFlash engine tracks no log-probabilities and no paged KV blocks.
Text follows upstream's LLM API: every response carries the whole text so far (streaming chunks
are cumulative, like `CompletionOutput.text`), the prompt comes first unless
sampling_param_exclude_input_from_output is true (upstream's default is false), and a stop
string is not part of the text.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dflash_trt.engine import SamplingParams
from dflash_trt.errors import InputError


@dataclass(frozen=True)
class TritonTensor:
    name: str
    triton_type: str  # TYPE_* in config.pbtxt
    dims: tuple[int, ...]
    optional: bool = False

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(NUMPY_TYPES[self.triton_type])


NUMPY_TYPES = {"TYPE_STRING": np.object_, "TYPE_BOOL": np.bool_, "TYPE_FP32": np.float32, "TYPE_INT32": np.int32,
               "TYPE_INT64": np.int64, "TYPE_UINT64": np.uint64}


def _opt(name: str, triton_type: str, dims: tuple[int, ...] = (1,)) -> TritonTensor:
    return TritonTensor(name, triton_type, dims, optional=True)


INPUTS = (
    TritonTensor("text_input", "TYPE_STRING", (-1,)),
    _opt("image_url", "TYPE_STRING", (-1,)),
    _opt("streaming", "TYPE_BOOL"),
    _opt("sampling_param_best_of", "TYPE_INT32"),
    _opt("sampling_param_temperature", "TYPE_FP32"),
    _opt("sampling_param_top_k", "TYPE_INT32"),
    _opt("sampling_param_top_p", "TYPE_FP32"),
    _opt("sampling_param_frequency_penalty", "TYPE_FP32"),
    _opt("sampling_param_presence_penalty", "TYPE_FP32"),
    _opt("sampling_param_max_tokens", "TYPE_INT32"),
    _opt("sampling_param_stop", "TYPE_STRING", (-1,)),
    _opt("sampling_param_seed", "TYPE_UINT64"),
    _opt("sampling_param_exclude_input_from_output", "TYPE_BOOL"),
    _opt("sampling_param_return_perf_metrics", "TYPE_BOOL"),
    _opt("sampling_param_logits_post_processor_name", "TYPE_STRING"),
    _opt("return_finish_reason", "TYPE_BOOL"),
    _opt("return_stop_reason", "TYPE_BOOL"),
    _opt("return_cumulative_logprob", "TYPE_BOOL"),
    _opt("stop", "TYPE_BOOL"),
    _opt("lora_id", "TYPE_UINT64"),
    _opt("lora_name", "TYPE_STRING"),
    _opt("lora_path", "TYPE_STRING"),
    _opt("lora_ckpt_source", "TYPE_STRING"),
)
OUTPUTS = (
    TritonTensor("text_output", "TYPE_STRING", (-1,)),
    TritonTensor("finish_reason", "TYPE_STRING", (-1,)),
    TritonTensor("stop_reason", "TYPE_STRING", (-1,)),
    TritonTensor("cumulative_logprob", "TYPE_FP32", (-1,)),
    TritonTensor("kv_cache_reused_block", "TYPE_INT32", (-1,)),
    TritonTensor("kv_cache_hit_rate", "TYPE_FP32", (-1,)),
    TritonTensor("kv_cache_alloc_new_blocks", "TYPE_INT32", (-1,)),
    TritonTensor("kv_cache_alloc_total_blocks", "TYPE_INT32", (-1,)),
    TritonTensor("kv_cache_missed_block", "TYPE_INT32", (-1,)),
    TritonTensor("arrival_time_ns", "TYPE_INT64", (1,)),
    TritonTensor("first_scheduled_time_ns", "TYPE_INT64", (1,)),
    TritonTensor("first_token_time_ns", "TYPE_INT64", (1,)),
    TritonTensor("last_token_time_ns", "TYPE_INT64", (1,)),
    TritonTensor("acceptance_rate", "TYPE_FP32", (1,)),
    TritonTensor("total_accepted_draft_tokens", "TYPE_INT32", (1,)),
    TritonTensor("total_draft_tokens", "TYPE_INT32", (1,)),
)
INPUT_BY_NAME = {t.name: t for t in INPUTS}
OUTPUT_BY_NAME = {t.name: t for t in OUTPUTS}
# inputs a client may send that this model cannot honour: name -> why (used when the value asks for it)
UNSUPPORTED = {
    "image_url": "image inputs are not supported: the DFlash target is text-only (send text_input alone)",
    "sampling_param_logits_post_processor_name": "logits post-processors are not supported by the DFlash engine",
    "return_cumulative_logprob": "cumulative_logprob is not computed: the DFlash engine tracks no log-probabilities",
    "lora": "LoRA adapters (lora_id / lora_name / lora_path / lora_ckpt_source) are not supported by this model",
}


@dataclass(frozen=True)
class ParsedRequest:
    prompt: str
    params: SamplingParams
    streaming: bool
    stop: bool  # a cancel request for the running requests with the same request id
    exclude_input_from_output: bool = False  # upstream's default: the prompt leads text_output
    return_finish_reason: bool = False
    return_stop_reason: bool = False
    return_perf_metrics: bool = False


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


def _refuse_unsupported(values: dict[str, np.ndarray], scalar) -> None:
    """A one-line error for every input that asks for something this model cannot do."""
    if "image_url" in values and any(_text("image_url", u) for u in values["image_url"].reshape(-1)):
        raise InputError(UNSUPPORTED["image_url"])
    best_of = scalar("sampling_param_best_of")
    if best_of is not None and best_of != 1:
        raise InputError(f"sampling_param_best_of is {best_of}: only 1 is supported (DFlash decodes one sequence "
                         "per request)")
    for name in ("sampling_param_frequency_penalty", "sampling_param_presence_penalty"):
        value = scalar(name)
        if value is not None and value != 0:
            raise InputError(f"{name} is {value}: penalties are not supported by the DFlash engine (it keeps the "
                             "target's own distribution): send 0 or drop the input")
    name = "sampling_param_logits_post_processor_name"
    if name in values and _text(name, values[name].reshape(-1)[0]):
        raise InputError(UNSUPPORTED[name])
    if scalar("return_cumulative_logprob"):
        raise InputError(UNSUPPORTED["return_cumulative_logprob"])
    if any(n in values for n in ("lora_id", "lora_name", "lora_path", "lora_ckpt_source")):
        raise InputError(UNSUPPORTED["lora"])


def parse_request(inputs: dict[str, np.ndarray], default_max_tokens: int) -> ParsedRequest:
    """Validate one request's tensors (name -> array) into a prompt, sampling params and output
    options. Raises InputError with a message for the client."""
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
    _refuse_unsupported(values, scalar)
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
    return ParsedRequest(prompt=prompt, params=params, streaming=bool(scalar("streaming")), stop=stop,
                         exclude_input_from_output=bool(scalar("sampling_param_exclude_input_from_output")),
                         return_finish_reason=bool(scalar("return_finish_reason")),
                         return_stop_reason=bool(scalar("return_stop_reason")),
                         return_perf_metrics=bool(scalar("sampling_param_return_perf_metrics")))


@dataclass(frozen=True)
class FinalStats:
    finish_reason: str
    total_draft_tokens: int
    total_accepted_draft_tokens: int
    stop_reason: str | None = None  # the stop string that ended the text
    arrival_time_ns: int = 0
    first_scheduled_time_ns: int = 0
    first_token_time_ns: int = 0
    last_token_time_ns: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / verified drafts (0 when nothing was drafted), as TensorRT-LLM reports it."""
        if self.total_draft_tokens == 0:
            return 0.0
        return self.total_accepted_draft_tokens / self.total_draft_tokens


PERF_OUTPUTS = ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns",
                "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")


def _array(name: str, value) -> np.ndarray:
    return np.array([value], dtype=OUTPUT_BY_NAME[name].numpy_dtype)


def output_arrays(text: str, stats: FinalStats | None, request: ParsedRequest) -> dict[str, np.ndarray]:
    """The response tensors: the text so far, plus on the final response what the request asked for."""
    out = {"text_output": np.array([text.encode("utf-8")], dtype=np.object_)}
    if stats is None:
        return out
    if request.return_finish_reason:
        out["finish_reason"] = np.array([stats.finish_reason.encode("utf-8")], dtype=np.object_)
    if request.return_stop_reason:
        out["stop_reason"] = np.array([str(stats.stop_reason).encode("utf-8")], dtype=np.object_)
    if request.return_perf_metrics:
        out.update({name: _array(name, getattr(stats, name)) for name in PERF_OUTPUTS})
    return out


def matched_stop(text: str, stops: tuple[str, ...]) -> str | None:
    """The stop string whose first occurrence in `text` comes first (None when none occurs)."""
    found = [(text.find(s), i, s) for i, s in enumerate(stops) if s in text]
    return min(found)[2] if found else None
