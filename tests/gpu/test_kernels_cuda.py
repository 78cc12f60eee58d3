"""Triton kernels on CUDA vs the torch reference at realistic DFlash sizes (skipped without CUDA).

Not executed where this was written (no GPU); see plugins/README.md.
"""
from __future__ import annotations

import os

import pytest
import torch

from dflash_trt.speculative.verify import accept_tokens, accept_tokens_ref
from plugins.kernels import ContextKVWeights, pack_taps, triton_available, write_context_kv
from plugins.kernels.reference import pack_taps_ref, write_context_kv_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not triton_available(), reason="needs triton"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="TRITON_INTERPRET=1 would interpret instead of compiling"),
]
DEV = "cuda"


@pytest.mark.parametrize("batch", [1, 8, 32])
@pytest.mark.parametrize("k", [0, 15])
def test_accept_cuda(batch, k):
    g = torch.Generator(device=DEV).manual_seed(batch + k)
    target = torch.randint(0, 3, (batch, k + 1), device=DEV, generator=g)
    draft = target[:, :k].clone()
    if k:
        flip = torch.rand(batch, k, device=DEV, generator=g) < 0.15
        draft[flip] += 1
    dlens = torch.randint(0, k + 1, (batch,), device=DEV, generator=g)
    start = torch.randint(0, 4096, (batch,), device=DEV, generator=g)
    tri = accept_tokens(draft, target, dlens, start)  # CUDA tensors -> Triton
    ref = accept_tokens_ref(draft, target, dlens, start)
    for field in ("accepted", "bonus", "new_pos"):
        assert torch.equal(getattr(tri, field), getattr(ref, field)), field


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_pack_taps_cuda(batch, dtype):
    taps = torch.randn(5, batch, 16, 2880, device=DEV, dtype=dtype)
    accepted = torch.randint(0, 16, (batch,), device=DEV)
    accepted[0] = 0
    tri = pack_taps(taps, accepted)
    ref = pack_taps_ref(taps, accepted)
    assert torch.equal(tri.packed, ref.packed)
    assert torch.equal(tri.counts, ref.counts)


def _weights(layers: int, dtype: torch.dtype, hidden: int = 512, kv_heads: int = 8,
             head_dim: int = 64, n_taps: int = 5) -> ContextKVWeights:
    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=DEV) * shape[-1] ** -0.5).to(dtype)

    return ContextKVWeights(
        fc_weight=rnd(hidden, n_taps * hidden),
        hidden_norm_weight=torch.rand(hidden, device=DEV, dtype=dtype) + 0.5,
        k_proj_weight=rnd(layers, kv_heads * head_dim, hidden),
        v_proj_weight=rnd(layers, kv_heads * head_dim, hidden),
        k_norm_weight=torch.rand(layers, head_dim, device=DEV, dtype=dtype) + 0.5,
        num_kv_heads=kv_heads, head_dim=head_dim, eps=1e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("layers", [1, 8])
def test_context_kv_cuda(layers, dtype, tol):
    w = _weights(layers, dtype)
    seqs, max_len, n = 8, 1024, 8 * 16
    rows = torch.arange(seqs, device=DEV).repeat_interleave(16)
    pos = torch.arange(16, device=DEV).repeat(seqs) + 900
    feats = torch.randn(n, 5 * w.hidden, device=DEV, dtype=dtype)
    inv_freq = 1.0 / 150000 ** (torch.arange(0, 64, 2, device=DEV, dtype=torch.float32) / 64)
    shape = (layers, seqs, w.num_kv_heads, max_len, w.head_dim)
    kc = torch.zeros(shape, device=DEV, dtype=dtype)
    vc = torch.zeros_like(kc)
    kr, vr = kc.clone(), vc.clone()
    write_context_kv(feats, rows, pos, w, inv_freq, kc, vc, attention_scaling=1.2)
    write_context_kv_ref(feats, rows, pos, w, inv_freq, kr, vr, attention_scaling=1.2)
    torch.testing.assert_close(kc.float(), kr.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(vc.float(), vr.float(), atol=tol, rtol=tol)
