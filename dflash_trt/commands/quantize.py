"""`dflash-trt quantize`: FP8 / NVFP4 checkpoints of a target and/or a DFlash drafter, in the
ModelOpt unified HF format (TensorRT-LLM PyTorch backend) or the TensorRT-LLM 1.2.x legacy format
(rank{N}.safetensors for `trtllm-build`), sharded --tp ways (--ep ways expert-parallel for MoE).

Activation scales are calibrated on --calib-prompts offline prompts (standard-library
instructions for targets with a tokenizer, seeded ids otherwise; never the benchmark sets).
Writes OUTPUT/target and/or OUTPUT/drafter; each carries provenance.json. FP8 / NVFP4 drafters and
gpt-oss targets run on dflash_trt's torch runtime only: TensorRT-LLM's DFlash drafter needs BF16
weights and its gpt-oss loader takes BF16 or MXFP4 experts with BF16 attention (`dflash-trt build`
ships those as released).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash_trt.errors import ConfigError

ALGOS = {"fp8": "FP8", "nvfp4": "NVFP4"}
FORMATS = ("modelopt-hf", "trtllm-legacy")


def register(sub) -> None:
    p = sub.add_parser("quantize", help="write FP8/NVFP4 (sharded) checkpoints for TensorRT-LLM",
                       description=__doc__)
    p.add_argument("--target", type=Path, default=None, help="target HF checkpoint directory")
    p.add_argument("--drafter", type=Path, default=None, help="DFlash drafter directory (needs --target for calibration)")
    p.add_argument("--algo", choices=sorted(ALGOS), required=True)
    p.add_argument("--format", choices=FORMATS, default="modelopt-hf")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (trtllm-legacy)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size inside --tp (MoE, trtllm-legacy)")
    p.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default="bfloat16",
                   help="dtype of the unquantized tensors (trtllm-legacy)")
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--calib-prompts", type=int, default=16, help="number of calibration prompts (>= 1)")
    p.add_argument("--calib-tokens", type=int, default=32, help="tokens drafted per prompt to calibrate the drafter")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dflash_trt.checkpoint import modelopt_hf, trtllm_legacy
    from dflash_trt.models.drafter import DFlashDrafter
    from dflash_trt.models.target import load_native_target
    from dflash_trt.builder.calibration import calibrate_drafter, calibrate_target, calibration_prompts
    from dflash_trt.runtime.factory import load_tokenizer

    if args.target is None:
        raise ConfigError("--target is required (the drafter is calibrated on the target's features)")
    if args.format == "modelopt-hf" and (args.tp != 1 or args.ep != 1):
        raise ConfigError("--tp/--ep shard the trtllm-legacy format; the ModelOpt-HF format is sharded by "
                          "TensorRT-LLM at load time (use --format trtllm-legacy, or --tp 1)")
    if args.calib_prompts < 1:
        raise ConfigError(f"no calibration data: --calib-prompts must be >= 1, got {args.calib_prompts}")
    algo = ALGOS[args.algo]
    target = load_native_target(args.target)
    tokenizer = load_tokenizer(args.target)
    prompts = calibration_prompts(args.calib_prompts, tokenizer=tokenizer, vocab_size=target.config.vocab_size,
                                  seed=args.seed)
    written = {}
    tcal = calibrate_target(target, prompts)
    if args.format == "modelopt-hf":
        written["target"] = modelopt_hf.write_target(target, args.output / "target", algo, tcal, args.target)
    else:
        written["target"] = trtllm_legacy.write_checkpoint(target, args.output / "target", algo, tcal, tp=args.tp,
                                                           ep=args.ep, dtype=args.dtype, source_dir=args.target)
    if args.drafter is not None:
        drafter = DFlashDrafter.from_pretrained(args.drafter)
        dcal = calibrate_drafter(target, drafter, prompts, args.calib_tokens)
        if args.format == "modelopt-hf":
            written["drafter"] = modelopt_hf.write_drafter(drafter, args.output / "drafter", algo, dcal, args.drafter)
        else:
            written["drafter"] = trtllm_legacy.write_checkpoint(drafter, args.output / "drafter", algo, dcal,
                                                                tp=args.tp, dtype=args.dtype, source_dir=args.drafter)
    json.dump({k: str(v) for k, v in written.items()} | {"algo": algo, "format": args.format, "tp": args.tp,
                                                          "ep": args.ep}, sys.stdout)
    sys.stdout.write("\n")
    return 0
