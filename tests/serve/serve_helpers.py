"""Helpers for the serve tests. The session runs one real `dflash-trt serve` process (a tiny
float64 Llama + a random DFlash drafter, on a free loopback port, with an API key) and runs
`dflash-trt generate --json` for the reference output in parallel with its start-up."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

API_KEY = "test-key-123"
MAX_SEQ_LEN = 512
MAX_BATCH = 8
MAX_QUEUE = 24  # 8 running + 24 waiting = 32 requests in flight before 429
BLOCK_SIZE = 8
GREEDY_PROMPT = "Hello there, DFlash!"
GREEDY_TOKENS = 24
STARTUP_TIMEOUT_S = 90


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "dflash_trt.cli", *args]


@dataclass
class Server:
    url: str
    model: str
    process: subprocess.Popen
    log: Path
    reference: dict  # `dflash-trt generate --json` for GREEDY_PROMPT

    def client(self, **kw) -> httpx.Client:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60, **kw)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


BIND_ERROR = "is already in use"  # `dflash-trt serve` when the port was taken between our probe and its bind


class PortTaken(Exception):
    """Another process took the free port between our probe and the server's bind: retry."""


def wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            if BIND_ERROR in log.read_text():
                raise PortTaken(url)
            pytest.fail(f"the server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail(f"the server was not healthy within {STARTUP_TIMEOUT_S} s:\n{log.read_text()}")
