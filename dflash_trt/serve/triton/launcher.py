"""Run a real Triton Inference Server from the build that PyPI `nvidia-pytriton` ships.

nvidia-pytriton 0.7.0 bundles tritonserver (2.51) and the Python backend. `assemble_server` copies
its bin/, backends/ and caches/ into one folder (cached; re-made when the pytriton or Python
version changes) and puts the Python backend stub built for this interpreter next to
libtriton_python.so. `server_env` adds what the binaries need: this interpreter's libpython and
the wheel's bundled libraries on LD_LIBRARY_PATH, and this environment's bin/ first on PATH, so
the stub runs the Python where dflash_trt, torch and numpy<2 are installed.

`TritonServer` starts tritonserver on loopback (HTTP, gRPC and metrics all bind `address`), waits
for /v2/health/ready with a timeout (a stub that cannot load hangs in "loading"; a model whose
initialize() fails makes the server exit), reports the log tail when it does not come up, and
stops it with SIGTERM (graceful: in-flight requests finish, models are finalized, the Python
backend's shared-memory regions are removed).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from dflash_trt.errors import BackendUnavailableError, ConfigError

log = logging.getLogger(__name__)

STAMP = ".dflash_trt_tritonserver"
STUB = "triton_python_backend_stub"


def _pytriton_root() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise BackendUnavailableError("Triton needs nvidia-pytriton: pip install 'nvidia-pytriton==0.7.0' "
                                      "(the project's `triton` extra)")
    return Path(spec.origin).parent


def check_python_env() -> None:
    import numpy

    if int(numpy.__version__.split(".")[0]) >= 2:
        raise BackendUnavailableError(f"Triton's Python backend needs numpy<2, this environment has {numpy.__version__}: "
                                      "pip install 'numpy<2'")


def assemble_server(server_dir: Path) -> Path:
    """A tritonserver folder (bin/, backends/, caches/) for this interpreter; returns it."""
    server_dir = Path(server_dir)
    source = _pytriton_root() / "tritonserver"
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    stamp = f"nvidia-pytriton {importlib.metadata.version('nvidia-pytriton')} python {py} {sys.base_prefix}\n"
    if (server_dir / STAMP).is_file() and (server_dir / STAMP).read_text() == stamp:
        return server_dir
    stub = source / "python_backend_stubs" / py / STUB
    if not stub.is_file():
        raise BackendUnavailableError(f"nvidia-pytriton has no Python backend stub for Python {py} ({stub})")
    server_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{server_dir.name}.", dir=server_dir.parent))
    try:
        for part in ("bin", "backends", "caches"):
            shutil.copytree(source / part, staging / part, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(stub, staging / "backends" / "python" / STUB)
        (staging / STAMP).write_text(stamp)
        if server_dir.exists():  # a stale build: move it aside, then swap in the new one
            stale = Path(tempfile.mkdtemp(prefix=f".{server_dir.name}.stale.", dir=server_dir.parent))
            server_dir.rename(stale / "old")
            shutil.rmtree(stale)
        try:
            staging.rename(server_dir)
        except OSError:  # another process finished first; use its copy if it is current
            if not ((server_dir / STAMP).is_file() and (server_dir / STAMP).read_text() == stamp):
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    log.info("assembled tritonserver in %s", server_dir)
    return server_dir


def server_env(base_env: Mapping[str, str]) -> dict[str, str]:
    """`base_env` plus what tritonserver and the Python stub need (see the module docstring)."""
    env = dict(base_env)
    libs = [str(sysconfig.get_config_var("LIBDIR")), str(_pytriton_root().parent / "nvidia_pytriton.libs")]
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(libs)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = f"{bin_dir}:{env['PATH']}" if env.get("PATH") else bin_dir
    return env


@dataclass(frozen=True)
class TritonServerConfig:
    repository: Path
    server_dir: Path  # from assemble_server
    log_file: Path
    address: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    ready_timeout_s: float = 300.0
    exit_timeout_s: int = 30  # in-flight requests may finish this long after SIGTERM
    shm_prefix: str = ""  # the Python backend's /dev/shm region names; "" = dflash_trt_<pid>_<http port>_

    def __post_init__(self) -> None:
        for name in ("http_port", "grpc_port", "metrics_port"):
            if not 1 <= getattr(self, name) <= 65535:
                raise ConfigError(f"{name} must be a TCP port in 1..65535, got {getattr(self, name)}")
        if len({self.http_port, self.grpc_port, self.metrics_port}) != 3:
            raise ConfigError("the HTTP, gRPC and metrics ports must differ")
        if self.ready_timeout_s <= 0 or self.exit_timeout_s < 0:
            raise ConfigError("ready_timeout_s must be > 0 and exit_timeout_s >= 0")


class TritonServer:
    def __init__(self, config: TritonServerConfig, base_env: Mapping[str, str]) -> None:
        if not (Path(config.repository).is_dir() and any(Path(config.repository).glob("*/config.pbtxt"))):
            raise ConfigError(f"{config.repository} is not a model repository (no <model>/config.pbtxt): "
                              "write one with `dflash-trt triton-repo --output REPO`")
        check_python_env()
        self.config = config
        self.env = server_env(base_env)
        self.shm_prefix = config.shm_prefix or f"dflash_trt_{os.getpid()}_{config.http_port}_"
        self.process: subprocess.Popen | None = None
        self.stopping = False

    def command(self) -> list[str]:
        c, root = self.config, Path(self.config.server_dir)
        return [
            str(root / "bin" / "tritonserver"),
            f"--model-repository={Path(c.repository).resolve()}",
            f"--backend-directory={root / 'backends'}",
            f"--cache-directory={root / 'caches'}",
            f"--http-address={c.address}", f"--http-port={c.http_port}",
            f"--grpc-address={c.address}", f"--grpc-port={c.grpc_port}",
            f"--metrics-address={c.address}", f"--metrics-port={c.metrics_port}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            f"--exit-timeout-secs={c.exit_timeout_s}",
        ]

    @property
    def http_url(self) -> str:
        return f"http://{self.config.address}:{self.config.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.config.address}:{self.config.grpc_port}"

    def start(self) -> "TritonServer":
        assert self.process is None, "server already started"
        self.config.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.config.log_file, "wb") as log_out:
            # its own session: a terminal's Ctrl-C reaches only us, and we forward one SIGTERM
            self.process = subprocess.Popen(self.command(), env=self.env, stdout=log_out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        log.info("tritonserver pid %d, log %s", self.process.pid, self.config.log_file)
        return self

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def wait_ready(self) -> None:
        assert self.process is not None, "start() first"
        deadline = time.monotonic() + self.config.ready_timeout_s
        while not self.is_ready():
            if self.process.poll() is not None:
                why = "was stopped" if self.stopping else f"exited with code {self.process.returncode}"
                raise BackendUnavailableError(f"tritonserver {why} before it was ready; log {self.config.log_file}:\n"
                                              f"{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise BackendUnavailableError(
                    f"tritonserver was not ready after {self.config.ready_timeout_s:.0f} s (a model stuck loading?); "
                    f"log {self.config.log_file}:\n{self.log_tail()}")
            time.sleep(0.25)

    def log_tail(self, lines: int = 40) -> str:
        path = Path(self.config.log_file)
        if not path.is_file():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def request_stop(self) -> None:
        """Ask for a graceful shutdown (SIGTERM); safe to call from a signal handler."""
        self.stopping = True
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait(self) -> int:
        assert self.process is not None, "start() first"
        return self.process.wait()

    def stop(self, grace_s: float | None = None) -> int:
        """SIGTERM, wait up to the exit timeout plus `grace_s`, then SIGKILL. Returns the exit code."""
        if self.process is None:
            return 0
        self.request_stop()
        try:
            return self.process.wait(timeout=self.config.exit_timeout_s + (10.0 if grace_s is None else grace_s))
        except subprocess.TimeoutExpired:
            log.warning("tritonserver did not stop in time: killing it")
            self.process.kill()
            return self.process.wait()

    def __enter__(self) -> "TritonServer":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
