"""Target adapters: what the DFlash loop needs from a target model.

Two implementations of one small interface (`new_cache`, `forward`, `embed`, `head`, `info`):
- `NativeCausalLM` (models/transformer.py): Llama, Qwen3, gpt-oss over a ragged KV cache; any
  batch size; used by the engine, tensor parallelism and quantized checkpoints.
- `HFTarget` (here): wraps ANY transformers causal LM with a `DynamicCache` (append and crop,
  gpt-oss sliding-window layers included via past recording). One sequence at a time. It is the
  route for architectures the native engine does not implement, and the oracle in tests.
Both return logits plus the concatenated hidden states of the tapped layers
(HF `hidden_states[layer_id + 1]`).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from dflash_trt.fileio import check_state_dict, read_state_dict
from dflash_trt.config import TargetInfo
from dflash_trt.errors import CheckpointError, ConfigError, InputError
from dflash_trt.engine import TargetOutput
from dflash_trt.models.transformer import NativeCausalLM, plain_linear_weight

log = logging.getLogger(__name__)

TARGET_BACKENDS = ("native", "hf")


def load_hf_config(directory: Path):
    from transformers import AutoConfig

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"no config.json in target directory {directory}")
    try:
        return AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise CheckpointError(f"cannot read target config in {directory}: {exc}") from exc


def dequantize_mxfp4_experts(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """gpt-oss releases store expert projections as MXFP4 (`*_blocks` + `*_scales`, [E, out, ...]);
    the HF module layout is [E, in, out]. Replace each pair by the dequantized, transposed tensor."""
    from dflash_trt.quant.mxfp4 import dequantize_mxfp4

    out = dict(state)
    for name in [n for n in state if n.endswith("_blocks")]:
        base = name[: -len("_blocks")]
        scales = out.pop(base + "_scales", None)
        if scales is None:
            raise CheckpointError(f"{name} has no matching {base}_scales tensor")
        out[base] = dequantize_mxfp4(out.pop(name), scales, dtype).transpose(-1, -2).contiguous()
    return out


def native_from_state_dict(config, state: dict[str, torch.Tensor], dtype: torch.dtype) -> NativeCausalLM:
    """Build a NativeCausalLM and load HF-named tensors with strict key checking (MXFP4 gpt-oss
    experts are dequantized on the way in)."""
    model = NativeCausalLM(config)
    state = dequantize_mxfp4_experts(state, torch.float32) if any(n.endswith("_blocks") for n in state) else dict(state)
    if "lm_head.weight" not in state and config.tie_word_embeddings:
        if "model.embed_tokens.weight" not in state:
            raise CheckpointError("checkpoint has neither lm_head.weight nor model.embed_tokens.weight")
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    check_state_dict(state, model.state_dict(), f"target checkpoint (a {config.model_type} model of this config)")
    model.load_state_dict(state, strict=True)
    model.to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def load_native_target(directory: Path, dtype: torch.dtype = torch.float32) -> NativeCausalLM:
    config = load_hf_config(directory)
    return native_from_state_dict(config, read_state_dict(directory), dtype)


def native_from_hf(model, dtype: torch.dtype | None = None) -> NativeCausalLM:
    """The native twin of an in-memory transformers model (same weights)."""
    param = next(model.parameters())
    return native_from_state_dict(model.config, model.state_dict(), dtype or param.dtype)


class HFCache:
    """A transformers DynamicCache for one sequence, with the RaggedKVCache crop interface."""

    def __init__(self, config, capacity: int) -> None:
        from transformers import DynamicCache

        self.config = config
        self.cache = DynamicCache(config=config)
        self.cache.activate_past_recording()
        self.capacity = capacity
        self.dead_slot = capacity
        self.num_rows = 0
        self.max_rows = 1

    @property
    def lengths(self) -> torch.Tensor:
        return torch.tensor([self.cache.get_seq_length()])

    def add_rows(self, count: int) -> range:
        if self.num_rows + count > 1:
            raise InputError("the HF target adapter decodes one sequence at a time; use the native engine to batch")
        self.num_rows += count
        return range(0, self.num_rows)

    def remove_row(self, row: int) -> None:
        """Free the sequence: a fresh, empty cache."""
        from transformers import DynamicCache

        if row != 0 or self.num_rows != 1:
            raise InputError(f"row {row} is not in use")
        self.cache = DynamicCache(config=self.config)
        self.cache.activate_past_recording()
        self.num_rows = 0
        return None

    def crop(self, lengths: torch.Tensor, rows: slice | None = None) -> None:
        remove = self.cache.get_seq_length() - int(lengths[0])
        if remove < 0:
            raise InputError(f"cannot grow an HF cache by cropping ({remove})")
        if remove:
            self.cache.crop(-remove)


class HFTarget:
    """Adapter over any transformers causal LM (one sequence at a time)."""

    def __init__(self, model) -> None:
        self.model = model.eval()
        self.config = model.config

    @classmethod
    def load(cls, directory: Path, dtype: torch.dtype = torch.float32) -> "HFTarget":
        from transformers import AutoModelForCausalLM

        load_hf_config(directory)
        attn = "eager"  # gpt-oss needs eager attention (sinks); eager is exact for the others too
        model = AutoModelForCausalLM.from_pretrained(
            str(directory), dtype=dtype, local_files_only=True, attn_implementation=attn
        )
        return cls(model)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def info(self) -> TargetInfo:
        return TargetInfo.from_hf_config(self.config)

    def new_cache(self, max_rows: int, capacity: int) -> HFCache:
        if max_rows != 1:
            raise InputError("the HF target adapter decodes one sequence at a time (batch size 1)")
        return HFCache(self.config, capacity)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(ids)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(hidden)

    def head_weight(self) -> torch.Tensor | None:
        return plain_linear_weight(self.model.get_output_embeddings())

    @torch.inference_mode()
    def forward(self, cache: HFCache, rows: slice, input_ids: torch.Tensor, positions: torch.Tensor,
                target_layer_ids: tuple[int, ...] = (), logit_index: torch.Tensor | None = None) -> TargetOutput:
        if input_ids.shape[0] != 1:
            raise InputError("the HF target adapter decodes one sequence at a time (batch size 1)")
        if bool((positions >= cache.dead_slot).any()):
            raise InputError("the HF target adapter does not take padded input")
        start = cache.cache.get_seq_length()
        if int(positions[0, 0]) != start:
            raise InputError(f"HF cache holds {start} tokens but the input starts at position {int(positions[0, 0])}")
        out = self.model(
            input_ids=input_ids, position_ids=positions, cache=cache.cache,
            use_cache=True, output_hidden_states=bool(target_layer_ids),
        )
        logits = out.logits
        if logit_index is not None:
            logits = torch.gather(logits, 1, logit_index[..., None].expand(-1, -1, logits.shape[-1]))
        hidden = torch.cat([out.hidden_states[i + 1] for i in target_layer_ids], dim=-1) if target_layer_ids else None
        return TargetOutput(logits=logits, target_hidden=hidden)


def load_target(directory: Path, backend: str = "native", dtype: torch.dtype = torch.float32):
    """Load a target from a HF directory with the chosen backend ('native' or 'hf')."""
    if backend == "native":
        return load_native_target(directory, dtype)
    if backend == "hf":
        return HFTarget.load(directory, dtype)
    raise ConfigError(f"unknown target backend '{backend}' (choose from {TARGET_BACKENDS})")
