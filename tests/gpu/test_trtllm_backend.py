"""The real TensorRT-LLM behind the engine seam equals our torch oracle (greedy), through the factory and
through the scheduler. Skipped without TensorRT-LLM and CUDA: it has never been executed in this
project's CI (tests/runtime/test_backends.py runs the same contract against a stand-in LLM)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is None or not torch.cuda.is_available(),
                       reason="needs TensorRT-LLM and a CUDA GPU"),
]


def test_trtllm_dflash_matches_torch_oracle(tmp_path):
    from dflash_trt.engine import EngineConfig, SamplingParams
    from dflash_trt.models.tiny import save_tiny_checkpoint
    from dflash_trt.runtime.factory import LoadConfig, load_backend
    from dflash_trt.runtime.scheduler import FinalEvent, Scheduler

    target, drafter = save_tiny_checkpoint(tmp_path, "llama", block_size=8, max_position_embeddings=512)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    prompt = [3, 80, 81, 82]
    config = EngineConfig(max_seq_len=256, max_batch_size=2)
    oracle = load_backend("torch", LoadConfig(target, drafter)).engine(config)
    expected = oracle.generate([prompt], params)[0].tokens
    engine = load_backend("trtllm", LoadConfig(target, drafter)).engine(config)
    try:
        assert engine.speculative and engine.block_size == 8
        assert engine.generate([prompt], params)[0].tokens == expected
        scheduler = Scheduler(engine)
        handle = scheduler.submit(prompt, params)
        for _ in range(64):
            scheduler.run_once()
        events = handle.drain()
        assert isinstance(events[-1], FinalEvent) and events[-1].result.tokens == expected
    finally:
        engine.shutdown()


def test_the_pinned_field_names_equal_the_installed_release():
    """dflash_trt/data/trtllm_<release>_llm_api.json was transcribed from upstream sources; inside the
    pinned container the installed tensorrt_llm is the authority."""
    import tensorrt_llm

    from dflash_trt.trtllm_release import installed_fields, pinned

    release = pinned()
    assert tensorrt_llm.__version__ == release.version, "run this in the pinned container"
    installed = installed_fields()
    for cls, names in installed.items():
        assert set(names) == release.classes[cls].declared, cls


def test_the_drafter_attention_backend_follows_this_gpu():
    from dflash_trt.runtime.trtllm import TRTLLM_ATTENTION_SM, dflash_attention_backend

    capability = torch.cuda.get_device_capability(0)
    expected = "TRTLLM" if tuple(capability) in TRTLLM_ATTENTION_SM else "VANILLA"
    assert dflash_attention_backend(capability) == expected
