"""Bad requests, auth, admission limits and client disconnects against the real server."""
from __future__ import annotations

import asyncio
import socket
import struct
import time
from pathlib import Path

import httpx
import openai
import pytest
from serve_helpers import API_KEY, MAX_BATCH, MAX_QUEUE, MAX_SEQ_LEN

AUTH = {"Authorization": f"Bearer {API_KEY}"}
C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
MSG = [{"role": "user", "content": "hi"}]

# (name, route, body (dict or raw bytes), status, param, code)
BAD = [
    ("malformed json", C, b'{"model": "tiny", "prompt": ', 400, None, None),
    ("not an object", C, b"[1, 2]", 400, None, None),
    ("empty body", C, b"", 400, None, None),
    ("missing prompt", C, {"model": "tiny"}, 400, "prompt", "missing_required_parameter"),
    ("missing model", C, {"prompt": "hi"}, 400, "model", "missing_required_parameter"),
    ("missing messages", CHAT, {"model": "tiny"}, 400, "messages", "missing_required_parameter"),
    ("max_tokens as string", C, {**OK, "max_tokens": "10"}, 400, "max_tokens", None),
    ("max_tokens as bool", C, {**OK, "max_tokens": True}, 400, "max_tokens", None),
    ("prompt as number", C, {**OK, "prompt": 5}, 400, "prompt", "invalid_type"),
    ("unknown field", C, {**OK, "frobnicate": 1}, 400, "frobnicate", "unknown_parameter"),
    ("unknown model", C, {**OK, "model": "gpt-9"}, 404, "model", "model_not_found"),
    ("unknown model (chat)", CHAT, {"model": "gpt-9", "messages": MSG}, 404, "model", "model_not_found"),
    ("negative temperature", C, {**OK, "temperature": -1}, 400, "temperature", None),
    ("temperature above 2", C, {**OK, "temperature": 2.5}, 400, "temperature", None),
    ("top_p zero", C, {**OK, "top_p": 0}, 400, "top_p", None),
    ("top_p above 1", C, {**OK, "top_p": 1.5}, 400, "top_p", None),
    ("top_k negative", C, {**OK, "top_k": -5}, 400, "top_k", None),
    ("max_tokens zero", C, {**OK, "max_tokens": 0}, 400, "max_tokens", None),
    ("negative seed", C, {**OK, "seed": -3}, 400, "seed", None),
    ("n=2", C, {**OK, "n": 2}, 400, "n", None),
    ("five stop strings", C, {**OK, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    ("empty stop string", C, {**OK, "stop": ""}, 400, "stop", None),
    ("presence penalty", C, {**OK, "presence_penalty": 1.0}, 400, "presence_penalty", None),
    ("logprobs", C, {**OK, "logprobs": 2}, 400, "logprobs", None),
    ("stream_options without stream", C, {**OK, "stream_options": {"include_usage": True}}, 400, "stream_options",
     None),
    ("prompt too long", C, {**OK, "prompt": [5] * (MAX_SEQ_LEN + 10)}, 400, "prompt", "context_length_exceeded"),
    ("max_tokens beyond context", C, {**OK, "max_tokens": 100_000}, 400, "max_tokens", "context_length_exceeded"),
    ("token id outside vocab", C, {**OK, "prompt": [10**6]}, 400, None, "invalid_value"),
    ("empty prompt", C, {**OK, "prompt": ""}, 400, None, "invalid_value"),
    ("empty messages", CHAT, {"model": "tiny", "messages": []}, 400, "messages", None),
    ("bad role", CHAT, {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role",
     None),
    ("image content", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages.0.content", None),
    # chat messages as OpenAI validates them: every message needs content (a string or text parts)
    ("message without content", CHAT, {"model": "tiny", "messages": [{"role": "user"}]}, 400, "messages.0.content",
     "missing_required_parameter"),
    ("assistant message without content", CHAT, {"model": "tiny", "messages": [*MSG, {"role": "assistant"}, *MSG]},
     400, "messages.1.content", "missing_required_parameter"),
    ("null content", CHAT, {"model": "tiny", "messages": [{"role": "system", "content": None}, *MSG]}, 400,
     "messages.0.content", "invalid_type"),
    ("empty content array", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": []}]}, 400,
     "messages.0.content", "invalid_value"),
    ("content as number", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400,
     "messages.0.content", "invalid_type"),
    ("text part without text", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     400, "messages.0.content", None),
    ("tool message without tool_calls", CHAT, {"model": "tiny", "messages": [
        *MSG, {"role": "tool", "content": "42", "tool_call_id": "call_1"}]}, 400, "messages.1.role", "invalid_value"),
    ("tool_call_id on a user message", CHAT, {"model": "tiny", "messages": [{**MSG[0], "tool_call_id": "x"}]}, 400,
     "messages.0.tool_call_id", None),
    ("message without role", CHAT, {"model": "tiny", "messages": [{"content": "hi"}]}, 400, "messages.0.role",
     "missing_required_parameter"),
    ("chat logprobs", CHAT, {"model": "tiny", "messages": MSG, "logprobs": True}, 400, "logprobs", None),
    ("chat tools", CHAT, {"model": "tiny", "messages": MSG, "tools": [{"type": "function"}]}, 400, "tools", None),
]


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


@pytest.mark.parametrize("name,route,body,status,param,code", BAD, ids=[b[0] for b in BAD])
def test_bad_request_answered_in_openai_shape(http, name, route, body, status, param, code):
    if isinstance(body, bytes):
        resp = http.post(route, content=body, headers={"Content-Type": "application/json"})
    else:
        resp = http.post(route, json=body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


def test_server_stays_healthy_after_bad_requests(http, server):
    for name, route, body, *_ in BAD:
        http.post(route, content=body) if isinstance(body, bytes) else http.post(route, json=body)
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert http.post(C, json=OK).status_code == 200
    assert server.process.poll() is None


def test_unknown_route_and_method_in_openai_shape(http):
    assert http.get("/v1/nope").json()["error"]["message"]
    resp = http.get(C)
    assert resp.status_code == 405 and resp.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"},
                                     {"Authorization": API_KEY}])
def test_api_key_enforced_on_v1_routes(server, headers):
    for method, route in (("GET", "/v1/models"), ("POST", C), ("POST", CHAT)):
        resp = httpx.request(method, f"{server.url}{route}", headers=headers, json=OK)
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_openai_client_with_wrong_key_gets_authentication_error(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def _wait_idle(server, cancelled: float | None = None, timeout_s: float = 30.0) -> dict[str, float]:
    """Wait until nothing runs or waits (and, if given, the cancelled count reached `cancelled`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["dflash:num_requests_running"] == 0 and m["dflash:num_requests_waiting"] == 0 \
                and (cancelled is None or m[CANCELLED] >= cancelled):
            return m
        time.sleep(0.05)
    pytest.fail(f"running/waiting did not return to 0 (or no cancel was counted) within {timeout_s} s: {m}")


LONG = {"model": "tiny", "prompt": "tell me everything", "max_tokens": MAX_SEQ_LEN - 40, "ignore_eos": True}
CANCELLED = 'dflash:request_success_total{finished_reason="cancelled"}'
LENGTH = 'dflash:request_success_total{finished_reason="length"}'


def test_disconnected_stream_frees_its_slot(server, http):
    before = _wait_idle(server)
    with http.stream("POST", C, json={**LONG, "stream": True}) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert server.metrics()["dflash:num_requests_running"] == 1
    after = _wait_idle(server, cancelled=before[CANCELLED] + 1)  # closing the stream cancelled the request
    assert after[CANCELLED] == before[CANCELLED] + 1 and after[LENGTH] == before[LENGTH]


def test_disconnected_plain_request_is_cancelled(server):
    before = _wait_idle(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}{C}", headers=AUTH, json=LONG, timeout=httpx.Timeout(5, read=0.5))
    after = _wait_idle(server, cancelled=before[CANCELLED] + 1)
    assert after[CANCELLED] == before[CANCELLED] + 1 and after[LENGTH] == before[LENGTH]


def test_queue_full_gets_429_with_retry_after_and_slots_free_on_close(server):
    _wait_idle(server)
    total = MAX_BATCH + MAX_QUEUE + 6

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as client:
            reqs = [client.build_request("POST", C, json={**LONG, "stream": True, "prompt": f"q{i}"})
                    for i in range(total)]
            responses = []
            for r in reqs:  # submitted one after another, all held open
                responses.append(await client.send(r, stream=True))
            statuses = [r.status_code for r in responses]
            rejected = [r for r in responses if r.status_code == 429]
            for r in rejected:
                await r.aread()
            bodies = [(r.headers.get("retry-after"), r.json()) for r in rejected]
            for r in responses:
                await r.aclose()
            return statuses, bodies

    statuses, bodies = asyncio.run(main())
    assert statuses.count(200) == MAX_BATCH + MAX_QUEUE and statuses.count(429) == 6
    for retry_after, body in bodies:
        assert int(retry_after) >= 1 and body["error"]["code"] == "queue_full"
    _wait_idle(server)
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.skipif(not Path("/proc/net/tcp").is_file(), reason="reads Linux /proc/net/tcp")
def test_server_listens_on_loopback_only(server):
    port = int(server.url.rsplit(":", 1)[1])
    listening = []  # local addresses of LISTEN sockets on the server's port
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, hex_port = local.split(":")
        if int(hex_port, 16) == port and state == "0A":
            listening.append(socket.inet_ntoa(struct.pack("<I", int(addr, 16))))
    assert listening == ["127.0.0.1"]
