"""The Triton model's backend: the factory's engine (torch or trtllm) behind the continuous-batching
Scheduler, so requests from every Triton client share decode steps.

The Triton glue (model.py) submits text and reads the scheduler's own request events
(runtime/scheduler.py: TokenEvent, FinalEvent, ErrorEvent) from the returned RequestHandle; this
module only turns text into ids (prompts.encode_prompt, the encoder the CLI and the OpenAI server
use too) and the final result into the statistics TensorRT-LLM's Triton model reports.
"""
from __future__ import annotations

import logging

from dflash_trt.engine import GenerationResult, SamplingParams
from dflash_trt.errors import ConfigError
from dflash_trt.prompts import encode_prompt
from dflash_trt.runtime.factory import load_backend
from dflash_trt.runtime.scheduler import RequestHandle, Scheduler
from dflash_trt.serve.triton.protocol import FinalStats
from dflash_trt.serve.triton.settings import TritonSettings

log = logging.getLogger(__name__)


def final_stats(result: GenerationResult, stop_reason: str | None, times_ns: dict[str, int]) -> FinalStats:
    """finish_reason, stop_reason, the draft/accepted totals and the timings of a finished request."""
    return FinalStats(finish_reason=result.finish_reason, stop_reason=stop_reason,
                      total_draft_tokens=sum(s.draft_tokens for s in result.steps),
                      total_accepted_draft_tokens=sum(s.accepted for s in result.steps), **times_ns)


class ModelBackend:
    """One loaded backend + one engine + one Scheduler for the whole Triton model instance."""

    def __init__(self, settings: TritonSettings, mpi_session: object | None = None) -> None:
        self.settings = settings
        if settings.torch_threads is not None:
            import torch

            torch.set_num_threads(settings.torch_threads)
        self.models = load_backend(settings.backend, settings.load_config(), settings.trtllm_options(mpi_session))
        if self.models.tokenizer is None:
            raise ConfigError(f"target {settings.target} has no tokenizer: the Triton model takes text")
        self.engine = self.models.engine(settings.engine_config())
        self.scheduler = Scheduler(self.engine, settings.scheduler_config()).start()
        log.info("%s backend ready: block %d, batch %d", settings.backend, self.engine.block_size,
                 settings.engine.max_batch_size)

    def detokenize(self, ids: list[int]) -> str:
        return self.models.detokenize(ids)

    def encode(self, prompt: str) -> list[int]:
        return encode_prompt(self.models.tokenizer, prompt, chat=self.settings.chat)

    def submit(self, ids: list[int], params: SamplingParams, request_id: str | None) -> RequestHandle:
        return self.scheduler.submit(ids, params, request_id)  # InputError / QueueFullError

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.engine.shutdown()
