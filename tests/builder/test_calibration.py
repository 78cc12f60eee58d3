"""Calibration: amax hooks, calibration prompts, errors."""
from __future__ import annotations

import pytest
import torch

from dflash_trt.errors import ConfigError
from dflash_trt.models.target import native_from_hf
from dflash_trt.models.tiny import build_tiny_target, build_tiny_tokenizer
from dflash_trt.builder.calibration import calibrate_target, calibration_prompts, collect_input_amax


def test_hook_amax_is_the_max_abs_input():
    lin = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    xs = [torch.randn(5, 4) for _ in range(3)]

    def run():
        for x in xs:
            lin(x)

    amax = collect_input_amax(lin, run, prefix="m.")
    assert amax["m.0"] == max(float(x.abs().max()) for x in xs)
    with torch.no_grad():
        assert amax["m.2"] == max(float(torch.relu(lin[0](x)).abs().max()) for x in xs)
    assert not lin[0]._forward_pre_hooks  # hooks removed


def test_target_calibration_covers_every_linear_and_needs_data():
    target = native_from_hf(build_tiny_target("gpt_oss", num_layers=2))
    cal = calibrate_target(target, calibration_prompts(2, vocab_size=256))
    linears = {n for n, m in target.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(cal.input_amax) == linears and all(v > 0 for v in cal.input_amax.values())
    assert cal.num_prompts == 2 and cal.num_tokens == 64
    with pytest.raises(ConfigError, match="no calibration data"):
        calibrate_target(target, [])
    with pytest.raises(ConfigError, match="no calibration data"):
        calibration_prompts(0, vocab_size=256)


def test_text_prompts_come_from_the_stdlib_not_the_benchmarks():
    tok = build_tiny_tokenizer()
    prompts = calibration_prompts(3, tokenizer=tok)
    texts = [tok.decode(p) for p in prompts]
    assert len(prompts) == 3 and all("<|im_start|>user" in t for t in texts)
    from dflash_trt.prompts import stdlib_prompts

    first = stdlib_prompts(0, limit=1)[0].text
    assert first[:40] in texts[0]
