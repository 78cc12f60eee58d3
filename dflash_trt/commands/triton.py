"""`dflash-trt triton-repo` and `dflash-trt triton-serve`: DFlash on Triton Inference Server.

triton-repo writes a model repository (Python backend) that is a drop-in for TensorRT-LLM's LLM-API
Triton model: the same input and output tensors (text_input, streaming, sampling_param_*,
return_* -> text_output, finish_reason, stop_reason, perf metrics), unary requests by default
(triton_config.decoupled: false in 1/model.yaml, as upstream) and streaming with --decoupled.
With --config the model settings come from a YAML (schema in dflash_trt/serve/triton/settings.py);
model flags that are given with a value other than their default override it.

triton-serve starts nvidia-pytriton's bundled tritonserver on that repository (loopback by
default), waits until it is ready, and stops it cleanly on SIGTERM / Ctrl-C.
"""
from __future__ import annotations

import argparse
import os
import signal
import tempfile
from pathlib import Path

from dflash_trt.commands.common import CACHE_ENV, add_backend_flag, add_model_flags, check_model_flags, load_config
from dflash_trt.errors import DFlashError

REPO_FLAGS = {  # flag dest -> (section or None, settings key)
    "target": (None, "target"), "drafter": (None, "drafter"), "target_backend": (None, "target_backend"),
    "dtype": (None, "dtype"), "cpu_kernels": (None, "cpu_kernels"), "model_name": (None, "model_name"), "backend": (None, "backend"),
    "chat": (None, "chat"), "default_max_tokens": (None, "default_max_tokens"), "torch_threads": (None, "torch_threads"),
    "block_size": ("engine", "block_size"), "acceptance": ("engine", "acceptance"),
    "max_seq_len": ("engine", "max_seq_len"), "max_batch_size": ("engine", "max_batch_size"),
    "max_queue": ("scheduler", "max_queue"), "token_budget": ("scheduler", "token_budget"),
    "decoupled": ("triton_config", "decoupled"),
    "draft_confidence": ("engine", "draft_confidence"), "draft_len_schedule": ("engine", "draft_len_schedule"),
    "no_draft_vocab": ("engine", "draft_vocab"), "ngram_lookup": ("engine", "ngram_lookup"),
}


def register(sub) -> None:
    p = sub.add_parser("triton-repo", help="write a Triton model repository that serves DFlash",
                       description=__doc__)
    p.add_argument("--config", type=Path, default=None, help="model settings YAML (see dflash_trt/serve/triton/settings.py)")
    p.add_argument("--output", type=Path, required=True, help="the model repository folder (created if missing)")
    p.add_argument("--model-name", default="dflash", help="Triton model name (default: dflash)")
    p.add_argument("--chat", action="store_true", help="wrap text_input in the target's chat template")
    p.add_argument("--default-max-tokens", type=int, default=128, help="when a request has no sampling_param_max_tokens")
    p.add_argument("--torch-threads", type=int, default=None, help="torch threads in the model process (default: torch's)")
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests beyond the running batch")
    p.add_argument("--token-budget", type=int, default=4096, help="tokens one scheduler step may process")
    p.add_argument("--decoupled", action="store_true",
                   help="streaming model (decoupled transaction policy); default: unary requests, as upstream")
    p.add_argument("--force", action="store_true", help="replace an existing model folder")
    add_backend_flag(p)
    add_model_flags(p)
    p.set_defaults(func=lambda args: run_repo(args, p))

    s = sub.add_parser("triton-serve", help="start tritonserver on a DFlash model repository",
                       description=__doc__)
    s.add_argument("repository", type=Path, help="model repository written by triton-repo")
    s.add_argument("--address", default="127.0.0.1", help="address HTTP, gRPC and metrics bind to (default: loopback)")
    s.add_argument("--http-port", type=int, default=8000)
    s.add_argument("--grpc-port", type=int, default=8001)
    s.add_argument("--metrics-port", type=int, default=8002)
    s.add_argument("--server-dir", type=Path, default=None,
                   help=f"where tritonserver is assembled (default: ${CACHE_ENV} or ~/.cache/dflash_trt, /tritonserver)")
    s.add_argument("--log-file", type=Path, default=None, help="tritonserver's log (default: a new file in the temp dir)")
    s.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for readiness")
    s.add_argument("--exit-timeout", type=int, default=30, help="seconds in-flight requests get after SIGTERM")
    s.set_defaults(func=run_serve)


def _settings_dict(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[dict, Path]:
    """The model settings as a dict, and the folder relative paths are taken from."""
    if args.config is not None:
        from dflash_trt.serve.triton.settings import TritonSettings

        raw = TritonSettings.load(args.config).model_dump(mode="json")
        base = args.config.resolve().parent
        given = {dest for dest in REPO_FLAGS if getattr(args, dest) != parser.get_default(dest)}
        if args.no_spec:
            raw["engine"]["speculative"], raw["drafter"] = False, None
    else:
        load = load_config(args)  # resolves the embedded default target and the shipped drafter
        raw = {"engine": {"speculative": not args.no_spec}, "scheduler": {}, "triton_config": {}}
        raw["target"], raw["drafter"] = str(load.target), None if load.drafter is None else str(load.drafter)
        base = Path.cwd()
        given = set(REPO_FLAGS) - {"target", "drafter"}
    for dest in given:
        section, key = REPO_FLAGS[dest]
        value = getattr(args, dest)
        value = str(value) if isinstance(value, Path) else value
        if dest == "no_draft_vocab":
            value = not value
        if dest == "draft_len_schedule" and value is not None:
            value = [list(pair) for pair in value]
        (raw if section is None else raw[section])[key] = value
    return raw, base


def run_repo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from dflash_trt.runtime.factory import check_backend
    from dflash_trt.serve.triton.repo import write_repository
    from dflash_trt.serve.triton.settings import TritonSettings

    if args.config is None:
        check_model_flags(args)  # before the default target is resolved (converted on first use)
    raw, base = _settings_dict(args, parser)
    settings = TritonSettings.from_dict(raw, "triton-repo").resolved(base)
    check_backend(settings.backend)  # the model loads it at startup: fail here, in one line, if it cannot run
    settings.check_paths()
    folder = write_repository(settings, args.output, overwrite=args.force)
    print(f"wrote model '{settings.model_name}' ({settings.backend} backend) to {folder}")
    print(f"serve it with: dflash-trt triton-serve {args.output}")
    return 0


def _server_dir(args: argparse.Namespace) -> Path:
    if args.server_dir is not None:
        return args.server_dir
    env = os.environ.get(CACHE_ENV)
    return (Path(env) if env else Path.home() / ".cache" / "dflash_trt") / "tritonserver"


def run_serve(args: argparse.Namespace) -> int:
    from dflash_trt.serve.triton.launcher import TritonServerConfig, TritonServer, assemble_server

    log_file = args.log_file
    if log_file is None:
        fd, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
        os.close(fd)
        log_file = Path(name)
    config = TritonServerConfig(repository=args.repository, server_dir=assemble_server(_server_dir(args)), log_file=log_file,
                          address=args.address, http_port=args.http_port, grpc_port=args.grpc_port,
                          metrics_port=args.metrics_port, ready_timeout_s=args.ready_timeout,
                          exit_timeout_s=args.exit_timeout)
    server = TritonServer(config, os.environ)
    previous = {sig: signal.signal(sig, lambda *_: server.request_stop()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.start()
        print(f"tritonserver starting (log: {log_file})", flush=True)
        try:
            server.wait_ready()
        except DFlashError:
            server.stop()
            raise
        print(f"ready: HTTP {server.http_url}  gRPC {server.grpc_url}  "
              f"metrics http://{args.address}:{args.metrics_port}/metrics", flush=True)
        code = server.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(f"tritonserver stopped (exit code {code})", flush=True)
    return 0 if code == 0 else max(code, 1)
