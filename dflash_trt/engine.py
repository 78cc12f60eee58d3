"""THE seam between the decode loop and everything that uses it (floor 0: imports config and errors only).

Two backends implement `Engine`: the torch engine (speculative/decoder.py, this project's own loop,
the numerical oracle) and the TensorRT-LLM adapter (runtime/trtllm.py). `runtime/factory.py` picks
and loads one; the server, the Triton model, the bench and training talk to an `Engine` and never
to a loop directly. The torch loop in turn reads its target through `Target` (native or HF target,
or a tensor-parallel shard of one).

What crosses the seam:
- requests: `SamplingParams` per request, `EngineConfig` per engine;
- per-request state: `Sequence` (made by `Engine.make_sequence`, advanced by `add` / `step`);
- results: `StepOutput` (tokens one call emitted for one sequence), `StepStat` (drafted vs accepted
  per verification step) and `GenerationResult` (a finished request);
- `check_request`, the request validation both engines apply, and `run_to_completion`, the one
  "generate these prompts" loop over any engine.
Glossary (DFlash paper, arXiv 2602.06036): block_size T slots per step, K = T - 1 drafts; a step
commits accepted + 1 tokens; tau = mean of (accepted + 1) over steps.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Literal, Protocol, Sequence as Seq, runtime_checkable

from dflash_trt.config import TargetInfo, check_block_size
from dflash_trt.errors import ConfigError, ContextLengthError, InputError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ACCEPTANCE_MODES = ("exact", "rejection")
# The default max_seq_len is the target's context, capped so that the target's dense KV cache for
# max_batch_size rows fits this budget (TensorRT-LLM likewise lowers max_seq_len to what its KV cache
# holds); an explicit max_seq_len is taken as given, up to the target's context.
KV_CACHE_BUDGET_BYTES = 1 << 30
MAX_SEQ_LEN_STEP = 256  # a capped default is a multiple of this, and at least this (or the context)
FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    max_new_tokens: int | None = None  # None = until EOS or the context is full
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings (need a tokenizer)
    ignore_eos: bool = False
    extra: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InputError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise InputError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.max_new_tokens is not None and (
            not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1
        ):
            raise InputError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise InputError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InputError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InputError(f"stop strings must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# the default draft_confidence of an engine on a CPU (EngineConfig.on_device): the threshold that measured
# fastest on the embedded default's full HumanEval and MT-Bench sets (MODEL_CARD.md, docs/bench/)
CPU_DRAFT_CONFIDENCE = 0.1  # 0.05 until session 36
NGRAM_MAX_MATCH = 8  # n-gram lookup counts match lengths up to this many tokens (speculative/ngram.py)


@dataclass(frozen=True)
class EngineConfig:
    """One engine's limits and mode (both backends read the same fields)."""

    block_size: int | None = None  # None = the drafter's; 1 or speculative=False = autoregressive
    max_batch_size: int = 8
    max_seq_len: int | None = None  # prompt + generated tokens per sequence; None = default_max_seq_len
    speculative: bool = True  # False: plain autoregressive decoding on the same engine
    acceptance: str = "exact"  # "exact" (one-hot q) or "rejection" (drafter's soft q)
    # verify only the drafts the drafter is confident in (speculative/draft_len.py); 0 = the whole block;
    # None = by device (EngineConfig.on_device): CPU_DRAFT_CONFIDENCE on a CPU, the whole block elsewhere
    draft_confidence: float | None = None
    # ((batch-size threshold, drafts per row), ...) as TensorRT-LLM's draft_len_schedule; None = always block - 1
    draft_len_schedule: tuple[tuple[int, int], ...] | None = None
    # draft over the drafter's draft vocabulary (draft_vocab.json, models/drafter.py) when it ships one;
    # False = the whole vocabulary. Verification is the same either way, so output is too.
    draft_vocab: bool = True
    # n-gram lookup drafts (speculative/ngram.py): a row whose history ends with a match of at least this
    # many tokens verifies the lookup's continuation instead of the drafter's block; 0 = off
    ngram_lookup: int = 0

    def __post_init__(self) -> None:
        if self.block_size is not None and not 1 <= self.block_size <= 64:
            raise ConfigError(f"block_size must be in [1, 64], got {self.block_size}")
        if self.max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ConfigError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.acceptance not in ACCEPTANCE_MODES:
            raise ConfigError(f"acceptance must be one of {ACCEPTANCE_MODES}, got '{self.acceptance}'")
        if self.draft_confidence is not None and not 0.0 <= self.draft_confidence < 1.0:
            raise ConfigError(f"draft_confidence must be in [0, 1), got {self.draft_confidence}")
        if not 0 <= self.ngram_lookup <= NGRAM_MAX_MATCH:
            raise ConfigError(f"ngram_lookup must be in [0, {NGRAM_MAX_MATCH}] (0 = off), got {self.ngram_lookup}")

    def on_device(self, device_type: str) -> "EngineConfig":
        """This config with the device-dependent defaults filled in: draft_confidence None becomes
        CPU_DRAFT_CONFIDENCE on a CPU, where a K-token verify costs well over a 1-token step so drafts
        likely to be rejected are not worth verifying, and 0 (the whole block) on a GPU, where a block
        verifies at about the cost of one token. An explicit value is kept."""
        if self.draft_confidence is not None:
            return self
        return replace(self, draft_confidence=CPU_DRAFT_CONFIDENCE if device_type == "cpu" else 0.0)

    def for_models(self, info: TargetInfo, drafter_block_size: int | None, kv_itemsize: int) -> "EngineConfig":
        """This config checked against the loaded models, with max_seq_len filled in (the rules every
        backend applies before it builds an engine): an explicit max_seq_len must fit the target's
        context, and a block size may not exceed the drafter's trained block (check_block_size).
        `kv_itemsize`: bytes per KV-cache element (the default max_seq_len's memory budget)."""
        if self.speculative and drafter_block_size is not None and self.block_size is not None:
            check_block_size(self.block_size, drafter_block_size, "in use")
        context = info.max_position_embeddings
        if self.max_seq_len is None:
            seq_len = default_max_seq_len(info, self.max_batch_size, kv_itemsize)
            log.info("max_seq_len %d (the target's context is %d positions%s)", seq_len, context,
                     "" if seq_len == context else f"; capped so {self.max_batch_size} rows of KV cache fit "
                     f"{KV_CACHE_BUDGET_BYTES >> 20} MiB: set max_seq_len for more")
            return replace(self, max_seq_len=seq_len)
        if self.max_seq_len > context:
            raise ConfigError(f"max_seq_len {self.max_seq_len} exceeds the target's context ({context} positions): "
                              f"set --max-seq-len (max_seq_len) to at most {context}, or leave it unset for the "
                              "target's own context")
        return self


def default_max_seq_len(info: TargetInfo, max_batch_size: int, kv_itemsize: int) -> int:
    """The target's context, capped so that a dense KV cache of `max_batch_size` rows stays within
    KV_CACHE_BUDGET_BYTES (a capped value is a multiple of MAX_SEQ_LEN_STEP and at least one step)."""
    fit = KV_CACHE_BUDGET_BYTES // (max_batch_size * info.kv_bytes_per_position(kv_itemsize))
    return min(info.max_position_embeddings, max(fit // MAX_SEQ_LEN_STEP * MAX_SEQ_LEN_STEP, MAX_SEQ_LEN_STEP))


@dataclass(frozen=True)
class StepStat:
    draft_tokens: int  # drafts verified this step (<= block_size - 1; 0 when autoregressive or none kept)
    accepted: int  # drafts accepted (0..draft_tokens); the step commits accepted + 1 tokens
    lookup: bool = False  # the drafts came from n-gram lookup (EngineConfig.ngram_lookup), not the drafter


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    prompt_tokens: int
    tokens: list[int]
    finish_reason: str  # FinishReason
    steps: tuple[StepStat, ...]
    time_to_first_token_s: float
    total_s: float

    @property
    def mean_acceptance_length(self) -> float:
        """tau: tokens committed per target verification step (accepted drafts + bonus)."""
        if not self.steps:
            return 1.0
        return sum(s.accepted + 1 for s in self.steps) / len(self.steps)

    def per_position_acceptance(self, draft_tokens: int) -> list[float]:
        """Fraction of steps whose draft i (0-based) was accepted, for i < draft_tokens."""
        if not self.steps:
            return [0.0] * draft_tokens
        return [sum(s.accepted > i for s in self.steps) / len(self.steps) for i in range(draft_tokens)]

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.total_s if self.total_s > 0 else 0.0


@dataclass
class Sequence:
    """Mutable per-request decode state. The fields after `max_new_tokens` up to `ctx_pos` are the
    torch engine's bookkeeping (cache row, positions, drafter context); other engines leave them."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    max_new_tokens: int
    generator: "torch.Generator | None" = None  # the request's own sampling stream (torch engine)
    row: int = -1  # cache row while active
    start: int = 0  # position of `pending` == committed target cache length
    pending: int = -1  # last emitted token, not yet in the target cache (block slot 0)
    ctx_hidden: "torch.Tensor | None" = None  # [n, n_layers_tapped * H] drafter context not yet cached
    ctx_pos: int = 0  # position of ctx_hidden[0] == drafter cache length
    tokens: list[int] = field(default_factory=list)  # emitted tokens
    steps: list[StepStat] = field(default_factory=list)
    finish_reason: str | None = None  # FinishReason once finished
    created_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    finished_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def result(self) -> GenerationResult:
        """The finished request's result (timings relative to its creation)."""
        assert self.finished and self.first_token_s is not None and self.finished_s is not None
        return GenerationResult(
            request_id=self.request_id, prompt_tokens=len(self.prompt), tokens=list(self.tokens),
            finish_reason=self.finish_reason, steps=tuple(self.steps),
            time_to_first_token_s=self.first_token_s - self.created_s, total_s=self.finished_s - self.created_s,
        )


@dataclass(frozen=True)
class StepOutput:
    sequence: Sequence
    new_tokens: list[int]


@dataclass(frozen=True)
class TargetOutput:
    logits: "torch.Tensor"  # [B, K, vocab] at the requested positions
    target_hidden: "torch.Tensor | None"  # [B, T, n_layers_tapped * hidden]: outputs of layers target_layer_ids


class Cache(Protocol):
    """A KV cache over `rows` sequences that the loop grows and crops (models/kv_cache.py)."""

    dead_slot: int

    def add_rows(self, count: int) -> range: ...
    def remove_row(self, row: int) -> int | None: ...
    def crop(self, lengths: "torch.Tensor", rows: slice | None = None) -> None: ...


@runtime_checkable
class Target(Protocol):
    """What a target model offers the torch decode loop."""

    @property
    def info(self) -> TargetInfo: ...

    @property
    def device(self) -> "torch.device": ...

    def new_cache(self, max_rows: int, capacity: int) -> Cache: ...

    def forward(self, cache: Cache, rows: slice, input_ids: "torch.Tensor", positions: "torch.Tensor",
                target_layer_ids: tuple[int, ...] = (), logit_index: "torch.Tensor | None" = None) -> TargetOutput:
        """input_ids, positions: [B, T]; logit_index: [B, K] or None (all T)."""

    def embed(self, ids: "torch.Tensor") -> "torch.Tensor":  # [B, T] -> [B, T, H]
        ...

    def head(self, hidden: "torch.Tensor") -> "torch.Tensor":  # [B, T, H] -> [B, T, vocab]
        ...

    def head_weight(self) -> "torch.Tensor | None":
        """The lm_head as one bias-free [vocab, H] matrix on this process, or None where the head is
        not one (vocab-parallel under TP): draft vocabularies need its rows."""
        ...


@runtime_checkable
class Engine(Protocol):
    """What an engine offers its users (scheduler, servers, bench, training)."""

    config: EngineConfig
    block_size: int  # tokens per verification block (1: autoregressive)
    speculative: bool  # a drafter proposes block_size - 1 tokens per step
    active: list[Sequence]

    @property
    def free_rows(self) -> int: ...

    def make_sequence(self, prompt: Seq[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        """Validate a request (check_request) and resolve its limits; does not schedule it."""

    def add(self, seqs: list[Sequence]) -> list[StepOutput]:
        """Start sequences (prefill); each emits its first token."""

    def step(self) -> list[StepOutput]:
        """One decode step for every active sequence."""

    def cancel(self, s: Sequence) -> None:
        """Stop a sequence now and free what it holds."""

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams] = SamplingParams(),
                 progress: Callable[[int], None] | None = None) -> list[GenerationResult]:
        """Run prompts to completion (run_to_completion)."""

    def shutdown(self) -> None: ...


def check_request(prompt: Seq[int], params: SamplingParams, vocab_size: int, max_seq_len: int,
                  can_detokenize: bool) -> tuple[list[int], int]:
    """The request rules both engines apply: returns (prompt ids, max_new_tokens resolved against
    the context). Raises InputError / ContextLengthError with what to change."""
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise InputError("the prompt is empty: give at least one token")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise InputError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if params.stop and not can_detokenize:
        raise InputError("stop strings need a tokenizer; this engine has none (use stop_token_ids)")
    room = max_seq_len - len(prompt)
    if room < 1:
        raise ContextLengthError(
            f"the prompt has {len(prompt)} tokens; the context holds {max_seq_len} "
            "(prompt + generated): shorten the prompt or raise max_seq_len"
        )
    if params.max_new_tokens is not None and params.max_new_tokens > room:
        raise ContextLengthError(
            f"prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
            f"context of {max_seq_len} tokens: lower max_new_tokens to at most {room}"
        )
    return prompt, params.max_new_tokens or room


def stamp_finished(active: list[Sequence]) -> list[Sequence]:
    """The finished sequences among `active`, with their finish time set (engines retire these)."""
    now = time.perf_counter()
    done = [s for s in active if s.finished]
    for s in done:
        s.finished_s = now
    return done


def run_to_completion(engine: Engine, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams],
                      progress: Callable[[int], None] | None = None) -> list[GenerationResult]:
    """Admit prompts as rows free up and step until all are done; results in prompt order.
    `progress(n)` is called after each step with the tokens that step emitted."""
    plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(plist) != len(prompts):
        raise InputError(f"{len(prompts)} prompts but {len(plist)} sampling params")
    waiting = [engine.make_sequence(p, sp) for p, sp in zip(prompts, plist)]
    everything = list(waiting)
    while waiting or engine.active:
        if waiting and engine.free_rows:
            batch, waiting = waiting[: engine.free_rows], waiting[engine.free_rows:]
            engine.add(batch)
        else:
            outs = engine.step()
            if progress is not None:
                progress(sum(len(o.new_tokens) for o in outs))
    return [s.result() for s in everything]


__all__ = ["ACCEPTANCE_MODES", "Cache", "Engine", "EngineConfig", "FinishReason", "GenerationResult", "Sequence",
           "SamplingParams", "StepOutput", "StepStat", "Target", "TargetOutput", "check_request", "run_to_completion",
           "stamp_finished"]
