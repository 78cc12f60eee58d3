"""Strict, frozen configs for the DFlash drafter and the target it serves.

The drafter config is read from the published DFlash checkpoint format (`config.json` with
`architectures: ["DFlashDraftModel"]`, `block_size`, `num_target_layers`,
`dflash_config: {mask_token_id, target_layer_ids}` and the Qwen3 decoder fields). The raw dict is
kept so that a checkpoint is saved back byte-for-byte in meaning (same keys, same values).

Cross-field rules that need the target (taps within its layer count, mask token in its vocabulary,
matching hidden size) are checked by `check_drafter_matches_target`, with messages that say what
to do.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from dflash_trt.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from pydantic import BaseModel, ValidationError

    M = TypeVar("M", bound=BaseModel)

DRAFTER_ARCHITECTURE = "DFlashDraftModel"
LAYER_TYPES = ("full_attention", "sliding_attention")


def default_target_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """`count` layer ids evenly spaced from layer 1 to layer N-3 (the DFlash paper's choice; Qwen3-8B
    with five gives [1, 9, 17, 25, 33]). One takes the middle layer."""
    if num_target_layers < 1 or count < 1:
        raise ConfigError(f"need >= 1 target layer and >= 1 target layer id, got {num_target_layers}, {count}")
    if count == 1:
        return [num_target_layers // 2]
    start, end = 1, max(num_target_layers - 3, 1)
    span = end - start
    return [round(start + i * span / (count - 1)) for i in range(count)]


def check_target_layer_ids(layer_ids: tuple[int, ...] | list[int], num_target_layers: int, where: str) -> None:
    """THE range check: every target layer id within the target's layers (0-based)."""
    bad = [t for t in layer_ids if not 0 <= t < num_target_layers]
    if bad:
        raise ConfigError(f"{where}: target_layer_ids {list(layer_ids)} has {bad} outside the target's "
                          f"{num_target_layers} layers (valid: 0..{num_target_layers - 1}): use the drafter trained "
                          "for this target, or fix its dflash_config")


def _require(raw: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in raw:
        raise ConfigError(f"{where}: missing required key '{key}'")
    value = raw[key]
    if isinstance(value, bool) and kind is not bool:
        raise ConfigError(f"{where}: '{key}' must be {kind}, got a bool")
    if not isinstance(value, kind):
        raise ConfigError(f"{where}: '{key}' must be {kind}, got {type(value).__name__} {value!r}")
    return value


def _optional(raw: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any, where: str) -> Any:
    if key not in raw or raw[key] is None:
        return default
    return _require(raw, key, kind, where)


@dataclass(frozen=True)
class DrafterConfig:
    """The DFlash drafter: Qwen3-style decoder layers conditioned on fused target features.

    Glossary (paper notation): `block_size` is the number of slots drafted per step (slot 0 holds
    the last committed token, slots 1..block_size-1 hold `mask_token_id`); `target_layer_ids` are
    the 0-based target decoder layers whose outputs are tapped (HF `hidden_states[id + 1]`).
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    max_position_embeddings: int
    attention_bias: bool
    block_size: int
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    layer_types: tuple[str, ...]
    sliding_window: int | None
    is_causal: bool | None  # drafter attention causality override (format option; None = paper default)
    torch_dtype: str | None  # dtype the checkpoint declares
    raw: dict[str, Any] = field(repr=False, compare=False, hash=False)

    @property
    def num_target_layer_ids(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "drafter config.json") -> "DrafterConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {type(raw).__name__}")
        archs = _require(raw, "architectures", list, where)
        if archs != [DRAFTER_ARCHITECTURE]:
            raise ConfigError(
                f"{where}: architectures is {archs}, expected ['{DRAFTER_ARCHITECTURE}'] "
                "(is this a DFlash drafter checkpoint?)"
            )
        dflash = _require(raw, "dflash_config", dict, where)
        hidden = _require(raw, "hidden_size", int, where)
        heads = _require(raw, "num_attention_heads", int, where)
        layers = _require(raw, "num_hidden_layers", int, where)
        head_dim = _optional(raw, "head_dim", int, hidden // max(heads, 1), where)
        n_target = _require(raw, "num_target_layers", int, where)
        layer_ids = dflash.get("target_layer_ids")  # optional in the format: default taps otherwise
        if layer_ids is None:
            layer_ids = default_target_layer_ids(n_target, layers)
        if not isinstance(layer_ids, list) or not layer_ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in layer_ids):
            raise ConfigError(f"{where}: dflash_config.target_layer_ids must be a non-empty list of ints, got {layer_ids!r}")
        if "mask_token_id" not in dflash:
            raise ConfigError(f"{where}: dflash_config.mask_token_id is required")
        mask_id = dflash["mask_token_id"]
        if not isinstance(mask_id, int) or isinstance(mask_id, bool):
            raise ConfigError(f"{where}: dflash_config.mask_token_id must be an int, got {mask_id!r}")
        layer_types = _optional(raw, "layer_types", list, ["full_attention"] * layers, where)
        if len(layer_types) != layers or any(t not in LAYER_TYPES for t in layer_types):
            raise ConfigError(
                f"{where}: layer_types must list {layers} entries from {LAYER_TYPES}, got {layer_types!r}"
            )
        window = _optional(raw, "sliding_window", int, None, where)
        if "sliding_attention" in layer_types and (window is None or window < 1):
            raise ConfigError(f"{where}: sliding_attention layers need a positive sliding_window")
        cfg = cls(
            hidden_size=hidden,
            intermediate_size=_require(raw, "intermediate_size", int, where),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=_optional(raw, "num_key_value_heads", int, heads, where),
            head_dim=head_dim,
            rms_norm_eps=float(_optional(raw, "rms_norm_eps", (int, float), 1e-6, where)),
            vocab_size=_require(raw, "vocab_size", int, where),
            max_position_embeddings=_optional(raw, "max_position_embeddings", int, 32768, where),
            attention_bias=_optional(raw, "attention_bias", bool, False, where),
            block_size=_require(raw, "block_size", int, where),
            num_target_layers=n_target,
            mask_token_id=mask_id,
            target_layer_ids=tuple(layer_ids),
            layer_types=tuple(layer_types),
            sliding_window=window,
            is_causal=_optional(raw, "is_causal", bool, None, where),
            torch_dtype=_optional(raw, "torch_dtype", str, None, where),
            raw=raw,
        )
        cfg._check_self(where)
        return cfg

    def _check_self(self, where: str) -> None:
        positive = {
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "num_target_layers": self.num_target_layers,
        }
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"{where}: {name} must be >= 1, got {value}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"{where}: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not 2 <= self.block_size <= 64:
            raise ConfigError(f"{where}: block_size must be in [2, 64], got {self.block_size}")
        if self.attention_bias:
            raise ConfigError(f"{where}: attention_bias is true, but DFlash drafters have no attention biases")
        if self.head_dim % 2:
            raise ConfigError(f"{where}: head_dim must be even for RoPE, got {self.head_dim}")
        check_target_layer_ids(self.target_layer_ids, self.num_target_layers, where)
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"{where}: mask_token_id {self.mask_token_id} is outside the vocabulary (size {self.vocab_size})"
            )

    @classmethod
    def load(cls, directory: Path) -> "DrafterConfig":
        path = require_dir(directory, "drafter directory") / "config.json"
        if not path.is_file():
            raise CheckpointError(f"no config.json in drafter directory {directory}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw, where=str(path))

    def to_dict(self) -> dict[str, Any]:
        """The config as it goes back to disk: the raw dict it was read from."""
        return json.loads(json.dumps(self.raw))


@dataclass(frozen=True)
class TargetInfo:
    """What the drafter and the decode loop need to know about a target model."""

    architecture: str  # "llama" | "qwen3" | "gpt_oss" | other transformers model_type
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    num_key_value_heads: int
    head_dim: int

    @classmethod
    def from_hf_config(cls, config) -> "TargetInfo":
        """From a transformers config (eos_token_id may be an int, a list, or absent). Multi-head
        attention configs (GPT-2 style, wrapped by the HF adapter) have no num_key_value_heads (one KV
        head per attention head) and older ones no head_dim (hidden_size // heads): transformers'
        own conventions for those optional fields."""
        eos = config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size,
                   config.max_position_embeddings, eos_ids, kv_heads, head_dim)

    def kv_bytes_per_position(self, itemsize: int) -> int:
        """Bytes of K and V one sequence position takes in a dense cache over every layer."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * itemsize


def check_block_size(block_size: int, drafter_block_size: int, drafter: str) -> None:
    """THE block-size rule of every command and backend (TensorRT-LLM's too: max_draft_len + 1 <= the
    drafter's block_size): a block may be smaller than the one the drafter was trained for, never larger
    (slots past its trained block get no useful drafts). `drafter` names it in the message."""
    if block_size > drafter_block_size:
        raise ConfigError(f"block size {block_size} (max_draft_len {block_size - 1}) exceeds the block size "
                          f"{drafter_block_size} the drafter {drafter} was trained for (max_draft_len + 1 must not "
                          f"exceed it, as in TensorRT-LLM): lower max_draft_len to at most {drafter_block_size - 1} "
                          f"(--block-size to at most {drafter_block_size}), or leave it unset for the drafter's own")


def check_drafter_matches_target(drafter: DrafterConfig, target: TargetInfo) -> None:
    """Cross-checks between a drafter and the target it drafts for; raises ConfigError."""
    if drafter.hidden_size != target.hidden_size:
        raise ConfigError(
            f"drafter hidden_size {drafter.hidden_size} != target hidden_size {target.hidden_size}: "
            "a DFlash drafter shares the target's embedding and lm_head, so it must be trained for this target"
        )
    if drafter.num_target_layers != target.num_hidden_layers:
        raise ConfigError(
            f"drafter was built for a {drafter.num_target_layers}-layer target, this target has "
            f"{target.num_hidden_layers} layers: use the drafter trained for this target"
        )
    check_target_layer_ids(drafter.target_layer_ids, target.num_hidden_layers, "drafter")
    if not 0 <= drafter.mask_token_id < target.vocab_size:
        raise ConfigError(
            f"mask_token_id {drafter.mask_token_id} is outside the target vocabulary (size {target.vocab_size})"
        )


def require_dir(path: Path, what: str) -> Path:
    """`path` when it is a directory; CheckpointError "<what> <path> does not exist" or "... is not a
    directory" (e.g. a file given where a checkpoint directory belongs) otherwise."""
    path = Path(path)
    if not path.is_dir():
        if path.exists():
            raise CheckpointError(f"{what} {path} is not a directory (it is a file): pass the checkpoint's directory")
        raise CheckpointError(f"{what} {path} does not exist")
    return path


def load_yaml_file(path: Path, what: str) -> Any:
    """The parsed content of a YAML file (any YAML value; callers check its shape).

    `what` names the file in the error (e.g. "build config", "--config file"): a missing file is a
    ConfigError "<what> <path> does not exist", a malformed one "<path> is not valid YAML: ...".
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc


def validate_model(model: "type[M]", raw: Any, where: str, *, heading: str = "",
                   unknown_key_hint: str = "remove it or fix its spelling") -> "M":
    """THE pydantic wrapper for our YAML schemas (build config, serve --config, Triton settings): `raw`
    must be a mapping; any validation problem is one ConfigError line (describe_validation_error), and
    a ConfigError raised by a model validator keeps its own message."""
    from pydantic import ValidationError

    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a YAML mapping at the top level, got {type(raw).__name__}")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        cause = errors[0]["ctx"]["error"] if errors and "error" in errors[0].get("ctx", {}) else None
        if isinstance(cause, ConfigError):
            raise ConfigError(f"{where}: {cause}") from None
        raise ConfigError(describe_validation_error(exc, where, heading=heading,
                                                    unknown_key_hint=unknown_key_hint)) from None


def describe_validation_error(exc: ValidationError, where: str, *, heading: str = "",
                              unknown_key_hint: str = "remove it or fix its spelling") -> str:
    """One line for a pydantic ValidationError: "<where>: <heading><problem>; <problem>...".

    Each problem names its dotted key ("<top level>" for the root); an unknown key (pydantic's
    extra_forbidden) reads "unknown key '<key>' (<unknown_key_hint>)", any other "<key>: <msg>".
    """
    parts = []
    for err in exc.errors(include_url=False):
        key = ".".join(str(p) for p in err["loc"]) or "<top level>"
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown key '{key}' ({unknown_key_hint})")
        else:
            parts.append(f"{key}: {err['msg']}")
    return f"{where}: {heading}" + "; ".join(parts)
