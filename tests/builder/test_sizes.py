"""Build size estimates per tensor group: the quantized-linear rule equals what the checkpoint
writer quantizes, and FP8 / NVFP4 estimates equal the bytes `write_target` puts on disk."""
from __future__ import annotations

import pytest

from dflash_trt.builder.sizes import QUANTIZED_WEIGHT, estimate, transform
from dflash_trt.checkpoint import modelopt_hf
from dflash_trt.checkpoint.layout import read_specs
from dflash_trt.checkpoint.quantized import plan_for
from dflash_trt.models.target import load_native_target
from dflash_trt.models.tiny import build_tiny_drafter, save_tiny_checkpoint


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_oss"])
def test_quantized_weight_rule_is_the_writers(tmp_path, arch):
    target_dir, _ = save_tiny_checkpoint(tmp_path, arch)
    target = load_native_target(target_dir)
    names = {s.name for s in read_specs(target_dir) if QUANTIZED_WEIGHT.fullmatch(s.name)}
    assert names == {f"{m}.weight" for m in plan_for(target, "FP8", "target").modules}
    drafter = build_tiny_drafter(target.config)
    drafter_names = {n for n in drafter.state_dict() if QUANTIZED_WEIGHT.fullmatch(n)}
    assert drafter_names == {f"{m}.weight" for m in plan_for(drafter, "FP8", "drafter").modules}


@pytest.mark.parametrize("algo", ["fp8", "nvfp4"])
def test_quantized_estimate_equals_the_written_tensors(tmp_path, algo):
    from dflash_trt.builder.calibration import calibrate_target, calibration_prompts
    from dflash_trt.checkpoint.layout import header_bytes

    target_dir, _ = save_tiny_checkpoint(tmp_path, "qwen3")
    target = load_native_target(target_dir)
    calibration = calibrate_target(target, calibration_prompts(1, vocab_size=target.config.vocab_size))
    out = modelopt_hf.write_target(target, tmp_path / "q", algo.upper(), calibration, target_dir)
    specs = read_specs(target_dir)
    est = estimate(specs, algo, 0, "test")
    written = read_specs(out)
    assert {(s.name, s.shape, s.dtype) for s in written} == {(o.name, o.shape, o.dtype)
                                                             for _s, outs, _l in transform(specs, algo) for o in outs}
    assert sum(g.est_bytes for g in est.groups) == sum(s.nbytes for s in written)
    assert est.other_bytes == header_bytes(written)
    label = {g.group: g.output for g in est.groups}
    assert label["attention"].startswith(algo.upper()) and label["embedding"] == "FP32 (kept)"
