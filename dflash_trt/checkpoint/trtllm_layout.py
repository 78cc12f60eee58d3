"""The tensor layout of TensorRT-LLM 1.2.x legacy checkpoints, as names and fusing on top of THE
split-rule table (mapping.py): every HF-named tensor is cut per rank by `shard_tensor`, then renamed
(and q/k/v, gate/up fused) into the legacy names; `unshard_state` splits the fused tensors back and
merges every HF name with `merge_shards` (which also checks that replicated copies agree). The
files around it (config.json, rank{N}.safetensors) are `dflash_trt.checkpoint.trtllm_legacy`.

Tensor names per rank (what ModelOpt's exporter and `convert_checkpoint.py` write):
  transformer.vocab_embedding.weight   vocab-parallel (dim 0, vocab padded to a multiple of tp)
  transformer.layers.{i}.input_layernorm.weight, .post_layernorm.weight            replicated
  transformer.layers.{i}.attention.qkv.{weight,bias}     fused [q; k; v] of this rank's heads
  transformer.layers.{i}.attention.{q,k}_layernorm.weight  (Qwen3, drafter)         replicated
  transformer.layers.{i}.attention.sinks                 (gpt-oss) split with the q heads
  transformer.layers.{i}.attention.dense.weight           row-parallel (dim 1)
  transformer.layers.{i}.mlp.fc / mlp.gate / mlp.proj     gate_proj / up_proj (column) / down_proj (row)
  transformer.ln_f.weight, lm_head.weight (vocab-parallel, padded)
Quantized linears add `weights_scaling_factor` (FP8: fp32 (1,); NVFP4: e4m3 block scales
[out, in/16]), `weights_scaling_factor_2` (NVFP4 global, fp32 0-d) and `activation_scaling_factor`.
These are the on-disk names; TensorRT-LLM's `preprocess_weights` renames the NVFP4 ones at load
time to `weights_block_scaling_factor(_interleaved)`, `weights_global_scaling_factor`,
`activation_global_scaling_factor` and adds `alpha` = activation x weight global scale. The reader
here accepts both spellings. Fused q/k/v share one weight scale, as TRT-LLM's fused GEMMs need.

gpt-oss (our layout; it never ran on the engine path): biased attention, `attention.sinks`,
`mlp.router.{weight,bias}` [E, H] replicated, experts `mlp.fc.weight` [E_local, 2*I_local, H] = this
rank's [gate; up] rows (de-interleaved from HF's gate_up_proj), `mlp.fc.bias`, `mlp.proj.weight`
[E_local, H, I_local], `mlp.proj.bias`; kept in high precision. The expert and MoE-TP ranks follow
TensorRT-LLM's Mapping (mapping.py). The DFlash drafter adds `fc.weight` and `hidden_norm.weight`
(high precision, replicated) and has no embedding or lm_head.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_trt.checkpoint.mapping import Dims, Mapping, check_mapping, full_shape, merge_shards, shard_tensor
from dflash_trt.errors import CheckpointError, ConfigError
from dflash_trt.quant.algo import QuantAlgo
from dflash_trt.quant.nvfp4 import BLOCK_SIZE

# HF suffix -> legacy suffix of a quantized linear's tensors
_QSUFFIX = {"weight": "weight", "bias": "bias", "weight_scale": "weights_scaling_factor",
            "weight_scale_2": "weights_scaling_factor_2", "input_scale": "activation_scaling_factor"}
_RUNTIME_NAMES = {"weights_block_scaling_factor": "weights_scaling_factor",
                  "weights_global_scaling_factor": "weights_scaling_factor_2",
                  "activation_global_scaling_factor": "activation_scaling_factor"}
_NORMS = (("input_layernorm.weight", "input_layernorm.weight"),
          ("post_attention_layernorm.weight", "post_layernorm.weight"),
          ("self_attn.q_norm.weight", "attention.q_layernorm.weight"),
          ("self_attn.k_norm.weight", "attention.k_layernorm.weight"))
_NO_CAST = (torch.float8_e4m3fn, torch.uint8)  # quantized codes and block scales keep their dtype


def _linears(experts: int) -> list[tuple[str, str]]:
    """(HF module, TRT-LLM module) of a layer's non-QKV linears (the dense MLP only without experts)."""
    linears = [("self_attn.o_proj", "attention.dense")]
    if not experts:
        linears += [("mlp.gate_proj", "mlp.fc"), ("mlp.up_proj", "mlp.gate"), ("mlp.down_proj", "mlp.proj")]
    return linears


@dataclass(frozen=True)
class Geometry:
    layers: int
    hidden: int
    dims: Dims
    hf_layer: str  # "model.layers." (target) or "layers." (drafter)
    drafter: bool

    def check(self, m: Mapping, algo: QuantAlgo | None) -> None:
        check_mapping(self.dims, m)
        d, tp = self.dims, m.tp_size
        if algo is QuantAlgo.NVFP4:
            widths = [("attention output", d.num_heads * d.head_dim)]
            widths += [] if d.num_experts else [("mlp down", d.intermediate_size)]
            for name, width in widths:
                if (width // tp) % BLOCK_SIZE:
                    raise ConfigError(f"NVFP4 row-parallel {name} input width {width}/{tp} is not a multiple "
                                      f"of {BLOCK_SIZE}; use a smaller --tp")


def geometry_of(model, drafter: bool) -> Geometry:
    """The sizes of a NativeCausalLM (drafter=False) or DFlashDrafter (drafter=True)."""
    if drafter:
        return Geometry(model.cfg.num_hidden_layers, model.cfg.hidden_size, Dims.of(model.cfg), "layers.", True)
    c = model.config
    return Geometry(c.num_hidden_layers, c.hidden_size, Dims.of(c), "model.layers.", False)


class _Tracked(dict):
    """A dict that records which keys were read (to find tensors the writer has no rule for)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.used: set[str] = set()

    def __getitem__(self, key):
        self.used.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        if key in self:
            self.used.add(key)
        return super().get(key, default)


def _cast(t: torch.Tensor, dtype: torch.dtype, floating: bool = True) -> torch.Tensor:
    return t.to(dtype) if floating and t.dtype not in _NO_CAST else t


def _layer_rank(state: _Tracked, g: Geometry, m: Mapping, i: int, rank: int, dtype) -> dict[str, torch.Tensor]:
    src, dst = f"{g.hf_layer}{i}.", f"transformer.layers.{i}."
    out: dict[str, torch.Tensor] = {}

    def part(name: str) -> torch.Tensor:
        return shard_tensor(src + name, state[src + name], g.dims, m, rank)

    for hf, trt in _NORMS + (("self_attn.sinks", "attention.sinks"),):
        if src + hf in state:
            out[dst + trt] = _cast(part(hf), dtype)
    for hf_sfx, trt_sfx in _QSUFFIX.items():
        if f"{src}self_attn.q_proj.{hf_sfx}" not in state:
            continue
        q, k, v = (part(f"self_attn.{p}_proj.{hf_sfx}") for p in "qkv")
        scalar = q.numel() == 1 and hf_sfx != "bias"
        fused = q if scalar else torch.cat([q, k, v], dim=0)  # one scale for the fused GEMM (shared at quantization)
        out[f"{dst}attention.qkv.{trt_sfx}"] = _cast(fused, dtype, hf_sfx in ("weight", "bias"))
    for hf_mod, trt_mod in _linears(g.dims.num_experts):
        for hf_sfx, trt_sfx in _QSUFFIX.items():
            if f"{src}{hf_mod}.{hf_sfx}" in state:
                out[f"{dst}{trt_mod}.{trt_sfx}"] = _cast(part(f"{hf_mod}.{hf_sfx}"), dtype, hf_sfx in ("weight", "bias"))
    if g.dims.num_experts:
        out[dst + "mlp.router.weight"] = _cast(part("mlp.router.weight"), dtype)
        out[dst + "mlp.router.bias"] = _cast(part("mlp.router.bias"), dtype)
        gu, gub = part("mlp.experts.gate_up_proj"), part("mlp.experts.gate_up_proj_bias")  # [E, H, 2I], [E, 2I]
        out[dst + "mlp.fc.weight"] = _cast(torch.cat([gu[..., 0::2], gu[..., 1::2]], dim=2).transpose(1, 2), dtype)
        out[dst + "mlp.fc.bias"] = _cast(torch.cat([gub[..., 0::2], gub[..., 1::2]], dim=1), dtype)
        out[dst + "mlp.proj.weight"] = _cast(part("mlp.experts.down_proj").transpose(1, 2), dtype)  # [E, H, I]
        out[dst + "mlp.proj.bias"] = _cast(part("mlp.experts.down_proj_bias"), dtype)
    return {k: t.contiguous() for k, t in out.items()}


def shard_state(state: dict, g: Geometry, m: Mapping, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """HF-named (quantized) state -> one legacy-named dict per tp rank."""
    state = _Tracked(state)
    if not g.drafter and "lm_head.weight" not in state:
        state = _Tracked({**state, "lm_head.weight": state["model.embed_tokens.weight"]})  # tied
    ranks = []
    for rank in range(m.tp_size):
        out: dict[str, torch.Tensor] = {}
        for i in range(g.layers):
            out.update(_layer_rank(state, g, m, i, rank, dtype))

        def part(name: str) -> torch.Tensor:
            return _cast(shard_tensor(name, state[name], g.dims, m, rank), dtype)

        if g.drafter:
            out.update({"fc.weight": part("fc.weight"), "hidden_norm.weight": part("hidden_norm.weight"),
                        "transformer.ln_f.weight": part("norm.weight")})
        else:
            out.update({"transformer.ln_f.weight": part("model.norm.weight"),
                        "transformer.vocab_embedding.weight": part("model.embed_tokens.weight"),
                        "lm_head.weight": part("lm_head.weight")})
        ranks.append({k: t.contiguous() for k, t in out.items()})
    unused = sorted(set(state) - state.used)
    if unused:
        raise CheckpointError(f"tensors with no legacy mapping (the writer does not know them): {unused[:8]}")
    return ranks


# ---- merge ----------------------------------------------------------------------------------
def _runtime_to_disk_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        base, _, leaf = name.rpartition(".")
        if leaf in ("alpha", "weights_block_scaling_factor_interleaved"):
            continue  # derived at load time by TensorRT-LLM
        out[f"{base}.{_RUNTIME_NAMES.get(leaf, leaf)}"] = t
    return out


def _pop(rank: dict, r: int, name: str) -> torch.Tensor:
    if name not in rank:
        raise CheckpointError(f"legacy checkpoint: tensor {name} is missing from rank(s) [{r}]")
    return rank.pop(name)


def _hf_layer_rank(rank: dict, r: int, first: set[str], g: Geometry, m: Mapping, i: int) -> dict[str, torch.Tensor]:
    """One rank's legacy tensors of layer i -> that rank's HF-named parts (the fusing undone). The
    tensors rank 0 holds (`first`) must be on every rank."""
    src, dst = f"transformer.layers.{i}.", f"{g.hf_layer}{i}."
    d, tp = g.dims, m.tp_size
    out: dict[str, torch.Tensor] = {}
    for hf, trt in _NORMS + (("self_attn.sinks", "attention.sinks"),):
        if src + trt in first:
            out[dst + hf] = _pop(rank, r, src + trt)
    qn = d.num_heads * d.head_dim // tp
    kvn = d.num_kv_heads * d.head_dim // tp if tp <= d.num_kv_heads else d.head_dim
    for hf_sfx, trt_sfx in _QSUFFIX.items():
        if src + f"attention.qkv.{trt_sfx}" not in first:
            continue
        t = _pop(rank, r, src + f"attention.qkv.{trt_sfx}")
        scalar = t.numel() == 1 and hf_sfx != "bias"
        parts = (t, t, t) if scalar else (t[:qn], t[qn:qn + kvn], t[qn + kvn:])
        for p, x in zip("qkv", parts):
            out[f"{dst}self_attn.{p}_proj.{hf_sfx}"] = x
    for hf_mod, trt_mod in _linears(d.num_experts):
        for hf_sfx, trt_sfx in _QSUFFIX.items():
            if f"{src}{trt_mod}.{trt_sfx}" in first:
                out[f"{dst}{hf_mod}.{hf_sfx}"] = _pop(rank, r, f"{src}{trt_mod}.{trt_sfx}")
    if d.num_experts:
        for sfx in ("weight", "bias"):
            out[f"{dst}mlp.router.{sfx}"] = _pop(rank, r, f"{src}mlp.router.{sfx}")
        fc, fcb = _pop(rank, r, src + "mlp.fc.weight").transpose(1, 2), _pop(rank, r, src + "mlp.fc.bias")
        half = fc.shape[-1] // 2
        out[dst + "mlp.experts.gate_up_proj"] = torch.stack([fc[..., :half], fc[..., half:]], dim=-1).flatten(-2)
        out[dst + "mlp.experts.gate_up_proj_bias"] = torch.stack([fcb[..., :half], fcb[..., half:]], dim=-1).flatten(-2)
        out[dst + "mlp.experts.down_proj"] = _pop(rank, r, src + "mlp.proj.weight").transpose(1, 2)
        out[dst + "mlp.experts.down_proj_bias"] = _pop(rank, r, src + "mlp.proj.bias")
    return out


def unshard_state(ranks: list[dict], g: Geometry, m: Mapping) -> dict[str, torch.Tensor]:
    """All ranks -> one HF-named (quantized) state dict; CheckpointError on missing/extra tensors or
    replicated copies that differ between ranks."""
    ranks = [_runtime_to_disk_names(r) for r in ranks]
    top = ({"fc.weight": "fc.weight", "hidden_norm.weight": "hidden_norm.weight", "norm.weight": "transformer.ln_f.weight"}
           if g.drafter else {"model.norm.weight": "transformer.ln_f.weight", "lm_head.weight": "lm_head.weight",
                              "model.embed_tokens.weight": "transformer.vocab_embedding.weight"})
    parts: list[dict[str, torch.Tensor]] = []
    first = set(ranks[0])
    for r, rank in enumerate(ranks):
        hf: dict[str, torch.Tensor] = {}
        for i in range(g.layers):
            hf.update(_hf_layer_rank(rank, r, first, g, m, i))
        hf.update({name: _pop(rank, r, trt) for name, trt in top.items()})
        parts.append(hf)
    extra = sorted({k for d in ranks for k in d})
    if extra:
        raise CheckpointError(f"legacy checkpoint has unexpected tensors: {extra[:8]}{'...' if len(extra) > 8 else ''}")
    return {name: merge_shards(name, [p[name] for p in parts], full_shape(name, tuple(parts[0][name].shape), g.dims, m),
                               g.dims, m)
            for name in parts[0]}


__all__ = ["Geometry", "geometry_of", "shard_state", "unshard_state"]
