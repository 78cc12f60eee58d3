"""Bench results: typed records, the statistics computed from them, report.json and report.md.

Definitions (all times wall clock, seconds):
- a record's `tokens_per_s` = generated tokens / time_s (prefill included);
- tau (mean acceptance length) = tokens committed per target verification step: from the
  per-step accepted counts where the mode exposes them (sum(accepted + 1) / steps), otherwise
  (tokens - 1) / steps (the first token comes from the prefill);
- per-position acceptance i = fraction of steps whose draft i (0-based) was accepted; it cannot
  increase with i because acceptance is a prefix;
- speed ratio A/B on one prompt = tokens_per_s(A) / tokens_per_s(B), over prompts whose outputs
  were identical to the reference mode's (a speedup over a different output is not one);
- sweep point: total tokens/s = all tokens / wall time of the point; tokens/s/user = mean over
  requests of tokens / (finish - submit); TTFT = first token - submit; TPOT = (finish - first
  token) / (tokens - 1); inter-token latency = gaps between successive token-carrying stream
  chunks (a DFlash step delivers several tokens in one chunk, as vLLM counts it).
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

SCHEMA_VERSION = 1
MIN_PROMPTS = 10  # a summary over fewer prompts gets a noise warning
DOMINANT_SHARE = 0.5  # ... and so does one where a single prompt takes more than this share of the time
# (and more than twice its even share 1/n: of two similar prompts one always takes over half)


@dataclass(frozen=True)
class Record:
    """One mode's greedy generation for one prompt (batch 1)."""

    mode: str
    dataset: str
    prompt_id: str
    category: str
    prompt_tokens: int
    tokens: int  # == len(token_ids)
    token_ids: list[int]
    time_s: float
    ttft_s: float | None
    tokens_per_s: float
    steps: int | None
    accepted: list[int] | None  # per step; engine DFlash only
    draft_tokens: int
    tau: float | None
    order: int  # this mode's position in the prompt's rotated mode order
    matches_reference: bool
    verified: list[int] | None = None  # drafts verified per step (engine DFlash; < draft_tokens when truncated)
    lookup_steps: int | None = None  # steps drafted by n-gram lookup (engine DFlash with ngram_lookup)


def tau_of(tokens: int, steps: int | None, accepted: list[int] | None) -> float | None:
    if accepted:
        return sum(a + 1 for a in accepted) / len(accepted)
    if steps:
        return (tokens - 1) / steps
    return None


def per_position(accepted_lists: list[list[int]], draft_tokens: int) -> list[float]:
    steps = [a for lst in accepted_lists for a in lst]
    if not steps or draft_tokens < 1:
        return []
    return [sum(a > i for a in steps) / len(steps) for i in range(draft_tokens)]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where two token lists differ (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return float(sum(xs) / len(xs)) if xs else None


def _geomean(xs):
    xs = [x for x in xs if x is not None and x > 0]
    return float(math.exp(sum(math.log(x) for x in xs) / len(xs))) if xs else None


def _pct(xs, q):
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if xs else None


# ---- batch-1 statistics ------------------------------------------------------------------
def speed_ratios(records: list[Record], pairs: list[tuple[str, str]]) -> dict[str, dict]:
    """Per-prompt tokens/s ratios A/B on the same prompts, with their mean and geometric mean."""
    by = {(r.mode, r.dataset, r.prompt_id): r for r in records}
    out = {}
    for a, b in pairs:
        per_prompt = []
        for (mode, ds, pid), ra in by.items():
            rb = by.get((b, ds, pid))
            if mode != a or rb is None or not (ra.matches_reference and rb.matches_reference):
                continue
            if ra.tokens_per_s > 0 and rb.tokens_per_s > 0:
                per_prompt.append({"dataset": ds, "prompt_id": pid, "ratio": ra.tokens_per_s / rb.tokens_per_s})
        ratios = [p["ratio"] for p in per_prompt]
        out[f"{a}/{b}"] = {"numerator": a, "denominator": b, "prompts": len(ratios), "mean": _mean(ratios),
                           "geomean": _geomean(ratios), "per_prompt": per_prompt}
    return out


def _summary(rs: list[Record], base: dict) -> dict:
    tokens, time_s = sum(r.tokens for r in rs), sum(r.time_s for r in rs)
    steps = sum(r.steps or 0 for r in rs)
    committed = sum(sum(a + 1 for a in r.accepted) if r.accepted else max(r.tokens - 1, 0) for r in rs)
    ratios = [r.tokens_per_s / base[(r.dataset, r.prompt_id)].tokens_per_s for r in rs
              if (r.dataset, r.prompt_id) in base and r.matches_reference and r.tokens_per_s > 0
              and base[(r.dataset, r.prompt_id)].tokens_per_s > 0]
    return {"prompts": len(rs), "tokens": tokens, "time_s": time_s,
            "tokens_per_s": tokens / time_s if time_s > 0 else None,
            "mean_ttft_s": _mean([r.ttft_s for r in rs]),
            "tau": committed / steps if steps else None,
            "verified_per_step": _mean([sum(r.verified) / len(r.verified) for r in rs if r.verified]),
            "lookup_share": (sum(r.lookup_steps for r in rs if r.lookup_steps is not None) / steps
                             if steps and any(r.lookup_steps for r in rs) else None),
            "speedup_vs_ar_geomean": _geomean(ratios)}


def aggregates(records: list[Record], baseline: str = "ar") -> dict[str, list[dict]]:
    """Per mode and dataset, and per mode, dataset and category."""
    base = {(r.dataset, r.prompt_id): r for r in records if r.mode == baseline}
    groups: dict[tuple, list[Record]] = defaultdict(list)
    cats: dict[tuple, list[Record]] = defaultdict(list)
    for r in records:
        groups[(r.mode, r.dataset)].append(r)
        cats[(r.mode, r.dataset, r.category)].append(r)
    return {
        "by_dataset": [{"mode": m, "dataset": d, **_summary(rs, base)} for (m, d), rs in groups.items()],
        "by_category": [{"mode": m, "dataset": d, "category": c, **_summary(rs, base)}
                        for (m, d, c), rs in sorted(cats.items())],
    }


def noise_warnings(records: list[dict], prompts_per_dataset: dict[str, int]) -> list[str]:
    """Why a summary may be noise: a dataset with fewer than MIN_PROMPTS prompts (every figure on it,
    batch 1 and sweep, rests on them), or a mode whose batch-1 time on a dataset is mostly one prompt's.
    `records`: the report's (record_dicts)."""
    out = [f"{ds}: {n} prompt{'s' if n != 1 else ''} (fewer than {MIN_PROMPTS}): its tok/s, tau and speedups are "
           "noisy; raise --limit" for ds, n in prompts_per_dataset.items() if n < MIN_PROMPTS]
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["mode"], r["dataset"])].append(r)
    for (mode, ds), rs in groups.items():
        total = sum(r["time_s"] for r in rs)
        top = max(rs, key=lambda r: r["time_s"])
        share = max(DOMINANT_SHARE, 2 / len(rs))
        if len(rs) > 1 and total > 0 and top["time_s"] > share * total:
            out.append(f"{ds}/{mode}: prompt {top['prompt_id']} takes {top['time_s'] / total:.0%} of the time, so "
                       "the summary mostly measures that one prompt")
    return out


# ---- concurrency sweep -------------------------------------------------------------------
@dataclass(frozen=True)
class RequestTiming:
    """One streamed request of a concurrency sweep (local engine or HTTP endpoint)."""

    prompt_id: str
    tokens: int
    submit_s: float
    chunk_times: list[float]  # arrival of each token-carrying chunk
    end_s: float
    steps: int | None = None
    accepted: list[int] | None = None
    draft_tokens: int = 0
    reported_tau: float | None = None  # from an endpoint's response, when it sends one


def sweep_point(mode: str, concurrency: int, reqs: list[RequestTiming], wall_s: float) -> dict:
    tokens = sum(r.tokens for r in reqs)
    ttft = [r.chunk_times[0] - r.submit_s for r in reqs if r.chunk_times]
    tpot = [(r.end_s - r.chunk_times[0]) / (r.tokens - 1) for r in reqs if r.chunk_times and r.tokens > 1]
    itl = [b - a for r in reqs for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    per_user = [r.tokens / (r.end_s - r.submit_s) for r in reqs if r.end_s > r.submit_s]
    with_steps = [r for r in reqs if r.accepted is not None]
    if with_steps:
        steps = sum(len(r.accepted) for r in with_steps)
        tau = sum(a + 1 for r in with_steps for a in r.accepted) / steps if steps else None
    else:
        reported = [r for r in reqs if r.reported_tau is not None]
        if reported and all(r.steps is not None for r in reported) and sum(r.steps for r in reported):
            # weight each request by its verification steps
            tau = sum(r.reported_tau * r.steps for r in reported) / sum(r.steps for r in reported)
        else:
            tau = _mean([r.reported_tau for r in reported])
    drafts = max((r.draft_tokens for r in reqs), default=0)
    return {
        "mode": mode, "concurrency": concurrency, "requests": len(reqs), "tokens": tokens, "wall_s": wall_s,
        "total_tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "tokens_per_s_per_user": _mean(per_user),
        "ttft_s": {"mean": _mean(ttft), "p50": _pct(ttft, 50), "p99": _pct(ttft, 99)},
        "tpot_s": {"mean": _mean(tpot), "p50": _pct(tpot, 50), "p99": _pct(tpot, 99)},
        "itl_s": {"p50": _pct(itl, 50), "p99": _pct(itl, 99)},
        "tau": tau,
        "per_position_acceptance": per_position([r.accepted for r in with_steps], drafts),
    }


# ---- files --------------------------------------------------------------------------------
def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json(path: Path, report: dict) -> None:
    atomic_write_bytes(path, (json.dumps(report, indent=1) + "\n").encode())


def record_dicts(records: list[Record]) -> list[dict]:
    return [asdict(r) for r in records]


def _f(x, spec=".2f", scale=1.0):
    return "-" if x is None else format(x * scale, spec)


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"] + \
           ["| " + " | ".join(r) + " |" for r in rows]


def markdown(report: dict) -> str:
    cfg = report["config"]
    lines = ["# dflash-trt bench", "", f"Command: `{cfg['command']}`", ""]
    env = report["environment"]
    lines += [f"torch {env['torch']}, {env['cpu_count']} CPUs ({env['torch_threads']} torch threads), "
              f"max_new_tokens {cfg['max_new_tokens']}, block size {cfg['block_size']}", ""]
    if report["records"]:
        lines += ["## Batch 1 (modes interleaved prompt by prompt, greedy)", ""]
        rows = [[a["dataset"], a["mode"], str(a["prompts"]), str(a["tokens"]), _f(a["tokens_per_s"]),
                 _f(a["mean_ttft_s"], ".0f", 1e3), _f(a["tau"]), _f(a.get("verified_per_step")),
                 _f(a.get("lookup_share")), _f(a["speedup_vs_ar_geomean"])]
                for a in report["aggregates"]["by_dataset"]]
        lines += _table(["dataset", "mode", "prompts", "tokens", "tok/s", "TTFT ms", "tau", "drafts verified/step",
                         "steps by lookup", "speedup vs ar"], rows)
        cats = [a for a in report["aggregates"]["by_category"] if a["dataset"] == "mtbench"]
        if cats:
            lines += ["", "### MT-Bench by category", ""]
            lines += _table(["category", "mode", "prompts", "tok/s", "tau", "speedup vs ar"],
                            [[a["category"], a["mode"], str(a["prompts"]), _f(a["tokens_per_s"]), _f(a["tau"]),
                              _f(a["speedup_vs_ar_geomean"])] for a in cats])
        lines += ["", "### Speed ratios, prompt by prompt on identical outputs", ""]
        lines += _table(["ratio", "prompts", "mean", "geomean"],
                        [[k, str(v["prompts"]), _f(v["mean"]), _f(v["geomean"])] for k, v in report["ratios"].items()])
    if report["sweep"]:
        lines += ["", "## Concurrency sweep", ""]
        rows = [[p["mode"], str(p["concurrency"]), str(p["requests"]), _f(p["tokens_per_s_per_user"]),
                 _f(p["total_tokens_per_s"]), _f(p["ttft_s"]["mean"], ".0f", 1e3), _f(p["tpot_s"]["mean"], ".0f", 1e3),
                 _f(p["itl_s"]["p50"], ".0f", 1e3), _f(p["itl_s"]["p99"], ".0f", 1e3), _f(p["tau"])]
                for p in report["sweep"]]
        lines += _table(["mode", "concurrency", "requests", "tok/s/user", "total tok/s", "TTFT ms", "TPOT ms",
                         "ITL p50 ms", "ITL p99 ms", "tau"], rows)
    if report["warnings"]:
        lines += ["", "## Noise warnings", ""] + [f"- {w}" for w in report["warnings"]]
    skipped = report["modes"]["skipped"]
    if skipped:
        lines += ["", "## Skipped modes", ""] + [f"- `{m}`: {why}" for m, why in skipped.items()]
    costs = report.get("step_costs")
    if costs:
        lines += ["", f"## Step costs ({costs['threads']} threads, {costs['context']}-token context; "
                  f"1-token step {costs['one_token_s'] * 1e3:.1f} ms)", ""]
        head = [f"verify {t} tokens" for t in costs["verify_ratio"]] + ["draft (block)"]
        row = [_f(r) for r in costs["verify_ratio"].values()] + [_f(costs["draft_ratio"])]
        if costs["draft_vocab_ratio"] is not None:
            head.append("draft (block, draft vocabulary)")
            row.append(_f(costs["draft_vocab_ratio"]))
        lines += _table(head, [row])
    lines += ["", "## Errors", ""]
    lines += [f"- {e['message']}" for e in report["errors"]] or ["none"]
    if report.get("plots"):
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in report["plots"]]
    return "\n".join(lines) + "\n"
