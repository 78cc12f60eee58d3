"""Draft context K/V: reference vs a per-layer loop; Triton (interpreted) vs reference."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_cases import i64, inv_freq, make_weights, needs_interpreter

from dflash_trt.errors import InputError
from plugins.kernels import write_context_kv
from plugins.kernels.reference import rms_norm, rotate_half, write_context_kv_ref

SENTINEL = 7.0  # cache cells that must stay untouched


def _setup(hidden=16, n_taps=2, layers=2, kv_heads=2, head_dim=8, seqs=3, max_len=12,
           dtype=torch.float32, cache_dtype=None):
    w = make_weights(hidden, n_taps, layers, kv_heads, head_dim, dtype)
    rows, pos = i64([0, 0, 0, 2, 2, 1]), i64([0, 1, 2, 7, 8, 11])
    feats = torch.randn(len(rows), n_taps * hidden, generator=torch.Generator().manual_seed(1))
    shape = (layers, seqs, kv_heads, max_len, head_dim)
    k_cache = torch.full(shape, SENTINEL, dtype=cache_dtype or dtype)
    return feats.to(dtype), rows, pos, w, inv_freq(head_dim), k_cache, k_cache.clone()


def test_reference_matches_per_layer_loop():
    feats, rows, pos, w, freq, kc, vc = _setup(layers=3)
    write_context_kv_ref(feats, rows, pos, w, freq, kc, vc, attention_scaling=1.25)
    ctx = rms_norm(feats @ w.fc_weight.T, w.hidden_norm_weight, w.eps)
    for layer in range(w.n_layers):
        k = (ctx @ w.k_proj_weight[layer].T).view(-1, w.num_kv_heads, w.head_dim)
        v = (ctx @ w.v_proj_weight[layer].T).view(-1, w.num_kv_heads, w.head_dim)
        k = rms_norm(k, w.k_norm_weight[layer], w.eps)
        for n in range(len(rows)):
            ang = pos[n].float() * freq
            cos = torch.cat([ang.cos(), ang.cos()]) * 1.25
            sin = torch.cat([ang.sin(), ang.sin()]) * 1.25
            want_k = k[n] * cos + rotate_half(k[n]) * sin
            torch.testing.assert_close(kc[layer, rows[n], :, pos[n]], want_k)
            torch.testing.assert_close(vc[layer, rows[n], :, pos[n]], v[n])
    written = torch.zeros(kc.shape[1], kc.shape[3], dtype=torch.bool)
    written[rows, pos] = True
    for cache in (kc, vc):  # [L, S, KVH, Lmax, D] -> [L, S, Lmax, KVH, D] to mask (S, Lmax)
        assert (cache.permute(0, 1, 3, 2, 4)[:, ~written] == SENTINEL).all()


# name, setup kwargs, attention_scaling, atol/rtol
CASES = [
    ("one_layer", dict(layers=1), 1.0, 1e-5),
    ("three_layers_scaled", dict(layers=3), 1.3, 1e-5),
    ("head_dim_12_masked_halves", dict(head_dim=12, kv_heads=1), 1.0, 1e-5),
    ("bf16", dict(dtype=torch.bfloat16), 1.0, 3e-2),
    ("fp32_into_bf16_cache", dict(cache_dtype=torch.bfloat16), 1.0, 1e-2),
]


@needs_interpreter
@pytest.mark.parametrize("name,kwargs,scaling,tol", CASES, ids=[c[0] for c in CASES])
def test_triton_matches_reference(name, kwargs, scaling, tol):
    feats, rows, pos, w, freq, kc_ref, vc_ref = _setup(**kwargs)
    kc, vc = kc_ref.clone(), vc_ref.clone()
    write_context_kv(feats, rows, pos, w, freq, kc_ref, vc_ref, attention_scaling=scaling)
    write_context_kv(feats, rows, pos, w, freq, kc, vc, attention_scaling=scaling,
                     force_triton=True)
    torch.testing.assert_close(kc.float(), kc_ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(vc.float(), vc_ref.float(), atol=tol, rtol=tol)
    assert (kc == SENTINEL).sum() == (kc_ref == SENTINEL).sum()


BAD = [
    ("odd_head_dim", dict(head_dim=7), "head_dim must be even"),
    ("pos_past_cache", dict(pos=i64([0, 1, 2, 7, 8, 12])), "pos must lie"),
    ("row_past_cache", dict(rows=i64([0, 0, 0, 3, 2, 1])), "rows must lie"),
    ("cache_heads", dict(k_cache=torch.zeros(2, 3, 1, 12, 8)), "k_cache and v_cache must match"),
    ("feats_dtype", dict(feats=torch.zeros(6, 32, dtype=torch.int32)), "feats must have dtype"),
    ("inv_freq_len", dict(freq=torch.ones(3)), "inv_freq must be"),
    ("rows_len", dict(rows=i64([0, 1])), "rows must be"),
]


@pytest.mark.parametrize("force_triton", [False, True])
@pytest.mark.parametrize("name,override,message", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_raise(name, override, message, force_triton):
    feats, rows, pos, w, freq, kc, vc = _setup()
    if "head_dim" in override:
        w = dataclasses.replace(w, head_dim=override["head_dim"])
    args = dict(feats=feats, rows=rows, pos=pos, freq=freq, k_cache=kc, v_cache=vc)
    args.update({k: v for k, v in override.items() if k != "head_dim"})
    with pytest.raises(InputError, match=message):
        write_context_kv(args["feats"], args["rows"], args["pos"], w, args["freq"],
                         args["k_cache"], args["v_cache"], force_triton=force_triton)
