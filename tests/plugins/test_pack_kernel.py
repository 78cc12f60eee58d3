"""Tap gather/pack: reference semantics, Triton (interpreted) vs reference, bad inputs."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import i64, needs_interpreter

from dflash_trt.errors import InputError
from plugins.kernels import pack_taps
from plugins.kernels.reference import pack_taps_ref

# name, (n_taps, batch, T, hidden), accepted [batch]
CASES = [
    ("ragged", (3, 3, 5, 10), [0, 3, 1]),
    ("zero_accepted", (2, 2, 4, 8), [0, 0]),
    ("all_accepted", (2, 2, 4, 8), [3, 3]),
    ("single_row", (5, 1, 16, 12), [6]),
    ("single_slot", (1, 2, 1, 7), [0, 0]),  # K = 0: only slot 0 per row
    ("wide_hidden", (1, 1, 2, 1100), [0]),  # several feature blocks per tap
]


def _taps(shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(sum(shape))
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("name,shape,accepted", CASES, ids=[c[0] for c in CASES])
def test_reference_layout(name, shape, accepted):
    taps, acc = _taps(shape), i64(accepted)
    n_taps, batch, slots, hidden = shape
    out = pack_taps_ref(taps, acc)
    assert out.packed.shape == (batch, slots, n_taps * hidden)
    assert torch.equal(out.counts, acc + 1)
    for b in range(batch):
        for t in range(slots):
            row = out.packed[b, t]
            if t <= accepted[b]:
                want = torch.cat([taps[i, b, t] for i in range(n_taps)])
                assert torch.equal(row, want)
            else:
                assert not row.any()


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,shape,accepted", CASES, ids=[c[0] for c in CASES])
def test_triton_matches_reference(name, shape, accepted, dtype):
    taps, acc = _taps(shape, dtype), i64(accepted)
    taps[:, :, -1] = float("nan")  # slots past the accepted prefix must come out as zeros
    if accepted and max(accepted) == shape[2] - 1:
        taps = taps.nan_to_num()
    ref = pack_taps(taps, acc)
    tri = pack_taps(taps, acc, force_triton=True)
    assert tri.packed.dtype == dtype
    assert torch.equal(tri.packed, ref.packed)  # a pure copy: bit-exact
    assert torch.equal(tri.counts, ref.counts)


BAD = [
    ("accepted_past_T", lambda taps, acc: (taps, acc + 10), "accepted must lie"),
    ("accepted_negative", lambda taps, acc: (taps, acc - 2), "accepted must lie"),
    ("taps_3d", lambda taps, acc: (taps[0], acc), "taps must have 4 dims"),
    ("taps_int", lambda taps, acc: (taps.long(), acc), "taps must have dtype"),
    ("accepted_batch", lambda taps, acc: (taps, acc[:1]), "accepted must be"),
    ("accepted_int32", lambda taps, acc: (taps, acc.int()), "accepted must have dtype"),
]


@pytest.mark.parametrize("force_triton", [False, True])
@pytest.mark.parametrize("name,mutate,message", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_raise(name, mutate, message, force_triton):
    taps, acc = _taps((2, 2, 3, 4)), i64([1, 2])
    with pytest.raises(InputError, match=message):
        pack_taps(*mutate(taps, acc), force_triton=force_triton)
