"""The Triton model repository writer, the request protocol and the launcher's checks, without a
server (fast). The real server is exercised in test_triton.py."""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from dflash_trt import cli
from dflash_trt.errors import ConfigError, InputError
from dflash_trt.serve.text import TextStream
from dflash_trt.serve.triton.protocol import FinalStats, matched_stop, output_arrays, parse_request
from dflash_trt.serve.triton.settings import TritonSettings

# TensorRT-LLM's LLM-API Triton model (triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt
# @0a71057313ec0626527e164a8fc0205c5822e2f5; sampling_param_logits_post_processor_name from 1/model.yaml
# @0ebb1536ac12bbe27201185de960df3ab00bcecc): name -> (data type, dims, optional), transcribed.
UPSTREAM_INPUTS = {
    "text_input": ("TYPE_STRING", [-1], False),
    "image_url": ("TYPE_STRING", [-1], True),
    "streaming": ("TYPE_BOOL", [1], True),
    "sampling_param_best_of": ("TYPE_INT32", [1], True),
    "sampling_param_temperature": ("TYPE_FP32", [1], True),
    "sampling_param_top_k": ("TYPE_INT32", [1], True),
    "sampling_param_top_p": ("TYPE_FP32", [1], True),
    "sampling_param_frequency_penalty": ("TYPE_FP32", [1], True),
    "sampling_param_presence_penalty": ("TYPE_FP32", [1], True),
    "sampling_param_max_tokens": ("TYPE_INT32", [1], True),
    "sampling_param_stop": ("TYPE_STRING", [-1], True),
    "sampling_param_seed": ("TYPE_UINT64", [1], True),
    "sampling_param_exclude_input_from_output": ("TYPE_BOOL", [1], True),
    "sampling_param_return_perf_metrics": ("TYPE_BOOL", [1], True),
    "sampling_param_logits_post_processor_name": ("TYPE_STRING", [1], True),
    "return_finish_reason": ("TYPE_BOOL", [1], True),
    "return_stop_reason": ("TYPE_BOOL", [1], True),
    "return_cumulative_logprob": ("TYPE_BOOL", [1], True),
    "stop": ("TYPE_BOOL", [1], True),
    "lora_id": ("TYPE_UINT64", [1], True),
    "lora_name": ("TYPE_STRING", [1], True),
    "lora_path": ("TYPE_STRING", [1], True),
    "lora_ckpt_source": ("TYPE_STRING", [1], True),
}
UPSTREAM_OUTPUTS = {
    "text_output": ("TYPE_STRING", [-1]),
    "finish_reason": ("TYPE_STRING", [-1]),
    "stop_reason": ("TYPE_STRING", [-1]),
    "cumulative_logprob": ("TYPE_FP32", [-1]),
    "kv_cache_reused_block": ("TYPE_INT32", [-1]),
    "kv_cache_hit_rate": ("TYPE_FP32", [-1]),
    "kv_cache_alloc_new_blocks": ("TYPE_INT32", [-1]),
    "kv_cache_alloc_total_blocks": ("TYPE_INT32", [-1]),
    "kv_cache_missed_block": ("TYPE_INT32", [-1]),
    "arrival_time_ns": ("TYPE_INT64", [1]),
    "first_scheduled_time_ns": ("TYPE_INT64", [1]),
    "first_token_time_ns": ("TYPE_INT64", [1]),
    "last_token_time_ns": ("TYPE_INT64", [1]),
    "acceptance_rate": ("TYPE_FP32", [1]),
    "total_accepted_draft_tokens": ("TYPE_INT32", [1]),
    "total_draft_tokens": ("TYPE_INT32", [1]),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> tuple[Path, Path]:
    from dflash_trt.models.tiny import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("triton_repo_ckpt"), "llama", block_size=4)


def write(ckpt, out: Path, *extra: str) -> int:
    target, drafter = ckpt
    return cli.main(["triton-repo", "--output", str(out), "--target", str(target), "--drafter", str(drafter), *extra])


def test_config_pbtxt_is_a_valid_triton_config_with_the_upstream_tensors(ckpt, tmp_path):
    model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    from google.protobuf import text_format

    assert write(ckpt, tmp_path / "repo", "--model-name", "m1") == 0
    text = (tmp_path / "repo/m1/config.pbtxt").read_text()
    cfg = text_format.Parse(text, model_config_pb2.ModelConfig())
    assert cfg.name == "m1" and cfg.backend == "python"
    # as upstream: max_batch_size and the transaction policy come from model.yaml (auto_complete_config)
    assert not cfg.HasField("model_transaction_policy") and "max_batch_size" not in text.split("# ")[-1]
    assert [(g.count, model_config_pb2.ModelInstanceGroup.Kind.Name(g.kind)) for g in cfg.instance_group] == [(1, "KIND_CPU")]
    dtype = model_config_pb2.DataType.Name
    assert {i.name: (dtype(i.data_type), list(i.dims), i.optional) for i in cfg.input} == UPSTREAM_INPUTS
    assert {o.name: (dtype(o.data_type), list(o.dims)) for o in cfg.output} == UPSTREAM_OUTPUTS
    spec_path = tmp_path / "repo/m1" / cfg.parameters["dflash_model_yaml"].string_value
    spec = TritonSettings.load(spec_path)
    assert Path(spec.target) == ckpt[0].resolve() and Path(spec.drafter) == ckpt[1].resolve()
    assert spec.backend == "torch" and spec.engine.speculative and spec.model_name == "m1"
    assert (spec.triton_config.max_batch_size, spec.triton_config.decoupled) == (0, False)  # unary, as upstream
    assert yaml.safe_load(spec_path.read_text())["triton_config"] == {
        "max_batch_size": 0, "decoupled": False, "cancellation_check_period_ms": 100}
    assert "TritonPythonModel = model_class(" in (tmp_path / "repo/m1/1/model.py").read_text()
    assert write(ckpt, tmp_path / "repo", "--model-name", "m2", "--decoupled") == 0
    assert TritonSettings.load(tmp_path / "repo/m2/1/model.yaml").triton_config.decoupled
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["m1", "m2"], "no staging folders left behind"


def test_existing_model_needs_force(ckpt, tmp_path):
    assert write(ckpt, tmp_path, "--max-batch-size", "2") == 0
    assert write(ckpt, tmp_path, "--max-batch-size", "3") == 2
    assert TritonSettings.load(tmp_path / "dflash/1/model.yaml").engine.max_batch_size == 2
    assert write(ckpt, tmp_path, "--max-batch-size", "3", "--force") == 0
    assert TritonSettings.load(tmp_path / "dflash/1/model.yaml").engine.max_batch_size == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dflash"]


def test_config_yaml_with_relative_paths_and_flag_overrides(ckpt, tmp_path):
    target, drafter = ckpt
    cfg = tmp_path / "cfg" / "model.yaml"
    cfg.parent.mkdir()
    cfg.write_text(yaml.safe_dump({"model_name": "fromyaml", "target": os.path.relpath(target, cfg.parent),
                                   "drafter": str(drafter), "dtype": "float64",
                                   "engine": {"max_batch_size": 5, "block_size": 3}}))
    assert cli.main(["triton-repo", "--config", str(cfg), "--output", str(tmp_path / "repo"), "--max-seq-len", "300"]) == 0
    spec = TritonSettings.load(tmp_path / "repo/fromyaml/1/model.yaml")
    assert Path(spec.target) == target.resolve() and spec.dtype == "float64"
    assert spec.engine.max_batch_size == 5 and spec.engine.block_size == 3  # from the YAML
    assert spec.engine.max_seq_len == 300  # the flag given on the command line wins


def test_draft_speed_flags_reach_the_model_settings(ckpt, tmp_path):
    """--draft-confidence, --draft-len-schedule, --no-draft-vocab and --ngram-lookup land in model.yaml
    and in the engine config the model builds; without them the device's default confidence (null), the
    draft vocabulary and no n-gram lookup."""
    assert write(ckpt, tmp_path / "a") == 0
    plain = TritonSettings.load(tmp_path / "a/dflash/1/model.yaml")
    assert plain.engine.draft_confidence is None and plain.engine_config().draft_confidence is None
    assert plain.engine.draft_vocab and plain.engine.draft_len_schedule is None
    assert plain.engine.ngram_lookup == 0
    assert write(ckpt, tmp_path / "b", "--draft-confidence", "0.3", "--draft-len-schedule", "1:3,4:0",
                 "--no-draft-vocab", "--ngram-lookup", "3") == 0
    config = TritonSettings.load(tmp_path / "b/dflash/1/model.yaml").engine_config()
    assert (config.draft_confidence, config.draft_len_schedule, config.draft_vocab) == (0.3, ((1, 3), (4, 0)), False)
    assert config.ngram_lookup == 3


def test_config_yaml_errors_are_typed(ckpt, tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump({"target": str(ckpt[0]), "drafter": str(ckpt[1]), "engine": {"max_batchsize": 2}}))
    assert cli.main(["triton-repo", "--config", str(cfg), "--output", str(tmp_path / "repo")]) == 2
    assert "engine.max_batchsize" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="no tokenizer"):
        TritonSettings(target=str(ckpt[1]), drafter=str(ckpt[1])).check_paths()
    with pytest.raises(ConfigError, match="no drafter"):
        TritonSettings(target=str(ckpt[0])).check_paths()
    with pytest.raises(ConfigError, match="backend"):
        TritonSettings.from_dict({"target": "x", "backend": "vllm"}, "spec")
    with pytest.raises(ConfigError, match="mpi: world .* needs backend: trtllm"):
        TritonSettings.from_dict({"target": "x", "mpi": "world"}, "spec")
    with pytest.raises(ConfigError, match="triton_config.max_batch_size"):
        TritonSettings.from_dict({"target": "x", "triton_config": {"max_batch_size": 8}}, "spec")
    with pytest.raises(ConfigError, match="unknown key 'attention_backend'"):
        TritonSettings.from_dict({"target": "x", "backend": "trtllm", "trtllm_llm_args": {"attention_backend": "X"}},
                                 "spec")


def _text(s) -> np.ndarray:
    return np.array([s.encode() if isinstance(s, str) else s], dtype=np.object_)


@pytest.mark.parametrize("inputs, message", [
    ({"streaming": np.array([True])}, "text_input' is required"),
    ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, "exactly one prompt"),
    ({"text_input": _text("")}, "empty"),
    ({"text_input": _text(b"\xff\xfe")}, "UTF-8"),
    ({"text_input": _text("hi"), "sampling_param_temperature": np.array([0.5])}, "TYPE_FP32"),
    ({"text_input": _text("hi"), "sampling_param_temperature": np.array([math.nan], dtype=np.float32)}, "finite"),
    ({"text_input": _text("hi"), "sampling_param_temperature": np.array([-1], dtype=np.float32)}, "temperature"),
    ({"text_input": _text("hi"), "sampling_param_top_p": np.array([1.5], dtype=np.float32)}, "top_p"),
    ({"text_input": _text("hi"), "sampling_param_top_k": np.array([-1], dtype=np.int32)}, "top_k"),
    ({"text_input": _text("hi"), "sampling_param_max_tokens": np.array([0], dtype=np.int32)}, "max_new_tokens"),
    ({"text_input": _text("hi"), "sampling_param_max_tokens": np.array([1, 2], dtype=np.int32)}, "exactly one value"),
    ({"text_input": _text("hi"), "sampling_param_stop": np.array([b""], dtype=np.object_)}, "stop strings"),
    ({"text_input": _text("hi"), "streaming": np.array([1], dtype=np.int32)}, "TYPE_BOOL"),
    ({"text_input": _text("hi"), "bogus": np.array([1])}, "unknown input"),
    # upstream inputs this model cannot honour: one line each saying why
    ({"text_input": _text("hi"), "sampling_param_best_of": np.array([2], dtype=np.int32)}, "best_of is 2"),
    ({"text_input": _text("hi"), "sampling_param_presence_penalty": np.array([0.5], dtype=np.float32)}, "penalties"),
    ({"text_input": _text("hi"), "sampling_param_frequency_penalty": np.array([-1], dtype=np.float32)}, "penalties"),
    ({"text_input": _text("hi"), "return_cumulative_logprob": np.array([True])}, "no log-probabilities"),
    ({"text_input": _text("hi"), "lora_id": np.array([3], dtype=np.uint64)}, "LoRA"),
    ({"text_input": _text("hi"), "image_url": np.array([b"http://x/cat.png"], dtype=np.object_)}, "text-only"),
    ({"text_input": _text("hi"), "sampling_param_logits_post_processor_name": _text("p")}, "post-processors"),
])
def test_parse_request_rejects_bad_tensors(inputs, message):
    with pytest.raises(InputError, match=message):
        parse_request(inputs, default_max_tokens=16)


def test_parse_request_reads_every_tensor():
    parsed = parse_request({
        "text_input": _text("héllo"), "streaming": np.array([True]),
        "sampling_param_temperature": np.array([0.5], dtype=np.float32),
        "sampling_param_top_k": np.array([7], dtype=np.int32), "sampling_param_top_p": np.array([0.9], dtype=np.float32),
        "sampling_param_max_tokens": np.array([12], dtype=np.int32),
        "sampling_param_seed": np.array([2**64 - 1], dtype=np.uint64),
        "sampling_param_stop": np.array([b"\n\n", b"END"], dtype=np.object_),
        # upstream inputs at their neutral values are accepted
        "sampling_param_best_of": np.array([1], dtype=np.int32),
        "sampling_param_frequency_penalty": np.array([0], dtype=np.float32),
        "sampling_param_presence_penalty": np.array([0], dtype=np.float32),
        "sampling_param_logits_post_processor_name": _text(""), "image_url": np.array([b""], dtype=np.object_),
        "return_cumulative_logprob": np.array([False]),
        "sampling_param_exclude_input_from_output": np.array([True]),
        "sampling_param_return_perf_metrics": np.array([True]),
        "return_finish_reason": np.array([True]), "return_stop_reason": np.array([True]),
    }, default_max_tokens=16)
    assert parsed.prompt == "héllo" and parsed.streaming and not parsed.stop
    p = parsed.params
    assert (p.temperature, p.top_k, p.max_new_tokens, p.seed, p.stop) == (0.5, 7, 12, 2**64 - 1, ("\n\n", "END"))
    assert p.top_p == pytest.approx(0.9)
    assert parsed.exclude_input_from_output and parsed.return_perf_metrics
    assert parsed.return_finish_reason and parsed.return_stop_reason
    defaults = parse_request({"text_input": _text("x")}, default_max_tokens=16)
    assert (defaults.params.greedy, defaults.params.max_new_tokens, defaults.streaming) == (True, 16, False)
    # upstream's defaults: the prompt is part of the output; no reasons, no metrics unless asked
    assert not (defaults.exclude_input_from_output or defaults.return_finish_reason or defaults.return_perf_metrics)
    assert parse_request({"stop": np.array([True])}, default_max_tokens=16).stop


def test_text_stream_never_splits_a_character():
    data = "añ€😀".encode()
    stream = TextStream(lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    pieces = [stream.push([b]) for b in data]
    assert "".join(pieces) + stream.finish() == "añ€😀"
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[1] == "" and pieces[2] == "ñ"  # the first byte of ñ is held back


def test_final_outputs_follow_what_the_request_asks_for():
    stats = FinalStats("stop", total_draft_tokens=30, total_accepted_draft_tokens=12, stop_reason="END",
                       arrival_time_ns=10, first_scheduled_time_ns=11, first_token_time_ns=12, last_token_time_ns=13)
    plain = parse_request({"text_input": _text("x")}, default_max_tokens=4)
    assert set(output_arrays("all", stats, plain)) == {"text_output"}  # upstream sends only what is asked for
    asked = parse_request({"text_input": _text("x"), "return_finish_reason": np.array([True]),
                           "return_stop_reason": np.array([True]),
                           "sampling_param_return_perf_metrics": np.array([True])}, default_max_tokens=4)
    out = output_arrays("all", stats, asked)
    assert out["text_output"][0] == b"all" and out["finish_reason"][0] == b"stop" and out["stop_reason"][0] == b"END"
    assert out["acceptance_rate"].dtype == np.float32 and out["acceptance_rate"][0] == pytest.approx(0.4)
    assert out["total_draft_tokens"].dtype == np.int32 and out["total_accepted_draft_tokens"][0] == 12
    assert out["arrival_time_ns"].dtype == np.int64 and out["last_token_time_ns"][0] == 13  # the declared dtypes
    assert "cumulative_logprob" not in out and not any(k.startswith("kv_cache") for k in out)
    no_stop = output_arrays("", FinalStats("length", 0, 0), asked)
    assert no_stop["stop_reason"][0] == b"None" and no_stop["acceptance_rate"][0] == 0.0  # str(None), as upstream
    assert set(output_arrays("chunk", None, asked)) == {"text_output"}
    assert matched_stop("a END b STOP", ("STOP", "END")) == "END" and matched_stop("abc", ("x",)) is None


def test_launcher_checks(tmp_path):
    from dflash_trt.serve.triton.launcher import TritonServerConfig, TritonServer, server_env

    with pytest.raises(ConfigError, match="ports must differ"):
        TritonServerConfig(repository=tmp_path, server_dir=tmp_path, log_file=tmp_path / "log", http_port=9000, grpc_port=9000)
    with pytest.raises(ConfigError, match="not a model repository"):
        TritonServer(TritonServerConfig(repository=tmp_path, server_dir=tmp_path, log_file=tmp_path / "log"), {})
    pytest.importorskip("pytriton", reason="nvidia-pytriton is not installed")
    env = server_env({"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/lib"})
    assert env["PATH"].split(":")[:2] == [str(Path(sys.executable).parent), "/usr/bin"]
    libs = env["LD_LIBRARY_PATH"].split(":")
    assert libs[-1] == "/opt/lib" and any(p.endswith("nvidia_pytriton.libs") for p in libs)
