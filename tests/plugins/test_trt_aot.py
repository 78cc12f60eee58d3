"""TensorRT plugin bindings without TensorRT: the missing-backend error, and the AOT path
(real PTX for sm_90 from Triton's compiler) driven through a stand-in tensorrt.plugin."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_trt.errors import BackendUnavailableError
from plugins.kernels import triton_available
from plugins.trt import register_plugins

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="tensorrt present")
def test_register_without_tensorrt_says_what_to_install():
    with pytest.raises(BackendUnavailableError, match="need the `tensorrt` package"):
        register_plugins()


@pytest.mark.skipif(not triton_available(), reason="needs triton")
@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None,
                    reason="the stand-in would shadow the real tensorrt; see tests/gpu")
def test_qdp_definitions_against_stand_in():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, str(HERE / "trt_stub_check.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["kinds"] == {pid: ["aot_impl", "autotune", "impl", "register"]
                               for pid in ("dflash::accept_tokens", "dflash::pack_taps")}
    assert report["accept_out_shapes"] == [[3], [3], [3]]
    assert report["accept_aot"] == {"name": "accept_kernel", "entry": True, "grid_x": 1,
                                    "scalars": [3, 15], "block_x": report["accept_aot"]["block_x"]}
    assert report["accept_aot"]["block_x"] % 32 == 0
    assert report["pack_out"] == [[[2, 16, 5 * 2880], "bfloat16"], [[2], "int64"]]
    assert report["pack_aot"] == {"name": "pack_taps_kernel", "bf16": True, "grid": [32, 5, 3],
                                  "scalars": [2, 16, 2880]}
    assert "block_k=8 must be >= K=15" in report["block_k_error"]


@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_aot_compile_refuses_interpreted_kernels():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("kernels are compiled, not interpreted, in this process")
    from plugins.trt.aot import compile_accept

    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
        compile_accept(16, 90)
