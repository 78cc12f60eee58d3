"""The DFlash drafter (arXiv 2602.06036, Sec. 3): a block-diffusion draft model.

Given hidden states tapped from `target_layer_ids` of the target, the drafter predicts a whole
block of future tokens in ONE forward:
- feature fusion: ctx = hidden_norm(fc(concat(target_hidden)))  (fc has no bias; hidden_norm is RMSNorm);
- KV injection: in EVERY draft layer the keys/values are concat(k_proj(ctx), k_proj(norm(x)))
  along the sequence (same for v); k_norm applies to both; ctx does not pass the layer's
  input_layernorm; queries come from the block only;
- attention is non-causal over context + block (sliding-window layers, where configured, use the
  window and are causal unless `is_causal` says otherwise);
- the block is [last committed token, mask, mask, ...] embedded with the TARGET's embedding, and
  logits come from the TARGET's lm_head (the drafter has neither).
The context K/V live in a RaggedKVCache that keeps only context: block K/V are written past the
committed length and dropped by the next crop.

Checkpoint format (as published by the DFlash authors): config.json with
`architectures: ["DFlashDraftModel"]` plus safetensors tensors `fc.weight`, `hidden_norm.weight`,
`norm.weight`, `layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.self_attn.{q,k}_norm.weight`,
`layers.{i}.mlp.{gate,up,down}_proj.weight`, `layers.{i}.{input,post_attention}_layernorm.weight`.

Optional draft vocabulary (this project's addition, FR-Spec, arXiv 2502.14856): `draft_vocab.json`
beside the weights lists the token ids the drafter was trained to propose (the most frequent ones of
its training data). The torch engine then computes draft logits over those lm_head rows only, which
cuts the drafter's largest GEMM (block_size - 1 positions x the whole vocabulary); verification is
unchanged, so output is too. Loaders that do not know the file (upstream DFlash, TensorRT-LLM)
ignore it and draft over the whole vocabulary.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.fileio import atomic_directory, check_state_dict, read_state_dict, write_json, write_safetensors
from dflash_trt.config import DrafterConfig
from dflash_trt.errors import CheckpointError, InputError
from dflash_trt.models.kv_cache import CacheShape, RaggedKVCache
from dflash_trt.models.layers import apply_rope, attend, attention_mask, rope_cos_sin
from dflash_trt.models.transformer import RMSNorm
from plugins.kernels.contracts import ContextKVWeights

log = logging.getLogger(__name__)
DRAFT_VOCAB_FILE = "draft_vocab.json"
DRAFT_VOCAB_FORMAT = "dflash_trt.draft_vocab/1"
_logged_paths: set[tuple[str, str]] = set()


def _log_context_path(path: str, device: torch.device) -> None:
    if (path, device.type) not in _logged_paths:
        _logged_paths.add((path, device.type))
        log.info("draft context K/V on %s: %s", device.type, path)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class DraftAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_idx: int) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        sliding = cfg.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = cfg.sliding_window if sliding else None
        self.causal = sliding if cfg.is_causal is None else cfg.is_causal
        self.layer_idx = layer_idx

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, N, H] -> k (normed, roped), v: [B, kv_heads, N, D]."""
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, rope_block, cache, rows, block_pos, row_end, kv_end):
        """Context K/V of this layer are already in the cache (DFlashDrafter.write_context)."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, *rope_block)
        k_blk, v_blk = self.kv(x, *rope_block)
        cache.write(self.layer_idx, rows, block_pos, k_blk, v_blk)
        keys, values = cache.read(self.layer_idx, rows, kv_end)
        mask = attention_mask(block_pos, kv_end, row_end, self.causal, self.sliding_window)
        out = attend(q, keys.to(q.dtype), values.to(q.dtype), mask, self.head_dim ** -0.5)
        return self.o_proj(out)


class DraftMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DraftAttention(cfg, layer_idx)
        self.mlp = DraftMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, *args):
        x = x + self.self_attn(self.input_layernorm(x), *args)
        return x + self.mlp(self.post_attention_layernorm(x))


def _rotary_inv_freq(cfg: DrafterConfig) -> tuple[torch.Tensor, float]:
    """RoPE frequencies of the drafter, computed by transformers' Qwen3 rotary class from the raw
    config (so rope_theta / rope_scaling / rope_parameters in any form are honoured)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    fields = {k: v for k, v in cfg.raw.items() if k not in ("architectures", "dflash_config", "auto_map")}
    rotary = Qwen3RotaryEmbedding(config=Qwen3Config(**fields))
    return rotary.inv_freq.detach().clone(), float(rotary.attention_scaling)


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DraftLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(cfg.num_target_layer_ids * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        inv_freq, scaling = _rotary_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_scaling = scaling
        self.checkpoint_dtype: dict[str, torch.dtype] = {}
        self.draft_vocab: torch.Tensor | None = None  # [K] int64 sorted token ids (draft_vocab.json) or None

    def set_draft_vocab(self, ids: torch.Tensor | list[int] | None) -> None:
        """The token ids this drafter proposes (sorted, unique, inside the vocabulary); None = all."""
        if ids is None:
            self.draft_vocab = None
            return
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        if ids.numel() == 0:
            raise CheckpointError("a draft vocabulary needs at least one token id")
        if bool((ids[1:] <= ids[:-1]).any()):
            raise CheckpointError("draft vocabulary token ids must be sorted and unique")
        if int(ids[0]) < 0 or int(ids[-1]) >= self.cfg.vocab_size:
            raise CheckpointError(f"draft vocabulary token ids must be in [0, {self.cfg.vocab_size}), "
                                  f"got {int(ids[0])}..{int(ids[-1])}")
        self.draft_vocab = ids

    def draft_vocab_files(self) -> dict[str, dict]:
        """{file name: JSON body} of the draft vocabulary, for a checkpoint writer ({} without one)."""
        if self.draft_vocab is None:
            return {}
        return {DRAFT_VOCAB_FILE: {"format": DRAFT_VOCAB_FORMAT, "token_ids": self.draft_vocab.tolist()}}

    def load_draft_vocab(self, directory: Path) -> None:
        """Take the draft vocabulary of a checkpoint directory, when it has one."""
        path = Path(directory) / DRAFT_VOCAB_FILE
        if path.is_file():
            self.set_draft_vocab(read_draft_vocab(path))

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def mask_token_id(self) -> int:
        return self.cfg.mask_token_id

    def new_cache(self, max_rows: int, capacity: int) -> RaggedKVCache:
        p = self.fc.weight
        shape = CacheShape(len(self.layers), self.cfg.num_key_value_heads, self.cfg.head_dim, capacity, p.dtype, p.device)
        return RaggedKVCache(shape, max_rows)

    def fuse(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """target_hidden: [B, C, n_layer_ids * H] -> fused context [B, C, H]."""
        if target_hidden.shape[-1] != self.fc.in_features:
            raise InputError(
                f"target features have width {target_hidden.shape[-1]}, the drafter expects {self.fc.in_features} "
                f"({self.cfg.num_target_layer_ids} target layers x hidden {self.cfg.hidden_size})"
            )
        return self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))

    def forward(self, cache: RaggedKVCache, rows: slice, ctx_hidden: torch.Tensor | None,
                ctx_slots: torch.Tensor | None, block_embeds: torch.Tensor, block_pos: torch.Tensor) -> torch.Tensor:
        """One drafting forward.

        ctx_hidden:     [B, C, n_taps * H] new context features (padding rows allowed), or None;
        ctx_slots:    [B, C] their positions (cache.dead_slot for padding);
        block_embeds: [B, T, H] target embeddings of [last token, mask, ...];
        block_pos:    [B, T] absolute positions of the block (contiguous per row).
        Returns the final-normed hidden states [B, T, H] (apply the target's lm_head).
        """
        dtype = self.fc.weight.dtype
        x = block_embeds.to(dtype)
        if ctx_hidden is not None and ctx_hidden.shape[1] > 0:
            if ctx_slots is None or ctx_slots.shape != ctx_hidden.shape[:2]:
                raise InputError("ctx_slots must be given with the same [B, C] shape as ctx_hidden")
            self.write_context(cache, rows, ctx_hidden, ctx_slots)
        rope_block = rope_cos_sin(block_pos, self.inv_freq, self.rope_scaling, dtype)
        row_end = block_pos[:, -1] + 1  # [B]
        kv_end = int(row_end.max())
        for layer in self.layers:
            x = layer(x, rope_block, cache, rows, block_pos, row_end, kv_end)
        return self.norm(x)

    def context_kv_weights(self) -> ContextKVWeights:
        attn = [layer.self_attn for layer in self.layers]
        return ContextKVWeights(
            fc_weight=self.fc.weight, hidden_norm_weight=self.hidden_norm.weight,
            k_proj_weight=torch.stack([a.k_proj.weight for a in attn]),
            v_proj_weight=torch.stack([a.v_proj.weight for a in attn]),
            k_norm_weight=torch.stack([a.k_norm.weight for a in attn]),
            num_kv_heads=self.cfg.num_key_value_heads, head_dim=self.cfg.head_dim, eps=self.cfg.rms_norm_eps,
        )

    def write_context(self, cache: RaggedKVCache, rows: slice, ctx_hidden: torch.Tensor, ctx_slots: torch.Tensor,
                      fused: bool | None = None) -> None:
        """KV injection: fc -> hidden_norm -> every layer's k_proj/k_norm/RoPE and v_proj, written
        into the draft cache at the context positions (padding slots go to the dead slot).

        fused=None picks the fused kernel (plugins.kernels.write_context_kv: Triton on CUDA) when
        the tensors are on CUDA and the projections are plain linears, and this module's own layers
        otherwise (CPU, quantized weights, calibration hooks that must see every linear).
        """
        if ctx_hidden.shape[-1] != self.fc.in_features:
            raise InputError(
                f"target features have width {ctx_hidden.shape[-1]}, the drafter expects {self.fc.in_features} "
                f"({self.cfg.num_target_layer_ids} target layers x hidden {self.cfg.hidden_size})"
            )
        plain = all(type(m) is nn.Linear for m in (self.fc, *(p for layer in self.layers
                                                              for p in (layer.self_attn.k_proj, layer.self_attn.v_proj))))
        if fused is None:
            fused = ctx_hidden.is_cuda and plain
        _log_context_path("fused kernel" if fused else "drafter modules", ctx_hidden.device)
        if fused:
            from plugins.kernels import write_context_kv

            real = ctx_slots < cache.dead_slot  # [B, C]
            row_idx = torch.arange(ctx_slots.shape[0], device=ctx_slots.device)[:, None] + rows.start
            feats = ctx_hidden.to(self.fc.weight.dtype)[real]  # [N, n_taps * H]
            write_context_kv(feats, row_idx.expand_as(ctx_slots)[real], ctx_slots[real], self.context_kv_weights(),
                             self.inv_freq.float(), cache.k, cache.v, attention_scaling=self.rope_scaling)
            return
        ctx = self.fuse(ctx_hidden)
        rope_ctx = rope_cos_sin(ctx_slots, self.inv_freq, self.rope_scaling, ctx.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv(ctx, *rope_ctx)
            cache.write(i, rows, ctx_slots, k, v)

    # ---- checkpoint I/O -------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, directory: Path, dtype: torch.dtype = torch.float32) -> "DFlashDrafter":
        directory = Path(directory)
        cfg = DrafterConfig.load(directory)
        state = read_state_dict(directory)
        model = cls(cfg)
        check_state_dict(state, model.state_dict(), f"drafter checkpoint {directory} (per its config.json)")
        model.checkpoint_dtype = {name: t.dtype for name, t in state.items()}
        model.load_state_dict(state, strict=True)
        model.load_draft_vocab(directory)
        return model.to(dtype).eval()

    def save_pretrained(self, directory: Path, dtype: torch.dtype | None = None) -> Path:
        """Write config.json + model.safetensors atomically. Tensors keep the dtype they were
        loaded with (bit-exact round trip) unless `dtype` is given."""
        state = {}
        for name, tensor in self.state_dict().items():
            declared = DTYPES[self.cfg.torch_dtype] if self.cfg.torch_dtype in DTYPES else tensor.dtype
            target = dtype or self.checkpoint_dtype.get(name, declared)
            state[name] = tensor.detach().to(target)
        with atomic_directory(Path(directory)) as tmp:
            write_json(tmp / "config.json", self.cfg.to_dict())
            write_safetensors(tmp / "model.safetensors", state, metadata={"format": "pt"})
            for name, body in self.draft_vocab_files().items():
                write_json(tmp / name, body)
        return Path(directory)


def read_draft_vocab(path: Path) -> list[int]:
    """The token ids of a draft_vocab.json (validated against the drafter by set_draft_vocab)."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or "format" not in data or data["format"] != DRAFT_VOCAB_FORMAT:
        raise CheckpointError(f"{path}: expected a JSON object with format '{DRAFT_VOCAB_FORMAT}'")
    ids = data["token_ids"] if "token_ids" in data else None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CheckpointError(f"{path}: token_ids must be a list of integers")
    return ids
