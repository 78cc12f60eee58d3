"""TensorRT-LLM 1.2.x legacy checkpoints (`trtllm-build --checkpoint_dir`): config.json + rank{N}.safetensors.

config.json: `architecture` (LlamaForCausalLM / Qwen3ForCausalLM / GptOssForCausalLM /
DFlashDraftModel), `dtype`, sizes, `mapping {world_size, tp_size, pp_size, moe_tp_size, moe_ep_size}`,
`quantization {quant_algo, kv_cache_quant_algo, group_size, exclude_modules}`, and a `dflash_trt`
block holding the source HF / DFlash config (so the checkpoint can be merged back and run here).

Tensor names per rank, TP/EP sharding and merging are in `dflash_trt.checkpoint.trtllm_layout`
(re-exported here).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from dflash_trt.fileio import atomic_directory, check_state_dict, write_json, write_safetensors
from dflash_trt.checkpoint.provenance import PROVENANCE_FILE, make_provenance
from dflash_trt.checkpoint.quantized import plan_for, quantize_state
from dflash_trt.checkpoint.mapping import Mapping
from dflash_trt.checkpoint.trtllm_layout import Geometry, geometry_of, shard_state, unshard_state
from dflash_trt.errors import CheckpointError, ConfigError
from dflash_trt.quant.algo import QuantAlgo, parse_quant_algo
from dflash_trt.quant.nvfp4 import BLOCK_SIZE

FORMAT = "trtllm-legacy"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gpt_oss": "GptOssForCausalLM"}
DRAFTER_ARCHITECTURE = "DFlashDraftModel"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _legacy_config(model, g: Geometry, m: Mapping, algo: QuantAlgo | None, exclude: list[str], dtype: str) -> dict:
    quant = {"quant_algo": None if algo is None else algo.value, "kv_cache_quant_algo": None}
    if algo is QuantAlgo.NVFP4:
        quant["group_size"] = BLOCK_SIZE
    quant["exclude_modules"] = exclude
    if g.drafter:
        c = model.cfg
        arch, eps, max_pos, source = DRAFTER_ARCHITECTURE, c.rms_norm_eps, c.max_position_embeddings, c.to_dict()
        act = "silu"
    else:
        c = model.config
        arch, eps, max_pos = ARCHITECTURES[model.arch.model_type], c.rms_norm_eps, c.max_position_embeddings
        source = c.to_dict()
        source.pop("quantization_config", None)
        act = "swiglu" if g.dims.num_experts else str(getattr(c, "hidden_act", "silu"))
    cfg = {
        "architecture": arch, "dtype": dtype, "logits_dtype": dtype, "num_hidden_layers": g.layers,
        "num_attention_heads": g.dims.num_heads, "num_key_value_heads": g.dims.num_kv_heads, "hidden_size": g.hidden,
        "norm_epsilon": eps, "vocab_size": g.dims.vocab_size, "max_position_embeddings": max_pos, "hidden_act": act,
        "use_parallel_embedding": True, "embedding_sharding_dim": 0, "head_size": g.dims.head_dim,
        "intermediate_size": g.dims.intermediate_size, "position_embedding_type": "rope_gpt_neox",
        "share_embedding_table": False, "bias": bool(source.get("attention_bias", False)), "rotary_pct": 1.0,
        "rmsnorm": True, "lm_head_bias": False, "mapping": m.to_json(), "quantization": quant,
    }
    if g.dims.num_experts:
        cfg["moe"] = {"num_experts": g.dims.num_experts, "top_k": source["num_experts_per_tok"]}
        cfg.update(layer_types=source["layer_types"], sliding_window=source["sliding_window"],
                   attention_sinks=True, swiglu_alpha=1.702, swiglu_limit=source["swiglu_limit"],
                   rope_parameters=source.get("rope_parameters"))
    if g.drafter:
        cfg.update(block_size=source["block_size"], num_target_layers=source["num_target_layers"],
                   dflash_config=source["dflash_config"])
    cfg["dflash_trt"] = {"source_config": source}
    return cfg


def write_checkpoint(model, out_dir: Path, algo: str | QuantAlgo | None, calibration=None, *, tp: int = 1,
                     ep: int = 1, dtype: str = "float16", source_dir: Path | None = None) -> Path:
    """Write a NativeCausalLM or DFlashDrafter as a TRT-LLM 1.2.x legacy checkpoint sharded tp ways
    (expert-parallel ep ways inside tp for MoE). algo None writes it unquantized."""
    from dflash_trt.models.drafter import DFlashDrafter
    from dflash_trt.models.transformer import NativeCausalLM

    if isinstance(model, DFlashDrafter):
        g = geometry_of(model, drafter=True)
        kind = "drafter"
    elif isinstance(model, NativeCausalLM):
        g = geometry_of(model, drafter=False)
        kind = "target"
        if model.arch.model_type not in ARCHITECTURES:
            raise ConfigError(f"legacy export supports {sorted(ARCHITECTURES)}, not {model.arch.model_type}")
    else:
        raise ConfigError(f"legacy export needs a NativeCausalLM or DFlashDrafter, got {type(model).__name__}")
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {dtype}")
    m = Mapping.for_sizes(tp, ep if g.dims.num_experts else 1)
    if ep > 1 and not g.dims.num_experts:
        raise ConfigError(f"--ep {ep} needs a mixture-of-experts model; this one is dense")
    parsed = None if algo is None else parse_quant_algo(algo)
    g.check(m, parsed)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if kind == "target" and model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    exclude = ["lm_head"] if kind == "target" else ["fc"]
    if kind == "target" and g.dims.num_experts:  # the legacy layout's own module names
        exclude += ["transformer.layers.*.mlp.router", "transformer.layers.*.mlp.experts"]
    if parsed is not None:
        plan = plan_for(model, parsed, kind)
        state = quantize_state(state, plan, None if calibration is None else calibration.input_amax,
                               share_fp8_weight_scale=True)
    ranks = shard_state(state, g, m, DTYPES[dtype])
    if parsed is QuantAlgo.NVFP4:  # ModelOpt writes the NVFP4 scalars 0-d (FP8 ones stay (1,))
        scalars = (".weights_scaling_factor_2", ".activation_scaling_factor")
        ranks = [{k: (v.reshape(()) if k.endswith(scalars) else v) for k, v in r.items()} for r in ranks]
    config = _legacy_config(model, g, m, parsed, exclude, dtype)
    quant = dict(config["quantization"], calibration=None if calibration is None else calibration.describe())
    prov = make_provenance(FORMAT, quant, {kind: source_dir})
    with atomic_directory(Path(out_dir)) as tmp:
        write_json(tmp / "config.json", config)
        for rank, tensors in enumerate(ranks):
            write_safetensors(tmp / f"rank{rank}.safetensors", tensors, metadata=prov.metadata())
        write_json(tmp / PROVENANCE_FILE, prov.to_json())
    return Path(out_dir)


def read_config(directory: Path) -> dict:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"no config.json in legacy checkpoint {directory}")
    try:
        cfg = json.loads(path.read_text())
        arch, mapping = cfg["architecture"], cfg["mapping"]
        cfg["dflash_trt"]["source_config"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is not a dflash_trt legacy config: {exc}") from exc
    supported = sorted(ARCHITECTURES.values()) + [DRAFTER_ARCHITECTURE]
    if arch not in supported:
        raise ConfigError(f"legacy architecture {arch} is not supported here (supported: {supported})")
    Mapping.from_json(mapping)
    return cfg


def read_ranks(directory: Path, world_size: int) -> list[dict[str, torch.Tensor]]:
    ranks = []
    for r in range(world_size):
        path = Path(directory) / f"rank{r}.safetensors"
        if not path.is_file():
            raise CheckpointError(f"legacy checkpoint {directory} lacks rank{r}.safetensors (world size {world_size})")
        with safe_open(str(path), framework="pt") as fh:
            ranks.append({k: fh.get_tensor(k) for k in fh.keys()})
    return ranks


def load_merged(directory: Path, dtype: torch.dtype = torch.float32):
    """Merge all ranks of a legacy checkpoint and load it (TP=1) as a NativeCausalLM or DFlashDrafter
    with QuantLinear layers where it is quantized."""
    from dflash_trt.checkpoint.quantized import algo_of_state, load_quantized_state

    cfg = read_config(directory)
    m = Mapping.from_json(cfg["mapping"])
    source = dict(cfg["dflash_trt"]["source_config"])
    if cfg["architecture"] == DRAFTER_ARCHITECTURE:
        from dflash_trt.config import DrafterConfig
        from dflash_trt.models.drafter import DFlashDrafter

        model = DFlashDrafter(DrafterConfig.from_dict(source)).to(dtype)
        g = geometry_of(model, drafter=True)
    else:
        from transformers import AutoConfig

        from dflash_trt.models.transformer import NativeCausalLM

        model_type = source.pop("model_type")
        model = NativeCausalLM(AutoConfig.for_model(model_type, **source)).to(dtype)
        g = geometry_of(model, drafter=False)
    state = unshard_state(read_ranks(directory, m.tp_size), g, m)
    algo = algo_of_state(state)
    if algo is None:
        check_state_dict(state, model.state_dict(), f"legacy checkpoint {directory} (per its dflash_trt.source_config)")
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
        return model.eval()
    return load_quantized_state(model, state, algo, str(directory))


__all__ = ["ARCHITECTURES", "DRAFTER_ARCHITECTURE", "Geometry", "load_merged", "read_config", "shard_state",
           "unshard_state", "write_checkpoint"]
