"""The build plan: which stages run for a config, what each one writes, the commands it stands for,
and per tensor group what it becomes and its estimated size (dflash_trt.builder.sizes). `--dry-run`
prints it and writes nothing.

Stages, in order (cached ones are keyed by a hash of their inputs, see builder.py):
  target   quantize (fp8 / nvfp4, ModelOpt HF format) or copy the target checkpoint (none, and the
           gpt-oss MXFP4 release: mxfp4) -> target/
  drafter  quantize (fp8, torch backend), write in BF16 (TensorRT-LLM) or copy the drafter -> drafter/
  shard    TP/EP-sharded checkpoint (config.json + rank{N}.safetensors) -> shards/target/
           (torch backend with tp > 1 only; TensorRT-LLM's PyTorch backend shards the HF
           checkpoint itself at load time)
  triton   Triton model repository -> triton/ (assembly time: it embeds the final paths)
  deploy   llm_api_options.yaml + launch/ (assembly time)
  manifest manifest.json (last)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dflash_trt.builder import sizes, trtllm
from dflash_trt.builder.config import GPU_ARCHS, BuildConfig
from dflash_trt.builder.sizes import SizeEstimate
from dflash_trt.builder.sources import Sources, human_bytes
from dflash_trt.checkpoint.modelopt_hf import COPIED_FILES

CACHED_STAGES = ("target", "drafter", "shard")
# source aliases `dflash-trt build` writes into its cache dir when they are missing (commands/build.py)
WRITTEN_BY_THE_BUILD = ("@default", "@tiny-gpt-oss", "@tiny-gpt-oss-drafter")
ASSEMBLY_STAGES = ("triton", "deploy", "manifest")
MODELOPT_COPIED = ("config.json", *COPIED_FILES)  # what a quantized target stage copies besides the weights


@dataclass(frozen=True)
class StagePlan:
    name: str
    output: str  # folder or file inside the output directory ("" for none)
    what: str
    commands: tuple[str, ...] = ()
    est_bytes: int | None = None
    cached: bool = True
    tensor_groups: SizeEstimate | None = None  # per tensor group (target and drafter stages)


@dataclass(frozen=True)
class BuildPlan:
    config: BuildConfig
    out: Path
    sources: Sources
    stages: tuple[StagePlan, ...] = field(default_factory=tuple)

    def stage(self, name: str) -> StagePlan:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def has(self, name: str) -> bool:
        return any(s.name == name for s in self.stages)

    @property
    def est_bytes(self) -> int:
        """Everything the output directory's weights take: target, drafter and shards/engine."""
        return sum(s.est_bytes for s in self.stages if s.est_bytes is not None)


def needs_shards(cfg: BuildConfig) -> bool:
    return cfg.backend == "torch" and cfg.parallel.tp > 1


def _target_stage(cfg: BuildConfig, src: Sources) -> tuple[StagePlan, list]:
    specs, basis = sizes.target_source_specs(cfg, src.target_tensors, src.target_path)
    mode = sizes.target_mode(cfg)
    here = src.target_path if src.target_exists else None
    other = sizes.other_files_bytes(here, None if mode == "copy" else MODELOPT_COPIED)
    estimate = sizes.estimate(specs, mode, other, basis)
    tq = cfg.target.quantization
    if tq == "mxfp4":
        what = (f"copy the gpt-oss release {src.target_path} unchanged: MXFP4 experts and BF16 attention, router, "
                "embeddings as released (no hf_quant_config.json; TensorRT-LLM reads quantization_config)")
    elif tq == "none":
        what = f"copy {src.target_path} unchanged"
    else:
        what = (f"quantize {src.target_path} to {tq.upper()} (ModelOpt HF format, {cfg.calibration_samples} "
                "calibration prompts)")
    return StagePlan("target", "target", what, est_bytes=estimate.total, tensor_groups=estimate), \
        sizes.written_specs(specs, mode)


def _drafter_stage(cfg: BuildConfig, src: Sources) -> StagePlan:
    specs, basis = sizes.drafter_source_specs(cfg, src.drafter_tensors, src.drafter_path)
    mode = sizes.drafter_mode(cfg)
    estimate = sizes.estimate(specs, mode, sizes.other_files_bytes(src.drafter_path if src.drafter_exists else None),
                              basis)
    what = {"fp8": f"quantize the drafter {src.drafter_path} to FP8 (fc and norms kept)",
            "bf16": f"write the drafter {src.drafter_path} in BF16 (TensorRT-LLM's DFlash drafter runs unscaled "
                    "BF16 weights; copied when it already is)",
            "copy": f"copy the drafter {src.drafter_path} unchanged"}[mode]
    return StagePlan("drafter", "drafter", what, est_bytes=estimate.total, tensor_groups=estimate)


def launch_commands(cfg: BuildConfig, out: Path) -> tuple[str, ...]:
    """The ways to start the build: torch TP > 1 only under mpirun (one rank per process),
    TensorRT-LLM also through Slurm."""
    serve, mpirun = trtllm.shell_line(trtllm.serve_argv(cfg, out)), trtllm.shell_line(trtllm.mpirun_argv(cfg, out))
    if cfg.backend == "torch":
        return (mpirun,) if cfg.parallel.tp > 1 else (serve,)
    return serve, mpirun, trtllm.shell_line(trtllm.srun_argv(cfg, out))


def make_plan(cfg: BuildConfig, out: Path, src: Sources) -> BuildPlan:
    out = Path(out).resolve()
    target, written = _target_stage(cfg, src)
    stages = [target, _drafter_stage(cfg, src)]
    p = cfg.parallel
    if needs_shards(cfg):
        ep = f", EP {p.ep} x MoE-TP {p.tp // p.ep}" if cfg.is_moe else ""
        copied = sizes.other_files_bytes(src.target_path if src.target_exists else None)
        kind = ("Hugging Face-named shards for the torch TP runtime" if cfg.target.quantization in ("none", "mxfp4")
                else "a TensorRT-LLM legacy checkpoint")
        stages.append(StagePlan("shard", "shards/target",
                                f"shard target/ into {kind}: TP {p.tp}{ep}, PP {p.pp} -> {p.ranks} x rank{{N}}.safetensors",
                                est_bytes=sizes.shard_bytes(cfg, written) + copied))
    if cfg.serve.triton:
        stages.append(StagePlan("triton", "triton", f"Triton model repository (python backend, model "
                                f"'{cfg.serve.triton_model_name}')", cached=False))
    stages.append(StagePlan("deploy", "llm_api_options.yaml, launch/",
                            "LLM-API options for `--config` and launch scripts", commands=launch_commands(cfg, out),
                            cached=False))
    stages.append(StagePlan("manifest", "manifest.json", "versions, source hashes, config, stages, tensor groups, taps",
                            cached=False))
    return BuildPlan(cfg, out, src, tuple(stages))


def _layout_line(cfg: BuildConfig) -> str:
    p = cfg.parallel
    where = (f"{p.ranks} process(es) on this machine" if cfg.gpu_arch == "cpu"
             else f"{p.ranks} ranks on {p.nodes} node(s) x {p.gpus_per_node} GPUs")
    ep = f" (EP {p.ep})" if cfg.is_moe else ""
    return f"  backend {cfg.backend} on {cfg.gpu_arch} ({GPU_ARCHS[cfg.gpu_arch][0]}); TP {p.tp} x PP {p.pp}{ep} = {where}"


def _group_lines(estimate: SizeEstimate) -> list[str]:
    rows = [("tensor group", "params", "source", "written", "size")]
    for g in estimate.groups:
        rows.append((g.group, _count(g.params), g.source, g.output, human_bytes(g.est_bytes)))
    rows.append(("headers, other files", "", "", "", human_bytes(estimate.other_bytes)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["       " + "  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + f"  {r[4]:>10}" for r in rows]
    return lines + [f"       (from {estimate.basis})"]


def _count(n: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _found(exists: bool, path: str) -> str:
    """'found', or what the build does about a missing source (it writes @default / @tiny-gpt-oss* itself)."""
    if exists:
        return "found"
    if path in WRITTEN_BY_THE_BUILD:
        return f"not written yet ({path}: the build writes it first)"
    return "NOT FOUND here (checked when building)"


def format_plan(plan: BuildPlan) -> str:
    cfg, src = plan.config, plan.sources
    lines = [
        f"build plan '{cfg.name}' -> {plan.out}",
        _layout_line(cfg),
        f"  target  {src.target_path} [{cfg.target.architecture}, {cfg.target.num_hidden_layers} layers"
        f"{f', {cfg.target.num_experts} experts' if cfg.is_moe else ''}] "
        f"{_found(src.target_exists, cfg.target.path)}",
        f"  drafter {src.drafter_path} {_found(src.drafter_exists, cfg.drafter.path)}",
        f"  limits: max_batch_size {cfg.max_batch_size}, max_seq_len {cfg.max_seq_len}, "
        f"max_draft_len {cfg.max_draft_len}, kv_cache_dtype {cfg.kv_cache_dtype}",
        "stages:",
    ]
    for i, s in enumerate(plan.stages, 1):
        size = f"  ~{human_bytes(s.est_bytes)}" if s.est_bytes is not None else ""
        lines.append(f"  {i}. {s.name:<8} -> {s.output or '-'}{size}")
        lines.append(f"       {s.what}")
        if s.tensor_groups is not None:
            lines.extend(_group_lines(s.tensor_groups))
        lines.extend(f"       $ {c}" for c in s.commands)
    parts = " + ".join(s.name for s in plan.stages if s.est_bytes is not None)
    lines.append(f"estimated output size: ~{human_bytes(plan.est_bytes)} = {plan.est_bytes / 1e9:.2f} GB ({parts})")
    return "\n".join(lines)
