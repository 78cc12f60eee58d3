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
from dflash_trt.serve.triton.protocol import FinalStats, output_arrays, parse_request
from dflash_trt.serve.triton.settings import TritonSettings

# TensorRT-LLM's llmapi Triton model (triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt):
# name -> (data type, dims, optional) for the tensors we serve.
UPSTREAM_INPUTS = {
    "text_input": ("TYPE_STRING", [-1], False),
    "streaming": ("TYPE_BOOL", [1], True),
    "sampling_param_temperature": ("TYPE_FP32", [1], True),
    "sampling_param_top_k": ("TYPE_INT32", [1], True),
    "sampling_param_top_p": ("TYPE_FP32", [1], True),
    "sampling_param_max_tokens": ("TYPE_INT32", [1], True),
    "sampling_param_seed": ("TYPE_UINT64", [1], True),
    "sampling_param_stop": ("TYPE_STRING", [-1], True),
    "stop": ("TYPE_BOOL", [1], True),
}
UPSTREAM_OUTPUTS = {
    "text_output": ("TYPE_STRING", [-1]),
    "finish_reason": ("TYPE_STRING", [-1]),
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
    cfg = text_format.Parse((tmp_path / "repo/m1/config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert cfg.name == "m1" and cfg.backend == "python" and cfg.max_batch_size == 0
    assert cfg.model_transaction_policy.decoupled
    assert [(g.count, model_config_pb2.ModelInstanceGroup.Kind.Name(g.kind)) for g in cfg.instance_group] == [(1, "KIND_CPU")]
    dtype = model_config_pb2.DataType.Name
    assert {i.name: (dtype(i.data_type), list(i.dims), i.optional) for i in cfg.input} == UPSTREAM_INPUTS
    assert {o.name: (dtype(o.data_type), list(o.dims)) for o in cfg.output} == UPSTREAM_OUTPUTS
    spec_path = tmp_path / "repo/m1" / cfg.parameters["dflash_model_yaml"].string_value
    spec = TritonSettings.load(spec_path)
    assert Path(spec.target) == ckpt[0].resolve() and Path(spec.drafter) == ckpt[1].resolve()
    assert spec.backend == "torch" and spec.engine.speculative and spec.model_name == "m1"
    assert "TritonPythonModel" in (tmp_path / "repo/m1/1/model.py").read_text()
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["m1"], "no staging folders left behind"


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
    }, default_max_tokens=16)
    assert parsed.prompt == "héllo" and parsed.streaming and not parsed.stop
    p = parsed.params
    assert (p.temperature, p.top_k, p.max_new_tokens, p.seed, p.stop) == (0.5, 7, 12, 2**64 - 1, ("\n\n", "END"))
    assert p.top_p == pytest.approx(0.9)
    defaults = parse_request({"text_input": _text("x")}, default_max_tokens=16)
    assert (defaults.params.greedy, defaults.params.max_new_tokens, defaults.streaming) == (True, 16, False)
    assert parse_request({"stop": np.array([True])}, default_max_tokens=16).stop


def test_text_stream_never_splits_a_character():
    data = "añ€😀".encode()
    stream = TextStream(lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    pieces = [stream.push([b]) for b in data]
    assert "".join(pieces) + stream.finish() == "añ€😀"
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[1] == "" and pieces[2] == "ñ"  # the first byte of ñ is held back


def test_final_outputs_and_acceptance_rate():
    out = output_arrays("tail", FinalStats("length", total_draft_tokens=30, total_accepted_draft_tokens=12))
    assert out["text_output"][0] == b"tail" and out["finish_reason"][0] == b"length"
    assert out["acceptance_rate"].dtype == np.float32 and out["acceptance_rate"][0] == pytest.approx(0.4)
    assert out["total_draft_tokens"].dtype == np.int32 and out["total_accepted_draft_tokens"][0] == 12
    assert set(output_arrays("chunk", None)) == {"text_output"}
    assert FinalStats("stop", 0, 0).acceptance_rate == 0.0


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
