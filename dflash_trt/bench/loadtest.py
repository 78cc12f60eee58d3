"""A bounded load test of an OpenAI-compatible server (ours or any other) over streaming completions.

  python -m dflash_trt.bench.loadtest --url http://127.0.0.1:8000 --requests 200 --concurrency 16

Sends `--requests` streaming /v1/completions requests, at most `--concurrency` in flight, and
reports: wall time, request and output-token throughput, TTFT p50/p99 (request sent -> first
token), inter-token latency p50/p99 (per output token after the first: the gap before a chunk is
split over the tokens it carries, so a block of accepted drafts counts as several fast tokens),
and errors. Token counts per chunk come from the `return_token_ids` extension (vLLM's and ours);
without it (`--no-token-ids`) each chunk counts as one token. Greedy with `ignore_eos` by default,
so every request generates exactly `--max-tokens` tokens and runs are comparable.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field


@dataclass
class RequestStats:
    ok: bool
    tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # per token after the first
    error: str | None = None
    mean_acceptance_length: float | None = None


@dataclass(frozen=True)
class LoadReport:
    requests: int
    concurrency: int
    errors: int
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    output_tokens: int
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    mean_acceptance_length: float | None
    error_samples: tuple[str, ...]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


async def _one(client, url: str, body: dict, token_ids: bool) -> RequestStats:
    import httpx

    stats = RequestStats(ok=False)
    sent = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                stats.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return stats
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    stats.error = f"stream error: {chunk['error'].get('message')}"
                    return stats
                if "dflash" in chunk:
                    stats.mean_acceptance_length = chunk["dflash"]["mean_acceptance_length"]
                if not chunk.get("choices"):
                    continue
                choice = chunk["choices"][0]
                n = len(choice.get("token_ids", ())) if token_ids else int(bool(choice.get("text")))
                if n == 0:
                    continue
                now = time.perf_counter()
                if last is None:
                    stats.ttft_s = now - sent
                    stats.itl_s.extend([] if n == 1 else [0.0] * (n - 1))
                else:
                    stats.itl_s.extend([(now - last) / n] * n)
                last = now
                stats.tokens += n
        stats.ok = stats.ttft_s is not None
        if not stats.ok:
            stats.error = "no tokens received"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        stats.error = f"{type(exc).__name__}: {exc}"
    return stats


async def run_load(url: str, requests: int, concurrency: int, max_tokens: int, model: str | None = None,
                   api_key: str | None = None, temperature: float = 0.0, ignore_eos: bool = True,
                   token_ids: bool = True, timeout_s: float = 600.0) -> LoadReport:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s, limits=limits) as client:
        if model is None:
            resp = await client.get("/v1/models")
            resp.raise_for_status()
            model = resp.json()["data"][0]["id"]
        gate = asyncio.Semaphore(concurrency)

        async def gated(i: int) -> RequestStats:
            body = {"model": model, "prompt": f"Request {i}: write a short story about the number {i}.",
                    "max_tokens": max_tokens, "temperature": temperature, "stream": True}
            if ignore_eos:
                body["ignore_eos"] = True
            if token_ids:
                body["return_token_ids"] = True
            async with gate:
                return await _one(client, "/v1/completions", body, token_ids)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(gated(i) for i in range(requests)))
        wall = time.perf_counter() - t0
    good = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in good)
    ttft = [r.ttft_s for r in good]
    itl = [x for r in good for x in r.itl_s]
    taus = [r.mean_acceptance_length for r in good if r.mean_acceptance_length is not None]
    errors = [r.error or "unknown" for r in results if not r.ok]
    return LoadReport(
        requests=requests, concurrency=concurrency, errors=len(errors), wall_s=wall,
        requests_per_s=len(good) / wall, output_tokens_per_s=tokens / wall, output_tokens=tokens,
        ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        itl_p50_s=percentile(itl, 50), itl_p99_s=percentile(itl, 99),
        mean_acceptance_length=sum(taus) / len(taus) if taus else None, error_samples=tuple(errors[:5]),
    )


def format_report(r: LoadReport, label: str = "") -> str:
    tau = f"{r.mean_acceptance_length:.2f}" if r.mean_acceptance_length is not None else "n/a"
    head = f"[{label}] " if label else ""
    lines = [
        f"{head}{r.requests} requests at concurrency {r.concurrency}: {r.errors} errors, {r.wall_s:.2f} s wall",
        f"  throughput: {r.requests_per_s:.2f} req/s, {r.output_tokens_per_s:.1f} output tok/s "
        f"({r.output_tokens} tokens)",
        f"  TTFT: p50 {r.ttft_p50_s * 1e3:.1f} ms, p99 {r.ttft_p99_s * 1e3:.1f} ms",
        f"  inter-token latency: p50 {r.itl_p50_s * 1e3:.2f} ms, p99 {r.itl_p99_s * 1e3:.2f} ms",
        f"  mean acceptance length (server-reported, per request): {tau}",
    ]
    lines += [f"  error: {e}" for e in r.error_samples]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_trt.bench.loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model", default=None, help="model id (default: the first from /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help="stop at EOS")
    p.add_argument("--no-token-ids", dest="token_ids", action="store_false",
                   help="server lacks return_token_ids: count one token per chunk")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--label", default="", help="a label printed with the report")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = p.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        p.error("--requests, --concurrency and --max-tokens must be >= 1")
    report = asyncio.run(run_load(args.url, args.requests, args.concurrency, args.max_tokens, args.model,
                                  args.api_key, args.temperature, args.ignore_eos, args.token_ids, args.timeout))
    if args.json:
        print(json.dumps({"label": args.label, **asdict(report)}))
    else:
        print(format_report(report, args.label))
    return 0 if report.errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
