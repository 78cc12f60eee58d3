"""Fixtures: a tiny checkpoint and one real server for the session (see serve_helpers.py)."""
from __future__ import annotations

import contextlib
import io
import json
import subprocess
from pathlib import Path

import pytest
from serve_helpers import (API_KEY, BLOCK_SIZE, GREEDY_PROMPT, GREEDY_TOKENS, MAX_BATCH, MAX_QUEUE, MAX_SEQ_LEN,
                           PortTaken, Server, cli, free_port, wait_healthy)

from dflash_trt.cli import main


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> tuple[Path, Path]:
    from dflash_trt.models.tiny import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("serve_ckpt"), "llama", block_size=BLOCK_SIZE)


def _start(models: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cli("serve", *models, "--port", str(port), "--api-key", API_KEY,
                                    "--served-model-name", "tiny", "--max-batch-size", str(MAX_BATCH),
                                    "--max-queue", str(MAX_QUEUE), "--log-level", "warning"),
                                stdout=fh, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def server(tiny_checkpoint, tmp_path_factory):
    target, drafter = tiny_checkpoint
    log = tmp_path_factory.mktemp("serve_log") / "server.log"
    # whole blocks (not the CPU default's confidence cut): every step then carries BLOCK_SIZE - 1 drafts,
    # which the metrics tests count on
    models = ["--target", str(target), "--drafter", str(drafter), "--dtype", "float64",
              "--max-seq-len", str(MAX_SEQ_LEN), "--draft-confidence", "0"]
    proc, url = _start(models, log)
    try:
        # `dflash-trt generate --json`, run in this process while the server starts (saves a start-up)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["generate", *models, "--prompt", GREEDY_PROMPT, "--max-new-tokens", str(GREEDY_TOKENS),
                         "--ignore-eos", "--json"]) == 0
        for attempt in range(3):
            try:
                wait_healthy(url, proc, log)
                break
            except PortTaken:
                if attempt == 2:
                    raise
                proc, url = _start(models, log)
        yield Server(url=url, model="tiny", process=proc, log=log, reference=json.loads(out.getvalue()))
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
