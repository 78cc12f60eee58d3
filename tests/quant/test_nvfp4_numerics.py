"""NVFP4 / E2M1 numerics: bit-exact parity with ModelOpt, exact round trips, error bounds, errors."""
from __future__ import annotations

import pytest
import torch

from dflash_trt.errors import InputError
from dflash_trt.quant.e2m1 import E2M1_VALUES, decode_e2m1, encode_e2m1, pack_nibbles, unpack_nibbles
from dflash_trt.quant.fp8 import FP8_DTYPE
from dflash_trt.quant.nvfp4 import (
    BLOCK_SIZE,
    NVFP4Weight,
    dequantize_nvfp4,
    fake_quant_nvfp4,
    global_scale_from_amax,
    quantize_nvfp4,
)

# Magnitudes around every rounding midpoint of the E2M1 grid, plus saturation.
_MIDPOINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
_EDGE_MAGNITUDES = sorted(
    {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 6.5, 100.0, 1e-30}
    | {m for m in _MIDPOINTS}
    | {float(torch.nextafter(torch.tensor(m), torch.tensor(0.0))) for m in _MIDPOINTS}
    | {float(torch.nextafter(torch.tensor(m), torch.tensor(10.0))) for m in _MIDPOINTS}
)
_EDGE_VALUES = torch.tensor(_EDGE_MAGNITUDES + [-m for m in _EDGE_MAGNITUDES], dtype=torch.float32)


def _special_weight(shape: tuple[int, ...], scale: float, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gaussian weight with a zero block, a tiny block, and a block whose values all sit at its max."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * scale
    rows = w.reshape(-1, shape[-1])  # row 0 stays Gaussian, so the tensor is never all zero
    if rows.shape[0] > 1:
        rows[1, :BLOCK_SIZE] = 0.0  # all-zero block -> block scale 1.0
    if rows.shape[0] > 2:
        rows[2, :BLOCK_SIZE] *= 1e-6  # tiny block -> block scale clamped at 2^-9
    if rows.shape[0] > 3:
        rows[3, :BLOCK_SIZE] = scale * torch.tensor([1.0, -1.0] * (BLOCK_SIZE // 2))  # at block maxima
    return rows.reshape(shape).to(dtype)


def _half_step_bound(x: torch.Tensor, q: NVFP4Weight) -> torch.Tensor:
    """Per-element bound: half the E2M1 grid spacing at |x|/step (0.25, 0.5, 1) times the step,
    or the saturation excess (|x|/step - 6) when the FP8 block scale rounded below amax/6."""
    step = (q.block_scale.float() * q.global_scale).repeat_interleave(BLOCK_SIZE, dim=-1)
    scaled = x.float().abs() / step
    half = torch.where(scaled < 2, 0.25, torch.where(scaled < 4, 0.5, 1.0))
    return torch.maximum(half, scaled - 6.0) * step


@pytest.mark.parametrize(
    ("codes", "expected_byte"),
    [([1, 2], 0x21), ([0, 15], 0xF0), ([7, 8], 0x87), ([15, 0], 0x0F)],
)
def test_pack_puts_even_element_in_low_nibble(codes: list[int], expected_byte: int) -> None:
    packed = pack_nibbles(torch.tensor(codes, dtype=torch.uint8))
    assert packed.tolist() == [expected_byte]
    assert unpack_nibbles(packed).tolist() == codes


@pytest.mark.parametrize(
    ("value", "code"),
    [
        (0.25, 0), (0.26, 1), (0.75, 2), (1.25, 2), (1.3, 3), (1.75, 4), (2.5, 4),
        (2.6, 5), (3.5, 6), (5.0, 6), (5.1, 7), (6.0, 7), (1e9, 7),
        (-0.1, 8), (-0.0, 0), (-0.75, 10), (-6.0, 15), (-7.0, 15),
    ],
)
def test_e2m1_rounds_to_nearest_even_and_saturates(value: float, code: int) -> None:
    assert encode_e2m1(torch.tensor([value])).tolist() == [code]


def test_e2m1_codes_roundtrip_exactly() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(decode_e2m1(codes), E2M1_VALUES)
    nonneg_zero = torch.where(codes == 8, torch.zeros_like(codes), codes)  # -0.0 encodes as +0
    assert torch.equal(encode_e2m1(decode_e2m1(codes)), nonneg_zero)


def test_e2m1_matches_modelopt_rounding_at_midpoints() -> None:
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")
    expected = qtensor.NVFP4QTensor._cast_fp4(_EDGE_VALUES.clone())
    assert torch.equal(encode_e2m1(_EDGE_VALUES), expected)


# fp16 skips 1e-20: it underflows to an all-zero tensor, where ModelOpt stores NaN scales by design.
_PARITY_CASES = [
    (dtype, scale)
    for dtype in (torch.float32, torch.bfloat16, torch.float16)
    for scale in (1.0, 1e-3, 1e4, 1e-20)
    if not (dtype == torch.float16 and scale == 1e-20)
]


@pytest.mark.parametrize("shape", [(2, 16), (8, 64), (48, 272), (2, 4, 32)])
@pytest.mark.parametrize(("dtype", "scale"), _PARITY_CASES)
def test_quantize_matches_modelopt_bit_exactly(shape: tuple[int, ...], dtype: torch.dtype, scale: float) -> None:
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")
    w = _special_weight(shape, scale, dtype, seed=sum(shape))
    ref, ref_block_scale, ref_global = qtensor.NVFP4QTensor.quantize(w.clone(), BLOCK_SIZE)
    ours = quantize_nvfp4(w)
    assert torch.equal(ours.packed, ref._quantized_data)
    assert torch.equal(ours.block_scale.view(torch.uint8), ref_block_scale.view(torch.uint8))
    assert torch.equal(ours.global_scale, ref_global.reshape(1))
    ref_deq = ref.dequantize(dtype=dtype, scale=ref_block_scale, double_scale=ref_global, block_sizes={-1: 16})
    assert torch.equal(dequantize_nvfp4(ours, dtype), ref_deq)


@pytest.mark.parametrize("global_amax", [0.5, 3.0, 1e-3])  # 1e-3 << amax: block scales saturate at 448
def test_quantize_with_given_global_scale_matches_modelopt(global_amax: float) -> None:
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")
    w = _special_weight((16, 128), 1.0, torch.bfloat16, seed=7)
    global_scale = global_scale_from_amax(global_amax)
    ref, ref_block_scale, _ = qtensor.NVFP4QTensor.quantize(
        w.clone(), BLOCK_SIZE, weights_scaling_factor_2=global_scale.reshape(())
    )
    ours = quantize_nvfp4(w, global_scale)
    assert torch.equal(ours.packed, ref._quantized_data)
    assert torch.equal(ours.block_scale.view(torch.uint8), ref_block_scale.view(torch.uint8))


def _representable(out: int, inp: int, global_scale: float, seed: int) -> NVFP4Weight:
    """Random codes and FP8 block scales, every block holding a +-6 and block (0, 0) at scale 448,
    so that quantizing the dequantized tensor must reproduce it exactly."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, inp), generator=gen, dtype=torch.uint8)
    codes[:, ::BLOCK_SIZE] = torch.where(torch.rand(out, inp // BLOCK_SIZE, generator=gen) < 0.5, 7, 15).to(
        torch.uint8
    )
    exponents = torch.randint(-6, 8, (out, inp // BLOCK_SIZE), generator=gen)
    mantissas = torch.randint(8, 16, (out, inp // BLOCK_SIZE), generator=gen) / 8.0
    block_scale = (mantissas * torch.pow(2.0, exponents.float())).to(FP8_DTYPE)
    block_scale[0, 0] = 448.0
    return NVFP4Weight(pack_nibbles(codes), block_scale, torch.tensor([global_scale]))


@pytest.mark.parametrize("global_scale", [1.0, 2.0**-12, 2.0**10])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pass_global_scale", [True, False])
def test_representable_values_roundtrip_exactly(
    global_scale: float, dtype: torch.dtype, pass_global_scale: bool
) -> None:
    q = _representable(24, 96, global_scale, seed=3)
    x = dequantize_nvfp4(q, dtype)
    again = quantize_nvfp4(x, q.global_scale if pass_global_scale else None)
    assert torch.equal(again.global_scale, q.global_scale)
    assert torch.equal(again.block_scale.view(torch.uint8), q.block_scale.view(torch.uint8))
    assert torch.equal(dequantize_nvfp4(again, dtype), x)


@pytest.mark.parametrize("scale", [1.0, 1e-4, 1e4])
@pytest.mark.parametrize("heavy_tail", [False, True])
def test_dequantized_error_within_half_a_grid_step(scale: float, heavy_tail: bool) -> None:
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(64, 256, generator=gen) * scale
    if heavy_tail:
        x = x * torch.exp(3 * torch.randn(64, 256, generator=gen))  # blocks far below the tensor max
    q = quantize_nvfp4(x)
    err = (dequantize_nvfp4(q) - x).abs()
    assert bool((err <= _half_step_bound(x, q) * (1 + 1e-6)).all())


def test_all_zero_tensor_gets_unit_scales_and_zero_output() -> None:
    q = quantize_nvfp4(torch.zeros(4, 32))
    assert q.global_scale.tolist() == [1.0]
    assert torch.equal(q.block_scale.float(), torch.ones(4, 2))
    assert torch.equal(dequantize_nvfp4(q), torch.zeros(4, 32))


def test_layout_and_dtypes() -> None:
    q = quantize_nvfp4(torch.randn(6, 48, dtype=torch.bfloat16))
    assert (q.packed.shape, q.packed.dtype) == (torch.Size([6, 24]), torch.uint8)
    assert (q.block_scale.shape, q.block_scale.dtype) == (torch.Size([6, 3]), torch.float8_e4m3fn)
    assert (q.global_scale.shape, q.global_scale.dtype) == (torch.Size([1]), torch.float32)
    assert q.shape == torch.Size([6, 48])
    assert dequantize_nvfp4(q, torch.bfloat16).dtype == torch.bfloat16


def test_fake_quant_keeps_dtype_and_matches_quantize_dequantize() -> None:
    x = torch.randn(3, 5, 32, dtype=torch.bfloat16)
    scale = global_scale_from_amax(float(x.float().abs().max()))
    expected = dequantize_nvfp4(quantize_nvfp4(x, scale), torch.bfloat16)
    assert torch.equal(fake_quant_nvfp4(x, scale), expected)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: quantize_nvfp4(torch.randn(4, 24)), "multiple of 16"),
        (lambda: quantize_nvfp4(torch.randint(0, 3, (4, 32))), "dtype"),
        (lambda: quantize_nvfp4(torch.tensor([[float("nan")] * 16])), "inf or NaN"),
        (lambda: quantize_nvfp4(torch.randn(2, 16), torch.tensor([0.0])), "> 0"),
        (lambda: quantize_nvfp4(torch.randn(2, 16), torch.tensor(1.0)), "shape"),
        (
            lambda: NVFP4Weight(torch.zeros(2, 8, dtype=torch.uint8), torch.ones(2, 2).to(FP8_DTYPE), torch.ones(1)),
            "block_scale",
        ),
        (lambda: NVFP4Weight(torch.zeros(2, 8), torch.ones(2, 1).to(FP8_DTYPE), torch.ones(1)), "dtype"),
        (lambda: global_scale_from_amax(0.0), "> 0"),
    ],
)
def test_bad_inputs_raise_input_error(make, message: str) -> None:
    with pytest.raises(InputError, match=message):
        make()
