"""Calibration (a build step): the absolute maximum of every linear layer's input over offline prompts.

Two routes, giving the same statistic (the per-tensor max |x| that ModelOpt's max calibrator
records as `input_quantizer.amax`):
- `modelopt_calibrate`: nvidia-modelopt's `mtq.quantize(model, FP8_DEFAULT_CFG | NVFP4_DEFAULT_CFG,
  forward_loop)` on a transformers model (runs on CPU; its NVFP4 fake-quant FORWARD needs CUDA, but
  calibration itself only observes unquantized activations). Returns the amax per module name and
  leaves the model ready for modelopt's own exporters (used by the parity tests).
- `calibrate_target` / `calibrate_drafter`: our own forward hooks on the native target (any
  architecture, gpt-oss included) and on the DFlash drafter while the DFlash loop drafts.
Calibration prompts must not come from the evaluation sets (MT-Bench, HumanEval): real targets are
calibrated on the standard-library prompts of `dflash_trt.prompts`, tiny ones on seeded ids.
The numerics that use the statistic (FP8 / NVFP4 scales) are in dflash_trt/quant/.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from dflash_trt.engine import EngineConfig, SamplingParams
from dflash_trt.errors import BackendUnavailableError, ConfigError, InputError
from dflash_trt.prompts import chat_prompt_ids, stdlib_prompts
from dflash_trt.quant.algo import QuantAlgo, parse_quant_algo
from dflash_trt.runtime.factory import torch_engine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Calibration:
    """Per-layer input amax (module name -> max |x|, fp32) and how it was obtained."""

    input_amax: dict[str, float]
    method: str  # "dflash_trt-hooks" | "modelopt-max"
    num_prompts: int
    num_tokens: int
    extra: dict[str, str] = field(default_factory=dict)

    def describe(self) -> dict:
        return {"method": self.method, "num_prompts": self.num_prompts, "num_tokens": self.num_tokens, **self.extra}


def _require_prompts(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    out = [list(p) for p in prompts if len(p) > 0]
    if not out:
        raise ConfigError(
            "no calibration data: static activation scales need at least one non-empty calibration prompt "
            "(pass --calib-prompts N with N >= 1)"
        )
    return out


def collect_input_amax(model: nn.Module, run: Callable[[], None], prefix: str = "") -> dict[str, float]:
    """Run `run()` with hooks on every nn.Linear of `model`; return {prefix + name: max |input|}."""
    amax: dict[str, float] = {}
    handles = []

    def hook_for(name: str):
        def hook(_module, args):
            x = args[0].detach()
            if x.numel():
                amax[name] = max(amax.get(name, 0.0), float(x.abs().max()))
        return hook

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            handles.append(module.register_forward_pre_hook(hook_for(prefix + name)))
    try:
        with torch.inference_mode():
            run()
    finally:
        for h in handles:
            h.remove()
    return amax


def calibration_prompts(count: int, *, tokenizer=None, vocab_size: int | None = None, seed: int = 0,
                        length: int = 32) -> list[list[int]]:
    """`count` calibration prompts as token ids.

    With a tokenizer: standard-library instruction prompts (dflash_trt.prompts), chat-formatted,
    never MT-Bench/HumanEval. Without one (tiny random models): seeded random ids of `length`.
    """
    if count < 1:
        raise ConfigError(f"no calibration data: --calib-prompts must be >= 1, got {count}")
    if tokenizer is None:
        if vocab_size is None or vocab_size < 2:
            raise ConfigError("calibration without a tokenizer needs the vocabulary size")
        gen = torch.Generator().manual_seed(seed)
        return [torch.randint(0, vocab_size, (length,), generator=gen).tolist() for _ in range(count)]
    prompts = stdlib_prompts(seed, limit=count)
    if len(prompts) < count:
        raise ConfigError(f"only {len(prompts)} offline calibration prompts are available, {count} asked")
    return [chat_prompt_ids(tokenizer, p.text)[: 8 * length] for p in prompts]


def calibrate_target(target, prompts: Sequence[Sequence[int]]) -> Calibration:
    """Input amax of every nn.Linear of a NativeCausalLM over one prefill per prompt (batch 1, no padding)."""
    prompts = _require_prompts(prompts)

    def run() -> None:
        for ids in prompts:
            cache = target.new_cache(1, len(ids))
            rows = cache.add_rows(1)
            ids_t = torch.tensor([ids])
            pos = torch.arange(len(ids))[None]
            target.forward(cache, slice(rows.start, rows.stop), ids_t, pos)

    amax = collect_input_amax(target, run)
    return Calibration(amax, "dflash_trt-hooks", len(prompts), sum(map(len, prompts)))


def calibrate_drafter(target, drafter, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32) -> Calibration:
    """Input amax of every nn.Linear of a DFlash drafter while it drafts greedily for `target`."""
    prompts = _require_prompts(prompts)
    longest = max(map(len, prompts)) + max_new_tokens + 2 * drafter.block_size
    engine = torch_engine(target, drafter, EngineConfig(max_batch_size=1, max_seq_len=longest))
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)

    def run() -> None:
        for ids in prompts:
            engine.generate([ids], params)

    amax = collect_input_amax(drafter, run)
    if not amax:
        raise InputError("the drafter never ran during calibration (is speculative decoding enabled?)")
    return Calibration(amax, "dflash_trt-hooks", len(prompts), sum(map(len, prompts)))


def _modelopt():
    try:
        import modelopt.torch.quantization as mtq
    except ImportError as exc:
        raise BackendUnavailableError(
            "ModelOpt calibration needs nvidia-modelopt: pip install nvidia-modelopt==0.47.0 requests"
        ) from exc
    return mtq


def modelopt_config(algo: str | QuantAlgo) -> dict:
    mtq = _modelopt()
    algo = parse_quant_algo(algo)
    if algo is QuantAlgo.FP8:
        return mtq.FP8_DEFAULT_CFG
    if algo is QuantAlgo.NVFP4:
        return mtq.NVFP4_DEFAULT_CFG
    raise ConfigError(f"ModelOpt calibration supports quant_algo FP8 and NVFP4, not {algo.value}")


def modelopt_calibrate(hf_model, algo: str | QuantAlgo, prompts: Sequence[Sequence[int]]) -> Calibration:
    """mtq.quantize(hf_model, FP8/NVFP4 default config) over the prompts (in place); returns the
    calibrated input amax of every quantized linear, named as the model's modules."""
    mtq = _modelopt()
    prompts = _require_prompts(prompts)
    if not getattr(hf_model.config, "architectures", None):
        hf_model.config.architectures = [type(hf_model).__name__]  # modelopt's exporters need it

    def forward_loop(model) -> None:
        for ids in prompts:
            model(torch.tensor([ids]))

    with torch.inference_mode(False), torch.no_grad():
        mtq.quantize(hf_model, modelopt_config(algo), forward_loop)
    amax: dict[str, float] = {}
    for name, module in hf_model.named_modules():
        quantizer = getattr(module, "input_quantizer", None)
        if quantizer is not None and getattr(quantizer, "is_enabled", False) and quantizer.amax is not None:
            amax[name] = float(quantizer.amax.float().max())
    import modelopt

    return Calibration(amax, "modelopt-max", len(prompts), sum(map(len, prompts)),
                       {"modelopt_version": modelopt.__version__})


__all__ = ["Calibration", "calibrate_drafter", "calibrate_target", "calibration_prompts", "collect_input_amax",
           "modelopt_calibrate", "modelopt_config"]
