"""A batch worker for tensor-parallel checks: `mpirun -n N python -m dflash_trt.runtime.tp_worker
--tp N --cases cases.json --out result.json`.

It starts one TP session and runs several cases through it (one MPI start-up for many checks):
each case loads a target (HF or pre-sharded) with a drafter, generates the prompts on the lockstep
engines, and rank 0 writes per case the tokens, the per-step time and the collectives issued per
step. `--fail-rank R --fail-after-steps K [--fail-mode exit|hang]` makes rank R die (os._exit) or hang
after K steps, to test that the job fails as a whole (fault injection for tests; nothing else reads it).

A case: {"target": dir, "drafter": dir | null, "moe_tp_size": 1, "dtype": "float64",
"prompts": [[ids...]], "max_new_tokens": 24, "block_size": null, "temperature": 0.0, "seed": null,
"ngram_lookup": 0} (ngram_lookup optional: EngineConfig.ngram_lookup).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import NoReturn


def run_case(session, case: dict, fail: tuple[int, int, str] | None) -> dict:
    from dflash_trt.checkpoint.mapping import Mapping
    from dflash_trt.runtime.factory import LoadConfig
    from dflash_trt.engine import EngineConfig, SamplingParams

    load = LoadConfig(target=Path(case["target"]), drafter=Path(case["drafter"]) if case["drafter"] else None,
                      dtype=case["dtype"])
    mapping = Mapping(session.world.size, case["moe_tp_size"])
    models = session.load(load, mapping)
    config = EngineConfig(block_size=case["block_size"], max_batch_size=max(len(case["prompts"]), 1),
                          max_seq_len=256, speculative=load.drafter is not None,
                          ngram_lookup=case.get("ngram_lookup", 0))
    engine = session.make_engine(models.target, models.drafter, config, models.detokenize)
    if not session.is_leader:
        on_step = None
        if fail is not None and fail[0] == session.world.rank:
            def on_step(steps: int) -> None:
                if steps >= fail[1]:
                    print(f"[rank {session.world.rank}] fault injection: {fail[2]} after {steps} steps",
                          file=sys.stderr, flush=True)
                    if fail[2] == "hang":
                        time.sleep(3600)
                    os._exit(3)
        session.follow(on_step)
        return {}
    params = SamplingParams(temperature=case["temperature"], seed=case["seed"],
                            max_new_tokens=case["max_new_tokens"], ignore_eos=True)
    session.ctx.stats.reset()
    stamps = [time.perf_counter()]

    def progress(_: int) -> None:
        stamps.append(time.perf_counter())
    results = engine.generate(case["prompts"], params, progress=progress)
    elapsed, steps = time.perf_counter() - stamps[0], len(stamps) - 1
    session.stop_followers(0)
    stats = session.ctx.stats
    return {
        "tokens": [r.tokens for r in results],
        "steps": steps,  # decode steps after the one prefill
        "seconds": elapsed,
        "step_seconds": (stamps[-1] - stamps[1]) / (steps - 1) if steps > 1 else None,  # decode steps only
        "collectives": dict(sorted(stats.by_site.items())),  # per call site, prefill + all steps
        "collective_bytes": stats.bytes,
        "lookup": [[st.lookup for st in r.steps] for r in results],  # per row, per step: drafted by n-gram lookup
    }


def main(argv: list[str] | None = None) -> NoReturn:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--cases", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--fail-rank", type=int, default=None)
    p.add_argument("--fail-after-steps", type=int, default=1)
    p.add_argument("--fail-mode", choices=("exit", "hang"), default="exit")
    args = p.parse_args(argv)

    import torch

    from dflash_trt.runtime.mpi import TPConfig, TPSession, discover_world, install_signal_messages

    torch.set_num_threads(args.threads)
    install_signal_messages(discover_world(args.tp))
    session = TPSession.start(TPConfig(args.tp, timeout_s=args.timeout))
    fail = None if args.fail_rank is None else (args.fail_rank, args.fail_after_steps, args.fail_mode)
    with session:
        cases = json.loads(args.cases.read_text())
        out = [run_case(session, case, fail) for case in cases]
        if session.is_leader:
            tmp = args.out.with_name(args.out.name + ".tmp")
            tmp.write_text(json.dumps(out))
            os.replace(tmp, args.out)
        session.exit(0)


if __name__ == "__main__":
    sys.exit(main())
