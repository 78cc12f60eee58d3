"""FP8 E4M3 numerics: exact round trips, error bound, per-channel vs per-tensor, ModelOpt parity, errors."""
from __future__ import annotations

import pytest
import torch

from dflash_trt.errors import InputError
from dflash_trt.quant.fp8 import (
    E4M3_MAX,
    FP8_DTYPE,
    FP8Weight,
    activation_scale,
    cast_to_fp8,
    dequantize_fp8_weight,
    dequantize_kv,
    fake_quant_fp8,
    fake_quant_fp8_per_token,
    kv_cache_scales,
    quantize_fp8_weight,
    quantize_kv,
)

# Every finite E4M3 value (the bytes 0x7F and 0xFF are NaN).
_ALL_CODES = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
_ALL_VALUES = _ALL_CODES.view(FP8_DTYPE).float()


def _representable(rows: int, row_scales: torch.Tensor) -> torch.Tensor:
    """[rows, 254] weights: all finite E4M3 values times a power-of-two scale per row."""
    return _ALL_VALUES.repeat(rows, 1) * row_scales.unsqueeze(-1)


@pytest.mark.parametrize("scale", [1.0, 2.0**-10, 2.0**7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_tensor_roundtrip_is_exact(scale: float, dtype: torch.dtype) -> None:
    w = _representable(3, torch.full((3,), scale)).to(dtype)  # amax = 448 * scale
    q = quantize_fp8_weight(w)
    assert q.scale.tolist() == [scale]
    assert torch.equal(q.data[0].view(torch.uint8), _ALL_CODES)
    assert torch.equal(dequantize_fp8_weight(q, dtype), w)


def test_per_channel_roundtrip_is_exact_and_maps_each_row_max_to_448() -> None:
    row_scales = torch.tensor([2.0**-12, 1.0, 2.0**5, 2.0**-3])
    w = _representable(4, row_scales)
    q = quantize_fp8_weight(w, per_channel=True)
    assert q.per_channel and q.scale.shape == (4,)
    assert torch.equal(q.scale, row_scales)
    assert bool((q.data.float().abs().amax(dim=-1) == E4M3_MAX).all())
    assert torch.equal(dequantize_fp8_weight(q), w)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 1e3])
def test_relative_error_of_normal_values_at_most_2_pow_minus_4(per_channel: bool, magnitude: float) -> None:
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(32, 128, generator=gen) * magnitude * torch.exp(torch.randn(32, 1, generator=gen))
    q = quantize_fp8_weight(w, per_channel=per_channel)
    scale = q.scale.unsqueeze(-1) if per_channel else q.scale
    normal = (w / scale).abs() >= 2.0**-6  # E4M3's smallest normal
    rel = ((dequantize_fp8_weight(q) - w).abs() / w.abs())[normal]
    assert rel.numel() > 0 and float(rel.max()) <= 2.0**-4


def test_per_channel_beats_per_tensor_on_rows_of_different_magnitude() -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(8, 64, generator=gen) * torch.logspace(-7, 0, 8).unsqueeze(-1)
    per_tensor = (dequantize_fp8_weight(quantize_fp8_weight(w)) - w).norm(dim=-1) / w.norm(dim=-1)
    per_channel = (dequantize_fp8_weight(quantize_fp8_weight(w, per_channel=True)) - w).norm(dim=-1) / w.norm(dim=-1)
    assert float(per_channel.max()) < 0.04
    # with one scale for the tensor, the 1e-7 and 1e-6 rows fall below E4M3's smallest subnormal
    assert float(per_tensor[:2].min()) > 0.5
    assert torch.equal(per_channel[-1], per_tensor[-1])  # the row holding the tensor max: same scale


@pytest.mark.parametrize("per_channel", [False, True])
def test_matches_modelopt_fp8_qtensor(per_channel: bool) -> None:
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor.fp8_tensor")
    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(9))
    ref, ref_scale = qtensor.FP8QTensor.quantize(w, axis=0 if per_channel else None)
    q = quantize_fp8_weight(w, per_channel=per_channel)
    assert torch.equal(q.data.view(torch.uint8), ref._quantized_data.view(torch.uint8))
    assert torch.equal(q.scale, ref_scale.reshape(q.scale.shape))


@pytest.mark.parametrize(
    ("value", "expected"),
    [(448.0, 448.0), (500.0, 448.0), (1e30, 448.0), (float("inf"), 448.0), (-1e30, -448.0), (2.0**-10, 0.0)],
)
def test_cast_saturates(value: float, expected: float) -> None:
    assert cast_to_fp8(torch.tensor([value])).float().tolist() == [expected]


def test_zero_weight_and_zero_row_get_unit_scale() -> None:
    w = torch.randn(3, 16)
    w[1] = 0.0
    assert quantize_fp8_weight(torch.zeros(2, 16)).scale.tolist() == [1.0]
    q = quantize_fp8_weight(w, per_channel=True)
    assert q.scale[1].item() == 1.0 and torch.equal(dequantize_fp8_weight(q)[1], torch.zeros(16))


def test_activation_fake_quant() -> None:
    x = torch.randn(4, 7, 32, dtype=torch.bfloat16)
    scale = activation_scale(float(x.float().abs().max()))
    y = fake_quant_fp8(x, scale)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert float(((y.float() - x.float()).abs() / x.float().abs().clamp_min(1e-3)).max()) <= 2.0**-4 + 2.0**-8
    big = fake_quant_fp8(torch.tensor([1e4]), scale)  # beyond the calibrated range: saturates
    assert big.tolist() == [pytest.approx(448.0 * scale.item())]


def test_per_token_fake_quant_keeps_each_row_max() -> None:
    x = torch.randn(5, 64) * torch.logspace(-3, 3, 5).unsqueeze(-1)
    y = fake_quant_fp8_per_token(x)
    assert torch.allclose(y.abs().amax(dim=-1), x.abs().amax(dim=-1), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("min_scale", "k_amax", "v_amax", "k_scale", "v_scale"),
    [(1.0, 44.8, 896.0, 1.0, 2.0), (0.0, 44.8, 896.0, 0.1, 2.0), (0.0, 448.0, 448.0, 1.0, 1.0)],
)
def test_kv_cache_scales(min_scale: float, k_amax: float, v_amax: float, k_scale: float, v_scale: float) -> None:
    s = kv_cache_scales(k_amax, v_amax, min_scale=min_scale)
    assert s.k_scale.item() == pytest.approx(k_scale) and s.v_scale.item() == pytest.approx(v_scale)
    assert s.combined.item() == pytest.approx(max(k_scale, v_scale))
    kv = torch.randn(2, 4, 8, 16, dtype=torch.bfloat16) * 10
    back = dequantize_kv(quantize_kv(kv, s.combined), s.combined, torch.bfloat16)
    assert torch.allclose(back.float(), kv.float(), rtol=2.0**-4 + 2.0**-8, atol=2.0**-6 * s.combined.item())


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: quantize_fp8_weight(torch.randn(16)), "at least 2 dims"),
        (lambda: quantize_fp8_weight(torch.ones(2, 2, dtype=torch.float64)), "dtype"),
        (lambda: quantize_fp8_weight(torch.tensor([[1.0, float("inf")]])), "inf or NaN"),
        (lambda: FP8Weight(torch.zeros(2, 3).to(FP8_DTYPE), torch.ones(3)), "per-channel"),
        (lambda: FP8Weight(torch.zeros(2, 3), torch.ones(1)), "dtype"),
        (lambda: activation_scale(0.0), "> 0"),
        (lambda: activation_scale(torch.ones(2)), "single value"),
        (lambda: fake_quant_fp8(torch.randn(3), torch.tensor([-1.0])), "> 0"),
        (lambda: kv_cache_scales(1.0, float("nan")), "finite"),
    ],
)
def test_bad_inputs_raise_input_error(make, message: str) -> None:
    with pytest.raises(InputError, match=message):
        make()
