"""`dflash-trt serve`: an OpenAI-compatible HTTP server with DFlash speculative decoding.

  dflash-trt serve [MODEL] [--drafter DIR] [--config cfg.yaml] [--host 127.0.0.1] [--port 8000]
                   [--api-key KEY] [--max-batch-size N] [--max-queue N] ...

MODEL is the target checkpoint directory (same as --target); with none, the embedded default is
served. `--config` takes the YAML that `trtllm-serve --config` takes, e.g.
  speculative_config: {decoding_type: DFlash, max_draft_len: 15, speculative_model: /path/to/drafter}
  max_batch_size: 16
  max_seq_len: 4096
Values from the file apply as if given as flags (max_draft_len N -> --block-size N+1,
speculative_model -> --drafter, use_rejection_sampling -> --acceptance rejection); a flag given
explicitly with a different value is an error. --backend trtllm serves TensorRT-LLM's engine behind the
same server (the file's TensorRT-LLM runtime keys go to it). Endpoints: /v1/models, /v1/completions,
/v1/chat/completions, /health, /metrics. Binds to loopback unless --host says otherwise.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from dflash_trt.commands.common import add_backend_flag, add_model_flags, check_model_flags, load, load_config, tp_config
from dflash_trt.errors import ConfigError

# flag dest -> ServeOverrides field, for the --config file
_OVERRIDABLE = {"drafter": "drafter", "block_size": "block_size", "no_spec": "no_spec", "acceptance": "acceptance",
                "max_batch_size": "max_batch_size", "max_seq_len": "max_seq_len", "max_num_tokens": "max_num_tokens",
                "max_input_len": "max_input_len", "dtype": "dtype", "tp": "tensor_parallel_size"}


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server (continuous batching, DFlash)", description=__doc__)
    p.add_argument("model", nargs="?", type=Path, default=None, help="target checkpoint directory (same as --target)")
    p.add_argument("--config", "--extra_llm_api_options", dest="config", type=Path, default=None,
                   help="trtllm-serve style YAML: speculative_config + LLM-API keys (unknown keys are errors)")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every /v1 route")
    s.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the build's name when MODEL is a build's target/, "
                        "else MODEL as given)")
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: `mpirun -n N dflash-trt serve --tp N`")
    s.add_argument("--moe-tp-size", type=int, default=1,
                   help="with --tp: ranks splitting each expert's intermediate dim (the rest split the experts)")
    s.add_argument("--tp-timeout", type=float, default=300.0, help="with --tp: seconds before a stuck collective fails")
    s.add_argument("--max-queue", type=int, default=256, help="waiting requests beyond the batch; more get 429")
    s.add_argument("--max-num-tokens", type=int, default=4096, help="tokens one decode step may process")
    s.add_argument("--max-input-len", type=int, default=None, help="refuse longer prompts with 400")
    s.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="info")
    add_backend_flag(p)
    add_model_flags(p)
    p.set_defaults(func=run, _serve_parser=p, _trtllm_args={})


def _apply_config(args: argparse.Namespace) -> None:
    """Fold the --config file into args (in place); an explicit flag that disagrees is an error.
    Top-level keys that only tune TensorRT-LLM's runtime go to it with --backend trtllm."""
    from dflash_trt.config import DrafterConfig
    from dflash_trt.serve.config import check_against_drafter, load_llm_api_config, resolve_overrides

    over = resolve_overrides(load_llm_api_config(args.config))
    args._trtllm_args = dict(over.trtllm_args)
    tp = over.tensor_parallel_size
    if tp is not None and tp > 1 and args.tp != tp:
        raise ConfigError(f"{args.config} sets tensor_parallel_size: {tp}: launch with --tp {tp} "
                          f"(under mpirun -n {tp}) or remove the key")
    parser: argparse.ArgumentParser = args._serve_parser
    for dest, name in _OVERRIDABLE.items():
        value = getattr(over, name)
        if value is None:
            continue
        current, default = getattr(args, dest), parser.get_default(dest)
        if current != default and current != value:
            flag = "--" + dest.replace("_", "-")
            raise ConfigError(f"{args.config} sets {name}={value} but {flag} is {current}: give it in one place")
        setattr(args, dest, value)
    if over.mask_token_id is not None or over.target_layer_ids is not None or over.block_size is not None:
        if args.drafter is not None and not args.no_spec:
            check_against_drafter(over, DrafterConfig.load(args.drafter), str(args.drafter))
        elif over.mask_token_id is not None or over.target_layer_ids is not None:
            raise ConfigError("speculative_config.mask_token_id / target_layer_ids need a drafter to check against: "
                              "set speculative_model or --drafter")


def served_model_name(args: argparse.Namespace) -> str:
    """--served-model-name, else the build's name for a build's target/ (its manifest names it), else
    MODEL as given (as vLLM and trtllm-serve do); the embedded default serves under its folder's name."""
    if args.served_model_name is not None:
        return args.served_model_name
    if args.target is None:
        from dflash_trt.models.smollm2 import DEFAULT_CACHE_SUBDIR

        return DEFAULT_CACHE_SUBDIR
    from dflash_trt.builder.manifest import build_name

    name = build_name(Path(args.target).parent)
    return name if name is not None else str(args.target)


def _server_config(args: argparse.Namespace):
    from dflash_trt.serve.config import OpenAIServerConfig

    return OpenAIServerConfig(served_model_name=served_model_name(args), host=args.host, port=args.port,
                              api_key=args.api_key, max_input_len=args.max_input_len, log_level=args.log_level)


def _scheduler_config(args: argparse.Namespace):
    from dflash_trt.runtime.scheduler import SchedulerConfig

    if args.max_queue < 0:
        raise ConfigError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.max_num_tokens < 1:
        raise ConfigError(f"--max-num-tokens must be >= 1, got {args.max_num_tokens}")
    return SchedulerConfig(max_queue=args.max_queue, token_budget=args.max_num_tokens)


def run(args: argparse.Namespace) -> int:
    if args.model is not None:
        if args.target is not None and args.target != args.model:
            raise ConfigError(f"MODEL ({args.model}) and --target ({args.target}) disagree: give one of them")
        args.target = args.model
    if args.config is not None:
        _apply_config(args)
    # every check that needs no model, then the port, then the models
    eng = check_model_flags(args)
    tp = tp_config(args)
    sched = _scheduler_config(args)
    server = _server_config(args)
    from dflash_trt.serve.openai_server import bind_socket, serve

    listening = []  # the socket rank 0 (or the only process) bound before loading

    def load_after_binding():
        listening.append(bind_socket(server.host, server.port))
        return load_config(args)

    def lead(models, engine) -> int:  # rank 0 (or the only rank) serves HTTP
        return serve(models, engine, sched, server, listening[0])

    if args.backend == "torch" and args.tp > 1:
        from dflash_trt.runtime.mpi import tp_main

        return tp_main(tp, load_after_binding, eng, lead)
    listening.append(bind_socket(server.host, server.port))
    models = load(args, args.tp, args.moe_tp_size, args._trtllm_args)
    engine = models.engine(eng)
    try:
        return lead(models, engine)
    finally:
        engine.shutdown()
