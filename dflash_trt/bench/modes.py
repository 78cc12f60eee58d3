"""Decoding modes the bench measures side by side on one target, one prompt at a time (greedy).

The engine of the chosen backend (runtime/factory.py; torch by default): `dflash` and `ar` (the
same engine with the drafter off).
Peers on the same target weights, each only where installed: `hf-generate` (transformers'
`generate`, greedy autoregressive), `hf-prompt-lookup` (transformers' prompt-lookup decoding,
`prompt_lookup_num_tokens`), and `dflash-reference` (the upstream `dflash` package's
`spec_generate` with our drafter directory, loaded by its own `from_pretrained`).

Every mode returns a `ModeOutput`: the generated token ids, wall time, time to first token and,
where the mode exposes them, the number of target forwards after prefill (`steps`) and the drafts
accepted per step. For the peers, steps and TTFT come from a forward hook on the HF target (the
first forward is the prefill), so they need no cooperation from the peer's code.
A mode that cannot run here raises `ModeUnavailable` with the reason; the runner logs it and
records it in the report. `register_mode` adds a mode (tests add deliberately broken ones).
"""
from __future__ import annotations

import importlib.util
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from dflash_trt.errors import DFlashError, InputError
from dflash_trt.engine import NGRAM_MAX_MATCH, EngineConfig, SamplingParams
from dflash_trt.models.cpu_linear import any_packed, prepack

log = logging.getLogger(__name__)

REFERENCE_PIP = "pip install --no-deps dflash==0.1.0"
ENGINE_MODES = ("dflash", "dflash-full", "dflash-full-vocab", "ar")
PEER_MODES = ("hf-generate", "hf-prompt-lookup", "dflash-reference")


class ModeUnavailable(DFlashError):
    """A mode cannot run in this environment (package missing, no drafter); it is skipped."""


@dataclass(frozen=True)
class ModeOutput:
    tokens: list[int]  # generated ids (prompt excluded), stop token included when hit
    time_s: float  # wall time of the whole generation, prefill included
    ttft_s: float | None  # time to the first generated token
    steps: int | None  # target forwards after prefill (verification or decode steps)
    accepted: list[int] | None = None  # drafts accepted at each step (engine DFlash only)
    draft_tokens: int = 0  # drafts a step may verify (block_size - 1; 0 for autoregressive)
    verified: list[int] | None = None  # drafts actually verified at each step (engine DFlash only)
    lookup_steps: int | None = None  # steps whose drafts came from n-gram lookup (engine DFlash only)


@dataclass
class ModeContext:
    """What every mode may use: the loaded models, the engine settings, the checkpoint paths."""

    models: object  # a loaded backend (runtime/factory.py): .engine(config), .info, .load, .tokenizer
    engine_config: EngineConfig  # max_batch_size is overridden to 1 for the per-prompt runs
    target_dir: Path
    drafter_dir: Path | None
    dtype: torch.dtype
    block_size: int  # the DFlash block size in use (the drafter's unless overridden)
    prompt_lookup_tokens: int
    _hf: object | None = field(default=None, repr=False)

    @property
    def eos_ids(self) -> list[int]:
        return list(self.models.info.eos_token_ids)

    def hf_target(self):
        """The target as a plain transformers model (loaded once, shared by the peers)."""
        if self._hf is None:
            from transformers import AutoModelForCausalLM

            self._hf = AutoModelForCausalLM.from_pretrained(
                str(self.target_dir), dtype=self.dtype, local_files_only=True).eval()
            if any_packed(getattr(self.models, "target", None)):
                prepack(self._hf)  # the engine's linears run prepacked (--cpu-kernels): the peers' do too
        return self._hf


class BenchMode(ABC):
    name: str

    @abstractmethod
    def run(self, prompt: list[int], max_new_tokens: int) -> ModeOutput:
        """Greedy-decode `prompt` for at most `max_new_tokens` tokens (stops at EOS)."""


def _setting_text(mode: str, name: str) -> str | None:
    """The text after '@' of a mode named `name@VALUE`; None for any other name."""
    head, sep, value = mode.partition("@")
    return value if head == name and sep else None


def confidence_of(mode: str) -> float | None:
    """The threshold of a `dflash@C` mode (DFlash with draft_confidence C: one point of a threshold
    sweep, e.g. `--modes dflash@0,dflash@0.1,dflash@0.2,ar`); None for any other name."""
    value = _setting_text(mode, "dflash")
    if value is None:
        return None
    try:
        confidence = float(value)
    except ValueError as exc:
        raise InputError(f"mode '{mode}': dflash@C takes a number C in [0, 1)") from exc
    if not 0.0 <= confidence < 1.0:
        raise InputError(f"mode '{mode}': dflash@C takes C in [0, 1), got {confidence}")
    return confidence


def ngram_of(mode: str) -> int | None:
    """The minimum match of a `dflash-ngram@N` mode (DFlash with n-gram lookup drafts where the text
    repeats at least N tokens, speculative/ngram.py); None for any other name."""
    value = _setting_text(mode, "dflash-ngram")
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError as exc:
        raise InputError(f"mode '{mode}': dflash-ngram@N takes an integer N (the shortest repeat to look up)") from exc
    if not 1 <= n <= NGRAM_MAX_MATCH:
        raise InputError(f"mode '{mode}': dflash-ngram@N takes N in [1, {NGRAM_MAX_MATCH}], got {n}")
    return n


def parametric(mode: str) -> bool:
    """A `dflash@C` or `dflash-ngram@N` mode: an engine mode with one setting in its name."""
    return confidence_of(mode) is not None or ngram_of(mode) is not None


def mode_engine_config(base: EngineConfig, mode: str, max_batch_size: int) -> EngineConfig:
    """The engine settings of an engine mode: `dflash` as configured (draft truncation and schedule
    included), `dflash-full` always verifying the whole block, `dflash-full-vocab` as configured but
    drafting over the whole vocabulary (no draft vocabulary), `dflash@C` truncating drafts at
    confidence C, `dflash-ngram@N` with n-gram lookup drafts on repeats of >= N tokens, `ar` without
    the drafter."""
    confidence, ngram = confidence_of(mode), ngram_of(mode)
    if mode not in ENGINE_MODES and confidence is None and ngram is None:
        raise InputError(f"'{mode}' is not an engine mode ({', '.join(ENGINE_MODES)}, dflash@C, dflash-ngram@N)")
    cfg = replace(base, speculative=mode != "ar", max_batch_size=max_batch_size)
    if mode == "dflash-full":
        cfg = replace(cfg, draft_confidence=0.0, draft_len_schedule=None)
    if mode == "dflash-full-vocab":
        cfg = replace(cfg, draft_vocab=False)
    if confidence is not None:
        cfg = replace(cfg, draft_confidence=confidence)
    if ngram is not None:
        cfg = replace(cfg, ngram_lookup=ngram)
    return cfg


class EngineMode(BenchMode):
    """DFlash (as configured, or verifying full blocks) or autoregressive decoding on the backend's
    engine, batch 1."""

    def __init__(self, name: str, ctx: ModeContext, kind: str | None = None) -> None:
        kind = kind or name  # which engine mode a registered mode of another name runs
        if kind != "ar" and ctx.models.load.drafter is None:
            raise ModeUnavailable("no drafter loaded (pass --drafter, or use the shipped one)")
        self.name = name
        self.engine = ctx.models.engine(mode_engine_config(ctx.engine_config, kind, 1))

    def run(self, prompt: list[int], max_new_tokens: int) -> ModeOutput:
        t0 = time.perf_counter()
        result = self.engine.generate([prompt], SamplingParams(max_new_tokens=max_new_tokens))[0]
        elapsed = time.perf_counter() - t0
        speculative = self.engine.speculative
        return ModeOutput(tokens=list(result.tokens), time_s=elapsed, ttft_s=result.time_to_first_token_s,
                          steps=len(result.steps), accepted=[s.accepted for s in result.steps] if speculative else None,
                          draft_tokens=self.engine.block_size - 1,
                          verified=[s.draft_tokens for s in result.steps] if speculative else None,
                          lookup_steps=sum(s.lookup for s in result.steps) if speculative else None)


class _ForwardClock:
    """Counts a HF model's forward calls and stamps the end of the first (the prefill)."""

    def __init__(self, model) -> None:
        self.calls, self.first_end = 0, None
        self._handle = model.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        self.calls += 1
        if self.first_end is None:
            self.first_end = time.perf_counter()

    def close(self) -> None:
        self._handle.remove()


class HFMode(BenchMode):
    """A peer that decodes through the transformers model of the target."""

    def __init__(self, name: str, ctx: ModeContext) -> None:
        self.name, self.ctx = name, ctx
        self.model = ctx.hf_target()

    def _decode(self, ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:  # [1, P] -> [1, P + n]
        raise NotImplementedError

    @torch.inference_mode()
    def run(self, prompt: list[int], max_new_tokens: int) -> ModeOutput:
        ids = torch.tensor([prompt], dtype=torch.long)
        clock = _ForwardClock(self.model)
        try:
            t0 = time.perf_counter()
            out = self._decode(ids, max_new_tokens)
            elapsed = time.perf_counter() - t0
        finally:
            clock.close()
        tokens = out[0, len(prompt):].tolist()
        ttft = None if clock.first_end is None else clock.first_end - t0
        return ModeOutput(tokens=tokens, time_s=elapsed, ttft_s=ttft, steps=max(clock.calls - 1, 0),
                          draft_tokens=self._drafts())

    def _drafts(self) -> int:
        return 0

    def _generation_config(self, max_new_tokens: int, **extra):
        from transformers import GenerationConfig

        eos = self.ctx.eos_ids
        return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                                pad_token_id=eos[0] if eos else 0, **extra)


class HFGenerateMode(HFMode):
    def _decode(self, ids, max_new_tokens):
        return self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                   generation_config=self._generation_config(max_new_tokens))


class HFPromptLookupMode(HFMode):
    def _decode(self, ids, max_new_tokens):
        cfg = self._generation_config(max_new_tokens, prompt_lookup_num_tokens=self.ctx.prompt_lookup_tokens)
        return self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)

    def _drafts(self) -> int:
        return self.ctx.prompt_lookup_tokens


class _CacheKeyword:
    """The target as the reference package calls it, with its KV cache passed the way transformers
    5.24 takes it: `cache=` (the reference passes `past_key_values=`, deprecated there with a
    FutureWarning on every bench run). Everything else is the wrapped model's."""

    def __init__(self, model) -> None:
        self._model = model

    def __call__(self, *args, past_key_values=None, **kwargs):
        return self._model(*args, cache=past_key_values, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._model, name)


class ReferenceDFlashMode(HFMode):
    """The upstream reference implementation (`dflash` on PyPI) with our drafter weights."""

    def __init__(self, name: str, ctx: ModeContext) -> None:
        if importlib.util.find_spec("dflash") is None:
            raise ModeUnavailable(f"the reference `dflash` package is not installed (`{REFERENCE_PIP}`)")
        if ctx.drafter_dir is None:
            raise ModeUnavailable("no drafter directory to load into the reference implementation")
        super().__init__(name, ctx)
        from dflash.model import DFlashDraftModel

        self.drafter = DFlashDraftModel.from_pretrained(str(ctx.drafter_dir), dtype=ctx.dtype).eval()
        if self.drafter.block_size != ctx.block_size:
            log.info("dflash-reference: block size %d -> %d (--block-size)", self.drafter.block_size, ctx.block_size)
            self.drafter.block_size = ctx.block_size

    def _decode(self, ids, max_new_tokens):
        return self.drafter.spec_generate(_CacheKeyword(self.model), ids, max_new_tokens, self.ctx.eos_ids)

    def _drafts(self) -> int:
        return self.ctx.block_size - 1


ModeFactory = Callable[[str, ModeContext], BenchMode]

MODES: dict[str, ModeFactory] = {
    "dflash": EngineMode,
    "dflash-full": EngineMode,
    "dflash-full-vocab": EngineMode,
    "ar": EngineMode,
    "hf-generate": HFGenerateMode,
    "hf-prompt-lookup": HFPromptLookupMode,
    "dflash-reference": ReferenceDFlashMode,
}


def register_mode(name: str, factory: ModeFactory) -> None:
    """Add a mode under `name` (extensions and tests); an existing name is an error."""
    if name in MODES:
        raise InputError(f"mode '{name}' is already registered")
    MODES[name] = factory


def unregister_mode(name: str) -> None:
    if name in ENGINE_MODES + PEER_MODES:
        raise InputError(f"mode '{name}' is built in and cannot be removed")
    MODES.pop(name, None)


def parse_modes(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise InputError("--modes is empty: name at least one of " + ", ".join(MODES))
    unknown = [m for m in names if m not in MODES and not parametric(m)]
    if unknown:
        raise InputError(f"unknown modes {unknown}; choose from {', '.join(MODES)}, dflash@C (C in [0, 1)), "
                         f"dflash-ngram@N (N in [1, {NGRAM_MAX_MATCH}])")
    if len(set(names)) != len(names):
        raise InputError(f"--modes names a mode twice: {names}")
    return names


def build_modes(names: list[str], ctx: ModeContext) -> tuple[list[BenchMode], dict[str, str]]:
    """Instantiate the requested modes; those that cannot run here are skipped with a reason."""
    modes, skipped = [], {}
    for name in names:
        try:
            factory = EngineMode if parametric(name) else MODES[name]
            modes.append(factory(name, ctx))
        except ModeUnavailable as exc:
            log.warning("bench: skipping mode %s: %s", name, exc)
            skipped[name] = str(exc)
    return modes, skipped
