"""Shared helpers for the kernel tests (tests/plugins): markers and input builders."""
from __future__ import annotations

import pytest
import torch

from plugins.kernels import ContextKVWeights, triton_available, triton_interpreting

# Interpreter mode is fixed when triton is first imported: if anything imported triton before
# tests/plugins/conftest.py set TRITON_INTERPRET=1, these tests cannot run in this process.
INTERPRETED = triton_available() and triton_interpreting()
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED,
    reason="needs triton imported with TRITON_INTERPRET=1 (tests/plugins/conftest.py sets it "
    "without CUDA; export TRITON_INTERPRET=1 if triton was imported earlier in the session)",
)


def i64(rows: list) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


def make_weights(hidden: int, n_taps: int, layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, seed: int = 0) -> ContextKVWeights:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    return ContextKVWeights(
        fc_weight=rnd(hidden, n_taps * hidden, scale=(n_taps * hidden) ** -0.5),
        hidden_norm_weight=(torch.rand(hidden, generator=g) + 0.5).to(dtype),
        k_proj_weight=rnd(layers, kv_heads * head_dim, hidden, scale=hidden ** -0.5),
        v_proj_weight=rnd(layers, kv_heads * head_dim, hidden, scale=hidden ** -0.5),
        k_norm_weight=(torch.rand(layers, head_dim, generator=g) + 0.5).to(dtype),
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        eps=1e-6,
    )


def inv_freq(head_dim: int, theta: float = 10000.0) -> torch.Tensor:  # [head_dim / 2]
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
