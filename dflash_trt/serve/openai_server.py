"""The OpenAI-compatible server over the continuous-batching Scheduler (entry points).

`create_app(models, engine, scheduler_config, server_config)` builds the ASGI app over an engine
(`models.engine(config)`, or rank 0's broadcasting engine of a TP job; the scheduler thread
starts with the app); `serve(...)` runs it under uvicorn until interrupted. The modules behind it:
- config.py: the trtllm-serve `--config` YAML (speculative_config and LLM-API keys) and OpenAIServerConfig;
- schemas.py: strict OpenAI request bodies and the OpenAI error shape;
- app.py: routes, SSE streaming, auth, cancellation on disconnect;
- bridge.py: scheduler events -> asyncio, incremental detokenization with stop strings;
- metrics.py: Prometheus metrics (vLLM-style spec-decode counters under `dflash:`).
"""
from __future__ import annotations

import errno
import ipaddress
import logging
import socket

from dflash_trt.engine import Engine
from dflash_trt.errors import ConfigError
from dflash_trt.runtime.scheduler import Scheduler, SchedulerConfig
from dflash_trt.serve.app import ServerState, build_app
from dflash_trt.serve.config import OpenAIServerConfig
from dflash_trt.serve.metrics import ServerMetrics

log = logging.getLogger(__name__)


def create_app(models, engine: Engine, scheduler_config: SchedulerConfig,
               server_config: OpenAIServerConfig):
    scheduler = Scheduler(engine, scheduler_config)
    metrics = ServerMetrics(num_positions=engine.block_size - 1, running=lambda: scheduler.num_running,
                            waiting=lambda: scheduler.queue_depth, model_name=server_config.served_model_name)
    detokenize = models.detokenize if models.tokenizer is not None else None
    state = ServerState(scheduler=scheduler, config=server_config, tokenizer=models.tokenizer,
                        detokenize=detokenize, metrics=metrics)
    return build_app(state)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound now (as uvicorn binds it: SO_REUSEADDR, IPv6 for a ':' host),
    so that a busy port is one ConfigError before any model is loaded (trtllm-serve binds first too);
    `serve` listens on it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} on {host} is already in use (another server?): stop it or pick another "
                              "--port") from None
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}: check --host and --port") from None
    return sock


def serve(models, engine: Engine, scheduler_config: SchedulerConfig,
          server_config: OpenAIServerConfig, sock: socket.socket | None = None) -> int:
    """Run the server in this thread until SIGINT/SIGTERM, on `sock` (bind_socket; bound here when None)."""
    import uvicorn

    if not _is_loopback(server_config.host) and server_config.api_key is None:
        log.warning("serving on %s without --api-key: anyone who can reach this address can use the model",
                    server_config.host)
    if sock is None:
        sock = bind_socket(server_config.host, server_config.port)
    app = create_app(models, engine, scheduler_config, server_config)
    config = uvicorn.Config(app, host=server_config.host, port=server_config.port,
                            log_level=server_config.log_level, access_log=False, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
    return 0
