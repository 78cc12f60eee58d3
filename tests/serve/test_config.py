"""The trtllm-serve style `--config` YAML: strict keys, mapping onto our settings, drafter checks."""
from __future__ import annotations

import logging
import re

import pytest
import yaml

from dflash_trt.cli import main
from dflash_trt.config import DrafterConfig
from dflash_trt.errors import ConfigError
from dflash_trt.serve.config import (ServeOverrides, check_against_drafter, load_llm_api_config,
                                     parse_llm_api_config, resolve_overrides)

TRTLLM_EXAMPLE = """
speculative_config:
  decoding_type: DFlash
  max_draft_len: 15
  speculative_model: /models/drafter
  use_rejection_sampling: true
max_batch_size: 16
max_seq_len: 4096
max_num_tokens: 8192
dtype: bfloat16
"""


def test_trtllm_serve_example_maps_onto_our_settings(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(TRTLLM_EXAMPLE)
    over = resolve_overrides(load_llm_api_config(path))
    assert over.block_size == 16 and over.no_spec is False  # max_draft_len + 1
    assert str(over.drafter) == "/models/drafter" and over.acceptance == "rejection"
    assert (over.max_batch_size, over.max_seq_len, over.max_num_tokens, over.dtype) == (16, 4096, 8192, "bfloat16")
    assert over.ignored == ()


def test_max_draft_len_zero_is_autoregressive():
    over = resolve_overrides(parse_llm_api_config({"speculative_config": {"decoding_type": "DFlash",
                                                                          "max_draft_len": 0}}))
    assert over.no_spec is True and over.block_size == 1


@pytest.mark.parametrize("raw,needle", [
    ({"max_batch_sise": 8}, "max_batch_sise"),
    ({"speculative_config": {"decoding_type": "DFlash", "draft_len": 3}}, "speculative_config.draft_len"),
    ({"max_batch_size": "8"}, "max_batch_size"),
    ({"max_batch_size": 0}, "max_batch_size"),
    ({"speculative_config": {"decoding_type": "Eagle3", "max_draft_len": 3}}, "DFlash only"),
    ({"speculative_config": {"decoding_type": "DFlash", "max_draft_len": 3, "max_total_draft_tokens": 9}}, "tree"),
    ({"max_beam_width": 4}, "beam"),
    ({"context_parallel_size": 2}, "context_parallel_size"),
    ({"lora_config": {"lora_dir": ["/x"]}}, "lora_config"),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
    ({"enable_lora": True}, "enable_lora"),
    ({"kv_cache_config": {"dtype": "fp8"}}, "kv_cache_config.dtype"),
    ([1, 2], "mapping"),
])
def test_bad_configs_are_errors_naming_the_key(raw, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        resolve_overrides(parse_llm_api_config(raw))


def test_keys_without_effect_are_listed_in_one_warning(caplog):
    raw = {"kv_cache_config": {"free_gpu_memory_fraction": 0.9}, "cuda_graph_config": None,
           "attn_backend": "VANILLA", "enable_chunked_prefill": True,
           "speculative_config": {"decoding_type": "DFlash", "max_draft_len": 7, "attention_backend": "TRTLLM",
                                  "max_concurrency": 4, "context_recompute_tail": 8}}
    with caplog.at_level(logging.WARNING, logger="dflash_trt.serve.config"):
        over = resolve_overrides(parse_llm_api_config(raw))
    assert set(over.ignored) == {"kv_cache_config", "cuda_graph_config", "attn_backend", "enable_chunked_prefill",
                                 "speculative_config.attention_backend", "speculative_config.max_concurrency",
                                 "speculative_config.context_recompute_tail"}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "speculative_config.max_concurrency" in warnings[0].getMessage()
    # with --backend trtllm these go to TensorRT-LLM as given (the speculative ones under speculative_config)
    assert over.trtllm_args["attn_backend"] == "VANILLA" and over.trtllm_args["cuda_graph_config"] is None
    assert over.trtllm_args["speculative_config"] == {"attention_backend": "TRTLLM", "max_concurrency": 4,
                                                      "context_recompute_tail": 8}


@pytest.mark.parametrize("raw, needle", [
    ({"attention_backend": "TRTLLM"}, "unknown key 'attention_backend'"),  # upstream's top-level field is attn_backend
    ({"kv_cache_free_gpu_memory_fraction": 0.9}, "unknown key 'kv_cache_free_gpu_memory_fraction'"),
    ({"kv_cache_config": {"free_gpu_memory": 0.9}}, "unknown key 'kv_cache_config.free_gpu_memory'"),
    ({"moe_config": {"backend": "TRTLLM", "load_balance": 1}}, "'moe_config.load_balance'"),
    ({"speculative_config": {"decoding_type": "DFlash", "block_size": 8}}, "'speculative_config.block_size'"),
    ({"backend": "tensorrt"}, "backend is 'tensorrt'"),
    ({"speculative_config": {"decoding_type": "DFlash", "attention_backend": "FLASHINFER"}}, "accepts VANILLA"),
])
def test_keys_outside_the_pinned_release_are_refused(raw, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)) as info:
        parse_llm_api_config(raw)
    assert "1.4.0rc1" in str(info.value) or "accepts" in str(info.value)


def test_speculative_model_dir_is_an_alias():
    over = resolve_overrides(parse_llm_api_config({"speculative_config": {"decoding_type": "DFlash",
                                                                          "speculative_model_dir": "/d"}}))
    assert str(over.drafter) == "/d" and over.ignored == ()


def test_mask_token_and_target_layer_ids_must_match_the_drafter(tiny_checkpoint):
    drafter = DrafterConfig.load(tiny_checkpoint[1])
    check_against_drafter(ServeOverrides(mask_token_id=drafter.mask_token_id,
                                         target_layer_ids=drafter.target_layer_ids), drafter, "d")
    with pytest.raises(ConfigError, match="mask_token_id"):
        check_against_drafter(ServeOverrides(mask_token_id=drafter.mask_token_id + 1), drafter, "d")
    with pytest.raises(ConfigError, match="target_layer_ids"):
        check_against_drafter(ServeOverrides(target_layer_ids=(0,)), drafter, "d")


def _serve(tmp_path, tiny_checkpoint, cfg: dict, *flags: str) -> int:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    target, drafter = tiny_checkpoint
    return main(["serve", str(target), "--drafter", str(drafter), "--config", str(path), *flags])


@pytest.mark.parametrize("cfg,flags,needle", [
    ({"bogus_key": 1}, (), "unknown key 'bogus_key'"),
    ({"attention_backend": "VANILLA"}, (), "unknown key 'attention_backend'"),
    ({"speculative_config": {"decoding_type": "DFlash", "max_draft_len": 9}}, (), "lower max_draft_len to at most 7"),
    ({"tensor_parallel_size": 2}, (), "--tp 2"),
    ({"max_batch_size": 4}, ("--max-batch-size", "2"), "give it in one place"),
    ({"speculative_config": {"decoding_type": "DFlash", "mask_token_id": 7}}, (), "trained with 4"),
])
def test_cli_rejects_bad_config_before_loading(tmp_path, tiny_checkpoint, capsys, cfg, flags, needle):
    assert _serve(tmp_path, tiny_checkpoint, cfg, *flags) == 2
    assert needle in capsys.readouterr().err
