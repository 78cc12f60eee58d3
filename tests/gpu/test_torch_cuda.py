"""The torch backend on CUDA: greedy DFlash on the GPU equals the CPU oracle. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from dflash_trt.models.target import native_from_hf
from dflash_trt.models.tiny import TINY_ARCHS, build_tiny_drafter, build_tiny_target
from dflash_trt.engine import EngineConfig, SamplingParams
from dflash_trt.speculative.decoder import DFlashEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_cuda_greedy_equals_cpu(arch):
    hf = build_tiny_target(arch, seed=2, dtype=torch.float64)
    drafter = build_tiny_drafter(hf.config, seed=2, dtype=torch.float64, num_layers=2, block_size=8)
    prompts = [[5, 6, 7], list(range(30, 50))]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    cpu = DFlashEngine(native_from_hf(hf), drafter, EngineConfig(max_seq_len=128, max_batch_size=2)).generate(prompts, params)
    gpu_target = native_from_hf(hf).to("cuda")
    engine = DFlashEngine(gpu_target, drafter.to("cuda"), EngineConfig(max_seq_len=128, max_batch_size=2))
    assert engine.config.draft_confidence == 0.0  # the default on a GPU: whole blocks (EngineConfig.on_device)
    gpu = engine.generate(prompts, params)
    assert [r.tokens for r in gpu] == [r.tokens for r in cpu]
