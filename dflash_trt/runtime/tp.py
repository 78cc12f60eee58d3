"""Tensor-parallel NativeCausalLM: the same model code with sharded parameters and collectives.

`load_tp_target` builds the native target on the meta device, turns its modules into their
parallel forms IN PLACE (same classes' code, same HF parameter names, local shapes), and loads
this rank's shard (sliced from a HF checkpoint, or a pre-sharded `rank{N}.safetensors`). The
split rules and the rank convention (TensorRT-LLM's) live in checkpoint/mapping.py; here are the collectives they imply:
- attention: q/k/v hold this rank's heads (the KV cache holds local kv heads only), the attention
  runs unchanged on them, and o_proj is row-parallel: partial product, all-reduce, bias once;
- dense MLP: gate/up column-parallel, down_proj row-parallel (all-reduce, bias once);
- MoE: every rank routes all tokens (replicated router), computes its experts (EP, via
  `MoEMLP.expert_offset`) or its slice of every expert's intermediate dim (MoE-TP), and the
  partial outputs are all-reduced; down_proj_bias is added by moe_tp_rank 0 only;
- embed_tokens is vocab-parallel (masked local lookup, all-reduce), lm_head is vocab-parallel
  (local logits, all-gather, padding dropped).
So per target forward: 2 all-reduces per layer + 1 (embedding) + 1 all-gather (logits). Hidden
states between layers are replicated, hence DFlash's tapped features are full width on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.checkpoint.mapping import Dims, Mapping, check_mapping, local_shape
from dflash_trt.checkpoint.sharding import is_presharded, load_presharded_rank, load_rank_state, read_mapping
from dflash_trt.errors import ConfigError
from dflash_trt.fileio import check_state_dict
from dflash_trt.models.transformer import Attention, DenseMLP, MoEMLP, NativeCausalLM


@dataclass
class CommStats:
    """Counts of the collectives this rank issued (tensor bytes moved per call, summed)."""

    all_reduce: int = 0
    all_gather: int = 0
    bytes: int = 0
    by_site: dict[str, int] = field(default_factory=dict)

    def note(self, kind: str, site: str, tensor: torch.Tensor) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        self.bytes += tensor.numel() * tensor.element_size()
        self.by_site[site] = self.by_site.get(site, 0) + 1

    def reset(self) -> None:
        self.all_reduce = self.all_gather = self.bytes = 0
        self.by_site.clear()


@dataclass
class TPContext:
    """What the parallel modules share: the process group, this rank, and the counters."""

    mapping: Mapping
    rank: int
    group: object | None = None  # a torch.distributed ProcessGroup (None: the default group)
    stats: CommStats = field(default_factory=CommStats)

    def all_reduce(self, x: torch.Tensor, site: str) -> torch.Tensor:
        import torch.distributed as dist

        self.stats.note("all_reduce", site, x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor, site: str) -> torch.Tensor:
        """Concatenate every rank's x along the last dim (rank order)."""
        import torch.distributed as dist

        self.stats.note("all_gather", site, x)
        parts = [torch.empty_like(x) for _ in range(self.mapping.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


class RowParallelLinear(nn.Linear):
    """nn.Linear whose weight holds a slice of the input dim: partial product, all-reduce, bias once."""

    tp: TPContext
    site: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(F.linear(x, self.weight), self.site)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_start + local rows) of the table; other ids look up zeros."""

    tp: TPContext
    vocab_start: int
    vocab_stop: int

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.vocab_start) & (ids < self.vocab_stop)
        local = torch.where(mine, ids - self.vocab_start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * mine[..., None].to(self.weight.dtype)
        return self.tp.all_reduce(out, "embed")


class VocabParallelHead(nn.Linear):
    """lm_head over this rank's vocab rows (zero-padded); logits are all-gathered, padding dropped."""

    tp: TPContext
    vocab_size: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last(F.linear(x, self.weight), "lm_head")
        return logits[..., : self.vocab_size]


class ParallelMoEMLP(MoEMLP):
    """MoEMLP over this rank's experts (EP) or expert slices (MoE-TP); partial outputs all-reduced."""

    tp: TPContext

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x), "moe")


def _meta_param(module: nn.Module, name: str, shape: tuple[int, ...]) -> None:
    old = getattr(module, name)
    setattr(module, name, nn.Parameter(torch.empty(shape, dtype=old.dtype, device="meta"), requires_grad=False))


def parallelize(model: NativeCausalLM, ctx: TPContext) -> NativeCausalLM:
    """Turn a (meta-device) NativeCausalLM into rank `ctx.rank`'s part: local parameter shapes
    (still to be loaded), local head counts, and the collectives. In place; returns the model."""
    config, m, rank = model.config, ctx.mapping, ctx.rank
    d = Dims.of(config)
    check_mapping(d, m)
    for name, param in list(model.named_parameters()):
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        _meta_param(owner, attr, local_shape(name, tuple(param.shape), d, m, rank))
    for module in model.modules():
        if isinstance(module, Attention):
            module.num_heads = d.num_heads // m.tp_size
            module.num_kv_heads = max(d.num_kv_heads // m.tp_size, 1)
            module.o_proj.__class__ = RowParallelLinear
            module.o_proj.tp, module.o_proj.site = ctx, "o_proj"
        elif isinstance(module, MoEMLP):
            module.__class__ = ParallelMoEMLP
            module.tp = ctx
            module.expert_offset = m.moe_ep_rank(rank) * (d.num_experts // m.moe_ep_size)
        elif isinstance(module, DenseMLP):
            module.down_proj.__class__ = RowParallelLinear
            module.down_proj.tp, module.down_proj.site = ctx, "down_proj"
    per = model.model.embed_tokens.weight.shape[0]
    embed = model.model.embed_tokens
    embed.__class__ = VocabParallelEmbedding
    embed.tp, embed.vocab_start, embed.vocab_stop = ctx, rank * per, min((rank + 1) * per, d.vocab_size)
    embed.num_embeddings = per
    model.lm_head.__class__ = VocabParallelHead
    model.lm_head.tp, model.lm_head.vocab_size = ctx, d.vocab_size
    model.lm_head.out_features = per
    model.num_kv_heads = model.model.layers[0].self_attn.num_kv_heads
    return model


def _rotary_inv_freq(model: NativeCausalLM) -> torch.Tensor:
    import importlib

    cls = getattr(importlib.import_module(model.arch.rotary_module), model.arch.rotary_class)
    with torch.device("cpu"):
        return cls(config=model.config).inv_freq.detach().clone()


def load_tp_target(directory: Path, ctx: TPContext, dtype: torch.dtype, device: torch.device | str = "cpu"
                   ) -> NativeCausalLM:
    """This rank's part of a native target, from a HF checkpoint (sliced on read) or a
    pre-sharded directory written by `write_tp_shards` (its mapping must equal ctx.mapping)."""
    from dflash_trt.models.target import dequantize_mxfp4_experts, load_hf_config

    directory = Path(directory)
    config = load_hf_config(directory)
    check_mapping(Dims.of(config), ctx.mapping)
    if is_presharded(directory):
        stored = read_mapping(directory)
        if stored != ctx.mapping:
            raise ConfigError(f"{directory} is sharded for {stored}, but this run uses {ctx.mapping}: "
                              "launch with the stored tp/moe sizes or re-shard the HF checkpoint")
        state = load_presharded_rank(directory, ctx.rank)
    else:
        state = load_rank_state(directory, config, ctx.mapping, ctx.rank)
    if any(name.endswith("_blocks") for name in state):  # gpt-oss MXFP4 experts: this rank's slice
        state = dequantize_mxfp4_experts(state, dtype)
    with torch.device("meta"):
        model = NativeCausalLM(config)
    parallelize(model, ctx)
    tied = bool(config.tie_word_embeddings)
    if tied and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    check_state_dict(state, model.state_dict(),
                     f"rank {ctx.rank}'s shard of {directory} ({config.model_type}, {ctx.mapping})")
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = _rotary_inv_freq(model).to(device)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, MoEMLP) and not rank_owns_moe_bias(ctx):
                module.experts.down_proj_bias.zero_()  # added once per expert group, by moe_tp_rank 0
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def rank_owns_moe_bias(ctx: TPContext) -> bool:
    return ctx.mapping.moe_tp_rank(ctx.rank) == 0
