"""Result types and boundary checks shared by the torch references and the Triton kernels.

Every public kernel entry point validates its inputs here (shape, dtype, device) and raises
`dflash_trt.errors.InputError` with a message that says what to pass instead. Value-range
checks (draft_lens within 0..K, positions inside the cache) run only on host tensors: on CUDA
they would force a device synchronisation on the decode hot path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_trt.errors import InputError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # float64: CPU oracle runs


@dataclass(frozen=True)
class AcceptResult:
    """Outcome of verifying one block per row."""

    accepted: torch.Tensor  # [batch] int64: drafts accepted (tau - 1), 0..draft_lens[b]
    bonus: torch.Tensor  # [batch] int64: target token at slot accepted[b] (the bonus token)
    new_pos: torch.Tensor  # [batch] int64: start_pos + accepted + 1 (next block's slot 0)


@dataclass(frozen=True)
class PackedTaps:
    """Hidden states of the committed positions of each row, packed for the drafter."""

    packed: torch.Tensor  # [batch, T, n_taps * hidden]: tap-major features, zero past counts[b]
    counts: torch.Tensor  # [batch] int64: valid slots per row = accepted + 1


@dataclass(frozen=True)
class ContextKVWeights:
    """Drafter weights needed to turn target features into every draft layer's context K/V."""

    fc_weight: torch.Tensor  # [hidden, n_taps * hidden]: fc (no bias)
    hidden_norm_weight: torch.Tensor  # [hidden]: RMSNorm after fc
    k_proj_weight: torch.Tensor  # [n_layers, kv_heads * head_dim, hidden]: stacked k_proj
    v_proj_weight: torch.Tensor  # [n_layers, kv_heads * head_dim, hidden]: stacked v_proj
    k_norm_weight: torch.Tensor  # [n_layers, head_dim]: stacked k_norm (RMSNorm over head_dim)
    num_kv_heads: int
    head_dim: int
    eps: float

    @property
    def n_layers(self) -> int:
        return int(self.k_proj_weight.shape[0])

    @property
    def hidden(self) -> int:
        return int(self.fc_weight.shape[0])


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise InputError(message)


def _check_tensor(name: str, t: object, ndim: int,
                  dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    _require(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    assert isinstance(t, torch.Tensor)
    _require(t.dim() == ndim, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    names = ", ".join(str(d) for d in dtypes)
    _require(t.dtype in dtypes, f"{name} must have dtype in ({names}), got {t.dtype}")
    return t


def _same_device(**tensors: torch.Tensor) -> None:
    devices = {str(t.device) for t in tensors.values()}
    _require(len(devices) == 1,
             f"{', '.join(tensors)} must be on one device, got {sorted(devices)}")


def check_accept_inputs(
    draft_tokens: torch.Tensor,  # [batch, K] int64
    target_tokens: torch.Tensor,  # [batch, K + 1] int64
    draft_lens: torch.Tensor,  # [batch] int64
    start_pos: torch.Tensor,  # [batch] int64
) -> tuple[int, int]:
    """Validate acceptance inputs; return (batch, K)."""
    i64 = (torch.int64,)
    _check_tensor("draft_tokens", draft_tokens, 2, i64)
    _check_tensor("target_tokens", target_tokens, 2, i64)
    _check_tensor("draft_lens", draft_lens, 1, i64)
    _check_tensor("start_pos", start_pos, 1, i64)
    batch, k = draft_tokens.shape
    _require(batch >= 1, "batch must be at least 1 row")
    _require(
        tuple(target_tokens.shape) == (batch, k + 1),
        f"target_tokens must be [batch, K + 1] = [{batch}, {k + 1}], got {tuple(target_tokens.shape)}",
    )
    for name, t in (("draft_lens", draft_lens), ("start_pos", start_pos)):
        _require(t.shape[0] == batch, f"{name} must be [batch] = [{batch}], got {tuple(t.shape)}")
    _same_device(draft_tokens=draft_tokens, target_tokens=target_tokens, draft_lens=draft_lens,
                 start_pos=start_pos)
    if draft_lens.device.type == "cpu":
        _require(bool(((draft_lens >= 0) & (draft_lens <= k)).all()),
                 f"draft_lens must lie in 0..K={k}, got {draft_lens.tolist()}")
    return int(batch), int(k)


def check_pack_inputs(
    taps: torch.Tensor,  # [n_taps, batch, T, hidden] float
    accepted: torch.Tensor,  # [batch] int64
) -> tuple[int, int, int, int]:
    """Validate tap-pack inputs; return (n_taps, batch, T, hidden)."""
    _check_tensor("taps", taps, 4, FLOAT_DTYPES)
    _check_tensor("accepted", accepted, 1, (torch.int64,))
    n_taps, batch, t, hidden = taps.shape
    _require(n_taps >= 1 and batch >= 1 and t >= 1 and hidden >= 1,
             f"taps must have non-empty dims [n_taps, batch, T, hidden], got {tuple(taps.shape)}")
    _require(accepted.shape[0] == batch,
             f"accepted must be [batch] = [{batch}], got {tuple(accepted.shape)}")
    _same_device(taps=taps, accepted=accepted)
    if accepted.device.type == "cpu":
        _require(bool(((accepted >= 0) & (accepted < t)).all()),
                 f"accepted must lie in 0..T-1={t - 1} (accepted + 1 slots are kept), "
                 f"got {accepted.tolist()}")
    return int(n_taps), int(batch), int(t), int(hidden)


def check_context_kv_inputs(
    feats: torch.Tensor,  # [N, n_taps * hidden] float
    rows: torch.Tensor,  # [N] int64
    pos: torch.Tensor,  # [N] int64
    weights: ContextKVWeights,
    inv_freq: torch.Tensor,  # [head_dim / 2] float32
    k_cache: torch.Tensor,  # [n_layers, S, kv_heads, Lmax, head_dim] float
    v_cache: torch.Tensor,  # [n_layers, S, kv_heads, Lmax, head_dim] float
) -> None:
    """Validate the context K/V precompute inputs against the drafter weights and caches."""
    _check_tensor("feats", feats, 2, FLOAT_DTYPES)
    _check_tensor("rows", rows, 1, (torch.int64,))
    _check_tensor("pos", pos, 1, (torch.int64,))
    _check_tensor("inv_freq", inv_freq, 1, (torch.float32,))
    _check_tensor("k_cache", k_cache, 5, FLOAT_DTYPES)
    _check_tensor("v_cache", v_cache, 5, FLOAT_DTYPES)
    w = weights
    _check_tensor("fc_weight", w.fc_weight, 2, (feats.dtype,))
    _check_tensor("hidden_norm_weight", w.hidden_norm_weight, 1, FLOAT_DTYPES)
    _check_tensor("k_proj_weight", w.k_proj_weight, 3, (feats.dtype,))
    _check_tensor("v_proj_weight", w.v_proj_weight, 3, (feats.dtype,))
    _check_tensor("k_norm_weight", w.k_norm_weight, 2, FLOAT_DTYPES)
    n, d, kvh, layers, hidden = feats.shape[0], w.head_dim, w.num_kv_heads, w.n_layers, w.hidden
    _require(n >= 1, "feats must hold at least one position")
    _require(d >= 2 and d % 2 == 0, f"head_dim must be even (rotate-half RoPE), got {d}")
    _require(tuple(w.fc_weight.shape) == (hidden, feats.shape[1]),
             f"fc_weight must be [hidden, n_taps*hidden] = [{hidden}, {feats.shape[1]}], "
             f"got {tuple(w.fc_weight.shape)}")
    _require(tuple(w.hidden_norm_weight.shape) == (hidden,),
             f"hidden_norm_weight must be [{hidden}], got {tuple(w.hidden_norm_weight.shape)}")
    for name, t in (("k_proj_weight", w.k_proj_weight), ("v_proj_weight", w.v_proj_weight)):
        _require(tuple(t.shape) == (layers, kvh * d, hidden),
                 f"{name} must be [n_layers, kv_heads*head_dim, hidden] = "
                 f"[{layers}, {kvh * d}, {hidden}], got {tuple(t.shape)}")
    _require(tuple(w.k_norm_weight.shape) == (layers, d),
             f"k_norm_weight must be [n_layers, head_dim] = [{layers}, {d}], "
             f"got {tuple(w.k_norm_weight.shape)}")
    _require(tuple(inv_freq.shape) == (d // 2,),
             f"inv_freq must be [head_dim/2] = [{d // 2}], got {tuple(inv_freq.shape)}")
    for name, t in (("rows", rows), ("pos", pos)):
        _require(tuple(t.shape) == (n,), f"{name} must be [N] = [{n}], got {tuple(t.shape)}")
    _require(k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype,
             f"k_cache and v_cache must match, got {tuple(k_cache.shape)} {k_cache.dtype} vs "
             f"{tuple(v_cache.shape)} {v_cache.dtype}")
    _require(k_cache.shape[0] == layers and k_cache.shape[2] == kvh and k_cache.shape[4] == d,
             f"caches must be [n_layers={layers}, S, kv_heads={kvh}, Lmax, head_dim={d}], "
             f"got {tuple(k_cache.shape)}")
    _require(k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous")
    _same_device(feats=feats, rows=rows, pos=pos, inv_freq=inv_freq, k_cache=k_cache,
                 v_cache=v_cache, fc_weight=w.fc_weight, k_proj_weight=w.k_proj_weight)
    if rows.device.type == "cpu":
        s, lmax = k_cache.shape[1], k_cache.shape[3]
        _require(bool(((rows >= 0) & (rows < s)).all()), f"rows must lie in 0..S-1={s - 1}")
        _require(bool(((pos >= 0) & (pos < lmax)).all()), f"pos must lie in 0..Lmax-1={lmax - 1}")
