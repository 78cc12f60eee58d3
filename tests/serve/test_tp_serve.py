"""`mpirun -n 2 dflash-trt serve --tp 2`: rank 0 serves HTTP, rank 1 follows; greedy output equals
the single-rank `dflash-trt generate` reference (float64)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from serve_helpers import GREEDY_PROMPT, GREEDY_TOKENS, MAX_SEQ_LEN, free_port, wait_healthy

pytest.importorskip("mpi4py", reason="mpi4py is not installed: pip install -e '.[mpi]'")
MPIRUN = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")


@pytest.mark.slow
@pytest.mark.skipif(MPIRUN is None, reason="no mpirun: pip install -e '.[mpi]'")
def test_tp2_server_matches_single_rank_generate(server, tiny_checkpoint, tmp_path):
    target, drafter = tiny_checkpoint
    port = free_port()
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    log = tmp_path / "tp.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen([MPIRUN, "-n", "2", "--oversubscribe", sys.executable, "-m", "dflash_trt.cli", "serve",
                                 str(target), "--drafter", str(drafter), "--dtype", "float64", "--max-seq-len",
                                 str(MAX_SEQ_LEN), "--port", str(port), "--tp", "2", "--served-model-name", "tiny",
                                 "--log-level", "warning"], stdout=fh, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        body = {"model": "tiny", "prompt": GREEDY_PROMPT, "max_tokens": GREEDY_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == server.reference["tokens"]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
