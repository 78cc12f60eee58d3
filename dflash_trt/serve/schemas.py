"""OpenAI request bodies (strict pydantic) and the OpenAI error shape.

Unknown fields are refused with 400, as OpenAI does ("unrecognized request argument"), and so are
OpenAI features this server does not implement when they are set to anything but their neutral
value (n > 1, logprobs, penalties, logit_bias, tools, echo, suffix, non-text response formats).
Extensions (vLLM's names): `top_k`, `ignore_eos`, `stop_token_ids`, `return_token_ids`
(completions and chat), `add_generation_prompt` / `chat_template_kwargs` (chat).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dflash_trt.engine import SamplingParams

MAX_STOP_STRINGS = 4
MAX_SEED = 2**63 - 1


class APIError(Exception):
    """An error answered in the OpenAI shape {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


_STRICT = ConfigDict(extra="forbid", strict=True)
_UNION_TAGS = {"str", "int", "float", "bool"}


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _Request(BaseModel):
    model_config = _STRICT
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's default
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # extension: 0 or -1 = off
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False

    def check_supported(self) -> None:
        if self.n != 1:
            raise bad_request("only n=1 is supported", "n")
        if self.presence_penalty or self.frequency_penalty:
            which = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            raise bad_request(f"{which} is not supported (leave it at 0)", which)
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise bad_request(f"at most {MAX_STOP_STRINGS} stop sequences are allowed, got {len(stops)}", "stop")
        if any(not s for s in stops):
            raise bad_request("stop sequences must be non-empty strings", "stop")
        return tuple(stops)

    def sampling_params(self, max_new_tokens: int | None) -> SamplingParams:
        if any(t < 0 for t in self.stop_token_ids or ()):
            raise bad_request("stop_token_ids must be non-negative token ids", "stop_token_ids")
        return SamplingParams(
            temperature=float(self.temperature), top_k=max(self.top_k, 0), top_p=float(self.top_p), seed=self.seed,
            max_new_tokens=max_new_tokens, stop_token_ids=tuple(self.stop_token_ids or ()), stop=self.stop_strings(),
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise bad_request("echo is not supported", "echo")
        if self.logprobs is not None:
            raise bad_request("logprobs is not supported", "logprobs")
        if self.best_of not in (None, 1):
            raise bad_request("only best_of=1 is supported", "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            raise bad_request("one prompt per request: send a string, a list of token ids, or a list of one string",
                              "prompt")


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message. Parsing checks the shapes; `check` the rules OpenAI applies per role (every
    message needs its content, a string or a non-empty array of text parts; a `tool` message answers an
    assistant's `tool_calls`, which this server does not accept, so it is refused as OpenAI refuses an
    orphan one)."""

    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # required (checked in `check`: missing and null differ)
    name: str | None = None
    tool_call_id: str | None = None

    def check(self, index: int) -> None:
        where = f"messages.{index}"
        if self.role == "tool":
            raise bad_request(f"'{where}': a message with role 'tool' must answer a preceding assistant message's "
                              "tool_calls, and this server does not support tools", f"{where}.role", "invalid_value")
        if self.tool_call_id is not None:
            raise bad_request(f"'{where}.tool_call_id' is only allowed on messages with role 'tool'",
                              f"{where}.tool_call_id", "unknown_parameter")
        if "content" not in self.model_fields_set:
            raise bad_request(f"Missing required parameter: '{where}.content'", f"{where}.content",
                              "missing_required_parameter")
        if self.content is None:
            raise bad_request(f"'{where}.content' must be a string or an array of text parts, got null",
                              f"{where}.content", "invalid_type")
        if isinstance(self.content, list) and not self.content:
            raise bad_request(f"'{where}.content' is an empty array: give at least one content part",
                              f"{where}.content", "invalid_value")

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for i, message in enumerate(self.messages):
            message.check(i)
        if self.logprobs or self.top_logprobs:
            raise bad_request("logprobs is not supported", "logprobs")
        if self.tools:
            raise bad_request("tools are not supported by this server", "tools")
        if self.tool_choice not in (None, "none"):
            raise bad_request("tool_choice is not supported by this server", "tool_choice")
        if self.response_format is not None and self.response_format.type != "text":
            raise bad_request("only response_format {type: text} is supported", "response_format")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise bad_request("max_tokens and max_completion_tokens disagree: send one of them", "max_tokens")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def _param(loc: tuple) -> str | None:
    keep = [str(x) for x in loc if not (isinstance(x, str) and (x in _UNION_TAGS or "[" in x))]
    return ".".join(keep) or None


def parse_body(raw: bytes, model: type[_Request]) -> _Request:
    """Validate a JSON body; malformed JSON, missing fields and wrong types all give 400."""
    if not raw.strip():
        raise bad_request("the request body is empty: send a JSON object")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        if first["type"] == "json_invalid":
            raise bad_request(f"the body is not valid JSON: {first['msg']}") from exc
        if first["type"] == "model_type" and not first["loc"]:
            raise bad_request("the body must be a JSON object") from exc
        param = _param(first["loc"])
        if first["type"] == "missing":
            raise bad_request(f"'{param}' is a required field", param, "missing_required_parameter") from exc
        if first["type"] == "extra_forbidden":
            raise bad_request(f"unrecognized request argument supplied: {param}", param,
                              "unknown_parameter") from exc
        same = [e for e in errors if _param(e["loc"]) == param]
        if len(same) > 1:  # a union: every alternative failed
            raise bad_request(f"'{param}' has the wrong type or value ({'; '.join(e['msg'] for e in same)})",
                              param, "invalid_type") from exc
        raise bad_request(f"'{param}': {first['msg']}", param, "invalid_value") from exc
