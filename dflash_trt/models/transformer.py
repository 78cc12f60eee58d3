"""The native target: one decoder-only transformer for Llama, Qwen3 and gpt-oss checkpoints.

transformers' models cannot serve what the DFlash runtime needs: ragged batches whose rows accept
different numbers of tokens each step (per-row cache crop), tensor-parallel sharding across MPI
ranks, and quantized (FP8/NVFP4) weight emulation. This module implements the three architectures
once, with a small `Architecture` adapter each, over the HF parameter names (so a HF state dict loads
with strict key checking), and is tested token-for-token against transformers (the oracle).

Architectural notes (from the model cards / HF configs):
- Llama: RMSNorm, RoPE (optionally llama3-scaled), GQA, SwiGLU MLP.
- Qwen3: Llama plus per-head RMSNorm on q and k (`q_norm`, `k_norm`) before RoPE.
- gpt-oss: attention biases, learned per-head attention sinks, sliding-window attention on the
  layers marked `sliding_attention`, YaRN RoPE, and a top-k MoE of biased, clamped SwiGLU experts
  (gate/up interleaved in `gate_up_proj` [E, H, 2I], `glu = gate * sigmoid(alpha * gate)`,
  `out = (up + 1) * glu`).
RoPE frequencies come from transformers' own rotary class for the architecture, so every rope
scaling variant the checkpoint declares is honoured exactly.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.config import TargetInfo
from dflash_trt.engine import TargetOutput
from dflash_trt.errors import ConfigError, InputError
from dflash_trt.models.kv_cache import CacheShape, RaggedKVCache
from dflash_trt.models.layers import apply_rope, attend, attention_mask, rms_norm, rope_cos_sin


@dataclass(frozen=True)
class Architecture:
    model_type: str
    rotary_module: str  # transformers module holding the rotary embedding class
    rotary_class: str
    qk_norm: bool
    sinks: bool
    moe: bool


ARCHS: dict[str, Architecture] = {
    "llama": Architecture("llama", "transformers.models.llama.modeling_llama", "LlamaRotaryEmbedding", False, False, False),
    "qwen3": Architecture("qwen3", "transformers.models.qwen3.modeling_qwen3", "Qwen3RotaryEmbedding", True, False, False),
    "gpt_oss": Architecture("gpt_oss", "transformers.models.gpt_oss.modeling_gpt_oss", "GptOssRotaryEmbedding", False, True, True),
}


def plain_linear_weight(module: nn.Module) -> torch.Tensor | None:
    """The weight of a plain bias-free nn.Linear (not a subclass such as TP's vocab-parallel head), else None."""
    return module.weight if type(module) is nn.Linear and module.bias is None else None


def head_dim_of(config) -> int:
    """A HF config's head_dim (an optional field: hidden_size // num_attention_heads when absent)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def arch_for(config) -> Architecture:
    model_type = config.model_type
    if model_type not in ARCHS:
        raise ConfigError(
            f"target architecture '{model_type}' is not supported by the native torch engine "
            f"(supported: {sorted(ARCHS)}); use the HF adapter (--target-backend hf) for other models"
        )
    return ARCHS[model_type]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config, arch: Architecture, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        bias = bool(config.attention_bias)
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        if arch.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        if arch.sinks:
            self.sinks = nn.Parameter(torch.zeros(self.num_heads))
        layer_types = getattr(config, "layer_types", None)
        sliding = layer_types is not None and layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if sliding else None
        self.layer_idx = layer_idx
        self.arch = arch

    def forward(self, x, cos, sin, cache: RaggedKVCache, rows: slice, slots, q_pos, kv_end: int):
        """x: [B, T, H]; slots/q_pos: [B, T]."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if self.arch.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        cache.write(self.layer_idx, rows, slots, k, v.transpose(1, 2))
        keys, values = cache.read(self.layer_idx, rows, kv_end)
        mask = attention_mask(q_pos, kv_end, None, True, self.sliding_window)
        sinks = self.sinks if self.arch.sinks else None
        out = attend(q, keys.to(q.dtype), values.to(q.dtype), mask, self.head_dim ** -0.5, sinks)
        return self.o_proj(out)


class DenseMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.num_local_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.zeros(config.num_local_experts))


class Experts(nn.Module):
    """Expert weights in the HF gpt-oss layout: x @ gate_up_proj[e] (no transpose)."""

    def __init__(self, config) -> None:
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, h, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i))
        self.down_proj = nn.Parameter(torch.zeros(e, i, h))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, h))


class MoEMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.router = Router(config)
        self.experts = Experts(config)
        self.top_k = config.num_experts_per_tok
        self.alpha = float(config.swiglu_alpha) if hasattr(config, "swiglu_alpha") else 1.702
        self.limit = float(config.swiglu_limit)
        self.expert_offset = 0  # first global expert id held here (expert parallelism)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, H]
        logits = F.linear(flat, self.router.weight, self.router.bias)  # [N, E]
        top_vals, top_idx = torch.topk(logits, self.top_k, dim=-1)
        weights = torch.softmax(top_vals, dim=-1)  # [N, k]
        out = torch.zeros_like(flat)
        local = self.experts.gate_up_proj.shape[0]
        for expert in torch.unique(top_idx).tolist():
            e = expert - self.expert_offset
            if not 0 <= e < local:
                continue  # held by another rank (expert parallelism); summed by the all-reduce
            token, slot = torch.where(top_idx == expert)
            gate_up = flat[token] @ self.experts.gate_up_proj[e] + self.experts.gate_up_proj_bias[e]
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            act = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
            y = act @ self.experts.down_proj[e] + self.experts.down_proj_bias[e]
            out.index_add_(0, token, y * weights[token, slot, None])
        return out.view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, config, arch: Architecture, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, arch, layer_idx)
        self.mlp = MoEMLP(config) if arch.moe else DenseMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, cache, rows, slots, q_pos, kv_end):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, rows, slots, q_pos, kv_end)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, config, arch: Architecture) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, arch, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class NativeCausalLM(nn.Module):
    """A Llama / Qwen3 / gpt-oss causal LM over a ragged KV cache. Parameter names match HF."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.arch = arch_for(config)
        self.model = Backbone(config, self.arch)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        rotary_cls = getattr(importlib.import_module(self.arch.rotary_module), self.arch.rotary_class)
        rotary = rotary_cls(config=config)
        self.register_buffer("inv_freq", rotary.inv_freq.detach().clone(), persistent=False)
        self.rope_scaling = float(rotary.attention_scaling)
        attn = self.model.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def info(self) -> TargetInfo:
        return TargetInfo.from_hf_config(self.config)

    def new_cache(self, max_rows: int, capacity: int) -> RaggedKVCache:
        param = self.lm_head.weight
        shape = CacheShape(len(self.model.layers), self.num_kv_heads, self.head_dim, capacity, param.dtype, param.device)
        return RaggedKVCache(shape, max_rows)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [B, T] -> [B, T, H]."""
        return self.model.embed_tokens(ids)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, T, H] (already final-normed) -> logits [B, T, vocab]."""
        return self.lm_head(hidden)

    def head_weight(self) -> torch.Tensor | None:
        """lm_head.weight [vocab, H]; None when the head is not a plain bias-free Linear (TP's vocab-parallel head)."""
        return plain_linear_weight(self.lm_head)

    def forward(
        self,
        cache: RaggedKVCache,
        rows: slice,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        target_layer_ids: tuple[int, ...] = (),
        logit_index: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Run T tokens per row, appending their K/V at their positions.

        input_ids, positions: [B, T]; a position equal to `cache.dead_slot` marks padding.
        logit_index: [B, K] token indices whose logits are wanted (default: all T).
        target_hidden holds the outputs of decoder layers `target_layer_ids` (HF hidden_states[id + 1]; the
        last layer's is taken after the final norm, as HF reports it).
        """
        if input_ids.shape != positions.shape or input_ids.dim() != 2:
            raise InputError(f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must be equal [B, T]")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
            raise InputError(f"token ids must be in [0, {self.config.vocab_size}), got range "
                             f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        real = positions < cache.dead_slot
        if not bool(real.any()):
            raise InputError("forward needs at least one real (non-padding) token")
        kv_end = int(positions[real].max()) + 1
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_scaling, x.dtype)
        by_layer: dict[int, torch.Tensor] = {}
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache, rows, positions, positions, kv_end)
            if i in target_layer_ids and i != last:
                by_layer[i] = x
        x = self.model.norm(x)
        if last in target_layer_ids:
            by_layer[last] = x
        if logit_index is not None:
            x = torch.gather(x, 1, logit_index[..., None].expand(-1, -1, x.shape[-1]))
        tapped = torch.cat([by_layer[i] for i in target_layer_ids], dim=-1) if target_layer_ids else None
        return TargetOutput(logits=self.lm_head(x), target_hidden=tapped)
