"""THE TensorRT-LLM release this project targets, and the LLM-API key names it accepts.

One data file is the source: `dflash_trt/data/trtllm_<release>_llm_api.json` (package data). It
holds the release (1.4.0rc1), its container images, and the field names of the LLM-API classes a
`trtllm-serve --config` YAML reaches: `TorchLlmArgs` (top level), `KvCacheConfig`,
`CudaGraphConfig`, `MoeConfig`, and `DFlashDecodingConfig` with its base `DecodingBaseConfig`,
each with the upstream source it was transcribed from (file + commit, or the release's generated
API reference). Upstream builds these classes with `extra="forbid"` (`StrictBaseModel`,
`BaseLlmArgs.model_config`), so a key outside the list makes `trtllm-serve` refuse the file; ours
does the same (`TrtllmRelease.check`).

Users of the pin: the serve `--config` parser (serve/config.py), the builder's YAML and image
defaults (builder/), the Triton image and Slurm jobs (docker/, checked by tests/docker/), and the
tests that walk every YAML we write. Inside the pinned container, `installed_fields()` reads the
same names from the installed `tensorrt_llm` so the transcription can be compared
(tests/gpu/test_trtllm_backend.py does).
"""
from __future__ import annotations

import functools
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from dflash_trt.errors import ConfigError

DATA_DIR = Path(__file__).resolve().parent / "data"
TOP = "TorchLlmArgs"
DFLASH = "DFlashDecodingConfig"
DECODING_TYPE = "DFlash"


@dataclass(frozen=True)
class LlmApiClass:
    name: str
    keys: frozenset[str]  # accepted input keys: fields, aliases, removed-but-accepted, the base's keys
    nested: Mapping[str, str]  # key -> the class its mapping value is checked against
    declared: frozenset[str]  # this class's own field input names (what installed_fields() reports)


@dataclass(frozen=True)
class TrtllmRelease:
    version: str
    release_image: str  # nvcr.io/nvidia/tensorrt-llm/release:<version>
    triton_base_image: str  # the tritonserver *-trtllm-python-py3 image docker/Dockerfile.triton builds on
    classes: Mapping[str, LlmApiClass]
    values: Mapping[str, tuple[str, ...]]  # "Class.field" -> the accepted values of a Literal field
    sources: Mapping[str, str]

    def keys(self, cls: str) -> frozenset[str]:
        return self.classes[cls].keys

    def unknown_keys(self, raw: Mapping[str, Any], cls: str = TOP, prefix: str = "") -> list[str]:
        """Dotted keys of `raw` (and of its checked sub-mappings) that `cls` does not accept.
        A speculative_config of another decoding_type is not walked (only DFlash is served here;
        the parser refuses the type itself)."""
        spec = self.classes[cls]
        unknown = []
        for key, value in raw.items():
            dotted = f"{prefix}{key}"
            if key not in spec.keys:
                unknown.append(dotted)
            elif key in spec.nested and isinstance(value, Mapping):
                inner = spec.nested[key]
                if inner == DFLASH and not ("decoding_type" in value and value["decoding_type"] == DECODING_TYPE):
                    continue
                unknown += self.unknown_keys(value, inner, dotted + ".")
        return unknown

    def check(self, raw: Mapping[str, Any], where: str) -> None:
        """ConfigError naming every key TensorRT-LLM <version> would refuse (upstream: extra="forbid")."""
        unknown = self.unknown_keys(raw)
        if unknown:
            names = ", ".join(f"'{k}'" for k in unknown)
            raise ConfigError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {names}: not a TensorRT-LLM "
                              f"{self.version} LLM-API field (trtllm-serve --config refuses it too); fix the "
                              "spelling or remove it")

    def allowed(self, dotted: str) -> tuple[str, ...]:
        return self.values[dotted]


def _class(name: str, raw: Mapping[str, Any], table: Mapping[str, Any]) -> LlmApiClass:
    keys = set(raw["fields"]) | set(raw["aliases"]) | set(raw["removed_but_accepted"])
    if raw["base"] is not None:
        keys |= _class(raw["base"], table[raw["base"]], table).keys
    return LlmApiClass(name, frozenset(keys), dict(raw["nested"]), frozenset(raw["fields"]) | set(raw["aliases"]))


def data_file() -> Path:
    files = sorted(DATA_DIR.glob("trtllm_*_llm_api.json"))
    if len(files) != 1:
        raise ConfigError(f"expected exactly one pinned TensorRT-LLM data file in {DATA_DIR}, found {len(files)}")
    return files[0]


@functools.cache
def pinned() -> TrtllmRelease:
    """The pinned release (read once from the data file)."""
    raw = json.loads(data_file().read_text())
    table = raw["classes"]
    return TrtllmRelease(
        version=raw["release"], release_image=raw["images"]["trtllm_release"],
        triton_base_image=raw["images"]["triton_base"],
        classes={name: _class(name, spec, table) for name, spec in table.items()},
        values={k: tuple(v) for k, v in raw["values"].items()}, sources=dict(raw["sources"]))


def installed_fields() -> dict[str, list[str]]:
    """The same field names read from the installed tensorrt_llm (only where it is installed: the
    pinned container). Input names: a field's alias or validation aliases where it has them."""
    from pydantic import AliasChoices

    args = importlib.import_module("tensorrt_llm.llmapi.llm_args")

    def names(model) -> set[str]:
        out = set()
        for name, info in model.model_fields.items():
            out.add(info.alias or name)
            if isinstance(info.validation_alias, AliasChoices):
                out.update(c for c in info.validation_alias.choices if isinstance(c, str))
        return out

    base = names(args.DecodingBaseConfig)
    return {TOP: sorted(names(args.TorchLlmArgs)), "KvCacheConfig": sorted(names(args.KvCacheConfig)),
            "CudaGraphConfig": sorted(names(args.CudaGraphConfig)), "MoeConfig": sorted(names(args.MoeConfig)),
            "DecodingBaseConfig": sorted(base), DFLASH: sorted(names(args.DFlashDecodingConfig) - base)}


__all__ = ["DECODING_TYPE", "LlmApiClass", "TrtllmRelease", "data_file", "installed_fields", "pinned"]
