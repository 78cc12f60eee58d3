"""The pinned TensorRT-LLM release and its LLM-API key names (dflash_trt/trtllm_release.py, one data
file): the serve --config parser accepts exactly those names, and every YAML we write (build
outputs for every build config, Triton model settings, README/docs examples) uses only them and
always sets max_seq_len."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from dflash_trt.errors import ConfigError
from dflash_trt.serve.config import DFlashSpeculativeConfig, LlmApiConfig, parse_llm_api_config
from dflash_trt.trtllm_release import data_file, pinned

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "build_configs"
# values that pass our typed fields; every other key of the release takes any value here
SAMPLE = {"speculative_config": {"decoding_type": "DFlash"}, "max_batch_size": 1, "max_seq_len": 16,
          "max_num_tokens": 8, "max_input_len": 8, "dtype": "auto", "tensor_parallel_size": 1,
          "pipeline_parallel_size": 1, "context_parallel_size": 1, "max_beam_width": 1, "enable_lora": False,
          "lora_config": None, "backend": "pytorch", "kv_cache_config": {}}
SPEC_SAMPLE = {"decoding_type": "DFlash", "max_draft_len": 1, "max_total_draft_tokens": 1, "speculative_model": "/d",
               "speculative_model_dir": "/d", "mask_token_id": 0, "target_layer_ids": [1],
               "use_rejection_sampling": False, "attention_backend": "VANILLA"}


def test_the_data_file_names_its_release_and_sources():
    release = pinned()
    raw = json.loads(data_file().read_text())
    assert data_file().name == f"trtllm_{release.version}_llm_api.json" and release.version == "1.4.0rc1"
    assert release.release_image == f"nvcr.io/nvidia/tensorrt-llm/release:{release.version}"
    assert set(raw["sources"]) == set(raw["classes"])
    assert all(("@" in src and re.search(r"[0-9a-f]{40}", src)) or release.version in src
               for src in raw["sources"].values()), "every class cites an upstream commit or the release's docs"
    assert "attn_backend" in release.keys("TorchLlmArgs") and "attention_backend" not in release.keys("TorchLlmArgs")
    assert {"context_recompute_tail", "skip_ctx_buffer_budget_check", "moe_backend", "spec_dec_variant"} \
        <= release.keys("DFlashDecodingConfig")  # fields of the DFlash config at 1.4.0rc1


def test_our_typed_keys_are_keys_of_the_release():
    release = pinned()
    assert set(LlmApiConfig.model_fields) <= release.keys("TorchLlmArgs")
    assert set(DFlashSpeculativeConfig.model_fields) <= release.keys("DFlashDecodingConfig")


@pytest.mark.parametrize("cls, path", [("TorchLlmArgs", ()), ("KvCacheConfig", ("kv_cache_config",)),
                                       ("CudaGraphConfig", ("cuda_graph_config",)), ("MoeConfig", ("moe_config",)),
                                       ("DFlashDecodingConfig", ("speculative_config",))])
def test_the_parser_accepts_exactly_the_release_keys(cls, path):
    release = pinned()

    def wrap(key: str, value) -> dict:
        inner = {key: value}
        if path == ("speculative_config",):
            inner = {"decoding_type": "DFlash", **inner}
        return {path[0]: inner} if path else inner

    samples = SAMPLE if not path else SPEC_SAMPLE if path == ("speculative_config",) else {}
    for key in sorted(release.keys(cls)):
        parse_llm_api_config(wrap(key, samples[key] if key in samples else "x"))  # accepted
        with pytest.raises(ConfigError, match="unknown key"):
            parse_llm_api_config(wrap(key + "_x", 1))  # one letter off: refused, as upstream's extra="forbid"


def _drafter(block_size: int):
    """A drafter config whose block fits the build config (its other dimensions do not reach the YAML)."""
    from dflash_trt.config import DrafterConfig
    from dflash_trt.models.tiny import tiny_drafter_config, tiny_target_config

    return DrafterConfig.from_dict(tiny_drafter_config(tiny_target_config("llama", vocab_size=261),
                                                       block_size=block_size, mask_token_id=4))


def written_yamls(config: Path, tmp_path: Path) -> dict[str, dict]:
    """The LLM-API mappings `dflash-trt build` writes for a build config (llm_api_options.yaml and the
    Triton model's trtllm_llm_args), with a drafter whose block fits max_draft_len."""
    from dflash_trt.builder.config import load_build_config
    from dflash_trt.builder.deploy import triton_settings
    from dflash_trt.builder.plan import make_plan
    from dflash_trt.builder.sources import Sources
    from dflash_trt.builder.trtllm import llm_api_options

    cfg = load_build_config(config)
    drafter = _drafter(cfg.max_draft_len + 1)
    plan = make_plan(cfg, tmp_path / "out", Sources(Path("/t"), Path("/d"), False, True, None, drafter))
    out = {"llm_api_options.yaml": llm_api_options(cfg, plan.out / "drafter", drafter)}
    if cfg.serve.triton and cfg.backend != "torch":
        out["triton model.yaml trtllm_llm_args"] = triton_settings(plan).trtllm_llm_args
    return out


@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_build_config_writes_only_release_keys(config, tmp_path):
    from dflash_trt.builder.config import load_build_config

    cfg = load_build_config(CONFIGS / config)
    for what, mapping in written_yamls(CONFIGS / config, tmp_path).items():
        assert pinned().unknown_keys(mapping) == [], (config, what)
        assert mapping["max_seq_len"] == cfg.max_seq_len, (config, what)  # sizes the drafter's context arena
        parse_llm_api_config(mapping, where=f"{config} {what}")
        spec = mapping["speculative_config"]
        if cfg.backend == "trtllm-pytorch":
            blackwell = cfg.gpu_arch in ("sm_100", "sm_103")
            assert spec["attention_backend"] == ("TRTLLM" if blackwell else "VANILLA"), config
        else:
            assert "attention_backend" not in spec


def _yaml_examples(text: str) -> list[dict]:
    blocks = re.findall(r"```ya?ml\n(.*?)```", text, flags=re.S)
    return [doc for doc in (yaml.safe_load(b) for b in blocks) if isinstance(doc, dict) and "speculative_config" in doc]


def test_readme_and_docs_examples_use_only_release_keys():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    examples = [(path.name, doc) for path in docs for doc in _yaml_examples(path.read_text())]
    assert examples, "README shows a --config example"
    for name, doc in examples:
        assert pinned().unknown_keys(doc) == [], name
        assert "max_seq_len" in doc, name
        parse_llm_api_config(doc, where=name)
