"""Flags shared by the commands that load models (generate, demo, serve, bench)."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from dflash_trt.errors import ConfigError
from dflash_trt.runtime.loader import LoadedModels, ModelSpec, load_models
from dflash_trt.speculative.decoder import ACCEPTANCE_MODES, EngineConfig

CACHE_ENV = "DFLASH_TRT_CACHE"
SHIPPED_DRAFTER = Path(__file__).resolve().parent.parent / "assets" / "smollm2-135m-dflash"


def add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--target", type=Path, default=None,
                   help="target HF checkpoint directory (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--drafter", type=Path, default=None,
                   help="DFlash drafter directory (default: the shipped drafter when --target is the default)")
    g.add_argument("--target-backend", choices=("native", "hf"), default="native",
                   help="native: our ragged-batch engine (Llama/Qwen3/gpt-oss); hf: any transformers model, batch 1")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "float64"), default="float32")
    g.add_argument("--cache-dir", type=Path, default=None,
                   help=f"where the embedded default is converted once (default: ${CACHE_ENV} or ~/.cache/dflash_trt)")
    e = p.add_argument_group("decoding")
    e.add_argument("--block-size", type=int, default=None, help="DFlash block size (default: the drafter's)")
    e.add_argument("--no-spec", action="store_true", help="plain autoregressive decoding on the same engine")
    e.add_argument("--acceptance", choices=ACCEPTANCE_MODES, default="exact",
                   help="exact: target samples, drafts accepted while equal; rejection: min(1, p/q) with the drafter's q")
    e.add_argument("--max-seq-len", type=int, default=2048, help="prompt + generated tokens per sequence")
    e.add_argument("--max-batch-size", type=int, default=8)


def cache_dir(args: argparse.Namespace) -> Path:
    if args.cache_dir is not None:
        return args.cache_dir
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "dflash_trt"


def model_spec(args: argparse.Namespace) -> ModelSpec:
    target, drafter = args.target, args.drafter
    if target is None:
        from dflash_trt.models.smollm2 import ensure_default_target

        target = ensure_default_target(cache_dir(args))
        if drafter is None and not args.no_spec:
            if not (SHIPPED_DRAFTER / "config.json").is_file():
                raise ConfigError(f"the shipped drafter is missing at {SHIPPED_DRAFTER}; pass --drafter or --no-spec")
            drafter = SHIPPED_DRAFTER
    if drafter is None and not args.no_spec:
        raise ConfigError("--drafter is required with --target (or pass --no-spec for autoregressive decoding)")
    return ModelSpec(target=target, drafter=None if args.no_spec else drafter,
                     target_backend=args.target_backend, dtype=args.dtype)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(block_size=args.block_size, max_batch_size=args.max_batch_size,
                        max_seq_len=args.max_seq_len, spec=not args.no_spec, acceptance=args.acceptance)


def load(args: argparse.Namespace) -> LoadedModels:
    return load_models(model_spec(args))
