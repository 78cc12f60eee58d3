"""Continuous batching over an `Engine` (dflash_trt/engine.py, either backend): requests join and leave between decode steps.

One background thread owns the engine. Between steps it (1) drops cancelled requests, freeing
their cache rows at once, (2) admits waiting requests in arrival order while a batch row is free
and the step's token budget allows (prefill tokens + block tokens of the running rows), then
(3) runs one DFlash step for the whole batch and hands each request its new tokens.
Callers (the OpenAI server, the Triton model, the bench) submit from any thread and read events
from a per-request queue; `asyncio` callers wrap `RequestHandle.events` with run_in_executor or
poll `get(timeout)`.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from dflash_trt.errors import DFlashError, InputError
from dflash_trt.engine import Engine, GenerationResult, SamplingParams, Sequence

log = logging.getLogger(__name__)


class QueueFullError(DFlashError):
    """The waiting queue is at its limit; retry later (HTTP 429/503 with Retry-After)."""


class SchedulerClosedError(DFlashError):
    """The scheduler was shut down and takes no new requests (HTTP 503)."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_queue: int = 256  # waiting requests beyond the running batch
    token_budget: int = 4096  # tokens one step may process (prefills + running blocks)

    def __post_init__(self) -> None:
        if self.max_queue < 0 or self.token_budget < 1:
            raise InputError(f"max_queue must be >= 0 and token_budget >= 1, got {self.max_queue}, {self.token_budget}")


@dataclass(frozen=True)
class TokenEvent:
    tokens: list[int]  # newly emitted tokens (may be empty when a stop string trimmed them)
    time_s: float


@dataclass(frozen=True)
class FinalEvent:
    result: GenerationResult


@dataclass(frozen=True)
class ErrorEvent:
    message: str


@dataclass
class RequestHandle:
    sequence: Sequence
    events: "queue.Queue[TokenEvent | FinalEvent | ErrorEvent]" = field(default_factory=queue.Queue)
    cancel_requested: threading.Event = field(default_factory=threading.Event)
    submitted_ns: int = field(default_factory=time.time_ns)  # wall clock, for per-request timing reports
    admitted_ns: int | None = None  # when the scheduler started it on the engine (wall clock)

    @property
    def request_id(self) -> str:
        return self.sequence.request_id

    def cancel(self) -> None:
        """Ask the scheduler to drop this request; its cache rows are freed before the next step."""
        self.cancel_requested.set()

    def get(self, timeout: float | None = None):
        return self.events.get(timeout=timeout)

    def drain(self) -> list[TokenEvent | FinalEvent | ErrorEvent]:
        """Every event queued so far, without waiting."""
        out = []
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                return out


class Scheduler:
    def __init__(self, engine: Engine, config: SchedulerConfig = SchedulerConfig()) -> None:
        self.engine, self.config = engine, config
        self._waiting: list[RequestHandle] = []
        self._running: dict[int, RequestHandle] = {}  # id(sequence) -> handle
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stop = False
        self._thread: threading.Thread | None = None
        self.steps = 0

    # ---- submission (any thread) ----------------------------------------------------------
    def submit(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> RequestHandle:
        with self._wake:
            if self._stop:
                raise SchedulerClosedError("the scheduler is shut down: start a new one to serve requests")
            # validates (raises InputError); under the lock so concurrent submits get distinct ids
            handle = RequestHandle(self.engine.make_sequence(prompt, params, request_id))
            if len(self._waiting) >= self.config.max_queue + self.engine.free_rows:
                raise QueueFullError(f"{len(self._waiting)} requests are waiting (limit {self.config.max_queue}); retry later")
            self._waiting.append(handle)
            self._wake.notify()
        return handle

    @property
    def queue_depth(self) -> int:
        with self._lock:
            return len(self._waiting)

    @property
    def num_running(self) -> int:
        with self._lock:
            return len(self._running)

    # ---- the loop (one thread) --------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """True while the scheduling thread runs (False before start, after shutdown or a crash)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "Scheduler":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dflash-scheduler", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; every waiting or running request ends with an ErrorEvent."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():  # mid-step: the loop fails its requests when the step ends
                log.warning("scheduler still finishing a step after %.1f s", timeout)
                return
        self._fail_all("server shutting down")  # also when the loop never started

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self._waiting and not self._running:
                    self._wake.wait(timeout=1.0)
                if self._stop:
                    break
            try:
                self.run_once()
            except Exception as exc:  # noqa: BLE001 - a bug must not hang every client: fail them all loudly
                log.exception("scheduler step failed")
                self._fail_all(f"internal error in the decode loop: {exc}")
        self._fail_all("server shutting down")

    def run_once(self) -> None:
        """Cancel, admit, step: one scheduling round (also usable without the thread)."""
        self._drop_cancelled()
        self._admit()
        if self.engine.active:
            outputs = self.engine.step()
            self.steps += 1
            self._dispatch(outputs)

    def _drop_cancelled(self) -> None:
        with self._lock:
            cancelled = [h for h in self._waiting if h.cancel_requested.is_set()]
            self._waiting = [h for h in self._waiting if not h.cancel_requested.is_set()]
            running = [h for h in self._running.values() if h.cancel_requested.is_set()]
        for h in cancelled:
            h.sequence.finish_reason = "cancelled"
            h.sequence.first_token_s = h.sequence.first_token_s or time.perf_counter()
            h.sequence.finished_s = time.perf_counter()
            h.events.put(FinalEvent(h.sequence.result()))
        for h in running:
            self.engine.cancel(h.sequence)
            self._finish(h)

    def _admit(self) -> None:
        block = self.engine.block_size
        budget = self.config.token_budget - block * len(self.engine.active)
        batch: list[RequestHandle] = []
        with self._lock:
            while self._waiting and len(batch) < self.engine.free_rows:
                cost = len(self._waiting[0].sequence.prompt) + block
                if cost > budget and (batch or self.engine.active):
                    break  # a lone request on an idle engine is admitted even past the budget
                batch.append(self._waiting.pop(0))
                budget -= cost
            now_ns = time.time_ns()
            for h in batch:
                h.admitted_ns = now_ns
                self._running[id(h.sequence)] = h
        if batch:
            self._dispatch(self.engine.add([h.sequence for h in batch]))

    def _dispatch(self, outputs) -> None:
        now = time.perf_counter()
        for out in outputs:
            with self._lock:
                handle = self._running.get(id(out.sequence))
            if handle is None:
                continue
            handle.events.put(TokenEvent(out.new_tokens, now))
            if out.sequence.finished:
                self._finish(handle)

    def _finish(self, handle: RequestHandle) -> None:
        with self._lock:
            self._running.pop(id(handle.sequence), None)
        handle.events.put(FinalEvent(handle.sequence.result()))

    def _fail_all(self, message: str) -> None:
        with self._lock:
            handles = list(self._waiting) + list(self._running.values())
            self._waiting, self._running = [], {}
        for s in list(self.engine.active):
            self.engine.cancel(s)
        for h in handles:
            h.events.put(ErrorEvent(message))
