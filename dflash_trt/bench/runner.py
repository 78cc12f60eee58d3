"""The bench run: prompts -> interleaved batch-1 runs of every mode -> concurrency sweep -> report.

Batch 1, numbered:
  1. each mode runs one short warm-up generation (not recorded);
  2. for prompt i, the modes run in the canonical order rotated by i, so machine drift (other
     processes, thermal state) hits every mode alike;
  3. each mode's greedy output is compared with the reference mode's (`ar` when measured, else
     the first mode): a difference is an error naming the mode, the prompt and the first
     differing index, and the run exits non-zero.
Sweep: for `dflash` and `ar` at each concurrency c, an engine with max_batch_size=c and the
continuous-batching Scheduler (driven in this thread with `run_once`) keeps c requests in flight
(the prompts cycled to at least c requests) until all are done; every request's token stream is
timestamped, and its output is checked against the batch-1 reference too.
"""
from __future__ import annotations

import logging
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from pathlib import Path

import torch

from dflash_trt.bench.datasets import load_humaneval, load_jsonl, load_mtbench
from dflash_trt.prompts import Prompt, encode_prompt
from dflash_trt.bench.modes import BenchMode, ModeContext, build_modes, mode_engine_config
from dflash_trt.bench.report import (SCHEMA_VERSION, Record, RequestTiming, aggregates, first_difference,
                                     per_position, record_dicts, speed_ratios, sweep_point, tau_of)
from dflash_trt.errors import InputError
from dflash_trt.runtime.scheduler import ErrorEvent, FinalEvent, Scheduler, TokenEvent
from dflash_trt.engine import SamplingParams

log = logging.getLogger(__name__)

BUILTIN_DATASETS = ("humaneval", "mtbench")
SWEEP_MODES = ("dflash", "dflash-full", "ar")
WARMUP_TOKENS = 8
DEFAULT_SWEEP = (1, 2, 4, 8, 16)  # concurrency levels, capped at the prompt count (BenchConfig.sweep_levels)


@dataclass(frozen=True)
class BenchConfig:
    datasets: tuple[str, ...] = ("humaneval",)  # humaneval | mtbench | path to a .jsonl file
    limit: int | None = None  # prompts per dataset (spread over categories)
    modes: tuple[str, ...] = ("dflash", "ar", "hf-generate", "hf-prompt-lookup", "dflash-reference")
    concurrency: tuple[int, ...] | None = None  # () = no sweep; None = sweep_levels: DEFAULT_SWEEP up to the prompts
    max_new_tokens: int = 128
    warmup: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.datasets:
            raise InputError("name at least one --dataset")
        if self.limit is not None and self.limit < 1:
            raise InputError(f"--limit must be >= 1, got {self.limit}")
        if self.max_new_tokens < 1:
            raise InputError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.concurrency is not None and any(c < 1 for c in self.concurrency):
            raise InputError(f"--concurrency values must be >= 1, got {list(self.concurrency)}")

    def sweep_levels(self, prompts: int) -> tuple[int, ...]:
        """The sweep's concurrency levels: --concurrency as given, else DEFAULT_SWEEP up to the prompt
        count (more requests in flight than there are prompts would only repeat prompts)."""
        if self.concurrency is not None:
            return self.concurrency
        return tuple(c for c in DEFAULT_SWEEP if c <= max(prompts, 1))


@dataclass(frozen=True)
class BenchPrompt:
    dataset: str
    prompt: Prompt
    ids: list[int] = field(default_factory=list)


def _spread(prompts: list[Prompt], limit: int | None) -> list[Prompt]:
    """The first `limit` prompts taken round-robin over categories (all when limit is None)."""
    if limit is None or limit >= len(prompts):
        return prompts
    by_cat: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    out, depth = [], 0
    while len(out) < limit:
        for ps in by_cat.values():
            if depth < len(ps) and len(out) < limit:
                out.append(ps[depth])
        depth += 1
    return out


def load_prompts(datasets: tuple[str, ...], limit: int | None) -> list[BenchPrompt]:
    out = []
    for name in datasets:
        if name == "humaneval":
            prompts, label = load_humaneval(), name
        elif name == "mtbench":
            prompts, label = load_mtbench(), name
        elif name.endswith(".jsonl"):
            prompts, label = load_jsonl(Path(name)), Path(name).stem
        else:
            raise InputError(f"unknown dataset '{name}': use humaneval, mtbench or a path to a .jsonl file")
        out += [BenchPrompt(label, p) for p in _spread(prompts, limit)]
    return out


def tokenize(prompts: list[BenchPrompt], tokenizer) -> list[BenchPrompt]:
    """Code prompts are completed as raw text; chat prompts go through the chat template."""
    if tokenizer is None:
        raise InputError("the target has no tokenizer, so text prompts cannot be encoded")
    return [replace(bp, ids=encode_prompt(tokenizer, bp.prompt.text, chat=bp.prompt.kind == "chat")) for bp in prompts]


def environment() -> dict:
    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {"python": sys.version.split()[0], "platform": platform.platform(), "machine": platform.machine(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "cuda": torch.cuda.is_available(),
            "versions": {p: version(p) for p in ("dflash_trt", "transformers", "numpy", "matplotlib", "dflash",
                                                 "httpx", "tqdm")}}


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="bench", unit="gen", disable=not enabled, file=sys.stderr)


# ---- batch 1 -------------------------------------------------------------------------------
def run_batch1(modes: list[BenchMode], prompts: list[BenchPrompt], cfg: BenchConfig, bar) -> tuple[list[Record], list[dict]]:
    if cfg.warmup and prompts:
        for mode in modes:
            mode.run(prompts[0].ids, min(WARMUP_TOKENS, cfg.max_new_tokens))
    names = [m.name for m in modes]
    ref_name = "ar" if "ar" in names else names[0]
    records, errors = [], []
    for i, bp in enumerate(prompts):
        order = modes[i % len(modes):] + modes[: i % len(modes)]
        outs = {}
        for pos, mode in enumerate(order):
            outs[mode.name] = (mode.run(bp.ids, cfg.max_new_tokens), pos)
            bar.update(1)
        ref_tokens = outs[ref_name][0].tokens
        for name in names:
            out, pos = outs[name]
            diff = first_difference(out.tokens, ref_tokens)
            if diff is not None:
                errors.append(_mismatch(name, ref_name, bp, diff, out.tokens, ref_tokens, "output_mismatch"))
            records.append(Record(
                mode=name, dataset=bp.dataset, prompt_id=bp.prompt.id, category=bp.prompt.category,
                prompt_tokens=len(bp.ids), tokens=len(out.tokens), token_ids=list(out.tokens), time_s=out.time_s,
                ttft_s=out.ttft_s, tokens_per_s=len(out.tokens) / out.time_s if out.time_s > 0 else 0.0,
                steps=out.steps, accepted=out.accepted, draft_tokens=out.draft_tokens,
                tau=tau_of(len(out.tokens), out.steps, out.accepted), order=pos, matches_reference=diff is None,
                verified=out.verified, lookup_steps=out.lookup_steps))
    return records, errors


def _mismatch(mode, ref, bp: BenchPrompt, index, got, want, kind) -> dict:
    g = got[index] if index < len(got) else None
    w = want[index] if index < len(want) else None
    return {"kind": kind, "mode": mode, "reference_mode": ref, "dataset": bp.dataset, "prompt_id": bp.prompt.id,
            "first_diff_index": index, "token": g, "reference_token": w,
            "message": f"{kind}: mode '{mode}' differs from '{ref}' on {bp.dataset}:{bp.prompt.id} at generated "
                       f"token {index} ({g} vs {w}; lengths {len(got)} vs {len(want)})"}


# ---- concurrency sweep ----------------------------------------------------------------------
def sweep_local(ctx: ModeContext, mode: str, prompts: list[BenchPrompt], c: int, max_new_tokens: int, bar):
    """One sweep point on our engine; returns (point, [(prompt, tokens)])."""
    engine = ctx.models.engine(mode_engine_config(ctx.engine_config, mode, c))
    sched = Scheduler(engine)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    waiting = [prompts[i % len(prompts)] for i in range(max(len(prompts), c))]
    inflight: dict[int, tuple] = {}  # id(handle) -> (handle, prompt, chunk times)
    timings, outputs = [], []
    t0 = time.perf_counter()
    while waiting or inflight:
        while waiting and len(inflight) < c:
            bp = waiting.pop(0)
            handle = sched.submit(bp.ids, params)
            inflight[id(handle)] = (handle, bp, [])
        sched.run_once()
        for key, (handle, bp, chunks) in list(inflight.items()):
            for ev in handle.drain():
                if isinstance(ev, TokenEvent) and ev.tokens:
                    chunks.append(ev.time_s)
                elif isinstance(ev, ErrorEvent):
                    raise RuntimeError(f"scheduler failed during the sweep: {ev.message}")
                elif isinstance(ev, FinalEvent):
                    r = ev.result
                    timings.append(RequestTiming(
                        prompt_id=bp.prompt.id, tokens=len(r.tokens), submit_s=handle.sequence.created_s,
                        chunk_times=chunks, end_s=handle.sequence.finished_s, steps=len(r.steps),
                        accepted=[s.accepted for s in r.steps], draft_tokens=engine.block_size - 1))
                    outputs.append((bp, list(r.tokens)))
                    del inflight[key]
                    bar.update(1)
    point = sweep_point(mode, c, timings, time.perf_counter() - t0)
    engine.shutdown()  # the trtllm backend's engine owns a tensorrt_llm.LLM
    if mode == "ar":
        point["tau"], point["per_position_acceptance"] = 1.0, []
    return point, outputs


def run_sweep(ctx: ModeContext, modes: list[str], prompts: list[BenchPrompt], cfg: BenchConfig,
              reference: dict[tuple[str, str], list[int]], bar) -> tuple[list[dict], list[dict]]:
    points, errors = [], []
    for j, c in enumerate(cfg.concurrency):
        order = modes[j % len(modes):] + modes[: j % len(modes)]
        for mode in order:
            point, outputs = sweep_local(ctx, mode, prompts, c, cfg.max_new_tokens, bar)
            points.append(point)
            for bp, tokens in outputs:
                want = reference.get((bp.dataset, bp.prompt.id))
                diff = None if want is None else first_difference(tokens, want)
                if diff is not None:
                    errors.append({**_mismatch(mode, "batch-1 reference", bp, diff, tokens, want, "sweep_output_mismatch"),
                                   "concurrency": c})
    points.sort(key=lambda p: (modes.index(p["mode"]), p["concurrency"]))
    return points, errors


# ---- the whole run --------------------------------------------------------------------------
def run_local(cfg: BenchConfig, ctx: ModeContext, prompts: list[BenchPrompt]) -> dict:
    """Batch-1 interleaved modes + the engine sweep; returns the report body (no config/env)."""
    modes, skipped = build_modes(list(cfg.modes), ctx)
    if not modes:
        raise InputError(f"no requested mode can run here: {skipped}")
    sweep_modes = [m for m in SWEEP_MODES if m in [x.name for x in modes]]
    sweep_requests = sum(max(len(prompts), c) for c in cfg.concurrency) * len(sweep_modes)
    with _progress(len(prompts) * len(modes) + sweep_requests, cfg.progress) as bar:
        records, errors = run_batch1(modes, prompts, cfg, bar)
        ref_name = "ar" if "ar" in [m.name for m in modes] else modes[0].name
        reference = {(r.dataset, r.prompt_id): r.token_ids for r in records if r.mode == ref_name}
        sweep, sweep_errors = run_sweep(ctx, sweep_modes, prompts, cfg, reference, bar) if sweep_modes else ([], [])
    names = [m.name for m in modes]
    pairs = [(m, "ar") for m in names if m != "ar" and "ar" in names]
    pairs += [("dflash", m) for m in names if m not in ("dflash", "ar") and "dflash" in names]
    acceptance = {}
    for name in names:
        for ds in dict.fromkeys(bp.dataset for bp in prompts):
            rs = [r for r in records if r.mode == name and r.dataset == ds and r.accepted]
            if rs:
                acceptance[f"{name}/{ds}"] = per_position([r.accepted for r in rs], rs[0].draft_tokens)
    return {"modes": {"measured": names, "skipped": skipped, "reference_mode": ref_name, "sweep": sweep_modes},
            "records": record_dicts(records), "aggregates": aggregates(records), "ratios": speed_ratios(records, pairs),
            "per_position_acceptance": acceptance, "sweep": sweep, "errors": errors + sweep_errors}


def assemble(cfg: BenchConfig, body: dict, extra_config: dict) -> dict:
    config = {**asdict(cfg), **extra_config}
    return {"schema_version": SCHEMA_VERSION, "config": config, "environment": environment(), **body}
