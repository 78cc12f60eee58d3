"""The ModelOpt unified Hugging Face checkpoint format (what TensorRT-LLM's PyTorch backend loads).

A directory holds:
- `hf_quant_config.json`: {"producer": {"name": "modelopt", "version"}, "quantization":
  {"quant_algo", "kv_cache_quant_algo", "group_size" (NVFP4), "exclude_modules"}};
- `config.json`: the model's HF config plus `quantization_config` (ModelOpt's `quant_method:
  modelopt` block, which transformers and TensorRT-LLM read);
- `model.safetensors`: tensors named as in `dflash_trt.checkpoint.quantized` (`weight`,
  `weight_scale`, `weight_scale_2`, `input_scale`; scalars 0-d, as ModelOpt writes them);
- `provenance.json` (and the same record in the safetensors metadata), plus the source's tokenizer
  and generation config files for targets.
The producer version is that of the installed nvidia-modelopt when present (the format version
TensorRT-LLM checks), else ours; `provenance.json` says that dflash_trt wrote it.

The DFlash drafter uses the same layout on top of its own config.json (`DFlashDraftModel`), with
`fc` and every norm kept in high precision. gpt-oss (which ModelOpt's exporter does not handle on
CPU) is written by the same code, experts and router in high precision.
KV-cache quantization is not produced (`kv_cache_quant_algo: null`).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from dflash_trt.fileio import atomic_directory, read_state_dict, write_json, write_safetensors
from dflash_trt.checkpoint.provenance import PROVENANCE_FILE, make_provenance
from dflash_trt.checkpoint.quantized import (
    QuantPlan,
    load_quantized_state,
    plan_for,
    quantize_state,
)
from dflash_trt.errors import CheckpointError, ConfigError
from dflash_trt.quant.algo import QuantAlgo, parse_quant_algo
from dflash_trt.quant.nvfp4 import BLOCK_SIZE

HF_QUANT_CONFIG = "hf_quant_config.json"
FORMAT = "modelopt-hf"
COPIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
           "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt")


def producer_version() -> str:
    try:
        import modelopt
    except ImportError:
        from dflash_trt import __version__
        return f"dflash_trt-{__version__}"
    return str(modelopt.__version__)


def quantization_block(plan: QuantPlan) -> dict:
    block = {"quant_algo": plan.algo.value, "kv_cache_quant_algo": None}
    if plan.algo is QuantAlgo.NVFP4:
        block["group_size"] = BLOCK_SIZE
    block["exclude_modules"] = list(plan.exclude_modules)
    return block


def hf_quant_config(plan: QuantPlan) -> dict:
    return {"producer": {"name": "modelopt", "version": producer_version()}, "quantization": quantization_block(plan)}


def config_quantization(plan: QuantPlan, static_inputs: bool) -> dict:
    """The `quantization_config` entry of config.json, as ModelOpt writes it."""
    bits = 4 if plan.algo is QuantAlgo.NVFP4 else 8
    spec = {"dynamic": False, "num_bits": bits, "type": "float"}
    if plan.algo is QuantAlgo.NVFP4:
        spec["group_size"] = BLOCK_SIZE
    group = {"weights": dict(spec), "targets": ["Linear"]}
    if static_inputs:
        group = {"input_activations": dict(spec), **group}
    return {"config_groups": {"group_0": group}, "ignore": list(plan.exclude_modules), "quant_algo": plan.algo.value,
            "producer": {"name": "modelopt", "version": producer_version()}, "quant_method": "modelopt"}


def _to_disk(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """(1,) scales -> 0-d scalars, the ModelOpt layout."""
    out = {}
    for name, t in state.items():
        leaf = name.rsplit(".", 1)[-1]
        scalar = leaf in ("input_scale", "weight_scale_2") or (leaf == "weight_scale" and t.dtype == torch.float32
                                                              and t.numel() == 1)
        out[name] = t.reshape(()) if scalar else t
    return out


def _write(out_dir: Path, config: dict, plan: QuantPlan, state: dict[str, torch.Tensor], calibration,
           sources: dict[str, Path | None], copy_from: Path | None, extra_json: dict[str, dict] | None = None) -> Path:
    quant = quantization_block(plan)
    quant["calibration"] = None if calibration is None else calibration.describe()
    prov = make_provenance(FORMAT, quant, sources)
    config = dict(config)
    config["quantization_config"] = config_quantization(plan, calibration is not None)
    with atomic_directory(Path(out_dir)) as tmp:
        write_json(tmp / "config.json", config)
        write_json(tmp / HF_QUANT_CONFIG, hf_quant_config(plan))
        write_safetensors(tmp / "model.safetensors", _to_disk(state), metadata=prov.metadata())
        write_json(tmp / PROVENANCE_FILE, prov.to_json())
        for name, body in (extra_json or {}).items():
            write_json(tmp / name, body)
        if copy_from is not None:
            for name in COPIED_FILES:
                if (Path(copy_from) / name).is_file():
                    shutil.copy2(Path(copy_from) / name, tmp / name)
    return Path(out_dir)


def target_float_state(model) -> dict[str, torch.Tensor]:
    """HF-named float tensors of a NativeCausalLM (lm_head dropped when tied, as HF saves it)."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def export_dtype_of(model, declared: torch.dtype | str | None) -> torch.dtype:
    """The dtype a ModelOpt HF export writes when none is given: the dtype the model's config
    declares, else that of its first parameter (`unified_export_hf.py::_resolve_export_dtype`)."""
    if isinstance(declared, str):
        declared = getattr(torch, declared)
    if declared is not None:
        return declared
    return next(model.parameters()).dtype


def write_target(model, out_dir: Path, algo: str | QuantAlgo, calibration=None, source_dir: Path | None = None,
                 dtype: torch.dtype | None = None) -> Path:
    """Quantize a NativeCausalLM (Llama / Qwen3 / gpt-oss) into a ModelOpt-HF directory.
    calibration: a quant.calibrate.Calibration (static input scales) or None (weight-only).
    dtype: the checkpoint dtype of the unquantized tensors (and of the codes' rounding, as
    ModelOpt's export); default the dtype the model's config declares (a bf16 release stays bf16
    even when the model was loaded in fp32)."""
    plan = plan_for(model, algo, "target")
    amax = None if calibration is None else calibration.input_amax
    dtype = export_dtype_of(model, model.config.dtype) if dtype is None else dtype
    state = quantize_state(target_float_state(model), plan, amax, export_dtype=dtype)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = str(dtype).removeprefix("torch.")
    if not config.get("architectures"):
        raise ConfigError("the target config has no 'architectures'; set it (e.g. LlamaForCausalLM) before export")
    return _write(out_dir, config, plan, state, calibration, {"target": source_dir}, source_dir)


def write_drafter(drafter, out_dir: Path, algo: str | QuantAlgo, calibration=None,
                  source_dir: Path | None = None, dtype: torch.dtype | None = None) -> Path:
    """Quantize a DFlash drafter (fc and norms stay high precision) into a ModelOpt-HF directory;
    dtype as in `write_target` (default: the drafter config's torch_dtype)."""
    plan = plan_for(drafter, algo, "drafter")
    amax = None if calibration is None else calibration.input_amax
    dtype = export_dtype_of(drafter, drafter.cfg.torch_dtype) if dtype is None else dtype
    state = quantize_state({k: v.detach() for k, v in drafter.state_dict().items()}, plan, amax, export_dtype=dtype)
    config = drafter.cfg.to_dict()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    return _write(out_dir, config, plan, state, calibration, {"drafter": source_dir}, None,
                  drafter.draft_vocab_files())


def read_quant_config(directory: Path) -> dict:
    """The `quantization` block of hf_quant_config.json, validated."""
    path = Path(directory) / HF_QUANT_CONFIG
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {HF_QUANT_CONFIG}: not a ModelOpt quantized checkpoint")
    try:
        raw = json.loads(path.read_text())
        quant = raw["quantization"]
        parse_quant_algo(quant["quant_algo"])
        exclude = quant["exclude_modules"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is malformed: {exc}") from exc
    if not isinstance(exclude, list):
        raise CheckpointError(f"{path}: exclude_modules must be a list")
    return quant


def load_target(directory: Path, dtype: torch.dtype = torch.float32):
    """A NativeCausalLM with QuantLinear layers from a ModelOpt-HF directory."""
    from dflash_trt.models.target import load_hf_config
    from dflash_trt.models.transformer import NativeCausalLM

    directory = Path(directory)
    quant = read_quant_config(directory)
    config = load_hf_config(directory)
    state = read_state_dict(directory)
    if config.tie_word_embeddings and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model = NativeCausalLM(config).to(dtype)
    load_quantized_state(model, state, parse_quant_algo(quant["quant_algo"]), str(directory))
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def load_drafter(directory: Path, dtype: torch.dtype = torch.float32):
    """A DFlashDrafter with QuantLinear layers from a ModelOpt-HF drafter directory."""
    from dflash_trt.config import DrafterConfig
    from dflash_trt.models.drafter import DFlashDrafter

    directory = Path(directory)
    quant = read_quant_config(directory)
    raw = json.loads((Path(directory) / "config.json").read_text())
    raw.pop("quantization_config", None)
    model = DFlashDrafter(DrafterConfig.from_dict(raw, where=str(directory / "config.json"))).to(dtype)
    model = load_quantized_state(model, read_state_dict(directory), parse_quant_algo(quant["quant_algo"]),
                                 str(directory))
    model.load_draft_vocab(directory)
    return model


def is_modelopt_dir(directory: Path) -> bool:
    return (Path(directory) / HF_QUANT_CONFIG).is_file()


__all__ = ["HF_QUANT_CONFIG", "hf_quant_config", "is_modelopt_dir", "load_drafter", "load_target",
           "read_quant_config", "write_drafter", "write_target"]
