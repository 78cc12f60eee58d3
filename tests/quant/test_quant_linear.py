"""QuantLinear against the reference paths: a plain Linear on the dequantized weight (tight) and the
unquantized Linear (within the format's stated tolerance)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.errors import ConfigError, InputError
from dflash_trt.quant.algo import SUPPORTED_ALGOS, QuantAlgo, parse_quant_algo
from dflash_trt.quant.fp8 import quantize_fp8_weight
from dflash_trt.quant.linear import QuantLinear
from dflash_trt.quant.nvfp4 import quantize_nvfp4

# (algo, calibrated input amax given): FP8_PER_CHANNEL_PER_TOKEN takes no static input scale.
_MODES = [
    (QuantAlgo.FP8, False),
    (QuantAlgo.FP8, True),
    (QuantAlgo.FP8_PER_CHANNEL_PER_TOKEN, False),
    (QuantAlgo.NVFP4, False),
    (QuantAlgo.NVFP4, True),
]
# Relative Frobenius error of the output vs the unquantized layer (Gaussian weights and inputs);
# measured: FP8 0.026 / 0.038 (with input quantization), per-channel 0.035, NVFP4 0.095 / 0.135.
_TOLERANCE = {
    (QuantAlgo.FP8, False): 0.05,
    (QuantAlgo.FP8, True): 0.05,
    (QuantAlgo.FP8_PER_CHANNEL_PER_TOKEN, False): 0.05,
    (QuantAlgo.NVFP4, False): 0.12,
    (QuantAlgo.NVFP4, True): 0.16,
}
_EXPECTED_STATE = {
    QuantAlgo.FP8: {"weight": ((48, 64), torch.float8_e4m3fn), "weight_scale": ((1,), torch.float32)},
    QuantAlgo.FP8_PER_CHANNEL_PER_TOKEN: {
        "weight": ((48, 64), torch.float8_e4m3fn),
        "weight_scale": ((48,), torch.float32),
    },
    QuantAlgo.NVFP4: {
        "weight": ((48, 32), torch.uint8),
        "weight_scale": ((48, 4), torch.float8_e4m3fn),
        "weight_scale_2": ((1,), torch.float32),
    },
}


def _linear(bias: bool, dtype: torch.dtype = torch.float32) -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(64, 48, bias=bias)
    nn.init.normal_(layer.weight, std=0.1)
    return layer.to(dtype)


def _calibrated(algo: QuantAlgo) -> bool:
    return algo is not QuantAlgo.FP8_PER_CHANNEL_PER_TOKEN


@pytest.mark.parametrize(("algo", "calibrate"), _MODES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_equals_linear_on_dequantized_weight(
    algo: QuantAlgo, calibrate: bool, bias: bool, dtype: torch.dtype
) -> None:
    linear = _linear(bias, dtype)
    x = torch.randn(2, 5, 64).to(dtype)
    q = QuantLinear.from_float(linear, algo, input_amax=float(x.float().abs().max()) if calibrate else None)
    reference = nn.Linear(64, 48, bias=bias).to(dtype)
    with torch.no_grad():
        reference.weight.copy_(q.dequantized_weight(dtype))
        if bias:
            reference.bias.copy_(linear.bias)
        expected = reference(q.quantize_input(x))
        y = q(x)
    assert y.dtype == dtype and y.shape == (2, 5, 48)
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("algo", "calibrate"), _MODES)
def test_forward_close_to_unquantized_linear(algo: QuantAlgo, calibrate: bool) -> None:
    linear = _linear(bias=True)
    x = torch.randn(16, 64)
    q = QuantLinear.from_float(linear, algo, input_amax=float(x.abs().max()) if calibrate else None)
    with torch.no_grad():
        expected, y = linear(x), q(x)
    rel = float((y - expected).norm() / expected.norm())
    assert rel < _TOLERANCE[(algo, calibrate)], rel


@pytest.mark.parametrize("algo", list(QuantAlgo))
def test_state_dict_layout_and_reload(algo: QuantAlgo) -> None:
    calibrated = _calibrated(algo)
    q = QuantLinear.from_float(_linear(bias=True), algo, input_amax=3.0 if calibrated else None)
    state = q.state_dict()
    expected = dict(_EXPECTED_STATE[algo], bias=((48,), torch.float32))
    if calibrated:
        expected["input_scale"] = ((1,), torch.float32)
    assert {k: (tuple(v.shape), v.dtype) for k, v in state.items()} == expected
    empty = QuantLinear(64, 48, algo.value, bias=True, static_input_scale=calibrated)
    empty.load_state_dict(state)
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(empty(x), q(x))


@pytest.mark.parametrize(
    ("weight", "algo"),
    [
        (quantize_fp8_weight(torch.randn(8, 32)), QuantAlgo.FP8),
        (quantize_fp8_weight(torch.randn(8, 32), per_channel=True), QuantAlgo.FP8_PER_CHANNEL_PER_TOKEN),
        (quantize_nvfp4(torch.randn(8, 32)), QuantAlgo.NVFP4),
    ],
)
def test_from_quantized_infers_algo(weight, algo: QuantAlgo) -> None:
    q = QuantLinear.from_quantized(weight)
    assert q.algo is algo and (q.in_features, q.out_features) == (32, 8)
    x = torch.randn(4, 32)
    expected = F.linear(q.quantize_input(x), q.dequantized_weight())
    torch.testing.assert_close(q(x), expected, rtol=0, atol=0)


@pytest.mark.parametrize("algo", list(QuantAlgo))
def test_module_dtype_cast_keeps_quantized_storage(algo: QuantAlgo) -> None:
    q = QuantLinear.from_float(_linear(bias=True), algo, input_amax=2.0 if _calibrated(algo) else None)
    dtypes = {name: t.dtype for name, t in q.state_dict().items()}
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = q(x)
        q.to(torch.bfloat16)
        y = q(x)
    assert {name: t.dtype for name, t in q.state_dict().items()} == dict(dtypes, bias=torch.bfloat16)
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


def test_parse_quant_algo() -> None:
    assert parse_quant_algo("NVFP4") is QuantAlgo.NVFP4
    assert parse_quant_algo(QuantAlgo.FP8) is QuantAlgo.FP8
    assert SUPPORTED_ALGOS == ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "NVFP4")


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: parse_quant_algo("INT8"), ConfigError, "supported: FP8, FP8_PER_CHANNEL_PER_TOKEN, NVFP4"),
        (lambda: parse_quant_algo("nvfp4"), ConfigError, "unsupported quant_algo"),
        (lambda: QuantLinear.from_float(_linear(False), "W4A16_AWQ"), ConfigError, "supported"),
        (lambda: QuantLinear(24, 8, "NVFP4"), InputError, "in_features % 16"),
        (lambda: QuantLinear(0, 8, "FP8"), InputError, "positive"),
        (lambda: QuantLinear(16, 8, "FP8_PER_CHANNEL_PER_TOKEN", static_input_scale=True), ConfigError, "per token"),
        (lambda: QuantLinear.from_float(_linear(False), "FP8_PER_CHANNEL_PER_TOKEN", 2.0), ConfigError, "per token"),
        (lambda: QuantLinear.from_float(_linear(False), "FP8", input_amax=0.0), InputError, "> 0"),
        (lambda: QuantLinear.from_quantized(quantize_fp8_weight(torch.randn(2, 8, 16))), InputError, "2-D"),
        (
            lambda: QuantLinear.from_quantized(quantize_nvfp4(torch.randn(8, 16)), bias=torch.ones(3)),
            InputError,
            "bias",
        ),
        (lambda: QuantLinear(16, 8, "FP8")(torch.randn(2, 15)), InputError, r"\[..., 16\]"),
        (lambda: QuantLinear(16, 8, "FP8")(torch.ones(2, 16, dtype=torch.int64)), InputError, "dtype"),
    ],
)
def test_errors(make, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        make()
