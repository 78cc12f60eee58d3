"""The cached build stages: each writes one folder (`out`, a fresh temporary directory) from its
inputs and returns facts for the manifest. Checkpoint work is delegated to dflash_trt.checkpoint
and dflash_trt.quant (imported lazily: a dry run or an unquantized build never loads them).
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from pathlib import Path

from tqdm import tqdm

from dflash_trt.builder.plan import BuildPlan
from dflash_trt.errors import CheckpointError

log = logging.getLogger(__name__)

ALGO = {"fp8": "FP8", "nvfp4": "NVFP4"}
CALIBRATION = ".calibration.json"  # hidden: kept in the stage cache, not linked into the output


FICLONE = 0x40049409  # Linux ioctl: share the extents of another file copy-on-write (btrfs, XFS, ...)


def _clone_or_copy(src: Path, dst: Path) -> str:
    """Copy one file: a copy-on-write clone where the filesystem supports it, else a byte copy.
    Either way dst is a new inode: writing to it never changes src."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        try:
            fcntl.ioctl(fout.fileno(), FICLONE, fin.fileno())
            mode = "reflink"
        except OSError:  # EOPNOTSUPP / EXDEV / EINVAL: this filesystem cannot clone
            mode = "copy"
    if mode == "copy":
        shutil.copyfile(src, dst)
    shutil.copystat(src, dst)
    return mode


def copy_tree(src: Path, dst: Path, progress: bool, what: str) -> str:
    """Copy every file of a SOURCE checkpoint `src` into `dst` (reflinked where the filesystem can):
    never hard links, so editing a build leaves the source untouched. Hidden files are skipped.
    Returns "reflink", "copy" or "reflink+copy"."""
    files = [p for p in sorted(Path(src).rglob("*")) if p.is_file() and not p.name.startswith(".")]
    total = sum(p.stat().st_size for p in files)
    modes = set()
    with tqdm(total=total, unit="B", unit_scale=True, desc=what, disable=not progress, leave=False) as bar:
        for path in files:
            target = dst / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            modes.add(_clone_or_copy(path, target))
            bar.update(path.stat().st_size)
    if "copy" in modes:
        log.info("%s: copied %s of %s (no copy-on-write clones on this filesystem)", what, _gib(total), src)
    return "+".join(sorted(modes, reverse=True)) or "copy"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def link_stage(src: Path, dst: Path) -> None:
    """Hard-link a finished stage folder of the build's own cache into the output directory (no
    second copy of a 65 GB target). The cache records each file's size and mtime when the stage
    finishes, and a re-run re-does a stage whose files were edited since (builder._Cache)."""
    for path in sorted(Path(src).rglob("*")):
        if path.is_file() and not path.name.startswith("."):
            target = dst / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, target)


def _dtype(name: str):
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


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
    """target/: the ModelOpt-HF quantized target, or the source copied unchanged (`none`, and the
    gpt-oss MXFP4 release for `mxfp4`, checked by dflash_trt.checkpoint.gpt_oss when the sources load)."""
    cfg, src = plan.config, plan.sources.target_path
    fmt = cfg.target.quantization
    if fmt in ("none", "mxfp4"):
        written_by = copy_tree(src, out, progress, "target")
        if fmt == "mxfp4":
            return {"format": "hf (gpt-oss release layout)", "quantization": "MXFP4 experts as released",
                    "written_by": written_by}
        return {"format": "hf", "quantization": None, "written_by": written_by}
    from dflash_trt.checkpoint.modelopt_hf import write_target
    from dflash_trt.builder.calibration import calibrate_target

    model = _native_target(src)
    tokenizer = _tokenizer(src)
    prompts = _calibration_prompts(plan, tokenizer, model.config.vocab_size)
    with tqdm(total=2, desc=f"target {fmt}", disable=not progress, leave=False) as bar:
        calibration = calibrate_target(model, prompts)
        bar.update()
        # the checkpoint dtype the build config declares (checked against the source's headers)
        write_target(model, out, ALGO[fmt], calibration=calibration, source_dir=src, dtype=_dtype(cfg.target.dtype))
        bar.update()
    (out / CALIBRATION).write_text(json.dumps({"input_amax": calibration.input_amax, **calibration.describe()}))
    return {"format": "modelopt-hf", "quantization": ALGO[fmt], "calibration": calibration.describe()}


def _saved_calibration(stage_dir: Path):
    from dflash_trt.builder.calibration import Calibration

    raw = json.loads((stage_dir / CALIBRATION).read_text())
    return Calibration(raw["input_amax"], raw["method"], raw["num_prompts"], raw["num_tokens"])


def _write_bf16_drafter(src: Path, out: Path) -> None:
    """The drafter with every float tensor in BF16 and config.json's torch_dtype saying so; the
    other files copied."""
    import torch

    from dflash_trt.fileio import read_state_dict, write_json, write_safetensors

    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in read_state_dict(src).items()}
    write_safetensors(out / "model.safetensors", state, metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    write_json(out / "config.json", config)
    for extra in sorted(Path(src).iterdir()):
        if extra.is_file() and not extra.name.startswith(".") and extra.suffix != ".safetensors" \
                and extra.name not in ("config.json", "model.safetensors.index.json"):
            _clone_or_copy(extra, out / extra.name)


def run_drafter(plan: BuildPlan, out: Path, progress: bool) -> dict:
    """drafter/: the FP8 drafter (fc and norms high precision, torch backend), the drafter in BF16
    (TensorRT-LLM: its DFlash draft model uses the raw q/k/v weights), or the source copied."""
    from dflash_trt.builder.sizes import drafter_mode

    cfg, src = plan.config, plan.sources.drafter_path
    mode = drafter_mode(cfg)
    if mode == "bf16":
        dtypes = {t.dtype for t in plan.sources.drafter_tensors if t.dtype in ("F32", "F16", "BF16")}
        if dtypes == {"BF16"}:
            return {"format": "dflash", "quantization": None, "dtype": "bfloat16",
                    "written_by": copy_tree(src, out, progress, "drafter")}
        _write_bf16_drafter(src, out)
        return {"format": "dflash", "quantization": None, "dtype": "bfloat16",
                "written_by": f"cast from {'/'.join(sorted(dtypes))} to BF16"}
    if mode == "copy":
        return {"format": "dflash", "quantization": None, "written_by": copy_tree(src, out, progress, "drafter")}
    from dflash_trt.checkpoint.layout import float_dtype_of
    from dflash_trt.checkpoint.modelopt_hf import write_drafter
    from dflash_trt.models.drafter import DFlashDrafter
    from dflash_trt.builder.calibration import calibrate_drafter

    target = _native_target(plan.sources.target_path)
    drafter = DFlashDrafter.from_pretrained(src)
    prompts = _calibration_prompts(plan, _tokenizer(plan.sources.target_path), target.config.vocab_size)
    with tqdm(total=2, desc="drafter fp8", disable=not progress, leave=False) as bar:
        calibration = calibrate_drafter(target, drafter, prompts)
        bar.update()
        write_drafter(drafter, out, "FP8", calibration=calibration, source_dir=src,
                      dtype=_dtype(float_dtype_of(list(plan.sources.drafter_tensors))))
        bar.update()
    return {"format": "modelopt-hf", "quantization": "FP8", "calibration": calibration.describe()}


def run_shard(plan: BuildPlan, target_dir: Path, out: Path, progress: bool) -> dict:
    """shards/target/: a pre-sharded target, config.json + rank{N}.safetensors with the `mapping`.
    For the torch backend's TP runtime: a quantized target in the TensorRT-LLM legacy checkpoint
    layout (fused qkv names, quantized from the float source with the target stage's calibration),
    HF-named shards for an unquantized or MXFP4-release target (MXFP4 experts split by expert and
    MoE-TP rows, still MXFP4)."""
    cfg = plan.config
    p = cfg.parallel
    if p.pp != 1:
        raise CheckpointError(f"pipeline-parallel shards (pp={p.pp}) are not written by this builder: use pp 1")
    ep = p.ep if cfg.is_moe else 1
    out.rmdir()  # the checkpoint writers rename their own temporary directory into place
    with tqdm(total=1, desc=f"shard tp{p.tp}", disable=not progress, leave=False) as bar:
        if cfg.backend == "torch" and cfg.target.quantization in ("none", "mxfp4"):
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
