"""Write a Triton model repository that serves DFlash:

    REPO/<model_name>/config.pbtxt     python backend, one CPU instance, the tensors of protocol.py
                                       (upstream's LLM-API model), parameter dflash_model_yaml
    REPO/<model_name>/1/model.py       binds the installed dflash_trt model class to this folder
    REPO/<model_name>/1/model.yaml     the resolved TritonSettings (settings.py), with triton_config

As in TensorRT-LLM's LLM-API model (triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt
@0a71057313ec0626527e164a8fc0205c5822e2f5), config.pbtxt sets neither max_batch_size nor the
transaction policy: the model's auto_complete_config() takes them from model.yaml triton_config.

The model folder is built next to its final place and renamed in, so a crash never leaves a
half-written model for Triton to load.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from dflash_trt.errors import ConfigError
from dflash_trt.serve.triton.protocol import INPUTS, OUTPUTS, TritonTensor
from dflash_trt.serve.triton.settings import MODEL_YAML, TritonSettings

VERSION = "1"
YAML_PARAMETER = "dflash_model_yaml"  # config.pbtxt parameter: the settings YAML, relative to the model folder

MODEL_PY = '''"""DFlash speculative decoding on Triton's Python backend (written by `dflash-trt triton-repo`).

The model lives in the dflash_trt package (dflash_trt/serve/triton/model.py); this file binds it to
its model folder. Triton's Python stub must run in the Python environment where dflash_trt is
installed: start the server with `dflash-trt triton-serve REPO`, which puts that environment's bin/
first on PATH, or use the image of docker/Dockerfile.triton.
"""
import sys
from pathlib import Path

try:
    from dflash_trt.serve.triton.model import model_class
except ImportError as exc:
    raise ImportError(
        f"the DFlash Triton model needs the dflash_trt package in the stub's Python ({sys.executable}): {exc}. "
        "Start tritonserver with `dflash-trt triton-serve REPO`, or put the bin/ folder of the environment "
        "where dflash_trt is installed first on PATH."
    ) from exc

TritonPythonModel = model_class(Path(__file__).resolve().parent.parent)
'''


def _tensor_block(tensor: TritonTensor) -> str:
    dims = ", ".join(str(d) for d in tensor.dims)
    lines = [f'    name: "{tensor.name}"', f"    data_type: {tensor.triton_type}", f"    dims: [ {dims} ]"]
    if tensor.optional:
        lines.append("    optional: true")
    return "  {\n" + "\n".join(lines) + "\n  }"


def config_pbtxt(settings: TritonSettings) -> str:
    inputs = ",\n".join(_tensor_block(t) for t in INPUTS)
    outputs = ",\n".join(_tensor_block(t) for t in OUTPUTS)
    return (
        "# DFlash speculative decoding (written by `dflash-trt triton-repo`). Tensors follow TensorRT-LLM's\n"
        "# LLM-API Triton model (triton_backend/all_models/llmapi/tensorrt_llm). max_batch_size and\n"
        "# model_transaction_policy are NOT set here: the model takes them from 1/model.yaml triton_config.\n"
        f'name: "{settings.model_name}"\n'
        'backend: "python"\n'
        "instance_group [\n  {\n    count: 1\n    kind: KIND_CPU\n  }\n]\n"
        f"input [\n{inputs}\n]\n"
        f"output [\n{outputs}\n]\n"
        "parameters {\n"
        f'  key: "{YAML_PARAMETER}"\n'
        f'  value {{ string_value: "{VERSION}/{MODEL_YAML}" }}\n'
        "}\n"
    )


def settings_path(model_folder: Path, parameters: dict) -> Path:
    """The settings YAML of a model folder, from config.pbtxt's parameters."""
    if YAML_PARAMETER not in parameters:
        raise ConfigError(f"config.pbtxt lacks the parameter '{YAML_PARAMETER}' (the model settings YAML)")
    return Path(model_folder) / parameters[YAML_PARAMETER]["string_value"]


def write_repository(settings: TritonSettings, output: Path, overwrite: bool = False) -> Path:
    """Write REPO/<model_name>/ for `settings` (already resolved and checked). Returns the model folder."""
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    final = output / settings.model_name
    if final.exists() and not overwrite:
        raise ConfigError(f"{final} already exists: pass --force to replace it, or choose another --output")
    staging = Path(tempfile.mkdtemp(prefix=f".{settings.model_name}.", dir=output))
    try:
        (staging / VERSION).mkdir()
        (staging / "config.pbtxt").write_text(config_pbtxt(settings))
        (staging / VERSION / "model.py").write_text(MODEL_PY)
        (staging / VERSION / MODEL_YAML).write_text(settings.to_yaml())
        staging.chmod(0o755)
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{settings.model_name}.old.", dir=output))
            final.rename(old / settings.model_name)
            staging.rename(final)
            shutil.rmtree(old)
        else:
            staging.rename(final)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return final
