"""The continuous-batching scheduler over a real DFlashEngine (tiny float64 Llama + drafter).

Threaded tests use the real background loop; the admission / cancellation tests drive
`run_once` (cancel, admit, step) by hand so that what happens between steps is observable.
Every wait has a timeout: a hang fails the test instead of blocking the suite.
"""
from __future__ import annotations

import queue
import threading

import pytest
import torch

from dflash_trt.errors import DFlashError
from dflash_trt.models.target import native_from_hf
from dflash_trt.models.tiny import build_tiny_drafter, build_tiny_target
from dflash_trt.runtime.scheduler import (ErrorEvent, FinalEvent, QueueFullError, Scheduler, SchedulerClosedError,
                                          SchedulerConfig,
                                          TokenEvent)
from dflash_trt.engine import EngineConfig, SamplingParams
from dflash_trt.speculative.decoder import DFlashEngine

VOCAB = 64
BLOCK = 4
WAIT_S = 60.0


@pytest.fixture(scope="module")
def models():
    hf = build_tiny_target("llama", seed=8, dtype=torch.float64, vocab_size=VOCAB, num_layers=3, hidden_size=32)
    return native_from_hf(hf), build_tiny_drafter(hf.config, seed=9, dtype=torch.float64, block_size=BLOCK)


def _engine(models, batch: int) -> DFlashEngine:
    target, drafter = models
    return DFlashEngine(target, drafter, EngineConfig(max_batch_size=batch, max_seq_len=64))


def _alone(models, prompt, params) -> list[int]:
    return _engine(models, 1).generate([prompt], params)[0].tokens


def _prompt(i: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randint(5, VOCAB - 1, (n,), generator=g).tolist()


def _params(i: int, max_new: int = 10) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.9, top_k=20, seed=i, max_new_tokens=max_new, ignore_eos=True)
    return SamplingParams(max_new_tokens=max_new, ignore_eos=True)


def _drain(handle, timeout: float = WAIT_S):
    """All events of one request up to its final/error event: (tokens streamed, last event)."""
    tokens = []
    while True:
        event = handle.get(timeout=timeout)
        if isinstance(event, TokenEvent):
            tokens.extend(event.tokens)
        else:
            return tokens, event


def test_requests_from_many_threads_complete_with_the_right_tokens(models):
    engine = _engine(models, 3)
    sched = Scheduler(engine).start()
    specs = [(_prompt(i, 2 + 3 * i), _params(i, 4 + 2 * i)) for i in range(8)]
    handles: dict[int, object] = {}
    errors: list[BaseException] = []

    def client(ids):
        for i in ids:
            try:
                handles[i] = sched.submit(*specs[i], request_id=f"r{i}")
            except DFlashError as exc:  # recorded and asserted on below
                errors.append(exc)

    threads = [threading.Thread(target=client, args=(list(range(t, 8, 4)),)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    try:
        assert not errors and len(handles) == 8
        for i, (prompt, params) in enumerate(specs):
            streamed, last = _drain(handles[i])
            assert isinstance(last, FinalEvent), last
            assert last.result.request_id == f"r{i}"
            assert streamed == last.result.tokens == _alone(models, prompt, params), f"request {i}"
            assert last.result.finish_reason == "length"
        assert sched.steps > 0 and engine.tcache.num_rows == 0
    finally:
        sched.shutdown()


def test_requests_join_and_leave_between_steps(models):
    engine = _engine(models, 2)
    sched = Scheduler(engine)
    a = sched.submit(_prompt(0, 5), _params(0, 2))  # leaves after its first step
    b = sched.submit(_prompt(1, 9), _params(1, 30))
    c = sched.submit(_prompt(2, 3), _params(2, 6))  # waits for a free row
    sched.run_once()
    assert [s.request_id for s in engine.active] in ([b.request_id], [a.request_id, b.request_id])
    rounds = 0
    while c.sequence.row < 0 and rounds < 10:  # c joins as soon as a's row is free
        sched.run_once()
        rounds += 1
    assert a.sequence.finished and not b.sequence.finished and c.sequence in engine.active
    while engine.active or sched.queue_depth:
        sched.run_once()
    for h, i, n in ((a, 0, 5), (b, 1, 9), (c, 2, 3)):
        streamed, last = _drain(h, timeout=1)
        assert streamed == last.result.tokens == _alone(models, _prompt(i, n), h.sequence.params)


def test_cancel_frees_cache_rows_before_the_next_step(models):
    engine = _engine(models, 4)
    rows_at_step: list[int] = []
    real_step = engine.step

    def step():
        rows_at_step.append(engine.tcache.num_rows)
        return real_step()

    engine.step = step
    sched = Scheduler(engine)
    handles = [sched.submit(_prompt(i, 4 + i), _params(i, 30)) for i in range(3)]
    fourth = sched.submit(_prompt(9, 4), _params(9, 30))
    sched.run_once()
    assert engine.tcache.num_rows == 4 and engine.dcache.num_rows == 4
    handles[1].cancel()
    fourth.cancel()  # two running rows, one of them the last (no row move) and one not
    sched.run_once()
    assert rows_at_step[-1] == 2, "cancelled rows must be freed before the step runs"
    assert engine.tcache.num_rows == engine.dcache.num_rows == 2
    for h in (handles[1], fourth):
        _, last = _drain(h, timeout=1)
        assert isinstance(last, FinalEvent) and last.result.finish_reason == "cancelled"
    while engine.active:
        sched.run_once()
    for i in (0, 2):
        streamed, last = _drain(handles[i], timeout=1)
        assert streamed == last.result.tokens == _alone(models, _prompt(i, 4 + i), _params(i, 30))


def test_cancel_while_waiting_never_runs(models):
    engine = _engine(models, 1)
    sched = Scheduler(engine)
    first = sched.submit(_prompt(0, 4), _params(0, 3))
    second = sched.submit(_prompt(1, 4), _params(1, 3))
    second.cancel()
    while engine.active or sched.queue_depth:
        sched.run_once()
    _, last = _drain(second, timeout=1)
    assert isinstance(last, FinalEvent) and last.result.finish_reason == "cancelled" and last.result.tokens == []
    assert isinstance(_drain(first, timeout=1)[1], FinalEvent)


def test_queue_limit_raises_queue_full(models):
    engine = _engine(models, 1)
    sched = Scheduler(engine, SchedulerConfig(max_queue=2))
    for i in range(3):  # one free batch row + two queued
        sched.submit(_prompt(i, 3), _params(i, 5))
    with pytest.raises(QueueFullError, match="retry later"):
        sched.submit(_prompt(3, 3), _params(3, 5))
    sched.run_once()  # one admitted: the queue holds two again, still full
    with pytest.raises(QueueFullError):
        sched.submit(_prompt(3, 3), _params(3, 5))
    while engine.active or sched.queue_depth:
        sched.run_once()
    sched.submit(_prompt(3, 3), _params(3, 5))  # room again


def test_token_budget_limits_admissions_per_step(models):
    engine = _engine(models, 8)
    # cost of a request: prompt (10) + block (4) = 14; running rows cost a block (4) each
    sched = Scheduler(engine, SchedulerConfig(token_budget=30))
    handles = [sched.submit(_prompt(i, 10), _params(i, 40)) for i in range(5)]
    admitted = []
    for _ in range(3):
        sched.run_once()
        admitted.append(len(engine.active))
    # idle: 30 -> two (28); then 30 - 8 = 22 -> one more; then 30 - 12 = 18 -> one more
    assert admitted == [2, 3, 4]
    assert sched.queue_depth == 1
    lone = Scheduler(_engine(models, 2), SchedulerConfig(token_budget=5))
    lone.submit(_prompt(0, 10), _params(0, 3))  # over budget, but alone on an idle engine
    lone.run_once()
    assert len(lone.engine.active) == 1
    del handles


def test_shutdown_fails_pending_requests(models):
    engine = _engine(models, 1)
    sched = Scheduler(engine)
    assert not sched.alive
    sched.start()
    assert sched.alive
    handles = [sched.submit(_prompt(i, 5), _params(i, 50)) for i in range(4)]
    sched.shutdown(timeout=WAIT_S)
    assert not sched.alive
    finals = [_drain(h, timeout=WAIT_S)[1] for h in handles]  # every request ends: no hang
    assert all(isinstance(e, (FinalEvent, ErrorEvent)) for e in finals)
    assert sum(isinstance(e, ErrorEvent) for e in finals) >= 3, finals
    assert all("shutting down" in e.message for e in finals if isinstance(e, ErrorEvent))
    assert engine.tcache.num_rows == 0
    with pytest.raises(SchedulerClosedError, match="shut down"):
        sched.submit(_prompt(0, 3), _params(0, 3))


def test_shutdown_of_a_never_started_scheduler_fails_its_queue(models):
    sched = Scheduler(_engine(models, 1))
    handle = sched.submit(_prompt(0, 3), _params(0, 3))
    sched.shutdown()
    assert isinstance(handle.get(timeout=1), ErrorEvent)


def test_events_queue_is_a_plain_queue(models):
    sched = Scheduler(_engine(models, 1))
    handle = sched.submit(_prompt(0, 3), _params(0, 1))
    assert isinstance(handle.events, queue.Queue)
    sched.run_once()
    streamed, last = _drain(handle, timeout=1)
    assert len(streamed) == 1 and last.result.finish_reason == "length"
