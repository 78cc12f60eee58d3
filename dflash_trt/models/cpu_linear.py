"""Prepacked oneDNN linears for inference on CPU (`--cpu-kernels`, the torch backend's float32 path).

Why: on CPU a DFlash step costs one K-token target verify, and with ATen's float32 `F.linear` (MKL sgemm
on the weight as stored) a GEMM over a few rows costs far more than the 1-row one: on a 2-core AVX2 EPYC
(this repository's kind of machine) the 30 layers' linears of SmolLM2-135M took 32 ms for 1 row and
59 ms for 8 rows, so a block-8 verify cost 1.7 one-token steps and ate most of what the drafts saved.
oneDNN reorders each weight once into its own blocked layout (`torch.ops.mkldnn._reorder_linear_weight`;
torch's inductor packs frozen CPU linears with the same ops, torch/_inductor/fx_passes/mkldnn_fusion.py) and
runs `torch.ops.mkldnn._linear_pointwise` on it: 26 ms for 1 row and 31 ms for 8 rows on the same machine. `dflash-trt bench --step-costs` measures
the model-level ratios on the machine at hand.

What `prepack` does to a module tree: every `nn.Linear` of exactly that class (tensor-parallel subclasses
and quantization emulation keep their own forward) whose weight is float32 on CPU gets an instance
`forward` that runs the packed weight. The module keeps its class, parameters and
state dict; only inference uses the packed copy:
- under autograd (`torch.is_grad_enabled()`), for an input that is not float32 on CPU, it runs `F.linear`
  on the weight as before (training and gradients never see the packed copy);
- the packed copy is rebuilt when the weight changes in place (its version counter moved: an optimizer
  step, `load_state_dict`) or is replaced by another tensor, so it is never stale.
Cost: one packed copy of every packed weight (about the model's float32 weight bytes again); `auto` packs
only while that stays under a quarter of the machine's memory.
Numerics: oneDNN sums in another order than MKL (differences ~1e-6 of the outputs' scale); the target's
greedy argmax is the reference for both autoregressive and DFlash decoding on the same engine, which
run the same packed weights (tests/models/test_cpu_linear.py checks outputs, token equality and fallbacks).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.errors import ConfigError

log = logging.getLogger(__name__)

CPU_KERNELS = ("auto", "onednn", "torch")
PACK_ROWS_HINT = 8  # the batch-size hint oneDNN picks its weight layout for (a block-8 verify)
_MEMORY_SHARE = 0.25  # `auto` packs only while the packed copies stay under this share of physical memory


def onednn_available() -> bool:
    """Whether this torch build has the oneDNN prepacked linear ops (CPU builds with MKLDNN do)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def check_kind(kind: str) -> None:
    if kind not in CPU_KERNELS:
        raise ConfigError(f"cpu kernels must be one of {CPU_KERNELS}, got '{kind}'")


def packable(module: nn.Module) -> list[nn.Linear]:
    """The linears `prepack` would pack: exactly nn.Linear, float32 weight on CPU."""
    return [m for m in module.modules()
            if type(m) is nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]


def _physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def should_pack(kind: str, modules: list[nn.Module]) -> bool:
    """`torch`: never. `onednn`: always (a clear error when this torch has no oneDNN or nothing is float32
    on CPU). `auto`: when oneDNN is here, something is packable, and the packed copies fit the budget."""
    check_kind(kind)
    if kind == "torch":
        return False
    linears = [lin for m in modules for lin in packable(m)]
    if kind == "onednn":
        if not onednn_available():
            raise ConfigError("--cpu-kernels onednn: this torch build has no oneDNN (MKLDNN) linear ops; "
                              "use --cpu-kernels torch")
        if not linears:
            raise ConfigError("--cpu-kernels onednn packs float32 weights on CPU, and these models have none "
                              "(another dtype or device): use --cpu-kernels torch or auto")
        return True
    if not linears or not onednn_available():
        return False
    extra = sum(lin.weight.numel() * lin.weight.element_size() for lin in linears)
    memory = _physical_memory_bytes()
    return memory is None or extra <= _MEMORY_SHARE * memory


@dataclass
class _Packed:
    source: torch.Tensor  # the weight tensor that was packed (a replaced weight is another object)
    version: int  # its version counter then (in-place changes move it)
    weight: torch.Tensor  # the oneDNN-layout copy


_ATTR = "_onednn_packed"


def _pack(module: nn.Linear) -> _Packed:
    weight = module.weight
    packed = _Packed(weight, weight._version, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT))
    object.__setattr__(module, _ATTR, packed)  # in __dict__, not as a parameter or buffer: no state-dict entry
    return packed


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    if (torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu"
            or weight.dtype != torch.float32 or weight.device.type != "cpu"):
        return F.linear(x, weight, self.bias)
    packed = vars(self)[_ATTR]
    if packed.source is not weight or packed.version != weight._version:
        packed = _pack(self)  # the weight was replaced or changed in place since it was packed
    bias = self.bias.detach() if self.bias is not None else None
    return torch.ops.mkldnn._linear_pointwise(x, packed.weight, bias, "none", [], "")


def prepack(module: nn.Module) -> int:
    """Pack every `packable` linear under `module` (see the module docstring); returns how many."""
    linears = packable(module)
    for lin in linears:
        _pack(lin)
        lin.forward = MethodType(_packed_forward, lin)
    return len(linears)


def prepack_if(kind: str, *modules: object) -> int:
    """`prepack` every module among `modules` when `should_pack(kind, ...)` says so; returns how many
    linears were packed (0 when none). The loaders' one entry point (runtime/factory.py, the demo's tiny models)."""
    mods = [m for m in modules if isinstance(m, nn.Module)]
    if not should_pack(kind, mods):
        return 0
    count = sum(prepack(m) for m in mods)
    log.info("float32 linears on CPU: %d packed for oneDNN (cpu kernels: %s)", count, kind)
    return count


def is_packed(module: nn.Module) -> bool:
    return _ATTR in vars(module)


def any_packed(module: object) -> bool:
    """Whether `prepack` packed anything under `module` (False for objects that are not modules)."""
    return isinstance(module, nn.Module) and any(is_packed(m) for m in module.modules())


def unpack(module: nn.Module) -> int:
    """Undo `prepack` (the plain F.linear forward again, packed copies freed); returns how many."""
    count = 0
    for m in module.modules():
        if is_packed(m):
            for name in ("forward", _ATTR):
                vars(m).pop(name, None)
            count += 1
    return count

