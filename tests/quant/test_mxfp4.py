"""MXFP4 (gpt-oss `*_blocks` / `*_scales`) dequantization against transformers and hand-built data."""
from __future__ import annotations

import pytest
import torch

from dflash_trt.errors import CheckpointError, InputError
from dflash_trt.quant.mxfp4 import dequantize_mxfp4, e8m0_to_float


def _random_mxfp4(
    prefix: tuple[int, ...], groups: int, lo: int, hi: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*prefix, groups, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(lo, hi, (*prefix, groups), generator=gen, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize(("experts", "rows", "groups"), [(1, 4, 1), (3, 10, 2), (2, 6, 5)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("lo", "hi"), [(118, 136), (0, 255)])  # typical range; every non-NaN code
def test_matches_transformers_gpt_oss_conversion(
    experts: int, rows: int, groups: int, dtype: torch.dtype, lo: int, hi: int
) -> None:
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    blocks, scales = _random_mxfp4((experts, rows), groups, lo, hi, seed=experts * 100 + rows)
    reference = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
    ours = dequantize_mxfp4(blocks, scales, dtype)  # [E, out, in]
    assert ours.shape == (experts, rows, groups * 32) and ours.dtype == dtype
    assert torch.equal(ours, reference.transpose(1, 2))


@pytest.mark.parametrize(
    ("byte", "scale", "expected"),
    [
        (0x21, 127, [0.5, 1.0]),  # low nibble is element 0
        (0x21, 128, [1.0, 2.0]),
        (0xF7, 127, [6.0, -6.0]),
        (0x9A, 125, [-0.25, -0.125]),
        (0x10, 0, [0.0, 2.0**-128]),  # scale code 0 = 2^-127 (an fp32 subnormal)
        (0x07, 254, [6.0 * 2.0**127, 0.0]),  # beyond fp32: inf, as torch.ldexp gives
    ],
)
def test_hand_built_group(byte: int, scale: int, expected: list[float]) -> None:
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = byte
    out = dequantize_mxfp4(blocks, torch.tensor([[scale]], dtype=torch.uint8), torch.float32)
    assert out.shape == (1, 32)
    assert out[0, :2].tolist() == [float(torch.tensor(v, dtype=torch.float32)) for v in expected]
    assert torch.equal(out[0, 2:], torch.zeros(30))


def test_e8m0_codes_are_exact_powers_of_two() -> None:
    codes = torch.arange(255, dtype=torch.uint8)
    expected = torch.pow(2.0, codes.double() - 127).float()
    assert torch.equal(e8m0_to_float(codes), expected)


@pytest.mark.parametrize(
    ("blocks", "scales", "error", "message"),
    [
        (torch.zeros(2, 3, 16, dtype=torch.uint8), torch.full((2, 3), 255, dtype=torch.uint8), CheckpointError, "NaN"),
        (torch.zeros(2, 3, 8, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8), InputError, "G, 16"),
        (torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8), InputError, "G, 16"),
        (torch.zeros(2, 3, 16, dtype=torch.int8), torch.zeros(2, 3, dtype=torch.uint8), InputError, "dtype"),
        (torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.float32), InputError, "dtype"),
    ],
)
def test_bad_inputs(blocks: torch.Tensor, scales: torch.Tensor, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        dequantize_mxfp4(blocks, scales)


def test_quantize_round_trips_representable_values_and_bounds_the_error():
    """Values already on the MXFP4 grid come back exactly (blocks, scales and values); random
    weights come back within 2 units of their group's scale (half the widest E2M1 step, or the
    spec's clamp of (6, 8) units to 6)."""
    from dflash_trt.quant.mxfp4 import quantize_mxfp4

    blocks, scales = _random_mxfp4((3, 5), 4, 110, 140, seed=7)
    blocks = blocks & 0x77 | 0x07  # every group holds a +6 (its max), so the exponent is recovered
    exact = dequantize_mxfp4(blocks, scales, torch.float32)
    q_blocks, q_scales = quantize_mxfp4(exact)
    assert torch.equal(q_scales, scales) and torch.equal(dequantize_mxfp4(q_blocks, q_scales, torch.float32), exact)
    w = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(0)) * 0.1
    w[0, 0, :32] = 0.0  # an all-zero group
    b, s = quantize_mxfp4(w.to(torch.bfloat16))
    assert b.shape == (4, 8, 2, 16) and s.shape == (4, 8, 2) and int(s[0, 0, 0]) == 0
    back = dequantize_mxfp4(b, s, torch.float32)
    unit = e8m0_to_float(s).repeat_interleave(32, dim=-1)
    err = (back - w.to(torch.bfloat16).float()).abs()
    assert bool((err <= 2 * unit).all()) and float(err.max()) > 0
    with pytest.raises(InputError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(2, 48))
