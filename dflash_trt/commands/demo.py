"""`dflash-trt demo`: DFlash on the embedded default, side by side with autoregressive decoding.

Answers a real chat prompt with SmolLM2-135M-Instruct + the shipped DFlash drafter on CPU and
prints the answer, then times both modes of the same engine in this process: one warm-up run of
each, then AR and DFlash interleaved (AR, DFlash, AR, DFlash, ...) for `--repeats` runs each, so
that a load change on the machine hits both alike; it prints the median time of each, tau and the
ratio of the medians. Every run's greedy output is checked identical.
`--tiny` runs the same on a tiny random-weight Llama instead (seconds; no acceptance to speak of).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from dflash_trt.commands.common import cache_dir, drafter_dir, load_config
from dflash_trt.config import DrafterConfig, check_block_size
from dflash_trt.engine import CPU_DRAFT_CONFIDENCE, EngineConfig, GenerationResult, SamplingParams
from dflash_trt.errors import ConfigError, DFlashError
from dflash_trt.models.cpu_linear import CPU_KERNELS, any_packed, prepack_if

TINY_BLOCK_SIZE = 8  # the --tiny drafter's trained block
DEFAULT_QUESTION = "Write a Python function that checks whether a string is a palindrome."


def register(sub) -> None:
    p = sub.add_parser("demo", help="DFlash vs autoregressive on the embedded default", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", default=DEFAULT_QUESTION, help="the user message (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each mode after the warm-up (default: %(default)s)")
    p.add_argument("--tiny", action="store_true", help="use a tiny random-weight model (no real answer)")
    g = p.add_argument_group("models")
    g.add_argument("--drafter", type=Path, default=None, help="a DFlash drafter directory (default: the shipped one)")
    g.add_argument("--cache-dir", type=Path, default=None, help="where the embedded default is converted once")
    g.add_argument("--cpu-kernels", choices=CPU_KERNELS, default="auto",
                   help="float32 linears on CPU: oneDNN-prepacked weights or ATen's F.linear (default: %(default)s)")
    e = p.add_argument_group("decoding")
    e.add_argument("--block-size", type=int, default=None, help="DFlash block size (default: the drafter's)")
    e.add_argument("--draft-confidence", type=float, default=None,
                   help="verify drafts only while the drafter is this confident, 0 = the whole block "
                        f"(default: {CPU_DRAFT_CONFIDENCE:g} on CPU, the whole block on a GPU)")
    e.add_argument("--ngram-lookup", type=int, default=0, metavar="N",
                   help="DFlash with n-gram lookup drafts where the text repeats >= N tokens, 0 = off "
                        "(default: %(default)s)")
    # what load_config reads beyond these flags: the demo always runs the embedded default target
    p.set_defaults(func=run, target=None, no_spec=False, target_backend="native", dtype="float32")


def _check(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
    if not args.prompt.strip():
        raise ConfigError("--prompt is empty")
    # the engine values and the block size against the drafter's config.json, before a model is loaded
    EngineConfig(block_size=args.block_size, draft_confidence=args.draft_confidence, ngram_lookup=args.ngram_lookup)
    if args.tiny:
        if args.drafter is not None:
            raise ConfigError("--drafter does nothing with --tiny (it builds its own random drafter): drop one of them")
        drafter, trained = "of --tiny", TINY_BLOCK_SIZE
    else:
        drafter = drafter_dir(args)
        trained = DrafterConfig.load(drafter).block_size
    if args.block_size is not None:
        check_block_size(args.block_size, trained, str(drafter))


def _tiny_models(args):
    import torch

    from dflash_trt.models.target import native_from_hf
    from dflash_trt.models.tiny import build_tiny_drafter, build_tiny_target
    from dflash_trt.runtime.factory import LoadConfig, TorchModels

    hf = build_tiny_target("llama", seed=0)
    drafter = build_tiny_drafter(hf.config, seed=0, num_layers=1, block_size=TINY_BLOCK_SIZE)
    load = LoadConfig(target=cache_dir(args), drafter=None, cpu_kernels=args.cpu_kernels)
    target = native_from_hf(hf, torch.float32)
    prepack_if(args.cpu_kernels, target, drafter)  # as runtime.factory.load_torch does for loaded models
    return TorchModels(load=load, target=target, drafter=drafter, tokenizer=None), [3, 14, 15, 92, 65]


def _timed(engine, ids: list[int], params: SamplingParams) -> tuple[GenerationResult, float]:
    t0 = time.perf_counter()
    result = engine.generate([ids], params)[0]
    return result, time.perf_counter() - t0


def _vocab_note(engine) -> str:
    head = engine.draft_head
    return f", draft vocabulary {head.ids.numel()} of {head.vocab_size} tokens" if head.restricted else ""


def _kernels_note(models) -> str:
    return "; float32 linears on oneDNN-prepacked weights" if any_packed(models.target) else ""


def _lookup_note(result: GenerationResult, min_match: int) -> str:
    if not min_match:
        return ""
    return f", --ngram-lookup {min_match}: {sum(s.lookup for s in result.steps)} steps drafted by lookup"


def run(args: argparse.Namespace) -> int:
    _check(args)
    if args.tiny:
        models, ids = _tiny_models(args)
    else:
        from dflash_trt.commands.generate import prompt_ids
        from dflash_trt.runtime.factory import load_backend

        models = load_backend("torch", load_config(args))  # the demo compares modes of our own engine
        ids = prompt_ids(models, args.prompt, None, chat=True)
    info = models.target.info
    cfg = EngineConfig(block_size=args.block_size, max_batch_size=1, draft_confidence=args.draft_confidence,
                       ngram_lookup=args.ngram_lookup,
                       max_seq_len=min(info.max_position_embeddings, len(ids) + args.max_new_tokens + 64))
    engines = {"autoregressive": models.engine(replace(cfg, speculative=False)), "dflash": models.engine(cfg)}
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    # 1. warm-up (first-call allocations, caches), then 2. interleaved timed runs
    results = {mode: _timed(engine, ids, params)[0] for mode, engine in engines.items()}
    reference = results["autoregressive"].tokens
    times: dict[str, list[float]] = {mode: [] for mode in engines}
    for _ in range(args.repeats):
        for mode, engine in engines.items():
            result, seconds = _timed(engine, ids, params)
            if result.tokens != reference:
                raise DFlashError(f"{mode} output differs from autoregressive output: this is a bug, please report it")
            results[mode] = result
            times[mode].append(seconds)
    df = results["dflash"]
    if models.tokenizer is not None:
        print(f"user> {args.prompt}\nassistant> {models.detokenize(df.tokens)}\n")
    else:
        print(f"prompt ids {ids} -> {df.tokens}\n")
    med = {mode: statistics.median(ts) for mode, ts in times.items()}
    n = len(reference)
    runs = {mode: " ".join(f"{t:.2f}" for t in ts) for mode, ts in times.items()}
    verified = sum(s.draft_tokens for s in df.steps) / max(len(df.steps), 1)
    block = engines["dflash"].block_size
    print(f"after one warm-up run each, {args.repeats} interleaved runs per mode (greedy; identical output every run)")
    print(f"autoregressive: {n} tokens, median {med['autoregressive']:.2f} s = {n / med['autoregressive']:.1f} tok/s"
          f"  (runs {runs['autoregressive']} s)")
    print(f"dflash:         {n} tokens, median {med['dflash']:.2f} s = {n / med['dflash']:.1f} tok/s"
          f"  (runs {runs['dflash']} s)")
    print(f"                tau {df.mean_acceptance_length:.2f} over {len(df.steps)} steps, "
          f"{verified:.1f} of {block - 1} drafts verified per step (block {block}, "
          f"--draft-confidence {engines['dflash'].config.draft_confidence:g}{_vocab_note(engines['dflash'])}"
          f"{_lookup_note(df, cfg.ngram_lookup)}{_kernels_note(models)})")
    print(f"speedup: {med['autoregressive'] / med['dflash']:.2f}x (median AR time / median DFlash time; "
          f"same engine, same process)")
    sys.stdout.flush()
    return 0
