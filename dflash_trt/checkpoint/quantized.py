"""Quantize HF-named float tensors into ModelOpt-named FP8 / NVFP4 tensors, and load quantized
checkpoints into our torch models by swapping nn.Linear for QuantLinear.

Naming (ModelOpt unified HF export, which TensorRT-LLM's PyTorch backend loads): a quantized
linear `<m>` becomes `<m>.weight` (e4m3 [out, in] or packed uint8 [out, in/2]), `<m>.weight_scale`
(fp32 scalar, or e4m3 [out, in/16] for NVFP4), `<m>.weight_scale_2` (NVFP4 global, fp32 scalar),
`<m>.input_scale` (fp32 scalar, static activation scale) and an unchanged `<m>.bias`.

Fused groups: layers that TensorRT-LLM fuses into one GEMM (q/k/v, gate/up) read the same input
and share one input scale; for NVFP4 they also share the global weight scale (max over the group),
as ModelOpt's export does. `share_fp8_weight_scale=True` (the legacy fused-QKV format) also shares
the FP8 per-tensor weight scale across a group.

What is quantized: every nn.Linear of the decoder layers (attention and dense MLP). Kept in high
precision: embeddings, lm_head, norms, the gpt-oss router and MoE experts (3-D parameters, not
linears), and the DFlash drafter's feature projection `fc`. Exclusions are written in the names the
loader matches: Hugging Face names for Llama / Qwen3, TensorRT-LLM's runtime names for gpt-oss
(whose FP8 / NVFP4 attention only dflash_trt's torch runtime loads; see checkpoint/gpt_oss.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from dflash_trt.checkpoint.gpt_oss import RUNTIME_EXCLUDES
from dflash_trt.errors import ConfigError
from dflash_trt.fileio import check_state_dict
from dflash_trt.quant.algo import QuantAlgo, parse_quant_algo
from dflash_trt.quant.fp8 import E4M3_MAX, export_codes, weight_scale_from_amax
from dflash_trt.quant.linear import QuantLinear
from dflash_trt.quant.nvfp4 import BLOCK_SIZE, global_scale_from_amax, quantize_nvfp4

WRITABLE_ALGOS = (QuantAlgo.FP8, QuantAlgo.NVFP4)
QUANT_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale")
_GROUP_MEMBERS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def writable_algo(algo: str | QuantAlgo) -> QuantAlgo:
    parsed = parse_quant_algo(algo)
    if parsed not in WRITABLE_ALGOS:
        raise ConfigError(f"quant_algo {parsed.value} cannot be written; supported: {[a.value for a in WRITABLE_ALGOS]}")
    return parsed


@dataclass(frozen=True)
class QuantPlan:
    algo: QuantAlgo
    modules: tuple[str, ...]  # names of the linears to quantize (HF names)
    exclude_modules: tuple[str, ...]  # hf_quant_config patterns of what stays in high precision
    in_features: dict[str, int]

    def group_of(self, name: str) -> tuple[str, ...]:
        """The fused group `name` belongs to (itself alone when not fused)."""
        parent, _, leaf = name.rpartition(".")
        for members in _GROUP_MEMBERS:
            if leaf in members:
                group = tuple(f"{parent}.{m}" for m in members if f"{parent}.{m}" in self.modules)
                return group or (name,)
        return (name,)


def plan_for(model: nn.Module, algo: str | QuantAlgo, kind: str) -> QuantPlan:
    """kind: "target" (NativeCausalLM) or "drafter" (DFlashDrafter)."""
    algo = writable_algo(algo)
    skip = {"lm_head"} if kind == "target" else {"fc"}
    names, sizes = [], {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name not in skip:
            if algo is QuantAlgo.NVFP4 and module.in_features % BLOCK_SIZE:
                raise ConfigError(f"NVFP4 needs in_features % {BLOCK_SIZE} == 0; {name} has {module.in_features}")
            names.append(name)
            sizes[name] = module.in_features
    if kind == "target" and model.arch.moe:
        # gpt-oss: TensorRT-LLM matches exclusions against its runtime module names (model.block.N...),
        # never the HF ones (dflash_trt.checkpoint.gpt_oss); router and experts stay high precision
        exclude = list(RUNTIME_EXCLUDES)
    elif kind == "target":
        exclude = ["lm_head", "model.embed_tokens"]  # Llama / Qwen3 runtime names are the HF ones
    else:
        exclude = ["fc"]
    return QuantPlan(algo, tuple(names), tuple(exclude), sizes)


def quantize_weight(w: torch.Tensor, algo: QuantAlgo, shared_amax: torch.Tensor | None = None,
                    export_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """w: [out, in] float -> {"weight", "weight_scale"[, "weight_scale_2"]} with (1,) scalars.

    shared_amax (1,): the amax that sets the per-tensor (FP8) or global (NVFP4) scale instead of
    w's own (a fused group's max). export_dtype: the checkpoint's dtype; the codes are rounded
    through it as ModelOpt's HF export does (`quant.fp8.export_codes`, `quant.nvfp4.quantize_nvfp4`),
    float32 means one rounding. Scales come from w as given."""
    w = w.detach().float()
    amax = w.abs().amax().reshape(1) if shared_amax is None else shared_amax.reshape(1).float()
    if algo is QuantAlgo.NVFP4:
        q = quantize_nvfp4(w, global_scale_from_amax(amax) if bool(amax > 0) else None, export_dtype)
        return {"weight": q.packed, "weight_scale": q.block_scale, "weight_scale_2": q.global_scale}
    scale = weight_scale_from_amax(amax)
    return {"weight": export_codes(w, scale, export_dtype), "weight_scale": scale}


def input_scale(algo: QuantAlgo, amax: float) -> torch.Tensor:
    if not amax > 0:
        raise ConfigError(f"calibration amax must be > 0, got {amax}")
    a = torch.tensor([amax], dtype=torch.float32)
    return global_scale_from_amax(a) if algo is QuantAlgo.NVFP4 else a / E4M3_MAX


def quantize_state(state: dict[str, torch.Tensor], plan: QuantPlan, input_amax: dict[str, float] | None,
                   share_fp8_weight_scale: bool = False, export_dtype: torch.dtype | None = None
                   ) -> dict[str, torch.Tensor]:
    """HF-named float state -> HF-named quantized state (scalars shaped (1,)).

    input_amax None: weight-only (no input_scale). Otherwise every quantized linear needs an amax.
    export_dtype: the checkpoint dtype (a ModelOpt HF export's `dtype`): unquantized float tensors
    are cast to it and the codes rounded through it; None keeps the tensors' dtypes and rounds once
    (the legacy writer casts per rank itself)."""
    if export_dtype is None:
        out = dict(state)
    else:
        out = {k: v.to(export_dtype) if v.is_floating_point() else v for k, v in state.items()}
    missing = [m for m in plan.modules if input_amax is not None and m not in input_amax]
    if missing:
        raise ConfigError(f"no calibration data reached {missing[:5]}{'...' if len(missing) > 5 else ''}: "
                          "calibrate on prompts that run the whole model")
    for name in plan.modules:
        group = plan.group_of(name)
        share = plan.algo is QuantAlgo.NVFP4 or share_fp8_weight_scale
        shared = None
        if share and len(group) > 1:
            shared = torch.stack([state[f"{m}.weight"].detach().float().abs().amax() for m in group]).amax()
        out.pop(f"{name}.weight")
        for suffix, tensor in quantize_weight(state[f"{name}.weight"], plan.algo, shared,
                                              export_dtype or torch.float32).items():
            out[f"{name}.{suffix}"] = tensor
        if input_amax is not None:
            amax = max(input_amax[m] for m in group)
            out[f"{name}.input_scale"] = input_scale(plan.algo, amax)
    return out


# ---- loading ---------------------------------------------------------------------------------
def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, leaf, module)


def swap_linears(model: nn.Module, state: dict[str, torch.Tensor], algo: QuantAlgo) -> list[str]:
    """Replace each nn.Linear whose `<name>.weight_scale` is in `state` by an empty QuantLinear."""
    swapped = []
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and f"{name}.weight_scale" in state:
            layer = QuantLinear(module.in_features, module.out_features, algo, bias=module.bias is not None,
                                static_input_scale=f"{name}.input_scale" in state,
                                bias_dtype=module.weight.dtype)
            _set_module(model, name, layer)
            swapped.append(name)
    return swapped


def _normalise_scalars(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ModelOpt writes scalar scales as 0-d tensors; QuantLinear holds them as (1,)."""
    return {k: (v.reshape(1) if v.dim() == 0 and k.rsplit(".", 1)[-1] in QUANT_SUFFIXES else v)
            for k, v in state.items()}


def load_quantized_state(model: nn.Module, state: dict[str, torch.Tensor], algo: QuantAlgo,
                         where: str) -> nn.Module:
    """Swap linears for QuantLinear and load `state` strictly; CheckpointError names any missing or
    extra tensors. Float tensors are cast to the model's dtype; quantized ones keep theirs."""
    state = _normalise_scalars(state)
    swap_linears(model, state, algo)
    expected = model.state_dict()
    check_state_dict(state, expected, f"{where} (quantized checkpoint)", exact_dtypes=True)
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=True)
    return model.eval()


def algo_of_state(state: dict[str, torch.Tensor]) -> QuantAlgo | None:
    """FP8 / NVFP4 from the tensors themselves (None when nothing is quantized)."""
    if any(k.endswith(".weight_scale_2") for k in state):
        return QuantAlgo.NVFP4
    if any(k.endswith(".weight_scale") for k in state):
        return QuantAlgo.FP8
    return None


def matches_exclude(name: str, patterns: tuple[str, ...] | list[str]) -> bool:
    return any(re.fullmatch(re.escape(p).replace(r"\*", ".*"), name) for p in patterns)


__all__ = ["QuantPlan", "WRITABLE_ALGOS", "algo_of_state", "input_scale", "load_quantized_state", "plan_for",
           "quantize_state", "quantize_weight", "swap_linears", "writable_algo"]
