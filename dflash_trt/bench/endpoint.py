"""THE OpenAI client for load generation: the concurrency sweep against a running OpenAI-compatible
server (ours, trtllm-serve, vLLM); `dflash-trt bench --endpoint URL` drives it.

Each request streams (`stream: true`, `stream_options.include_usage`), greedy (temperature 0):
chat prompts go to /v1/chat/completions, code prompts to /v1/completions as raw text. At each
concurrency c, c worker threads keep c requests in flight until every request is done.
Token counts come from the final chunk's `usage.completion_tokens` (else the number of
content chunks, noted in the point). With `ignore_eos` (vLLM's extension, ours too) every request
generates exactly max_new_tokens, so runs are comparable. tau comes from the response when the server sends a
`mean_acceptance_length` field: in a `dflash` object (our server's extension, with `steps`), at
the top level of a chunk, or inside `usage`; otherwise it is left empty.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from dflash_trt.prompts import Prompt
from dflash_trt.bench.report import RequestTiming, sweep_point
from dflash_trt.errors import BackendUnavailableError, InputError

log = logging.getLogger(__name__)

TAU_FIELD = "mean_acceptance_length"


@dataclass(frozen=True)
class EndpointConfig:
    url: str  # base URL, with or without a trailing /v1
    api_key: str | None = None
    model: str | None = None  # None: the first id from /v1/models
    timeout_s: float = 600.0
    ignore_eos: bool = False  # generate exactly max_new_tokens per request (server extension)

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise InputError(f"--endpoint must be an http(s) URL, got '{self.url}'")

    @property
    def base(self) -> str:
        base = self.url.rstrip("/")
        return base if base.endswith("/v1") else base + "/v1"


def _client(cfg: EndpointConfig):
    try:
        import httpx
    except ImportError as exc:
        raise BackendUnavailableError("--endpoint needs httpx: `pip install httpx`") from exc
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    return httpx.Client(headers=headers, timeout=cfg.timeout_s)


def resolve_model(cfg: EndpointConfig) -> str:
    """The model name to send: --model, or the first model the server lists."""
    if cfg.model:
        return cfg.model
    import httpx

    with _client(cfg) as client:
        try:
            resp = client.get(f"{cfg.base}/models")
        except httpx.HTTPError as exc:
            raise BackendUnavailableError(f"cannot reach {cfg.base}/models: {exc}; is the server running?") from exc
    if resp.status_code != 200:
        raise BackendUnavailableError(f"{cfg.base}/models answered HTTP {resp.status_code}: {resp.text[:200]} "
                                      "(pass --model, and --api-key if the server needs one)")
    data = resp.json()["data"]
    if not data:
        raise BackendUnavailableError(f"{cfg.base}/models lists no model; pass --model")
    return str(data[0]["id"])


def _tau_from(obj: dict) -> tuple[float, int | None] | None:
    """(tau, steps) from a chunk's extension fields, when the server sends them."""
    for holder in (obj.get("dflash") or {}, obj, obj.get("usage") or {}):
        if TAU_FIELD in holder:
            steps = holder.get("steps")
            return float(holder[TAU_FIELD]), None if steps is None else int(steps)
    return None


def stream_one(client, cfg: EndpointConfig, model: str, prompt: Prompt, max_new_tokens: int) -> tuple[RequestTiming, bool]:
    """Send one streaming request; returns its timing and whether usage gave the token count."""
    body: dict = {"model": model, "max_tokens": max_new_tokens, "temperature": 0.0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if prompt.kind == "chat":
        url, body["messages"] = f"{cfg.base}/chat/completions", [{"role": "user", "content": prompt.text}]
    else:
        url, body["prompt"] = f"{cfg.base}/completions", prompt.text
    chunks: list[float] = []
    usage_tokens, tau = None, None
    submit = time.perf_counter()
    with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            raise EndpointRequestError(f"{url} answered HTTP {resp.status_code} for prompt {prompt.id}: {resp.text[:200]}")
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            obj = json.loads(payload)
            now = time.perf_counter()
            for choice in obj.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") if prompt.kind == "chat" else choice.get("text")
                if text:
                    chunks.append(now)
                    break
            if obj.get("usage"):
                usage_tokens = int(obj["usage"]["completion_tokens"])
            tau = _tau_from(obj) or tau
    end = time.perf_counter()
    tokens = usage_tokens if usage_tokens is not None else len(chunks)
    return RequestTiming(prompt_id=prompt.id, tokens=tokens, submit_s=submit, chunk_times=chunks, end_s=end,
                         steps=None if tau is None else tau[1], reported_tau=None if tau is None else tau[0]), \
        usage_tokens is not None


class EndpointRequestError(Exception):
    """One request failed (HTTP status or transport); recorded as a bench error."""


def run_endpoint_sweep(cfg: EndpointConfig, prompts: list[Prompt], concurrencies: list[int], max_new_tokens: int,
                       advance: Callable[[int], None] = lambda n: None) -> tuple[list[dict], list[dict], str]:
    """The sweep over `concurrencies`; returns (points, errors, model name)."""
    import httpx

    model = resolve_model(cfg)
    points, errors = [], []
    for c in concurrencies:
        reqs = [prompts[i % len(prompts)] for i in range(max(len(prompts), c))]
        timings: list[RequestTiming] = []
        lock = threading.Lock()
        from_usage = []

        def work(prompt: Prompt, client) -> None:
            try:
                timing, usage = stream_one(client, cfg, model, prompt, max_new_tokens)
            except (httpx.HTTPError, EndpointRequestError, json.JSONDecodeError, KeyError) as exc:
                with lock:
                    errors.append({"kind": "endpoint_request", "concurrency": c, "prompt_id": prompt.id,
                                   "message": f"endpoint request for {prompt.id} at concurrency {c} failed: {exc}"})
            else:
                with lock:
                    timings.append(timing)
                    from_usage.append(usage)
            advance(1)

        with _client(cfg) as client, ThreadPoolExecutor(max_workers=c) as pool:
            t0 = time.perf_counter()
            list(pool.map(lambda p: work(p, client), reqs))
            wall = time.perf_counter() - t0
        point = sweep_point(f"endpoint:{model}", c, timings, wall)
        point["token_count_source"] = "usage" if from_usage and all(from_usage) else "chunks"
        points.append(point)
        log.info("endpoint c=%d: %.1f tok/s total", c, point["total_tokens_per_s"] or 0.0)
    return points, errors, model
