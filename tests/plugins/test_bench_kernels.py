"""plugins.bench_kernels: exits 2 with a clear message without CUDA; table formatting."""
from __future__ import annotations

import pytest
import torch

from plugins.bench_kernels import Timing, format_table, main


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the benchmark would run")
def test_without_cuda_exits_2(capsys):
    assert main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_table_reports_ratio():
    table = format_table([Timing("pack_taps", "B=8", torch_ms=0.5, triton_ms=0.25)])
    assert "pack_taps" in table and "2.00x" in table
