"""Build config validation (static rules and checks against real config.json files) and the dry run
of every shipped build config."""
from __future__ import annotations

import copy
import re
import json
from pathlib import Path

import pytest
import yaml

from dflash_trt.builder.builder import BuildOptions, build
from dflash_trt.builder.config import load_build_config, parse_build_config
from dflash_trt.cli import main
from dflash_trt.errors import CheckpointError, ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "build_configs"
GPT_OSS = CONFIGS / "gpt-oss-120b_dgx-b300_tp8_mxfp4.yaml"


def gpt_oss_raw() -> dict:
    return yaml.safe_load(GPT_OSS.read_text())


def edited(**changes) -> dict:
    raw = copy.deepcopy(gpt_oss_raw())
    for dotted, value in changes.items():
        node = raw
        *path, last = dotted.split("__")
        for key in path:
            node = node[key]
        node[last] = value
    return raw


@pytest.mark.parametrize("changes, message", [
    ({"tpyo": 1}, "unknown key 'tpyo'"),
    ({"parallel__extra": 1}, "unknown key 'parallel.extra'"),
    ({"parallel__ranks": 4}, "parallel.ranks is 4 but tp * pp"),
    ({"parallel": {"tp": 16, "ep": 8, "ranks": 16, "gpus_per_node": 8, "nodes": 1}}, "do not fit on 1 node"),
    ({"parallel": {"tp": 3, "ep": 1, "ranks": 3, "gpus_per_node": 8}}, "does not divide the target's 64 attention heads"),
    ({"target__num_attention_heads": 48, "parallel": {"tp": 6, "ep": 6, "ranks": 6, "gpus_per_node": 8}},
     "kv heads"),
    ({"target__num_experts": 100}, "does not divide the target's 100 experts"),
    ({"parallel": {"tp": 8, "ep": 3, "ranks": 8, "gpus_per_node": 8}}, "must divide tp=8"),
    ({"gpu_arch": "sm_90", "target__quantization": "nvfp4"}, "Hopper has FP8 but no FP4"),
    ({"gpu_arch": "sm_89", "kv_cache_dtype": "auto"}, "mxfp4 is not supported on sm_89"),
    ({"target__quantization": "nvfp4"}, "gpt-oss loader takes BF16 or MXFP4 experts"),
    ({"target__quantization": "fp8"}, "target.quantization fp8 for gpt-oss"),
    ({"target__architecture": "llama"}, "a llama target has none"),
    ({"drafter__quantization": "fp8"}, "it must be BF16"),
    ({"target__dtype": "int8"}, "target.dtype"),
    ({"gpu_arch": "sm_80", "target__quantization": "none"}, "kv_cache_dtype fp8 needs FP8"),
    ({"gpu_arch": "cpu"}, "runs on NVIDIA GPUs only"),
    ({"drafter__quantization": "nvfp4"}, "drafter.quantization"),
    ({"cuda_graph_batch_sizes": [1, 128]}, "cuda_graph_batch_sizes"),
    ({"max_num_tokens": 100}, "cannot hold one verify block"),
    ({"max_batch_size": "64"}, "max_batch_size"),
    ({"serve__container_image": "nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc27"}, "use nvcr.io/nvidia/tensorrt-llm/release:1.4.0rc1"),
])
def test_static_rules(changes, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_build_config(edited(**changes))


def test_shipped_config_is_valid():
    cfg = parse_build_config(gpt_oss_raw())
    assert (cfg.parallel.tp, cfg.parallel.ep, cfg.target.quantization, cfg.kv_cache_dtype) == (8, 8, "mxfp4", "fp8")
    assert cfg.serve.container_image == "nvcr.io/nvidia/tensorrt-llm/release:1.4.0rc1"  # the pin is the default
    assert cfg.serve.triton_image == "dflash-trt-triton:1.4.0rc1" and not cfg.serve.triton_decoupled


def _write_checkpoint_configs(root: Path, **drafter_overrides) -> tuple[Path, dict]:
    """config.json files only (no weights) of a tiny llama target and its drafter + a build YAML."""
    from dflash_trt.models.tiny import tiny_drafter_config, tiny_target_config

    tcfg = tiny_target_config("llama", vocab_size=261)
    tcfg.architectures = ["LlamaForCausalLM"]
    (root / "t").mkdir()
    tcfg.save_pretrained(str(root / "t"))
    dcfg = tiny_drafter_config(tcfg, block_size=8, mask_token_id=4)
    for key, value in drafter_overrides.items():
        if key in ("mask_token_id", "target_layer_ids"):
            dcfg["dflash_config"][key] = value
        else:
            dcfg[key] = value
    (root / "d").mkdir()
    (root / "d" / "config.json").write_text(json.dumps(dcfg))
    raw = {"name": "tiny", "backend": "torch", "gpu_arch": "cpu", "max_batch_size": 2, "max_seq_len": 128,
           "max_draft_len": 7, "drafter": {"path": "d"},
           "target": {"path": "t", "architecture": "llama", "num_hidden_layers": 6, "hidden_size": 64,
                      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                      "intermediate_size": 128, "vocab_size": 261}}
    return root / "b.yaml", raw


@pytest.mark.parametrize("drafter_overrides, yaml_changes, message", [
    ({}, {}, None),
    ({"hidden_size": 32, "head_dim": 8}, {}, "drafter .* was built for a target with hidden size 32"),
    ({"target_layer_ids": [1, 9]}, {}, "outside the target's 6 layers"),
    ({"mask_token_id": 999}, {}, "mask_token_id 999 is outside"),
    ({"num_target_layers": 12, "target_layer_ids": [1, 3]}, {}, "12 layers"),
    ({}, {"max_draft_len": 9}, r"max_draft_len 9\) exceeds the block size 8 .* lower max_draft_len to at most 7"),
    ({}, {"target": {"num_hidden_layers": 8}}, "num_hidden_layers: YAML 8, config.json 6"),
    ({}, {"max_seq_len": 4096}, "max_position_embeddings"),
])
def test_checks_against_real_configs(tmp_path, drafter_overrides, yaml_changes, message):
    path, raw = _write_checkpoint_configs(tmp_path, **drafter_overrides)
    for key, value in yaml_changes.items():
        if isinstance(value, dict):
            raw[key].update(value)
        else:
            raw[key] = value
    path.write_text(yaml.safe_dump(raw))
    options = BuildOptions(output=tmp_path / "out", dry_run=True)
    if message is None:
        report = build(path, options)
        assert report.plan.sources.complete
    else:
        with pytest.raises(ConfigError, match=message):
            build(path, options)
    assert not (tmp_path / "out").exists()


def test_missing_paths_fail_a_real_build_but_not_a_dry_run(tmp_path):
    raw = gpt_oss_raw()
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(raw))
    build(path, BuildOptions(output=tmp_path / "out", dry_run=True))
    with pytest.raises(CheckpointError, match="target checkpoint not found: /models/gpt-oss-120b"):
        build(path, BuildOptions(output=tmp_path / "out"))
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.build-cache").exists()


@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_dry_run_of_every_build_config(config, tmp_path, capsys):
    load_build_config(CONFIGS / config)
    out = tmp_path / "out"
    assert main(["build", str(CONFIGS / config), "--output", str(out), "--dry-run",
                 "--cache-dir", str(tmp_path / "cache")]) == 0
    text = capsys.readouterr().out
    assert "stages:" in text and "dry run: nothing was written" in text
    assert not out.exists() and not (tmp_path / "out.build-cache").exists()
    assert "GPUs" not in text if "cpu" in config else "GPUs" in text  # a CPU build runs processes, not GPUs
    if "_tp2_" in config and "cpu" in config:  # torch TP: ranks only exist under mpirun
        assert "$ mpirun -n 2 --oversubscribe dflash-trt serve" in text and "\n       $ dflash-trt serve" not in text
    if config.startswith("gpt-oss-120b"):
        assert "copy the gpt-oss release /models/gpt-oss-120b unchanged" in text
        assert re.search(r"experts +114\.70G +MXFP4 \+ BF16 +MXFP4 \+ BF16 \(copied\) +56\.8 GiB", text), text
        assert re.search(r"attention +955\.51M +BF16 +BF16 \(copied\)", text)
        assert "trtllm-llmapi-launch trtllm-serve" in text and "--tp_size 8" in text and "--ep_size 8" in text
        assert "--served_model_name gpt-oss-120b_dgx-b300_tp8_mxfp4" in text  # the build's name is the model id, not its path
        assert "srun --mpi=pmix" in text
    assert "trtllm-build" not in text and "engine/" not in text


def test_gpt_oss_size_estimate(tmp_path):
    """The 120b release layout: 36 layers x 128 experts in MXFP4 (1.694 GB per layer) + BF16 attention,
    router, embedding and lm_head = 65.25 GB; the same model with BF16 experts would be 233.7 GB."""
    report = build(GPT_OSS, BuildOptions(output=tmp_path / "o", dry_run=True))
    target = report.plan.stage("target")
    assert 65.2e9 < target.est_bytes < 65.3e9
    experts = {g.group: g for g in target.tensor_groups.groups}["experts"]
    assert experts.output == "MXFP4 + BF16 (copied)" and 60.9e9 < experts.est_bytes < 61.0e9
    path = tmp_path / "bf16.yaml"
    path.write_text(yaml.safe_dump(edited(target__quantization="none")))
    bf16 = build(path, BuildOptions(output=tmp_path / "o", dry_run=True)).plan.stage("target").est_bytes
    assert 233.6e9 < bf16 < 233.8e9


def test_the_engine_backend_is_refused_in_one_line(tmp_path, capsys):
    """TensorRT-LLM has no DFlash on its TensorRT-engine path: a config asking for it gets one line
    saying why and what to use, and the CLI exits 2."""
    raw = edited(backend="trtllm-engine")
    with pytest.raises(ConfigError, match="no DFlash on the trtllm-build engine path") as info:
        parse_build_config(raw)
    assert "use backend: trtllm-pytorch" in str(info.value) and "\n" not in str(info.value)
    path = tmp_path / "engine.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["build", str(path), "--output", str(tmp_path / "out"), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert "use backend: trtllm-pytorch" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("changes, reason", [
    ({"drafter__quantization": "fp8"}, "its DFlash drafter multiplies the raw q/k/v weights with no scale"),
    ({"target__quantization": "nvfp4"}, "gpt-oss loader takes BF16 or MXFP4 experts"),
])
def test_cli_refuses_what_tensorrt_llm_cannot_load(tmp_path, capsys, changes, reason):
    """`dflash-trt build` stops before any work with exit 2 and one line saying why."""
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(edited(**changes)))
    assert main(["build", str(path), "--output", str(tmp_path / "out"), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert reason in err and len(err.splitlines()) == 1


def test_calibration_counts_are_consistent_across_build_configs():
    """Every shipped config that quantizes calibrates on the same number of prompts (the default);
    none that quantizes nothing sets a count it would not use."""
    from dflash_trt.builder.config import BuildConfig

    default = BuildConfig.model_fields["calibration_samples"].default
    for path in sorted(CONFIGS.glob("*.yaml")):
        raw, cfg = yaml.safe_load(path.read_text()), load_build_config(path)
        quantizes = cfg.target.quantization in ("fp8", "nvfp4") or cfg.drafter.quantization != "none"
        assert cfg.calibration_samples == default, path.name
        assert quantizes or "calibration_samples" not in raw, path.name


def test_dry_run_on_a_fresh_clone_says_the_build_writes_its_tiny_sources(tmp_path, capsys):
    """From a fresh clone (empty cache dir) the tiny gpt-oss plan does not claim its sources are
    missing: `dflash-trt build` writes @tiny-gpt-oss and its drafter first (issue 17, item 11)."""
    config = CONFIGS / "tiny-gpt-oss_cpu_tp2_mxfp4.yaml"
    assert main(["build", str(config), "--output", str(tmp_path / "out"), "--dry-run",
                 "--cache-dir", str(tmp_path / "cache")]) == 0
    text = capsys.readouterr().out
    assert "NOT FOUND" not in text
    assert "not written yet (@tiny-gpt-oss: the build writes it first)" in text
    assert "not written yet (@tiny-gpt-oss-drafter: the build writes it first)" in text
