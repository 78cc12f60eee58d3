"""Warm start: a drafter initialized from the target's own top layers.

A DFlash drafter layer has the shape of a target decoder layer whenever it is built at the
target's width, heads and MLP size (our trainer's default), so its weights can start as a copy
of the target layers that follow the deepest tap instead of random numbers:

- `fc` passes the deepest tap through unchanged (identity on its slice, zeros elsewhere) and
  `hidden_norm` takes the first copied layer's `input_layernorm` weight, so the fused context
  is exactly what that target layer normalizes its input to: the drafter's first layer computes
  the same context keys and values (before k_norm) as the target's layer does;
- drafter layer i copies target layer `source_layers[i]` (attention projections, MLP, both
  norms; q_norm / k_norm from the target when it has them, ones otherwise);
- the final `norm` copies the target's final norm, so the drafter's output lands where the
  frozen lm_head expects it.

The other taps' slices of `fc` start at zero: training learns how to use them.
"""
from __future__ import annotations

import torch

from dflash_trt.errors import ConfigError


def default_source_layers(num_target_layers: int, deepest_tap: int, num_draft_layers: int) -> list[int]:
    """The layers right after the deepest tap; the target's last layers when too few follow it."""
    if num_draft_layers > num_target_layers:
        raise ConfigError(f"cannot copy {num_draft_layers} layers from a {num_target_layers}-layer target")
    first = min(deepest_tap + 1, num_target_layers - num_draft_layers)
    return list(range(first, first + num_draft_layers))


@torch.no_grad()
def warm_start_from_target(drafter, target, source_layers: list[int] | None = None) -> list[int]:
    """Copy target layers into `drafter` in place (see the module docstring); returns the layers used."""
    cfg = drafter.cfg
    target_layer_ids = list(cfg.target_layer_ids)
    t_layers = target.model.layers
    if source_layers is None:
        source_layers = default_source_layers(len(t_layers), max(target_layer_ids), len(drafter.layers))
    if len(source_layers) != len(drafter.layers) or not all(0 <= s < len(t_layers) for s in source_layers):
        raise ConfigError(f"source layers {source_layers} do not fit {len(drafter.layers)} draft layers "
                          f"of a {len(t_layers)}-layer target")
    for i, src in enumerate(source_layers):
        d, t = drafter.layers[i], t_layers[src]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            _copy(getattr(d.self_attn, name).weight, getattr(t.self_attn, name).weight, f"layers.{i}.{name}")
        for name in ("q_norm", "k_norm"):
            src_norm = getattr(t.self_attn, name, None)
            getattr(d.self_attn, name).weight.copy_(src_norm.weight if src_norm is not None else 1.0)
        if not hasattr(t.mlp, "gate_proj"):
            raise ConfigError("warm start needs a dense-MLP target (gate/up/down projections)")
        for name in ("gate_proj", "up_proj", "down_proj"):
            _copy(getattr(d.mlp, name).weight, getattr(t.mlp, name).weight, f"layers.{i}.mlp.{name}")
        _copy(d.input_layernorm.weight, t.input_layernorm.weight, f"layers.{i}.input_layernorm")
        _copy(d.post_attention_layernorm.weight, t.post_attention_layernorm.weight,
              f"layers.{i}.post_attention_layernorm")
    _copy(drafter.norm.weight, target.model.norm.weight, "norm")
    hidden = cfg.hidden_size
    deepest = target_layer_ids.index(max(target_layer_ids))
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, deepest * hidden:(deepest + 1) * hidden] = torch.eye(hidden)
    _copy(drafter.hidden_norm.weight, t_layers[source_layers[0]].input_layernorm.weight, "hidden_norm")
    return list(source_layers)


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ConfigError(f"warm start: drafter {name} has shape {tuple(dst.shape)}, the target's "
                          f"{tuple(src.shape)}: build the drafter at the target's width, heads and MLP size")
    dst.copy_(src.to(dst.dtype))
