"""Where the Triton model's tokens come from: our runtime (torch) or TensorRT-LLM's LLM API.

Both give the same small interface to the Triton glue in model.py:
`submit(prompt, params, request_id) -> Job`, `Job.next_event(timeout)` returning Chunk / Done /
Failed (or None on timeout), `Job.cancel()`, `detokenize(ids)`, `shutdown()`.

- TorchSource: load_models + one DFlashEngine + the continuous-batching Scheduler, so requests
  from every Triton client share decode steps. Runs on CPU here and is what the tests exercise.
- TrtllmSource: `tensorrt_llm.LLM` with `speculative_config: {decoding_type: DFlash, ...}` and
  `generate_async(streaming=True)`. tensorrt_llm is imported lazily; it cannot be installed on
  the CPU machines this project is developed on, so this path has never been executed here.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.config import DrafterConfig
from dflash_trt.errors import BackendUnavailableError, ConfigError
from dflash_trt.runtime.loader import load_models, load_tokenizer
from dflash_trt.runtime.scheduler import ErrorEvent, FinalEvent, RequestHandle, Scheduler, TokenEvent
from dflash_trt.serve.triton.protocol import FinalStats
from dflash_trt.serve.triton.settings import TritonModelSpec
from dflash_trt.speculative.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Chunk:
    tokens: list[int]  # tokens emitted by one decode step


@dataclass(frozen=True)
class Done:
    stats: FinalStats


@dataclass(frozen=True)
class Failed:
    message: str


Event = Chunk | Done | Failed


def _encode(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        from dflash_trt.models.smollm2 import chat_prompt_ids

        return chat_prompt_ids(tokenizer, prompt)
    return list(tokenizer.encode(prompt))


def open_source(spec: TritonModelSpec):
    """The token source the spec asks for (TensorRT-LLM only when backend is trtllm)."""
    return TrtllmSource(spec) if spec.backend == "trtllm" else TorchSource(spec)


# ---- torch: our engine + scheduler ------------------------------------------------------------
class TorchJob:
    def __init__(self, handle: RequestHandle) -> None:
        self.handle = handle

    def next_event(self, timeout: float) -> Event | None:
        try:
            event = self.handle.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(event, TokenEvent):
            return Chunk(list(event.tokens))
        if isinstance(event, FinalEvent):
            steps = event.result.steps
            return Done(FinalStats(finish_reason=event.result.finish_reason,
                                   total_draft_tokens=sum(s.draft_tokens for s in steps),
                                   total_accepted_draft_tokens=sum(s.accepted for s in steps)))
        assert isinstance(event, ErrorEvent), f"unexpected scheduler event {event!r}"
        return Failed(event.message)

    def cancel(self) -> None:
        self.handle.cancel()


class TorchSource:
    def __init__(self, spec: TritonModelSpec) -> None:
        self.spec = spec
        if spec.torch_threads is not None:
            import torch

            torch.set_num_threads(spec.torch_threads)
        models = load_models(spec.model_spec())
        if models.tokenizer is None:
            raise ConfigError(f"target {spec.target} has no tokenizer: the Triton model takes text")
        self.tokenizer = models.tokenizer
        self.detokenize = models.detokenize
        self.engine = models.engine(spec.engine_config())
        self.scheduler = Scheduler(self.engine, spec.scheduler_config()).start()
        log.info("torch source ready: block %d, batch %d", self.engine.block_size, spec.engine.max_batch_size)

    def submit(self, prompt: str, params: SamplingParams, request_id: str | None) -> TorchJob:
        ids = _encode(self.tokenizer, prompt, self.spec.chat)
        return TorchJob(self.scheduler.submit(ids, params, request_id))  # InputError / QueueFullError

    def shutdown(self) -> None:
        self.scheduler.shutdown()


# ---- trtllm: TensorRT-LLM's LLM API with DFlash (GPU machines; not executed here) ---------------
class QueueJob:
    def __init__(self) -> None:
        self.events: "queue.Queue[Event]" = queue.Queue()
        self.abort = None  # set to the request's abort callable once it runs

    def next_event(self, timeout: float) -> Event | None:
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None

    def cancel(self) -> None:
        if self.abort is not None:
            self.abort()


class TrtllmSource:
    def __init__(self, spec: TritonModelSpec) -> None:
        try:
            from tensorrt_llm import LLM
            from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_dict
        except ImportError as exc:
            raise BackendUnavailableError(
                f"backend 'trtllm' needs tensorrt_llm ({exc}); run on a TensorRT-LLM machine "
                "(NGC tensorrt-llm container) or write the repository with --backend torch") from exc
        self.spec = spec
        self.tokenizer = load_tokenizer(Path(spec.target))
        args: dict = {"model": spec.target, "backend": "pytorch", "max_batch_size": spec.engine.max_batch_size,
                      "max_seq_len": spec.engine.max_seq_len}
        extra = dict(spec.trtllm_llm_args)
        if spec.engine.spec and spec.drafter is not None:
            block = spec.engine.block_size or DrafterConfig.load(Path(spec.drafter)).block_size
            extra.setdefault("speculative_config", {"decoding_type": "DFlash", "max_draft_len": block - 1,
                                                    "speculative_model": spec.drafter})
        self.llm = LLM(**update_llm_args_with_extra_dict(args, extra))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="dflash-trtllm", daemon=True)
        self.thread.start()
        log.info("trtllm source ready: %s", extra.get("speculative_config"))

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def submit(self, prompt: str, params: SamplingParams, request_id: str | None) -> QueueJob:
        job = QueueJob()
        ids = _encode(self.tokenizer, prompt, self.spec.chat)
        asyncio.run_coroutine_threadsafe(self._run(ids, params, job), self.loop)
        return job

    async def _run(self, ids: list[int], params: SamplingParams, job: QueueJob) -> None:
        from tensorrt_llm import SamplingParams as TrtSamplingParams

        sp = TrtSamplingParams(max_tokens=params.max_new_tokens, temperature=params.temperature, top_k=params.top_k or None,
                               top_p=params.top_p, seed=params.seed, stop=list(params.stop) or None,
                               return_perf_metrics=True)
        try:
            stream = self.llm.generate_async(ids, sp, streaming=True)
            job.abort = stream.abort
            seen, last = 0, None
            async for out in stream:
                last = out.outputs[0]
                job.events.put(Chunk(list(last.token_ids[seen:])))
                seen = len(last.token_ids)
            metrics = last.request_perf_metrics.speculative_decoding if last and last.request_perf_metrics else None
            job.events.put(Done(FinalStats(
                finish_reason=(last.finish_reason if last else None) or "stop",
                total_draft_tokens=int(metrics.total_draft_tokens) if metrics else 0,
                total_accepted_draft_tokens=int(metrics.total_accepted_draft_tokens) if metrics else 0)))
        except Exception as exc:  # noqa: BLE001 - one failed request must answer its client, not hang it
            log.exception("TensorRT-LLM request failed")
            job.events.put(Failed(f"TensorRT-LLM request failed: {exc}"))

    def shutdown(self) -> None:
        self.llm.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
