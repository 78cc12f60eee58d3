"""The trtllm backend's argument mapping (runs everywhere) and its clear failure without TensorRT-LLM."""
from __future__ import annotations

import importlib.util

import pytest
import yaml

from dflash_trt.errors import BackendUnavailableError, ConfigError
from dflash_trt.models.tiny import save_tiny_checkpoint
from dflash_trt.runtime.trtllm_engine import TrtllmEngine, TrtllmSpec, llm_kwargs, speculative_config


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("trt"), "qwen3", block_size=16)


def test_speculative_config_follows_the_drafter(ckpt):
    target, drafter = ckpt
    cfg = speculative_config(TrtllmSpec(target=target, drafter=drafter))
    assert cfg["decoding_type"] == "DFlash" and cfg["max_draft_len"] == 15
    assert cfg["mask_token_id"] == 4 and cfg["target_layer_ids"] == [1, 3]
    assert cfg["speculative_model"] == str(drafter.resolve())
    yaml.safe_load(yaml.safe_dump({"speculative_config": cfg}))  # the trtllm-serve --config shape
    kwargs = llm_kwargs(TrtllmSpec(target=target, drafter=drafter, max_draft_len=7, tensor_parallel_size=8,
                                   moe_expert_parallel_size=4))
    assert kwargs["speculative_config"]["max_draft_len"] == 7
    assert kwargs["tensor_parallel_size"] == 8 and kwargs["moe_expert_parallel_size"] == 4
    assert "speculative_config" not in llm_kwargs(TrtllmSpec(target=target, drafter=None))


def test_bad_values_are_config_errors(ckpt):
    target, drafter = ckpt
    with pytest.raises(ConfigError, match="max_draft_len"):
        speculative_config(TrtllmSpec(target=target, drafter=drafter, max_draft_len=0))
    with pytest.raises(ConfigError, match="attention_backend"):
        TrtllmSpec(target=target, drafter=drafter, attention_backend="FLASH")


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None, reason="TensorRT-LLM is installed")
def test_without_tensorrt_llm_the_error_says_what_is_missing(ckpt):
    target, drafter = ckpt
    with pytest.raises(BackendUnavailableError, match="TensorRT-LLM"):
        TrtllmEngine(TrtllmSpec(target=target, drafter=drafter))
