"""Side-by-side decode throughput: DFlash vs autoregressive on the same target, in one process.

At each batch size b, b requests (the prompts, cycled) run as one full batch in each mode. The
two modes are interleaved round by round, alternating which goes first, so that load drift on a
shared machine hits both alike; engines are built and warmed up before any timing. Throughput is
generated tokens over wall-clock seconds summed across rounds; `speedup` is DFlash over
autoregressive. With greedy parameters the two modes must produce identical tokens, which is
recorded (`identical_outputs`) as a sanity check of the run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from tqdm.auto import tqdm

from dflash_trt.errors import InputError
from dflash_trt.engine import Engine, GenerationResult, SamplingParams

EngineFactory = Callable[[bool, int], Engine]  # (speculative, max_batch_size) -> engine
MODES = ("autoregressive", "dflash")


@dataclass(frozen=True)
class ModeThroughput:
    tokens: int  # generated tokens over all rounds
    seconds: float  # wall-clock seconds of those rounds
    target_steps: int  # decode steps (per request, summed; the prefill excluded)
    committed: int  # tokens committed by those steps: sum of (accepted drafts + 1)

    @property
    def mean_acceptance_length(self) -> float:
        """tau: tokens committed per decode step (1.0 for autoregressive)."""
        return self.committed / self.target_steps if self.target_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class BatchThroughput:
    batch_size: int
    autoregressive: ModeThroughput
    dflash: ModeThroughput
    identical_outputs: bool | None  # greedy runs: DFlash tokens == autoregressive tokens (None if sampled)

    @property
    def speedup(self) -> float:
        ar = self.autoregressive.tokens_per_s
        return self.dflash.tokens_per_s / ar if ar > 0 else 0.0


@dataclass(frozen=True)
class ThroughputReport:
    rows: tuple[BatchThroughput, ...]
    rounds: int
    max_new_tokens: int | None

    def table(self) -> str:
        """A Markdown table, one line per batch size."""
        lines = ["| batch | autoregressive tok/s | DFlash tok/s | speedup | DFlash tau | identical greedy output |",
                 "|---:|---:|---:|---:|---:|:---:|"]
        for r in self.rows:
            same = "n/a" if r.identical_outputs is None else ("yes" if r.identical_outputs else "NO")
            lines.append(f"| {r.batch_size} | {r.autoregressive.tokens_per_s:.1f} | {r.dflash.tokens_per_s:.1f} "
                         f"| {r.speedup:.2f}x | {r.dflash.mean_acceptance_length:.2f} | {same} |")
        return "\n".join(lines)


def _timed(engine: Engine, prompts, params) -> tuple[list[GenerationResult], float]:
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    return results, time.perf_counter() - start


def measure(engine_factory: EngineFactory, prompts: Sequence[Sequence[int]], batch_sizes: Sequence[int],
            params: SamplingParams = SamplingParams(max_new_tokens=64, ignore_eos=True), rounds: int = 2,
            progress: bool = False) -> ThroughputReport:
    """Tokens/s of autoregressive and DFlash decoding at each batch size, interleaved.

    engine_factory(speculative, max_batch_size) builds an engine on the same target for each mode
    (speculative=False: the autoregressive baseline). Sampled `params` need a seed so both modes decode
    reproducibly; greedy is the usual benchmark setting.
    """
    if not prompts:
        raise InputError("measure() needs at least one prompt")
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise InputError(f"batch sizes must be >= 1, got {list(batch_sizes)}")
    if rounds < 1:
        raise InputError(f"rounds must be >= 1, got {rounds}")
    rows = []
    bar = tqdm(total=len(batch_sizes) * rounds * 2, desc="throughput", unit="run", disable=not progress)
    for b in batch_sizes:
        batch = [list(prompts[i % len(prompts)]) for i in range(b)]
        engines = {mode: engine_factory(mode == "dflash", b) for mode in MODES}
        for engine in engines.values():  # warm-up (allocation, first-call overheads), untimed
            engine.generate([batch[0]], SamplingParams(max_new_tokens=4, ignore_eos=True))
        tokens = dict.fromkeys(MODES, 0)
        seconds = dict.fromkeys(MODES, 0.0)
        steps = dict.fromkeys(MODES, 0)
        committed = dict.fromkeys(MODES, 0)
        outputs: dict[str, list[list[int]]] = {}
        for r in range(rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                results, elapsed = _timed(engines[mode], batch, params)
                tokens[mode] += sum(len(res.tokens) for res in results)
                seconds[mode] += elapsed
                steps[mode] += sum(len(res.steps) for res in results)
                committed[mode] += sum(st.accepted + 1 for res in results for st in res.steps)
                outputs.setdefault(mode, [res.tokens for res in results])
                bar.update(1)
        same = outputs["dflash"] == outputs["autoregressive"] if params.greedy else None
        rows.append(BatchThroughput(
            batch_size=b,
            autoregressive=ModeThroughput(tokens["autoregressive"], seconds["autoregressive"],
                                          steps["autoregressive"], committed["autoregressive"]),
            dflash=ModeThroughput(tokens["dflash"], seconds["dflash"], steps["dflash"], committed["dflash"]),
            identical_outputs=same,
        ))
    bar.close()
    return ThroughputReport(rows=tuple(rows), rounds=rounds, max_new_tokens=params.max_new_tokens)
