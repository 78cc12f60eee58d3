"""The cached build stages: each writes one folder (`out`, a fresh temporary directory) from its
inputs and returns facts for the manifest. Checkpoint work is delegated to dflash_trt.checkpoint
and dflash_trt.quant (imported lazily: a dry run or an unquantized build never loads them).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

from tqdm import tqdm

from dflash_trt.builder import trtllm
from dflash_trt.builder.plan import BuildPlan
from dflash_trt.errors import BackendUnavailableError, CheckpointError

log = logging.getLogger(__name__)

ALGO = {"fp8": "FP8", "nvfp4": "NVFP4"}
CALIBRATION = ".calibration.json"  # hidden: kept in the stage cache, not linked into the output


def link_tree(src: Path, dst: Path, progress: bool, what: str) -> str:
    """Hard-link every file of `src` into `dst` (same bytes, no copy); copy where linking is not
    possible (another filesystem), saying so. Hidden files (tool markers) are skipped."""
    files = [p for p in sorted(Path(src).rglob("*")) if p.is_file() and not p.name.startswith(".")]
    total = sum(p.stat().st_size for p in files)
    mode = "hardlink"
    with tqdm(total=total, unit="B", unit_scale=True, desc=what, disable=not progress, leave=False) as bar:
        for path in files:
            target = dst / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, target)
            except OSError as exc:
                if mode == "hardlink":
                    log.warning("cannot hard-link %s into %s (%s): copying instead", src, dst, exc)
                mode = "copy"
                shutil.copy2(path, target)
            bar.update(path.stat().st_size)
    return mode


def _tokenizer(directory: Path):
    from dflash_trt.runtime.factory import load_tokenizer

    return load_tokenizer(directory)


def _calibration_prompts(plan: BuildPlan, tokenizer, vocab_size: int) -> list[list[int]]:
    from dflash_trt.builder.calibration import calibration_prompts

    return calibration_prompts(plan.config.calibration_samples, tokenizer=tokenizer, vocab_size=vocab_size)


def _native_target(directory: Path):
    from dflash_trt.models.target import load_native_target

    return load_native_target(directory)


def run_target(plan: BuildPlan, out: Path, progress: bool) -> dict:
    """target/: the ModelOpt-HF quantized target, or the source linked unchanged."""
    cfg, src = plan.config, plan.sources.target_path
    fmt = cfg.target.quantization
    if fmt == "none":
        return {"format": "hf", "quantization": None, "written_by": link_tree(src, out, progress, "target")}
    from dflash_trt.checkpoint.modelopt_hf import write_target
    from dflash_trt.builder.calibration import calibrate_target

    model = _native_target(src)
    tokenizer = _tokenizer(src)
    prompts = _calibration_prompts(plan, tokenizer, model.config.vocab_size)
    with tqdm(total=2, desc=f"target {fmt}", disable=not progress, leave=False) as bar:
        calibration = calibrate_target(model, prompts)
        bar.update()
        write_target(model, out, ALGO[fmt], calibration=calibration, source_dir=src)
        bar.update()
    (out / CALIBRATION).write_text(json.dumps({"input_amax": calibration.input_amax, **calibration.describe()}))
    return {"format": "modelopt-hf", "quantization": ALGO[fmt], "calibration": calibration.describe()}


def _saved_calibration(stage_dir: Path):
    from dflash_trt.builder.calibration import Calibration

    raw = json.loads((stage_dir / CALIBRATION).read_text())
    return Calibration(raw["input_amax"], raw["method"], raw["num_prompts"], raw["num_tokens"])


def run_drafter(plan: BuildPlan, out: Path, progress: bool) -> dict:
    """drafter/: the FP8 drafter (fc and norms high precision), or the source linked unchanged."""
    cfg, src = plan.config, plan.sources.drafter_path
    if cfg.drafter.quantization == "none":
        return {"format": "dflash", "quantization": None, "written_by": link_tree(src, out, progress, "drafter")}
    from dflash_trt.checkpoint.modelopt_hf import write_drafter
    from dflash_trt.models.drafter import DFlashDrafter
    from dflash_trt.builder.calibration import calibrate_drafter

    target = _native_target(plan.sources.target_path)
    drafter = DFlashDrafter.from_pretrained(src)
    prompts = _calibration_prompts(plan, _tokenizer(plan.sources.target_path), target.config.vocab_size)
    with tqdm(total=2, desc="drafter fp8", disable=not progress, leave=False) as bar:
        calibration = calibrate_drafter(target, drafter, prompts)
        bar.update()
        write_drafter(drafter, out, "FP8", calibration=calibration, source_dir=src)
        bar.update()
    return {"format": "modelopt-hf", "quantization": "FP8", "calibration": calibration.describe()}


def run_shard(plan: BuildPlan, target_dir: Path, out: Path, progress: bool) -> dict:
    """shards/target/: a pre-sharded target, config.json + rank{N}.safetensors with the `mapping`.
    TensorRT-LLM's 1.2.x legacy checkpoint (fused qkv names, quantized from the float source with
    the target stage's calibration) for the engine path and quantized targets; HF-named shards
    (what the torch TP runtime loads) for an unquantized torch-backend target."""
    cfg = plan.config
    p = cfg.parallel
    if p.pp != 1:
        raise CheckpointError(f"pipeline-parallel shards (pp={p.pp}) are not written by this builder: use pp 1")
    ep = p.ep if cfg.is_moe else 1
    out.rmdir()  # the checkpoint writers rename their own temporary directory into place
    with tqdm(total=1, desc=f"shard tp{p.tp}", disable=not progress, leave=False) as bar:
        if cfg.backend == "torch" and cfg.target.quantization == "none":
            from dflash_trt.checkpoint.mapping import Mapping
            from dflash_trt.checkpoint.sharding import write_tp_shards

            write_tp_shards(target_dir, out, Mapping.for_sizes(p.tp, ep))
            fmt = "hf-tp-shards"
        else:
            from dflash_trt.checkpoint.trtllm_legacy import write_checkpoint

            fmt_q = cfg.target.quantization
            calibration = _saved_calibration(target_dir) if fmt_q != "none" else None
            dtype = "float32" if cfg.gpu_arch == "cpu" else "bfloat16"
            write_checkpoint(_native_target(plan.sources.target_path), out, ALGO.get(fmt_q), calibration,
                             tp=p.tp, ep=ep, dtype=dtype, source_dir=plan.sources.target_path)
            fmt = "trtllm-legacy-1.2"
        bar.update()
    return {"format": fmt, "tp": p.tp, "ep": ep, "files": sorted(x.name for x in out.glob("rank*.safetensors"))}


def run_engine(plan: BuildPlan, shards_dir: Path, out: Path, progress: bool) -> dict:
    """engine/: trtllm-build of the legacy checkpoint with the tapped hidden states as outputs."""
    version = trtllm.engine_preflight(plan.config)
    layer_ids = plan.sources.drafter_config.target_layer_ids
    cls_file = out / trtllm.MODEL_CLASS_FILE
    cls_file.write_text(trtllm.model_class_source(plan.config, layer_ids))
    argv = trtllm.trtllm_build_argv(plan.config, shards_dir, out, cls_file)
    log.info("running %s", trtllm.shell_line(argv))
    proc = subprocess.run(argv, check=False)
    if proc.returncode != 0:
        raise BackendUnavailableError(f"trtllm-build failed with exit code {proc.returncode}: "
                                      f"{trtllm.shell_line(argv)}")
    return {"tensorrt_llm": version, "command": trtllm.shell_line(argv),
            "hidden_state_outputs": [f"dflash_hidden_{t}" for t in layer_ids]}
