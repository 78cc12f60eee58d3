"""From the scheduler's thread to asyncio, and from tokens to OpenAI text deltas.

`EventBridge`: the scheduler hands each request's events to a thread-safe `queue.Queue`. One
asyncio task polls every watched queue with `get_nowait` every `poll_s` (2 ms) while any request
is in flight and forwards events to per-request `asyncio.Queue`s, so the event loop never blocks
and no thread is spent per request. A request whose client went away is `detach`ed: the bridge
keeps draining it until the scheduler confirms the cancel with its final event (the slot is free
then) and hands that event to a callback (metrics).

`TextStream` (text.py): incremental detokenization with stop strings.

`RequestRun`: one request in flight (its events, text, metrics, cancellation), and
`CancellableStream`: an SSE response that cancels its request however the stream ends.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect

from dflash_trt.runtime.scheduler import ErrorEvent, FinalEvent, RequestHandle, TokenEvent
from dflash_trt.serve.schemas import APIError
from dflash_trt.serve.text import TextStream
from dflash_trt.engine import GenerationResult

log = logging.getLogger(__name__)
DISCONNECT_CHECK_S = 0.25  # how often a non-streaming request checks that its client is still there


@dataclass
class _Watch:
    handle: RequestHandle
    out: asyncio.Queue | None  # None once detached
    on_final: Callable[[FinalEvent | ErrorEvent], None] | None = None


class EventBridge:
    def __init__(self, poll_s: float = 0.002) -> None:
        self.poll_s = poll_s
        self._watches: dict[int, _Watch] = {}  # id(handle) -> watch
        self._task: asyncio.Task | None = None

    def attach(self, handle: RequestHandle) -> asyncio.Queue:
        out: asyncio.Queue = asyncio.Queue()
        self._watches[id(handle)] = _Watch(handle, out)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._pump(), name="dflash-event-bridge")
        return out

    def detach(self, handle: RequestHandle, on_final: Callable[[FinalEvent | ErrorEvent], None]) -> None:
        """Stop forwarding; keep draining until the final event, then call `on_final` with it."""
        watch = self._watches.get(id(handle))
        if watch is not None:
            watch.out, watch.on_final = None, on_final

    def forget(self, handle: RequestHandle) -> None:
        self._watches.pop(id(handle), None)

    @property
    def watching(self) -> int:
        return len(self._watches)

    async def _pump(self) -> None:
        while self._watches:
            for key, watch in list(self._watches.items()):
                self._drain(key, watch)
            await asyncio.sleep(self.poll_s)

    def _drain(self, key: int, watch: _Watch) -> None:
        while True:
            try:
                event = watch.handle.events.get_nowait()
            except queue.Empty:
                return
            final = isinstance(event, (FinalEvent, ErrorEvent))
            if watch.out is not None:
                watch.out.put_nowait(event)
            elif final and watch.on_final is not None:
                watch.on_final(event)
            if final:
                self._watches.pop(key, None)
                return


class RequestRun:
    """One request in flight: its events, its text and its metrics."""

    def __init__(self, state, handle: RequestHandle, arrival: float, stops: tuple[str, ...]) -> None:
        # state: app.ServerState (bridge, metrics, detokenize)
        self.state, self.handle, self.arrival = state, handle, arrival
        self.events = state.bridge.attach(handle)
        self.text = TextStream(state.detokenize, stops)
        self.last_token_s: float | None = None
        self.result: GenerationResult | None = None

    @property
    def done(self) -> bool:
        return self.result is not None

    def on_event(self, event) -> str:
        """Apply one event; return the text delta it makes safe to send."""
        m = self.state.metrics
        if isinstance(event, TokenEvent):
            if event.tokens:
                now = time.perf_counter()
                if self.last_token_s is None:
                    m.on_first_token(now - self.arrival)
                m.on_tokens(len(event.tokens), None if self.last_token_s is None else now - self.last_token_s)
                self.last_token_s = now
            return self.text.push(event.tokens)
        if isinstance(event, FinalEvent):
            self.result = event.result
            m.on_finished(event.result, event.result.finish_reason, time.perf_counter() - self.arrival)
            self.state.bridge.forget(self.handle)
            return self.text.finish()
        assert isinstance(event, ErrorEvent)
        self.state.bridge.forget(self.handle)
        m.on_finished(None, "error", None)
        raise APIError(500, f"generation failed: {event.message}", "server_error")

    async def collect(self, request: Request) -> None:
        """Run to the end (non-streaming), cancelling if the client disconnects."""
        next_check = time.monotonic() + DISCONNECT_CHECK_S
        while not self.done:
            try:
                self.on_event(await asyncio.wait_for(self.events.get(), DISCONNECT_CHECK_S))
            except asyncio.TimeoutError:
                pass
            if time.monotonic() >= next_check:  # checked on a clock: events may never pause
                next_check = time.monotonic() + DISCONNECT_CHECK_S
                if await request.is_disconnected():
                    self.abandon()
                    return

    def abandon(self) -> None:
        """The client is gone: cancel, and count the request when the scheduler confirms."""
        if self.done:
            return
        self.handle.cancel()
        m = self.state.metrics

        def confirmed(event) -> None:  # "cancelled", or how it ended if it finished before the cancel landed
            if isinstance(event, FinalEvent):
                m.on_finished(event.result, event.result.finish_reason, None)
            else:
                m.on_finished(None, "error", None)

        self.state.bridge.detach(self.handle, confirmed)


class CancellableStream(StreamingResponse):
    """An SSE response that cancels its request however the stream ends early."""

    def __init__(self, content: AsyncIterator[str], run: RequestRun) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (ClientDisconnect, OSError):
            log.debug("client disconnected from stream %s", self._run.handle.request_id)
        finally:
            self._run.abandon()
