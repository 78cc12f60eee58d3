"""The Triton model on the trtllm backend with a real TensorRT-LLM and a real tritonserver: unary and
streaming answers equal the torch oracle's greedy text, and a two-rank MPI world (model.yaml
mpi: world) serves through rank 0's MpiCommSession, as TensorRT-LLM's LLM-API Triton model does.
Skipped without TensorRT-LLM, tritonserver on PATH and two CUDA GPUs (the pinned Triton image,
docker/Dockerfile.triton, has all three): never executed in this project's CI."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is None or shutil.which("tritonserver") is None
                       or not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs TensorRT-LLM, tritonserver and two CUDA GPUs"),
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def _wait_ready(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-4000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(2)
    pytest.fail("tritonserver not ready:\n" + log.read_text()[-4000:])


@pytest.mark.parametrize("world", [False, True], ids=["spawn", "mpi-world"])
def test_trtllm_triton_model_matches_the_torch_oracle(tmp_path, world):
    from dflash_trt import cli
    from dflash_trt.models.tiny import save_tiny_checkpoint
    from dflash_trt.serve.triton.settings import TritonSettings

    target, drafter = save_tiny_checkpoint(tmp_path / "ckpt", "llama", block_size=8, max_position_embeddings=512)
    flags = ["--target", str(target), "--drafter", str(drafter), "--max-seq-len", "256", "--default-max-tokens", "16"]
    for name, extra in (("m", []), ("s", ["--decoupled"])):
        assert cli.main(["triton-repo", "--output", str(tmp_path / "repo"), "--model-name", name, *extra, *flags]) == 0
    for name in ("m", "s"):  # the trtllm backend, TP2, spawned workers or an MPI world
        path = tmp_path / "repo" / name / "1" / "model.yaml"
        raw = TritonSettings.load(path).model_dump(mode="json")
        raw.update(backend="trtllm", mpi="world" if world else "spawn", trtllm_llm_args={"tensor_parallel_size": 2})
        path.write_text(TritonSettings.from_dict(raw, str(path)).to_yaml())
    port, log = _port(), tmp_path / "triton.log"
    cmd = ["bash", str(ROOT / "docker/slurm/triton_rank.sh"), str(tmp_path / "repo"), str(port)]
    if world:
        cmd = [str(Path(sys.executable).parent / "mpirun"), "-n", "2", "--oversubscribe", *cmd]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        _wait_ready(proc, port, log)
        expected = subprocess.run([sys.executable, "-m", "dflash_trt.cli", "generate", "--prompt", "Hello", "--json",
                                   "--max-new-tokens", "16", "--target", str(target), "--drafter", str(drafter)],
                                  capture_output=True, text=True, check=True, cwd=ROOT)
        text = json.loads(expected.stdout)["text"]
        body = {"text_input": "Hello", "sampling_param_max_tokens": 16, "sampling_param_exclude_input_from_output": True}
        assert _post(f"http://127.0.0.1:{port}/v2/models/m/generate", body)["text_output"] == text
        stream = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/s/generate_stream",
                                        data=json.dumps({**body, "streaming": True}).encode())
        with urllib.request.urlopen(stream, timeout=300) as resp:
            events = [json.loads(x[6:]) for x in resp.read().decode().splitlines() if x.startswith("data: ")]
        assert events[-1]["text_output"] == text
    finally:
        proc.terminate()
        proc.wait(timeout=120)
