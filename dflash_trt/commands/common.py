"""Flags shared by the commands that load models (generate, demo, serve, bench, triton-repo)."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from dflash_trt.config import DrafterConfig, check_block_size, require_dir
from dflash_trt.engine import ACCEPTANCE_MODES, CPU_DRAFT_CONFIDENCE, KV_CACHE_BUDGET_BYTES, EngineConfig
from dflash_trt.errors import ConfigError
from dflash_trt.models.cpu_linear import CPU_KERNELS
from dflash_trt.runtime.factory import BACKENDS, LoadConfig, check_backend, load_backend

CACHE_ENV = "DFLASH_TRT_CACHE"
SHIPPED_DRAFTER = Path(__file__).resolve().parent.parent / "assets" / "smollm2-135m-dflash"


def add_backend_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=BACKENDS, default="torch",
                   help="torch: this project's engine (CPU or CUDA); trtllm: TensorRT-LLM's LLM API with DFlash "
                        "(needs a CUDA GPU and tensorrt_llm)")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--target", type=Path, default=None,
                   help="target HF checkpoint directory (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--drafter", type=Path, default=None,
                   help="DFlash drafter directory (default: the shipped drafter when --target is the default)")
    g.add_argument("--target-backend", choices=("native", "hf"), default="native",
                   help="native: our ragged-batch engine (Llama/Qwen3/gpt-oss); hf: any transformers model, batch 1")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "float64"), default="float32")
    g.add_argument("--cpu-kernels", choices=CPU_KERNELS, default="auto",
                   help="float32 linears on CPU (torch backend): onednn runs weights prepacked once for oneDNN "
                        "(a few-token verify costs little more than a 1-token step; one extra copy of the weights), "
                        "torch runs ATen's F.linear; auto: onednn when this torch has it and the copy fits in a "
                        "quarter of the memory")
    g.add_argument("--cache-dir", type=Path, default=None,
                   help=f"where the embedded default is converted once (default: ${CACHE_ENV} or ~/.cache/dflash_trt)")
    e = p.add_argument_group("decoding")
    e.add_argument("--block-size", type=int, default=None, help="DFlash block size (default: the drafter's)")
    e.add_argument("--no-spec", action="store_true", help="plain autoregressive decoding on the same engine")
    e.add_argument("--acceptance", choices=ACCEPTANCE_MODES, default="exact",
                   help="exact: target samples, drafts accepted while equal; rejection: min(1, p/q) with the drafter's q")
    e.add_argument("--draft-confidence", type=float, default=None,
                   help="verify a row's drafts only while the product of the drafter's top-1 probabilities stays "
                        ">= this (0 = always the whole block); output is unchanged, only speed: it pays where a "
                        "K-token verify costs well over a 1-token step (measure with `bench --modes dflash@C,...`). "
                        f"Default: {CPU_DRAFT_CONFIDENCE:g} on CPU, the whole block on a GPU and with --backend trtllm")
    e.add_argument("--draft-len-schedule", type=parse_draft_len_schedule, default=None, metavar="B:K,...",
                   help="drafts per row by batch size, as TensorRT-LLM's draft_len_schedule: '1:7,4:3,8:0' = 7 drafts "
                        "below 4 rows, 3 below 8, none from 8 rows up")
    e.add_argument("--ngram-lookup", type=int, default=0, metavar="N",
                   help="n-gram lookup drafts: a row whose text ends with a repeat of at least N tokens verifies "
                        "what followed the earlier occurrence instead of the drafter's block (0 = off); output is "
                        "unchanged, only speed (measure with `bench --modes dflash-ngram@N,...`)")
    e.add_argument("--no-draft-vocab", action="store_true",
                   help="draft over the whole vocabulary even when the drafter ships a draft vocabulary "
                        "(draft_vocab.json); output is the same, drafting slower")
    e.add_argument("--max-seq-len", type=int, default=None,
                   help="prompt + generated tokens per sequence (default: the target's context, capped so the KV "
                        f"cache of --max-batch-size sequences fits {KV_CACHE_BUDGET_BYTES >> 20} MiB)")
    e.add_argument("--max-batch-size", type=int, default=8)


def parse_draft_len_schedule(text: str) -> tuple[tuple[int, int], ...]:
    """'1:7,4:3,8:0' -> ((1, 7), (4, 3), (8, 0))."""
    try:
        pairs = tuple((int(a), int(b)) for a, b in (item.split(":") for item in text.split(",") if item.strip()))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected BATCH:DRAFTS pairs like '1:7,4:3,8:0', got '{text}'") from exc
    if not pairs:
        raise argparse.ArgumentTypeError("the schedule is empty")
    return pairs


def format_draft_len_schedule(pairs: tuple[tuple[int, int], ...]) -> str:
    """((1, 7), (4, 3), (8, 0)) -> '1:7,4:3,8:0': the inverse of parse_draft_len_schedule."""
    return ",".join(f"{batch}:{drafts}" for batch, drafts in pairs)


def cache_dir(args: argparse.Namespace) -> Path:
    if args.cache_dir is not None:
        return args.cache_dir
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "dflash_trt"


def drafter_dir(args: argparse.Namespace) -> Path | None:
    """The drafter the flags name: --drafter, the shipped one with the embedded default target, None
    with --no-spec. The target directory is checked first (a wrong --target is the first thing to say)."""
    if args.target is not None:
        require_dir(args.target, "target directory")
        _refuse_build_root(Path(args.target))
    if args.no_spec:
        return None
    if args.drafter is not None:
        return require_dir(args.drafter, "drafter directory")
    if args.target is None:
        if not (SHIPPED_DRAFTER / "config.json").is_file():
            raise ConfigError(f"the shipped drafter is missing at {SHIPPED_DRAFTER}; pass --drafter or --no-spec")
        return SHIPPED_DRAFTER
    raise ConfigError("--drafter is required with --target (or pass --no-spec for autoregressive decoding)")


def _refuse_build_root(target: Path) -> None:
    """A `dflash-trt build` output directory given where its target/ belongs: say how to use it."""
    from dflash_trt.builder.manifest import build_name

    name = build_name(target)
    if name is not None:
        raise ConfigError(f"{target} is the build directory of '{name}', not a checkpoint: pass {target / 'target'} "
                          f"(with --drafter {target / 'drafter'}), or serve it with {target / 'launch' / 'serve.sh'}")


def load_config(args: argparse.Namespace) -> LoadConfig:
    drafter = drafter_dir(args)
    target = args.target
    if target is None:
        from dflash_trt.models.smollm2 import ensure_default_target

        target = ensure_default_target(cache_dir(args))
    return LoadConfig(target=target, drafter=drafter, target_backend=args.target_backend, dtype=args.dtype,
                      cpu_kernels=args.cpu_kernels)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(block_size=args.block_size, max_batch_size=args.max_batch_size,
                        max_seq_len=args.max_seq_len, speculative=not args.no_spec, acceptance=args.acceptance,
                        draft_confidence=args.draft_confidence, draft_len_schedule=args.draft_len_schedule,
                        draft_vocab=not args.no_draft_vocab, ngram_lookup=args.ngram_lookup)


def check_model_flags(args: argparse.Namespace) -> EngineConfig:
    """Every check of the model flags that needs no model, run before one is loaded (or converted):
    the backend, the target and drafter directories, the engine settings, and the block size against the
    drafter's config.json (check_block_size). Returns the engine config."""
    check_backend(args.backend)
    drafter = drafter_dir(args)
    config = engine_config(args)
    if drafter is not None and config.block_size is not None:
        check_block_size(config.block_size, DrafterConfig.load(drafter).block_size, str(drafter))
    return config


def tp_config(args: argparse.Namespace):
    """--tp / --moe-tp-size / --tp-timeout, checked (runtime.mpi.TPConfig)."""
    from dflash_trt.runtime.mpi import TPConfig

    if args.tp < 1:
        raise ConfigError(f"--tp must be >= 1, got {args.tp}")
    return TPConfig(args.tp, args.moe_tp_size, args.tp_timeout)


def trtllm_options(backend: str, tp: int = 1, moe_tp_size: int = 1, llm_args: dict | None = None):
    """--backend trtllm: TensorRT-LLM runs its own tensor/expert parallelism from these LLM arguments
    (None on the torch backend, whose --tp is an MPI job: runtime/mpi.py)."""
    if backend != "trtllm":
        return None
    from dflash_trt.runtime.factory import TrtllmOptions

    llm_args = dict(llm_args or {})
    if tp > 1:
        llm_args["tensor_parallel_size"] = tp
    if moe_tp_size > 1:
        llm_args["moe_tensor_parallel_size"] = moe_tp_size
    return TrtllmOptions(llm_args=llm_args)


def load(args: argparse.Namespace, tp: int = 1, moe_tp_size: int = 1, llm_args: dict | None = None):
    """The backend --backend names, loaded; its availability is checked before the models are resolved
    (the embedded default target is converted on first use)."""
    check_backend(args.backend)
    return load_backend(args.backend, load_config(args), trtllm_options(args.backend, tp, moe_tp_size, llm_args))
