"""`dflash-trt demo`: DFlash on the embedded default, side by side with autoregressive decoding.

Answers a real chat prompt with SmolLM2-135M-Instruct + the shipped DFlash drafter on CPU and
prints the answer, tokens/s, the acceptance length tau and the speedup over autoregressive decoding
on the same engine (both runs in this process, greedy, checked token-identical).
`--tiny` runs the same on a tiny random-weight Llama instead (seconds; no acceptance to speak of).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from dflash_trt.commands.common import add_model_flags, cache_dir, engine_config, load_config
from dflash_trt.errors import DFlashError
from dflash_trt.engine import SamplingParams

DEFAULT_QUESTION = "Write a Python function that checks whether a string is a palindrome."


def register(sub) -> None:
    p = sub.add_parser("demo", help="DFlash vs autoregressive on the embedded default", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", default=DEFAULT_QUESTION, help="the user message")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tiny", action="store_true", help="use a tiny random-weight model (no real answer)")
    add_model_flags(p)
    p.set_defaults(func=run)


def _tiny_models(args):
    import torch

    from dflash_trt.models.target import native_from_hf
    from dflash_trt.models.tiny import build_tiny_drafter, build_tiny_target
    from dflash_trt.runtime.factory import LoadConfig, TorchModels

    hf = build_tiny_target("llama", seed=0)
    drafter = build_tiny_drafter(hf.config, seed=0, num_layers=1, block_size=8)
    load = LoadConfig(target=cache_dir(args), drafter=None)
    return TorchModels(load=load, target=native_from_hf(hf, torch.float32), drafter=drafter, tokenizer=None), [3, 14, 15, 92, 65]


def run(args: argparse.Namespace) -> int:
    if args.tiny:
        models, ids = _tiny_models(args)
        args.max_seq_len = min(args.max_seq_len, models.target.info.max_position_embeddings)
    else:
        from dflash_trt.runtime.factory import load_backend

        models = load_backend("torch", load_config(args))  # the demo compares modes of our own engine
        from dflash_trt.commands.generate import prompt_ids

        ids = prompt_ids(models, args.prompt, None, chat=True)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    cfg = engine_config(args)
    timings = {}
    results = {}
    for mode, speculative in (("autoregressive", False), ("dflash", True)):
        engine = models.engine(replace(cfg, speculative=speculative, max_batch_size=1))
        t0 = time.perf_counter()
        results[mode] = engine.generate([ids], params)[0]
        timings[mode] = time.perf_counter() - t0
    ar, df = results["autoregressive"], results["dflash"]
    if ar.tokens != df.tokens:
        raise DFlashError("DFlash output differs from autoregressive output: this is a bug, please report it")
    if models.tokenizer is not None:
        print(f"user> {args.prompt}\nassistant> {models.detokenize(df.tokens)}\n")
    else:
        print(f"prompt ids {ids} -> {df.tokens}\n")
    ar_tps = len(ar.tokens) / timings["autoregressive"]
    df_tps = len(df.tokens) / timings["dflash"]
    print(f"autoregressive: {len(ar.tokens)} tokens in {timings['autoregressive']:.2f} s = {ar_tps:.1f} tok/s")
    print(f"dflash:         {len(df.tokens)} tokens in {timings['dflash']:.2f} s = {df_tps:.1f} tok/s, "
          f"tau {df.mean_acceptance_length:.2f} over {len(df.steps)} steps (block {cfg.block_size or models.drafter.block_size})")
    print(f"speedup: {df_tps / ar_tps:.2f}x (same engine, same process, identical greedy output)")
    sys.stdout.flush()
    return 0
