"""Growing a trained drafter by decoder layers without changing what it computes.

A run that continues from a drafter (`--drafter-init`) can add capacity with `--grow-layers N`:
N decoder layers are appended after the existing ones, each a copy of the last trained layer
whose attention output projection (`o_proj`) and MLP down projection (`down_proj`) are zero.
A pre-norm residual layer whose two residual branches end in a zero matrix is the identity
(x + 0 + 0), so the grown drafter drafts exactly what the trained one drafted -- its starting
tau is the trained drafter's -- and training then moves the new layers away from the identity
(function-preserving growth in the sense of Net2Net, Chen et al., arXiv 1511.05641; the zero
output projection is the same device as the "zero-init residual branch" of Goyal et al.,
arXiv 1706.02677). Copying the last layer's other weights (rather than random numbers) gives the
new layer's first gradients meaningful queries, keys and MLP features: with `o_proj = 0` the
gradient reaches q/k/v only after the first optimizer step has made `o_proj` nonzero.

The grown checkpoint is an ordinary DFlash drafter with `num_hidden_layers` larger by N (and
`layer_types`, when the config lists them, extended with the last layer's type).
"""
from __future__ import annotations

import torch

from dflash_trt.config import DrafterConfig
from dflash_trt.errors import ConfigError
from dflash_trt.models.drafter import DFlashDrafter

MAX_GROW = 8


def grown_config(cfg: DrafterConfig, extra: int) -> DrafterConfig:
    """`cfg` with `extra` more decoder layers (validated like any config read from disk)."""
    if not 1 <= extra <= MAX_GROW:
        raise ConfigError(f"grow_layers must be in [1, {MAX_GROW}], got {extra}")
    raw = cfg.to_dict()
    raw["num_hidden_layers"] = cfg.num_hidden_layers + extra
    if "layer_types" in raw and raw["layer_types"] is not None:
        raw["layer_types"] = list(raw["layer_types"]) + [raw["layer_types"][-1]] * extra
    return DrafterConfig.from_dict(raw, where=f"drafter config grown by {extra} layer(s)")


@torch.no_grad()
def grow_drafter(drafter: DFlashDrafter, extra: int) -> DFlashDrafter:
    """A new drafter: `drafter`'s weights plus `extra` identity layers (see the module docstring).
    The draft vocabulary, dtype and device carry over; `drafter` itself is left unchanged."""
    cfg = grown_config(drafter.cfg, extra)
    p = drafter.fc.weight
    grown = DFlashDrafter(cfg).to(device=p.device, dtype=p.dtype)
    old = drafter.state_dict()
    new = grown.state_dict()
    last = drafter.cfg.num_hidden_layers - 1
    for name in new:
        if name in old:
            new[name].copy_(old[name])
            continue
        if not name.startswith("layers."):
            raise ConfigError(f"grown drafter has a tensor the trained one lacks outside the layers: {name}")
        _, idx, rest = name.split(".", 2)
        source = f"layers.{last}.{rest}"
        if int(idx) <= last or source not in old:
            raise ConfigError(f"cannot grow: no source for {name}")
        if rest in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            new[name].zero_()
        else:
            new[name].copy_(old[source])
    grown.load_state_dict(new)
    grown.set_draft_vocab(drafter.draft_vocab)
    grown.train(drafter.training)
    return grown
