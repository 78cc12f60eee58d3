"""The FastAPI app: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics.

Request path: auth (ASGI middleware, every /v1 route) -> strict body parse (schemas.py) -> model
name check (404) -> tokenize / chat template -> `Scheduler.submit` (validation 400, queue full 429
with Retry-After) -> events through the `EventBridge` -> a JSON response or an SSE stream
(`data: {chunk}` ... `data: [DONE]`). A client that disconnects gets its request cancelled
(`RequestHandle.cancel`), so its batch row is freed before the next decode step.
"""
from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from dflash_trt.errors import ContextLengthError, InputError
from dflash_trt.prompts import chat_ids, encode_prompt
from dflash_trt.runtime.scheduler import QueueFullError, Scheduler, TokenEvent
from dflash_trt.serve.bridge import CancellableStream, EventBridge, RequestRun
from dflash_trt.serve.config import OpenAIServerConfig
from dflash_trt.serve.metrics import CONTENT_TYPE, ServerMetrics
from dflash_trt.serve.schemas import (APIError, ChatCompletionRequest, CompletionRequest, _Request, bad_request,
                                      parse_body)
from dflash_trt.engine import GenerationResult, SamplingParams

log = logging.getLogger(__name__)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class ServerState:
    scheduler: Scheduler
    config: OpenAIServerConfig
    tokenizer: Any | None  # a transformers tokenizer, or None (token-id prompts only)
    detokenize: Callable[[list[int]], str] | None
    metrics: ServerMetrics
    bridge: EventBridge = field(default_factory=EventBridge)
    created: int = field(default_factory=lambda: int(time.time()))
    accepting: bool = True

    @property
    def max_seq_len(self) -> int:
        return self.scheduler.engine.config.max_seq_len

    @property
    def block_size(self) -> int:
        return self.scheduler.engine.block_size


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(result: GenerationResult) -> dict[str, int]:
    n = len(result.tokens)
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": n, "total_tokens": result.prompt_tokens + n}


def _dflash_stats(state: ServerState, result: GenerationResult) -> dict[str, Any]:
    drafted = sum(s.draft_tokens for s in result.steps)
    accepted = sum(s.accepted for s in result.steps)
    return {"mean_acceptance_length": result.mean_acceptance_length, "draft_tokens": drafted,
            "accepted_tokens": accepted, "steps": len(result.steps), "block_size": state.block_size}


class _Api:
    """Route handlers over one ServerState."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    # ---- shared steps ---------------------------------------------------------------------
    def _check_model(self, body: _Request) -> None:
        if body.model != self.state.config.served_model_name:
            raise APIError(404, f"the model '{body.model}' does not exist; this server serves "
                                f"'{self.state.config.served_model_name}' (see /v1/models)",
                           "invalid_request_error", "model", "model_not_found")

    def _encode(self, text: str) -> list[int]:
        if self.state.tokenizer is None:
            raise bad_request("this model has no tokenizer: send the prompt as a list of token ids", "prompt")
        return encode_prompt(self.state.tokenizer, text, chat=False)

    def _submit(self, ids: list[int], params: SamplingParams, param: str) -> Any:
        cfg, m = self.state.config, self.state.metrics
        if cfg.max_input_len is not None and len(ids) > cfg.max_input_len:
            raise bad_request(f"the prompt has {len(ids)} tokens; this server accepts at most {cfg.max_input_len}",
                              param, "context_length_exceeded")
        if not self.state.accepting:
            raise APIError(503, "the server is shutting down", "service_unavailable", None, None,
                           {"Retry-After": str(cfg.retry_after_s)})
        try:
            handle = self.state.scheduler.submit(ids, params, f"req-{uuid.uuid4().hex[:16]}")
        except ContextLengthError as exc:
            raise bad_request(str(exc), "max_tokens" if len(ids) < self.state.max_seq_len else param,
                              "context_length_exceeded") from exc
        except InputError as exc:
            raise bad_request(str(exc), None, "invalid_value") from exc
        except QueueFullError as exc:
            raise APIError(429, str(exc), "rate_limit_error", None, "queue_full",
                           {"Retry-After": str(cfg.retry_after_s)}) from exc
        m.prompt_tokens.inc(len(ids))
        return handle

    def _start(self, body: _Request, ids: list[int], max_new: int | None, param: str) -> RequestRun:
        try:
            params = body.sampling_params(max_new)
        except InputError as exc:
            raise bad_request(str(exc), None, "invalid_value") from exc
        arrival = time.perf_counter()
        return RequestRun(self.state, self._submit(ids, params, param), arrival, params.stop)

    def _final_fields(self, body: _Request, run: RequestRun) -> dict[str, Any]:
        res = run.result
        out = {"usage": _usage(res), "dflash": _dflash_stats(self.state, res)}
        if body.return_token_ids:
            out["prompt_token_ids"] = list(run.handle.sequence.prompt)
        return out

    # ---- routes ---------------------------------------------------------------------------
    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> JSONResponse:
        name = request.path_params["model"]
        if name != self.state.config.served_model_name:
            raise APIError(404, f"the model '{name}' does not exist", "invalid_request_error", "model",
                           "model_not_found")
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.state.config.served_model_name, "object": "model", "created": self.state.created,
                "owned_by": "dflash_trt", "max_model_len": self.state.max_seq_len}

    async def completions(self, request: Request) -> Response:
        body = parse_body(await request.body(), CompletionRequest)
        self._check_model(body)
        body.check_supported()
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        ids = self._encode(prompt) if isinstance(prompt, str) else list(prompt)
        max_new = body.max_tokens if body.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        run = self._start(body, ids, max_new, "prompt")
        rid, created, name = f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.state.config.served_model_name

        def chunk(text: str, finish: str | None, choices: bool = True) -> dict[str, Any]:
            c = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": "text_completion", "created": created, "model": name,
                    "choices": [c] if choices else []}

        if body.stream:
            return CancellableStream(self._stream(body, run, chunk), run)
        await run.collect(request)
        if not run.done:
            return Response(status_code=499)  # the client is gone; nobody reads this
        out = chunk(run.text.text, run.result.finish_reason)
        if body.return_token_ids:
            out["choices"][0]["token_ids"] = list(run.result.tokens)
        out.update(self._final_fields(body, run))
        return JSONResponse(out)

    async def chat(self, request: Request) -> Response:
        body = parse_body(await request.body(), ChatCompletionRequest)
        self._check_model(body)
        body.check_supported()
        tok = self.state.tokenizer
        if tok is None or not tok.chat_template:
            raise bad_request("this model has no chat template: use /v1/completions", "messages")
        try:
            ids = chat_ids(tok, body.chat_messages(), add_generation_prompt=body.add_generation_prompt,
                           template_kwargs=body.chat_template_kwargs)
        except (ValueError, TypeError) as exc:  # the template's own errors (jinja raises TemplateError(Exception))
            raise bad_request(f"the chat template failed on these messages: {exc}", "messages") from exc
        run = self._start(body, ids, body.token_limit, "messages")
        rid, created, name = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.state.config.served_model_name

        def chunk(text: str, finish: str | None, choices: bool = True, first: bool = False) -> dict[str, Any]:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                    "choices": [c] if choices else []}

        if body.stream:
            return CancellableStream(self._stream(body, run, chunk, chat=True), run)
        await run.collect(request)
        if not run.done:
            return Response(status_code=499)
        message = {"role": "assistant", "content": run.text.text}
        out = {"id": rid, "object": "chat.completion", "created": created, "model": name,
               "choices": [{"index": 0, "message": message, "logprobs": None,
                            "finish_reason": run.result.finish_reason}]}
        if body.return_token_ids:
            out["choices"][0]["token_ids"] = list(run.result.tokens)
        out.update(self._final_fields(body, run))
        return JSONResponse(out)

    async def _stream(self, body: _Request, run: RequestRun, chunk, chat: bool = False) -> AsyncIterator[str]:
        """SSE: content chunks, a finish chunk (with usage and dflash stats unless include_usage asks
        for OpenAI's separate usage chunk), then [DONE]. With return_token_ids every chunk carries the
        token ids it adds (a block of accepted drafts arrives as one chunk)."""
        try:
            if chat:
                yield _sse(chunk("", None, first=True))
            while not run.done:
                events = [await run.events.get()]
                while not run.events.empty():  # coalesce what piled up while the loop was busy
                    events.append(run.events.get_nowait())
                delta = "".join(run.on_event(e) for e in events)
                ids = [t for e in events if isinstance(e, TokenEvent) for t in e.tokens]
                if delta or (ids and body.return_token_ids):
                    out = chunk(delta, None)
                    if body.return_token_ids:  # this chunk's new token ids (they concatenate to the output)
                        out["choices"][0]["token_ids"] = list(ids)
                    yield _sse(out)
            last = chunk("", run.result.finish_reason)
            extra = self._final_fields(body, run)
            if body.return_token_ids:
                last["choices"][0]["token_ids"] = []
            if body.include_usage:
                yield _sse({**last, "usage": None})
                yield _sse({**chunk("", None, choices=False), **extra})
            else:
                yield _sse({**last, **extra})
        except APIError as exc:
            yield _sse(exc.body())
        yield "data: [DONE]\n\n"

    async def health(self, request: Request) -> JSONResponse:
        if not self.state.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if not self.state.scheduler.alive:
            return JSONResponse({"status": "decode loop not running"}, status_code=503)
        return JSONResponse({"status": "ok", "running": self.state.scheduler.num_running,
                             "waiting": self.state.scheduler.queue_depth})

    async def metrics(self, request: Request) -> Response:
        return Response(self.state.metrics.render(), media_type=CONTENT_TYPE)


class _AuthAndCount:
    """Pure ASGI middleware: Bearer auth on /v1 routes; counts /v1 responses by route and status."""

    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in _ROUTES else "other"
        key = self.state.config.api_key
        if key is not None:
            given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
                err = APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                               "invalid_request_error", None, "invalid_api_key")
                self.state.metrics.http_requests.labels(route, "401").inc()
                resp = JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        counted = False

        async def counting_send(message) -> None:
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:
                counted = True
                self.state.metrics.http_requests.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


_ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions")


def build_app(state: ServerState) -> FastAPI:
    """The ASGI app; starts the scheduler thread on startup and stops it on shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.scheduler.start()
        state.accepting = True
        try:
            yield
        finally:
            state.accepting = False
            state.scheduler.shutdown()

    app = FastAPI(title="dflash-trt", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    api = _Api(state)
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", api.model, methods=["GET"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat, methods=["POST"])
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/metrics", api.metrics, methods=["GET"])

    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500
                       else "server_error", None, None, dict(exc.headers or {}))
        return await api_error(request, err)

    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return await api_error(request, APIError(500, f"internal server error: {type(exc).__name__}", "server_error"))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    app.add_middleware(_AuthAndCount, state=state)
    return app
