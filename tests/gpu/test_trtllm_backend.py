"""TensorRT-LLM's LLM API with DFlash equals our torch oracle (greedy). Skipped without TensorRT-LLM
and CUDA: it has never been executed in this project's CI."""
from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorrt_llm") is None or not torch.cuda.is_available(),
    reason="needs TensorRT-LLM and a CUDA GPU",
)


def test_trtllm_dflash_matches_torch_oracle(tmp_path):
    from dflash_trt.models.tiny import save_tiny_checkpoint
    from dflash_trt.runtime.loader import ModelSpec, load_models
    from dflash_trt.runtime.trtllm_engine import TrtllmEngine, TrtllmSpec
    from dflash_trt.speculative.decoder import EngineConfig
    from dflash_trt.speculative.sampling import SamplingParams

    target, drafter = save_tiny_checkpoint(tmp_path, "llama", block_size=8, max_position_embeddings=512)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    prompt = [3, 80, 81, 82]
    oracle = load_models(ModelSpec(target=target, drafter=drafter)).engine(EngineConfig(max_seq_len=256))
    expected = oracle.generate([prompt], params)[0].tokens
    engine = TrtllmEngine(TrtllmSpec(target=target, drafter=drafter, max_seq_len=256))
    try:
        assert engine.generate([prompt], params)[0].tokens == expected
    finally:
        engine.shutdown()
