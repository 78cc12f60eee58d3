"""The tensor layout of TensorRT-LLM 1.2.x legacy checkpoints: HF names <-> per-rank legacy names,
tensor/expert-parallel sharding (`shard_state`) and its inverse (`unshard_state`). The files
around it (config.json, rank{N}.safetensors) are `dflash_trt.checkpoint.trtllm_legacy`.

Tensor names per rank (what ModelOpt's exporter and `convert_checkpoint.py` write):
  transformer.vocab_embedding.weight   vocab-parallel (dim 0, vocab padded to a multiple of tp)
  transformer.layers.{i}.input_layernorm.weight, .post_layernorm.weight            replicated
  transformer.layers.{i}.attention.qkv.{weight,bias}     fused [q; k; v] of this rank's heads; kv heads
                                                         duplicated when tp > num_kv_heads
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
here accepts both spellings. Fused q/k/v (and gate/up) share one weight scale, as TRT-LLM's fused
GEMMs need.

gpt-oss (our layout; it never ran on the engine path): biased attention, `attention.sinks`,
`mlp.router.{weight,bias}` [E, H] replicated, experts `mlp.fc.weight` [E_local, 2*I_local, H] = this
rank's [gate; up] rows, `mlp.fc.bias`, `mlp.proj.weight` [E_local, H, I_local], `mlp.proj.bias`;
experts split by expert (EP, rank -> tp_rank % moe_ep_size) and by intermediate (MoE TP,
tp_rank // moe_ep_size), kept in high precision. The DFlash drafter adds `fc.weight` and
`hidden_norm.weight` (high precision, replicated) and has no embedding or lm_head.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_trt.errors import CheckpointError, ConfigError
from dflash_trt.quant.algo import QuantAlgo
from dflash_trt.quant.nvfp4 import BLOCK_SIZE

# HF suffix -> legacy suffix of a quantized linear's tensors
_QSUFFIX = {"weight": "weight", "bias": "bias", "weight_scale": "weights_scaling_factor",
            "weight_scale_2": "weights_scaling_factor_2", "input_scale": "activation_scaling_factor"}
_RUNTIME_NAMES = {"weights_block_scaling_factor": "weights_scaling_factor",
                  "weights_global_scaling_factor": "weights_scaling_factor_2",
                  "activation_global_scaling_factor": "activation_scaling_factor"}


def _linears(g) -> list[tuple[str, str, str]]:
    """(HF module, TRT-LLM module, parallel kind) of a layer's non-QKV linears (dense MLP only)."""
    linears = [("self_attn.o_proj", "attention.dense", "row")]
    if not g.experts:
        linears += [("mlp.gate_proj", "mlp.fc", "col"), ("mlp.up_proj", "mlp.gate", "col"),
                    ("mlp.down_proj", "mlp.proj", "row")]
    return linears


@dataclass(frozen=True)
class Mapping:
    tp_size: int = 1
    moe_tp_size: int = 1
    moe_ep_size: int = 1

    def __post_init__(self) -> None:
        if min(self.tp_size, self.moe_tp_size, self.moe_ep_size) < 1:
            raise ConfigError(f"tp/moe sizes must be >= 1, got {self}")
        if self.moe_tp_size * self.moe_ep_size != self.tp_size:
            raise ConfigError(f"moe_tp_size x moe_ep_size must equal tp_size: {self.moe_tp_size} x "
                              f"{self.moe_ep_size} != {self.tp_size}")

    @classmethod
    def for_sizes(cls, tp: int, ep: int = 1) -> "Mapping":
        if ep < 1 or tp % ep:
            raise ConfigError(f"--ep ({ep}) must divide --tp ({tp})")
        return cls(tp, tp // ep, ep)

    def to_json(self) -> dict:
        return {"world_size": self.tp_size, "tp_size": self.tp_size, "pp_size": 1,
                "moe_tp_size": self.moe_tp_size, "moe_ep_size": self.moe_ep_size}

    def moe_ranks(self, rank: int) -> tuple[int, int]:
        """(moe_tp_rank, moe_ep_rank) of a tp rank, as TensorRT-LLM's Mapping assigns them."""
        return rank // self.moe_ep_size, rank % self.moe_ep_size


@dataclass(frozen=True)
class Geometry:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    experts: int  # 0: dense MLP
    hf_layer: str  # "model.layers." (target) or "layers." (drafter)
    drafter: bool

    def check(self, m: Mapping, algo: QuantAlgo | None) -> None:
        tp = m.tp_size
        bad = []
        if self.heads % tp:
            bad.append(f"num_attention_heads {self.heads}")
        if (self.kv_heads % tp) if tp <= self.kv_heads else (tp % self.kv_heads):
            bad.append(f"num_key_value_heads {self.kv_heads} (or be a multiple of it)")
        if not self.experts and self.intermediate % tp:
            bad.append(f"intermediate_size {self.intermediate}")
        if self.experts and (self.experts % m.moe_ep_size or self.intermediate % m.moe_tp_size):
            raise ConfigError(f"moe_ep_size {m.moe_ep_size} must divide the {self.experts} experts and moe_tp_size "
                              f"{m.moe_tp_size} the expert intermediate size {self.intermediate}")
        if bad:
            raise ConfigError(f"tp_size {tp} must divide " + ", ".join(bad) + "; choose another --tp")
        if algo is QuantAlgo.NVFP4:
            for name, width in (("attention output", self.heads * self.head_dim), ("mlp down", self.intermediate)):
                if not self.experts or name != "mlp down":
                    if (width // tp) % BLOCK_SIZE:
                        raise ConfigError(f"NVFP4 row-parallel {name} input width {width}/{tp} is not a multiple "
                                          f"of {BLOCK_SIZE}; use a smaller --tp")


def geometry_of(model, drafter: bool) -> Geometry:
    """The sizes of a NativeCausalLM (drafter=False) or DFlashDrafter (drafter=True)."""
    if drafter:
        c = model.cfg
        return Geometry(c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size,
                        c.intermediate_size, c.vocab_size, 0, "layers.", True)
    c = model.config
    attn = model.model.layers[0].self_attn
    return Geometry(c.num_hidden_layers, attn.num_heads, attn.num_kv_heads, attn.head_dim, c.hidden_size,
                    c.intermediate_size, c.vocab_size, int(getattr(c, "num_local_experts", 0) or 0) if model.arch.moe
                    else 0, "model.layers.", False)


def _chunk(t: torch.Tensor, n: int, dim: int) -> list[torch.Tensor]:
    return list(torch.chunk(t, n, dim=dim)) if n > 1 else [t]


def _is_scalar(t: torch.Tensor) -> bool:
    return t.numel() == 1 and t.dtype == torch.float32


def _qkv_rows(g: Geometry, tp: int, rank: int) -> tuple[slice, slice]:
    """Rows of q and of k/v (each [heads * head_dim, ...]) held by `rank`."""
    hq = g.heads // tp
    q = slice(rank * hq * g.head_dim, (rank + 1) * hq * g.head_dim)
    if tp <= g.kv_heads:
        hk = g.kv_heads // tp
        kv = slice(rank * hk * g.head_dim, (rank + 1) * hk * g.head_dim)
    else:
        head = rank // (tp // g.kv_heads)  # duplicated kv head
        kv = slice(head * g.head_dim, (head + 1) * g.head_dim)
    return q, kv


def _layer_rank(state: dict, g: Geometry, m: Mapping, i: int, rank: int, dtype) -> dict[str, torch.Tensor]:
    tp = m.tp_size
    src, dst = f"{g.hf_layer}{i}.", f"transformer.layers.{i}."
    out: dict[str, torch.Tensor] = {}

    def put(name, t, floating=True):
        out[dst + name] = t.to(dtype) if floating else t

    for hf, trt in (("input_layernorm.weight", "input_layernorm.weight"),
                    ("post_attention_layernorm.weight", "post_layernorm.weight"),
                    ("self_attn.q_norm.weight", "attention.q_layernorm.weight"),
                    ("self_attn.k_norm.weight", "attention.k_layernorm.weight")):
        if src + hf in state:
            put(trt, state[src + hf])
    if src + "self_attn.sinks" in state:
        put("attention.sinks", _chunk(state[src + "self_attn.sinks"], tp, 0)[rank])
    q_rows, kv_rows = _qkv_rows(g, tp, rank)
    for hf_sfx, trt_sfx in _QSUFFIX.items():
        parts = [state.get(f"{src}self_attn.{p}_proj.{hf_sfx}") for p in "qkv"]
        if parts[0] is None:
            continue
        if _is_scalar(parts[0]):
            out[f"{dst}attention.qkv.{trt_sfx}"] = parts[0]  # shared by the fused group
        else:
            t = torch.cat([parts[0][q_rows], parts[1][kv_rows], parts[2][kv_rows]], dim=0)
            floating = hf_sfx in ("weight", "bias") and t.dtype not in (torch.float8_e4m3fn, torch.uint8)
            out[f"{dst}attention.qkv.{trt_sfx}"] = t.to(dtype) if floating else t
    for hf_mod, trt_mod, kind in _linears(g):
        for hf_sfx, trt_sfx in _QSUFFIX.items():
            t = state.get(f"{src}{hf_mod}.{hf_sfx}")
            if t is None:
                continue
            if _is_scalar(t) and hf_sfx != "bias":
                part = t
            elif kind == "col" or (kind == "row" and hf_sfx == "bias"):
                part = _chunk(t, tp, 0)[rank] if kind == "col" else t
            else:
                part = _chunk(t, tp, t.dim() - 1)[rank]
            floating = hf_sfx in ("weight", "bias") and part.dtype not in (torch.float8_e4m3fn, torch.uint8)
            out[f"{dst}{trt_mod}.{trt_sfx}"] = part.to(dtype) if floating else part.contiguous()
    if g.experts:
        mtp, mep = m.moe_ranks(rank)
        e = g.experts // m.moe_ep_size
        experts = slice(mep * e, (mep + 1) * e)
        put("mlp.router.weight", state[src + "mlp.router.weight"])
        put("mlp.router.bias", state[src + "mlp.router.bias"])
        gu = state[src + "mlp.experts.gate_up_proj"][experts]  # [E, H, 2I] interleaved gate/up
        gub = state[src + "mlp.experts.gate_up_proj_bias"][experts]  # [E, 2I]
        gate, up = _chunk(gu[..., 0::2], m.moe_tp_size, 2)[mtp], _chunk(gu[..., 1::2], m.moe_tp_size, 2)[mtp]
        gb, ub = _chunk(gub[..., 0::2], m.moe_tp_size, 1)[mtp], _chunk(gub[..., 1::2], m.moe_tp_size, 1)[mtp]
        put("mlp.fc.weight", torch.cat([gate, up], dim=2).transpose(1, 2))
        put("mlp.fc.bias", torch.cat([gb, ub], dim=1))
        down = state[src + "mlp.experts.down_proj"][experts]  # [E, I, H]
        put("mlp.proj.weight", _chunk(down, m.moe_tp_size, 1)[mtp].transpose(1, 2))
        put("mlp.proj.bias", state[src + "mlp.experts.down_proj_bias"][experts])
    return {k: v.contiguous() for k, v in out.items()}


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


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-t.shape[0]) % multiple
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def shard_state(state: dict, g: Geometry, m: Mapping, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """HF-named (quantized) state -> one legacy-named dict per tp rank."""
    state = _Tracked(state)
    ranks = []
    for rank in range(m.tp_size):
        out: dict[str, torch.Tensor] = {}
        for i in range(g.layers):
            out.update(_layer_rank(state, g, m, i, rank, dtype))
        if g.drafter:
            out["fc.weight"] = state["fc.weight"].to(dtype)
            out["hidden_norm.weight"] = state["hidden_norm.weight"].to(dtype)
            out["transformer.ln_f.weight"] = state["norm.weight"].to(dtype)
        else:
            out["transformer.ln_f.weight"] = state["model.norm.weight"].to(dtype)
            emb = state["model.embed_tokens.weight"]
            head = state.get("lm_head.weight", emb)
            out["transformer.vocab_embedding.weight"] = _chunk(_pad_rows(emb, m.tp_size), m.tp_size, 0)[rank].to(dtype)
            out["lm_head.weight"] = _chunk(_pad_rows(head, m.tp_size), m.tp_size, 0)[rank].to(dtype)
        ranks.append({k: v.contiguous() for k, v in out.items()})
    unused = sorted(set(state) - state.used)
    if unused:
        raise CheckpointError(f"tensors with no legacy mapping (the writer does not know them): {unused[:8]}")
    return ranks


# ---- merge ----------------------------------------------------------------------------------
def _unshard_layer(ranks: list[dict], g: Geometry, m: Mapping, i: int) -> dict[str, torch.Tensor]:
    tp = m.tp_size
    src, dst = f"transformer.layers.{i}.", f"{g.hf_layer}{i}."
    r0 = ranks[0]
    out: dict[str, torch.Tensor] = {}

    def take(name: str) -> list[torch.Tensor]:
        missing = [r for r, d in enumerate(ranks) if src + name not in d]
        if missing:
            raise CheckpointError(f"legacy checkpoint: tensor {src + name} is missing from rank(s) {missing}")
        return [d.pop(src + name) for d in ranks]

    for hf, trt in (("input_layernorm.weight", "input_layernorm.weight"),
                    ("post_attention_layernorm.weight", "post_layernorm.weight"),
                    ("self_attn.q_norm.weight", "attention.q_layernorm.weight"),
                    ("self_attn.k_norm.weight", "attention.k_layernorm.weight")):
        if src + trt in r0:
            out[dst + hf] = take(trt)[0]
    if src + "attention.sinks" in r0:
        out[dst + "self_attn.sinks"] = torch.cat(take("attention.sinks"))
    qn, kvn = g.heads * g.head_dim // tp, (g.kv_heads * g.head_dim // tp if tp <= g.kv_heads else g.head_dim)
    for hf_sfx, trt_sfx in _QSUFFIX.items():
        if src + f"attention.qkv.{trt_sfx}" not in r0:
            continue
        parts = take(f"attention.qkv.{trt_sfx}")
        if _is_scalar(parts[0]):
            for p in "qkv":
                out[f"{dst}self_attn.{p}_proj.{hf_sfx}"] = parts[0]
            continue
        step = 1 if tp <= g.kv_heads else tp // g.kv_heads  # keep one copy of duplicated kv heads
        out[f"{dst}self_attn.q_proj.{hf_sfx}"] = torch.cat([p[:qn] for p in parts])
        out[f"{dst}self_attn.k_proj.{hf_sfx}"] = torch.cat([p[qn:qn + kvn] for p in parts[::step]])
        out[f"{dst}self_attn.v_proj.{hf_sfx}"] = torch.cat([p[qn + kvn:] for p in parts[::step]])
    for hf_mod, trt_mod, kind in _linears(g):
        for hf_sfx, trt_sfx in _QSUFFIX.items():
            if f"{src}{trt_mod}.{trt_sfx}" not in r0:
                continue
            parts = take(f"{trt_mod}.{trt_sfx}")
            if (_is_scalar(parts[0]) and hf_sfx != "bias") or (kind == "row" and hf_sfx == "bias"):
                merged = parts[0]
            else:
                merged = torch.cat(parts, dim=0 if kind == "col" else parts[0].dim() - 1)
            out[f"{dst}{hf_mod}.{hf_sfx}"] = merged
    if g.experts:
        out[dst + "mlp.router.weight"] = take("mlp.router.weight")[0]
        out[dst + "mlp.router.bias"] = take("mlp.router.bias")[0]
        fc, fcb, proj, projb = take("mlp.fc.weight"), take("mlp.fc.bias"), take("mlp.proj.weight"), take("mlp.proj.bias")
        gates, ups, gbs, ubs, downs, dbs = [], [], [], [], [], []
        for ep in range(m.moe_ep_size):
            rs = [r for r in range(tp) if m.moe_ranks(r)[1] == ep]  # ordered by moe_tp_rank
            ii = fc[rs[0]].shape[1] // 2
            gates.append(torch.cat([fc[r][:, :ii].transpose(1, 2) for r in rs], dim=2))
            ups.append(torch.cat([fc[r][:, ii:].transpose(1, 2) for r in rs], dim=2))
            gbs.append(torch.cat([fcb[r][:, :ii] for r in rs], dim=1))
            ubs.append(torch.cat([fcb[r][:, ii:] for r in rs], dim=1))
            downs.append(torch.cat([proj[r].transpose(1, 2) for r in rs], dim=1))
            dbs.append(projb[rs[0]])
        gate, up = torch.cat(gates), torch.cat(ups)
        gu = torch.stack([gate, up], dim=-1).flatten(-2)  # re-interleave
        gub = torch.stack([torch.cat(gbs), torch.cat(ubs)], dim=-1).flatten(-2)
        out[dst + "mlp.experts.gate_up_proj"] = gu
        out[dst + "mlp.experts.gate_up_proj_bias"] = gub
        out[dst + "mlp.experts.down_proj"] = torch.cat(downs)
        out[dst + "mlp.experts.down_proj_bias"] = torch.cat(dbs)
    return out


def _runtime_to_disk_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        base, _, leaf = name.rpartition(".")
        if leaf in ("alpha", "weights_block_scaling_factor_interleaved"):
            continue  # derived at load time by TensorRT-LLM
        out[f"{base}.{_RUNTIME_NAMES.get(leaf, leaf)}"] = t
    return out


def unshard_state(ranks: list[dict], g: Geometry, m: Mapping) -> dict[str, torch.Tensor]:
    """All ranks -> one HF-named (quantized) state dict; CheckpointError on missing/extra tensors."""
    ranks = [_runtime_to_disk_names(r) for r in ranks]
    out: dict[str, torch.Tensor] = {}
    for i in range(g.layers):
        out.update(_unshard_layer(ranks, g, m, i))

    def pop_all(name: str) -> list[torch.Tensor]:
        missing = [r for r, d in enumerate(ranks) if name not in d]
        if missing:
            raise CheckpointError(f"legacy checkpoint: tensor {name} is missing from rank(s) {missing}")
        return [d.pop(name) for d in ranks]

    out["norm.weight" if g.drafter else "model.norm.weight"] = pop_all("transformer.ln_f.weight")[0]
    if g.drafter:
        out["fc.weight"] = pop_all("fc.weight")[0]
        out["hidden_norm.weight"] = pop_all("hidden_norm.weight")[0]
    else:
        out["model.embed_tokens.weight"] = torch.cat(pop_all("transformer.vocab_embedding.weight"))[: g.vocab]
        out["lm_head.weight"] = torch.cat(pop_all("lm_head.weight"))[: g.vocab]
    extra = sorted({k for d in ranks for k in d})
    if extra:
        raise CheckpointError(f"legacy checkpoint has unexpected tensors: {extra[:8]}{'...' if len(extra) > 8 else ''}")
    return out


__all__ = ["Geometry", "Mapping", "geometry_of", "shard_state", "unshard_state"]
