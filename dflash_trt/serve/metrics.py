"""Prometheus metrics of the OpenAI server (own CollectorRegistry; text format at /metrics).

Names follow vLLM's with a `dflash:` prefix, so dashboards built for vLLM's speculative decoding
read ours by swapping the prefix:
- `dflash:spec_decode_num_drafts_total`: verification steps that carried a draft;
- `dflash:spec_decode_num_draft_tokens_total`: drafted tokens verified;
- `dflash:spec_decode_num_accepted_tokens_total`: drafted tokens accepted (<= draft tokens);
- `dflash:spec_decode_num_accepted_tokens_per_pos_total{position="i"}`: steps whose draft i
  (0-based) was accepted; position 0 sums to the accepted count of the first draft slot.
Mean acceptance length tau = 1 + accepted / drafts (accepted drafts + the bonus token per step).
Spec counters are added when a request finishes (its full step record is known then).
"""
from __future__ import annotations

import threading
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from dflash_trt.engine import GenerationResult

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
FINISH_REASONS = ("stop", "length", "cancelled", "error")
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self, num_positions: int, running: Callable[[], int], waiting: Callable[[], int],
                 model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, p = self.registry, "dflash:"
        self.num_positions = num_positions  # draft slots per step (block_size - 1; 0 without a drafter)
        Gauge(f"{p}num_requests_running", "Requests in the running batch", registry=r).set_function(running)
        Gauge(f"{p}num_requests_waiting", "Requests waiting for a batch row", registry=r).set_function(waiting)
        info = Gauge(f"{p}model_info", "Served model (value 1)", ["model_name", "draft_positions"], registry=r)
        info.labels(model_name, str(num_positions)).set(1)
        self.http_requests = Counter(f"{p}http_requests", "HTTP responses on /v1 routes", ["route", "status"],
                                     registry=r)
        self.request_finished = Counter(f"{p}request_success", "Finished generation requests", ["finished_reason"],
                                        registry=r)
        for reason in FINISH_REASONS:
            self.request_finished.labels(reason)
        self.prompt_tokens = Counter(f"{p}prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter(f"{p}generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram(f"{p}time_to_first_token_seconds", "Time from request arrival to its first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{p}inter_token_latency_seconds",
                             "Latency per output token after the first (a block's gap is split over its tokens)",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{p}e2e_request_latency_seconds", "Request latency from arrival to its last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.num_drafts = Counter(f"{p}spec_decode_num_drafts", "Verification steps with a draft", registry=r)
        self.num_draft_tokens = Counter(f"{p}spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.num_accepted = Counter(f"{p}spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_per_pos = Counter(f"{p}spec_decode_num_accepted_tokens_per_pos",
                                        "Steps whose draft at this position was accepted", ["position"], registry=r)
        self.mean_acceptance = Gauge(f"{p}spec_decode_mean_acceptance_length",
                                     "Mean acceptance length tau = 1 + accepted / drafts (1 before any draft)",
                                     registry=r)
        self.acceptance_rate_per_pos = Gauge(f"{p}spec_decode_acceptance_rate_per_pos",
                                             "Fraction of drafts whose token at this position was accepted",
                                             ["position"], registry=r)
        self.mean_acceptance.set(1.0)
        for i in range(num_positions):
            self.accepted_per_pos.labels(str(i))
            self.acceptance_rate_per_pos.labels(str(i)).set(0.0)
        self._lock = threading.Lock()
        self._drafts, self._accepted, self._per_pos = 0, 0, [0] * num_positions

    # ---- per-request updates (event-loop thread) ----------------------------------------------
    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_tokens(self, count: int, gap_s: float | None) -> None:
        """`count` new tokens arrived `gap_s` after the previous ones (None for the first batch)."""
        self.generation_tokens.inc(count)
        if gap_s is not None and count > 0:
            per_token = gap_s / count
            for _ in range(count):
                self.itl.observe(per_token)

    def on_finished(self, result: GenerationResult | None, reason: str, e2e_s: float | None) -> None:
        self.request_finished.labels(reason).inc()
        if e2e_s is not None:
            self.e2e.observe(e2e_s)
        if result is None:
            return
        steps = [s for s in result.steps if s.draft_tokens > 0]
        if not steps:
            return
        drafts, drafted = len(steps), sum(s.draft_tokens for s in steps)
        accepted = sum(s.accepted for s in steps)
        self.num_drafts.inc(drafts)
        self.num_draft_tokens.inc(drafted)
        self.num_accepted.inc(accepted)
        with self._lock:
            self._drafts += drafts
            self._accepted += accepted
            for i in range(self.num_positions):
                hits = sum(s.accepted > i for s in steps)
                self._per_pos[i] += hits
                if hits:
                    self.accepted_per_pos.labels(str(i)).inc(hits)
                self.acceptance_rate_per_pos.labels(str(i)).set(self._per_pos[i] / self._drafts)
            self.mean_acceptance.set(1.0 + self._accepted / self._drafts)

    def render(self) -> bytes:
        return generate_latest(self.registry)
