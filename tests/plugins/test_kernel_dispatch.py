"""Dispatch API: path choice, one log line per path, lazy triton import, missing triton."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_cases import i64, needs_interpreter

import plugins.kernels as kernels
from dflash_trt.errors import BackendUnavailableError
from dflash_trt.speculative.verify import accept_tokens  # the acceptance dispatch lives with the rule

ROOT = Path(__file__).resolve().parents[2]


def _accept_args():
    return i64([[1, 2]]), i64([[1, 3, 4]]), i64([2]), i64([5])


def test_cpu_tensors_take_reference_and_log_once(caplog, monkeypatch):
    monkeypatch.setattr(kernels, "_logged", set())
    with caplog.at_level(logging.INFO, logger="plugins.kernels"):
        accept_tokens(*_accept_args())
        out = accept_tokens(*_accept_args())
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["accept_tokens: torch reference on cpu"]
    assert out.accepted.tolist() == [1] and out.bonus.tolist() == [3] and out.new_pos.tolist() == [7]


@needs_interpreter
def test_force_triton_logs_triton_path(caplog, monkeypatch):
    monkeypatch.setattr(kernels, "_logged", set())
    with caplog.at_level(logging.INFO, logger="plugins.kernels"):
        accept_tokens(*_accept_args(), force_triton=True)
    assert [r.getMessage() for r in caplog.records] == [
        "accept_tokens: Triton kernel (forced) on cpu"]


def test_force_triton_without_triton_raises(monkeypatch):
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    with pytest.raises(BackendUnavailableError, match="pip install"):
        kernels.pack_taps(torch.zeros(1, 1, 2, 3), i64([0]), force_triton=True)


@pytest.mark.skipif(not kernels.triton_available(), reason="needs triton")
def test_force_triton_on_cpu_without_interpreter_says_so():
    code = (
        "import os, torch, triton; os.environ['TRITON_INTERPRET'] = '1'\n"
        "from dflash_trt.errors import BackendUnavailableError\n"
        "from dflash_trt.speculative.verify import accept_tokens\n"
        "t = torch.tensor([[1, 2, 3]])\n"
        "try:\n"
        "    accept_tokens(t[:, :2], t, torch.tensor([2]), torch.tensor([0]), force_triton=True)\n"
        "except BackendUnavailableError as exc:\n"
        "    assert 'imported in compiled mode' in str(exc), exc\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=120)


def test_import_does_not_import_triton_or_tensorrt():
    code = ("import sys, plugins.kernels, plugins.trt; "
            "assert 'triton' not in sys.modules and 'tensorrt' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
