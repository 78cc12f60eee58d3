"""The build's inputs on disk: path aliases, the real configs, expectation checks, size estimates and
source fingerprints.

Checks against real checkpoints run only when the paths exist (a dry run on a laptop can plan a
B300 build whose weights live on the cluster); a real build requires them.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.builder.config import BuildConfig
from dflash_trt.config import DrafterConfig, TargetInfo, check_drafter_matches_target, check_target_layer_ids
from dflash_trt.errors import CheckpointError, ConfigError
from dflash_trt.models.transformer import head_dim_of

log = logging.getLogger(__name__)

SHIPPED_DRAFTER = Path(__file__).resolve().parent.parent / "assets" / "smollm2-135m-dflash"
FULL_HASH_LIMIT = 64 << 20  # files above this are fingerprinted by (size, mtime) instead of content
ASSUMED_DRAFTER_LAYERS = 5  # for size estimates when the drafter config is not on disk
WEIGHT_BYTES = {"none": 2.0, "fp8": 1.0, "nvfp4": 0.5 + 1.0 / 16}  # + FP8 block scale per 16 values


@dataclass(frozen=True)
class Sources:
    """Resolved input paths and, when present on disk, their parsed configs."""

    target_path: Path
    drafter_path: Path
    target_exists: bool
    drafter_exists: bool
    target_config: object | None  # transformers PretrainedConfig
    drafter_config: DrafterConfig | None

    @property
    def complete(self) -> bool:
        return self.target_exists and self.drafter_exists


def resolve_path(text: str, default_target: Path | None, base: Path) -> Path:
    """`@default` -> the embedded SmolLM2 directory (given by the caller), `@shipped` -> the shipped
    drafter; relative paths are relative to the build config's folder."""
    if text == "@default":
        if default_target is None:
            raise ConfigError("target.path is @default (the embedded SmolLM2) but no default target directory "
                              "was given: run through `dflash-trt build`, which converts it once")
        return default_target
    if text == "@shipped":
        return SHIPPED_DRAFTER
    if text.startswith("@"):
        raise ConfigError(f"unknown path alias '{text}' (known: @default, @shipped)")
    path = Path(text).expanduser()
    return (path if path.is_absolute() else base / path).resolve()


def _real_dims(config) -> dict[str, int | str]:
    heads = config.num_attention_heads
    head_dim = head_dim_of(config)
    return {
        "architecture": config.model_type, "num_hidden_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size, "num_attention_heads": heads,
        "num_key_value_heads": config.num_key_value_heads, "head_dim": head_dim,
        "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size,
        "num_experts": getattr(config, "num_local_experts", 0) or 0,  # dense configs lack the field
    }


def check_against_real(cfg: BuildConfig, src: Sources) -> None:
    """YAML expectations vs config.json; drafter vs target; limits vs the models."""
    if src.target_config is not None:
        real = _real_dims(src.target_config)
        wrong = [f"{k}: YAML {getattr(cfg.target, k)!r}, config.json {v!r}" for k, v in real.items()
                 if getattr(cfg.target, k) != v]
        if wrong:
            raise ConfigError(f"target {src.target_path} is not what the build config describes ("
                              + "; ".join(wrong) + "): fix the target section of the YAML or the path")
        limit = src.target_config.max_position_embeddings
        if cfg.max_seq_len > limit:
            raise ConfigError(f"max_seq_len {cfg.max_seq_len} exceeds the target's max_position_embeddings {limit}")
    if src.drafter_config is not None:
        d = src.drafter_config
        if cfg.max_draft_len > d.block_size - 1:
            raise ConfigError(f"max_draft_len {cfg.max_draft_len} exceeds what the drafter drafts per step "
                              f"(block_size {d.block_size} - 1 = {d.block_size - 1}): lower max_draft_len")
        if d.hidden_size != cfg.target.hidden_size or d.num_target_layers != cfg.target.num_hidden_layers:
            raise ConfigError(f"drafter {src.drafter_path} was built for a target with hidden size {d.hidden_size} "
                              f"and {d.num_target_layers} layers, the build config's target has "
                              f"{cfg.target.hidden_size} and {cfg.target.num_hidden_layers}: use the drafter "
                              "trained for this target")
        check_target_layer_ids(d.target_layer_ids, cfg.target.num_hidden_layers, f"drafter {src.drafter_path}")
        if not 0 <= d.mask_token_id < cfg.target.vocab_size:
            raise ConfigError(f"drafter mask_token_id {d.mask_token_id} is outside the target vocabulary "
                              f"({cfg.target.vocab_size})")
    if src.target_config is not None and src.drafter_config is not None:
        check_drafter_matches_target(src.drafter_config, TargetInfo.from_hf_config(src.target_config))


def load_sources(cfg: BuildConfig, base: Path, default_target: Path | None, require: bool) -> Sources:
    """Resolve and read the inputs. `require=True` (a real build) makes missing paths an error."""
    from dflash_trt.models.target import load_hf_config

    target = resolve_path(cfg.target.path, default_target, base)
    drafter = resolve_path(cfg.drafter.path, default_target, base)
    t_ok, d_ok = (target / "config.json").is_file(), (drafter / "config.json").is_file()
    if require and not t_ok:
        raise CheckpointError(f"target checkpoint not found: {target}/config.json does not exist "
                              "(fix target.path, or use --dry-run to plan without the weights)")
    if require and not d_ok:
        hint = " (the shipped drafter is produced by `dflash-trt train`; see README)" if drafter == SHIPPED_DRAFTER else ""
        raise CheckpointError(f"drafter checkpoint not found: {drafter}/config.json does not exist{hint}")
    src = Sources(target, drafter, t_ok, d_ok, load_hf_config(target) if t_ok else None,
                  DrafterConfig.load(drafter) if d_ok else None)
    check_against_real(cfg, src)
    return src


# ---- sizes -----------------------------------------------------------------------------------

def target_param_counts(cfg: BuildConfig) -> tuple[int, int]:
    """(quantized linear params, params kept in high precision: embeddings, lm_head, MoE experts and
    routers) of the target, as dflash_trt.checkpoint.quantized splits them."""
    t = cfg.target
    q_dim, kv_dim = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    attn = t.hidden_size * (2 * q_dim + 2 * kv_dim)
    if t.num_experts:  # experts are 3-D tensors that dflash_trt.checkpoint.quantized keeps unquantized
        dense, experts = 0, t.num_experts * 3 * t.hidden_size * t.intermediate_size + t.hidden_size * t.num_experts
    else:
        dense, experts = 3 * t.hidden_size * t.intermediate_size, 0
    linear = t.num_hidden_layers * (attn + dense)
    other = 2 * t.vocab_size * t.hidden_size + t.num_hidden_layers * experts
    return linear, other


def drafter_param_counts(cfg: BuildConfig, drafter: DrafterConfig | None) -> tuple[int, int]:
    """(quantizable linear params, fc + norms) of the drafter; estimated when its config is absent."""
    t = cfg.target
    if drafter is not None:
        h, i, layers = drafter.hidden_size, drafter.intermediate_size, drafter.num_hidden_layers
        q, kv, n_ids = drafter.num_attention_heads * drafter.head_dim, drafter.num_key_value_heads * drafter.head_dim, drafter.num_target_layer_ids
    else:
        h, i, layers = t.hidden_size, t.intermediate_size, ASSUMED_DRAFTER_LAYERS
        q, kv, n_ids = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim, ASSUMED_DRAFTER_LAYERS
    linear = layers * (h * (2 * q + 2 * kv) + 3 * h * i)
    return linear, n_ids * h * h + (2 * layers + 2) * h


def estimated_bytes(linear: int, other: int, fmt: str, high_precision_bytes: float) -> int:
    """Weights of a checkpoint: quantized linears at the format's bytes/param, the rest unquantized."""
    per = high_precision_bytes if fmt == "none" else WEIGHT_BYTES[fmt]
    return int(linear * per + other * high_precision_bytes)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


# ---- fingerprints ----------------------------------------------------------------------------

def fingerprint(directory: Path) -> dict:
    """A stable digest of a checkpoint directory. Files up to 64 MiB are hashed by content; larger
    weight files by (name, size, mtime) so a 65 GB model is not re-read on every build."""
    directory = Path(directory)
    digest = hashlib.sha256()
    files, total, partial = 0, 0, False
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if rel.startswith(".") or "/." in rel:
            continue
        stat = path.stat()
        digest.update(rel.encode() + b"\0" + str(stat.st_size).encode() + b"\0")
        if stat.st_size <= FULL_HASH_LIMIT:
            with path.open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(chunk)
        else:
            digest.update(str(stat.st_mtime_ns).encode())
            partial = True
        files += 1
        total += stat.st_size
    if files == 0:
        raise CheckpointError(f"{directory} holds no files")
    method = "sha256(content); files > 64 MiB by (size, mtime)" if partial else "sha256(content)"
    return {"sha256": digest.hexdigest(), "files": files, "bytes": total, "method": method}


def json_digest(data: object) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()
