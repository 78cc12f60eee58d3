"""The build's inputs on disk: path aliases, the real configs and tensor lists, expectation checks and
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

from dflash_trt.builder.config import SOURCE_ALIASES, BuildConfig
from dflash_trt.checkpoint.layout import (TensorSpec, check_unscaled_drafter, expert_format_of, float_dtype_of,
                                         read_specs)
from dflash_trt.config import (DrafterConfig, TargetInfo, check_block_size, check_drafter_matches_target,
                               check_target_layer_ids)
from dflash_trt.errors import CheckpointError, ConfigError
from dflash_trt.fileio import INDEX_NAME
from dflash_trt.models.transformer import head_dim_of

log = logging.getLogger(__name__)

SHIPPED_DRAFTER = Path(__file__).resolve().parent.parent / "assets" / "smollm2-135m-dflash"
FULL_HASH_LIMIT = 64 << 20  # files above this are fingerprinted by (size, mtime) instead of content


@dataclass(frozen=True)
class Sources:
    """Resolved input paths and, when present on disk, their parsed configs."""

    target_path: Path
    drafter_path: Path
    target_exists: bool
    drafter_exists: bool
    target_config: object | None  # transformers PretrainedConfig
    drafter_config: DrafterConfig | None
    target_tensors: tuple[TensorSpec, ...] | None = None  # from the safetensors headers, when on disk
    drafter_tensors: tuple[TensorSpec, ...] | None = None

    @property
    def complete(self) -> bool:
        return self.target_exists and self.drafter_exists


def resolve_path(text: str, default_target: Path | None, base: Path, tiny_gpt_oss: Path | None = None) -> Path:
    """`@default` -> the embedded SmolLM2 directory (given by the caller), `@shipped` -> the shipped
    drafter, `@tiny-gpt-oss` / `@tiny-gpt-oss-drafter` -> target/ and drafter/ of the tiny gpt-oss
    stand-in root (given by the caller, which writes it once); relative paths are relative to the
    build config's folder."""
    if text == "@default":
        if default_target is None:
            raise ConfigError("target.path is @default (the embedded SmolLM2) but no default target directory "
                              "was given: run through `dflash-trt build`, which converts it once")
        return default_target
    if text == "@shipped":
        return SHIPPED_DRAFTER
    if text in ("@tiny-gpt-oss", "@tiny-gpt-oss-drafter"):
        if tiny_gpt_oss is None:
            raise ConfigError(f"{text} (the tiny gpt-oss stand-in) needs its directory: run through "
                              "`dflash-trt build`, which writes it once into the cache")
        return tiny_gpt_oss / ("drafter" if text.endswith("-drafter") else "target")
    if text.startswith("@"):
        raise ConfigError(f"unknown path alias '{text}' (known: {', '.join(SOURCE_ALIASES)})")
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
        "tie_word_embeddings": bool(config.tie_word_embeddings),
    }


def _check_tensors(cfg: BuildConfig, src: Sources) -> None:
    """The YAML's dtype and expert layout vs the target's safetensors headers."""
    tensors = list(src.target_tensors)
    dtype = float_dtype_of(tensors)
    if dtype != cfg.target.dtype:
        raise ConfigError(f"target {src.target_path} stores {dtype} tensors, the build config says target.dtype "
                          f"{cfg.target.dtype}: fix target.dtype")
    experts = expert_format_of(tensors)
    if experts == "mxfp4" and cfg.target.quantization != "mxfp4":
        raise ConfigError(f"target {src.target_path} has MXFP4 experts (the gpt-oss release): set target.quantization "
                          "mxfp4 to ship them as released")
    if cfg.target.quantization == "mxfp4":
        from dflash_trt.checkpoint.gpt_oss import check_mxfp4_release

        try:
            check_mxfp4_release(src.target_path)
        except CheckpointError as exc:
            raise ConfigError(str(exc)) from None


def check_against_real(cfg: BuildConfig, src: Sources) -> None:
    """YAML expectations vs config.json and the tensors; drafter vs target; limits vs the models."""
    if src.target_tensors is not None:
        _check_tensors(cfg, src)
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
    if src.drafter_tensors is not None and cfg.backend.startswith("trtllm"):
        try:  # the drafter stage writes it BF16 for TensorRT-LLM: only a float source can be cast
            check_unscaled_drafter(src.drafter_path, list(src.drafter_tensors))
        except CheckpointError as exc:
            raise ConfigError(str(exc)) from None
    if src.drafter_config is not None:
        d = src.drafter_config
        check_block_size(cfg.max_draft_len + 1, d.block_size, str(src.drafter_path))
        if d.hidden_size != cfg.target.hidden_size or d.num_target_layers != cfg.target.num_hidden_layers:
            raise ConfigError(f"drafter {src.drafter_path} was built for a target with hidden size {d.hidden_size} "
                              f"and {d.num_target_layers} layers, the build config's target has "
                              f"{cfg.target.hidden_size} and {cfg.target.num_hidden_layers}: use the drafter "
                              "trained for this target")
        if cfg.drafter.num_hidden_layers is not None and cfg.drafter.num_hidden_layers != d.num_hidden_layers:
            raise ConfigError(f"drafter {src.drafter_path} has {d.num_hidden_layers} layers, the build config says "
                              f"drafter.num_hidden_layers {cfg.drafter.num_hidden_layers}: fix it or remove it")
        check_target_layer_ids(d.target_layer_ids, cfg.target.num_hidden_layers, f"drafter {src.drafter_path}")
        if not 0 <= d.mask_token_id < cfg.target.vocab_size:
            raise ConfigError(f"drafter mask_token_id {d.mask_token_id} is outside the target vocabulary "
                              f"({cfg.target.vocab_size})")
    if src.target_config is not None and src.drafter_config is not None:
        check_drafter_matches_target(src.drafter_config, TargetInfo.from_hf_config(src.target_config))


def _tensors(directory: Path) -> tuple[TensorSpec, ...] | None:
    """The checkpoint's tensors from its headers; None when only its config is here (a dry run)."""
    if not ((directory / INDEX_NAME).is_file() or any(directory.glob("*.safetensors"))):
        return None
    return tuple(read_specs(directory))


def load_sources(cfg: BuildConfig, base: Path, default_target: Path | None, require: bool,
                 tiny_gpt_oss: Path | None = None) -> Sources:
    """Resolve and read the inputs. `require=True` (a real build) makes missing paths an error."""
    from dflash_trt.models.target import load_hf_config

    target = resolve_path(cfg.target.path, default_target, base, tiny_gpt_oss)
    drafter = resolve_path(cfg.drafter.path, default_target, base, tiny_gpt_oss)
    t_ok, d_ok = (target / "config.json").is_file(), (drafter / "config.json").is_file()
    if require and not t_ok:
        raise CheckpointError(f"target checkpoint not found: {target}/config.json does not exist "
                              "(fix target.path, or use --dry-run to plan without the weights)")
    if require and not d_ok:
        hint = " (the shipped drafter is produced by `dflash-trt train`; see README)" if drafter == SHIPPED_DRAFTER else ""
        raise CheckpointError(f"drafter checkpoint not found: {drafter}/config.json does not exist{hint}")
    src = Sources(target, drafter, t_ok, d_ok, load_hf_config(target) if t_ok else None,
                  DrafterConfig.load(drafter) if d_ok else None,
                  _tensors(target) if t_ok else None, _tensors(drafter) if d_ok else None)
    check_against_real(cfg, src)
    return src


# ---- sizes (estimates: dflash_trt.builder.sizes) -------------------------------------------

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
