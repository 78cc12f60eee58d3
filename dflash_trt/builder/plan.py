"""The build plan: which stages run for a config, what each one writes, the commands it stands for,
and estimated output sizes (parameters x bytes per format). `--dry-run` prints it and writes nothing.

Stages, in order (cached ones are keyed by a hash of their inputs, see builder.py):
  target   quantize (fp8 / nvfp4, ModelOpt HF format) or link the target checkpoint -> target/
  drafter  quantize (fp8) or link the DFlash drafter -> drafter/
  shard    TP/EP-sharded legacy checkpoint (config.json + rank{N}.safetensors) -> shards/target/
           (torch backend with tp > 1, and the trtllm-engine path; TensorRT-LLM's PyTorch backend
           shards the HF checkpoint itself at load time)
  engine   trtllm-build on the legacy checkpoint (trtllm-engine only) -> engine/
  triton   Triton model repository -> triton/ (assembly time: it embeds the final paths)
  deploy   llm_api_options.yaml + launch/ (assembly time)
  manifest manifest.json (last)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dflash_trt.builder import trtllm
from dflash_trt.builder.config import GPU_ARCHS, BuildConfig
from dflash_trt.builder.sources import (
    Sources,
    drafter_param_counts,
    estimated_bytes,
    human_bytes,
    target_param_counts,
)

CACHED_STAGES = ("target", "drafter", "shard", "engine")
ASSEMBLY_STAGES = ("triton", "deploy", "manifest")


@dataclass(frozen=True)
class StagePlan:
    name: str
    output: str  # folder or file inside the output directory ("" for none)
    what: str
    commands: tuple[str, ...] = ()
    est_bytes: int | None = None
    cached: bool = True


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


def needs_shards(cfg: BuildConfig) -> bool:
    return cfg.backend == "trtllm-engine" or (cfg.backend == "torch" and cfg.parallel.tp > 1)


def high_precision_bytes(cfg: BuildConfig) -> float:
    return 4.0 if cfg.gpu_arch == "cpu" else 2.0  # float32 on the CPU path, bf16 on GPUs


def make_plan(cfg: BuildConfig, out: Path, src: Sources) -> BuildPlan:
    out = Path(out).resolve()
    hp = high_precision_bytes(cfg)
    t_lin, t_other = target_param_counts(cfg)
    d_lin, d_other = drafter_param_counts(cfg, src.drafter_config)
    t_bytes = estimated_bytes(t_lin, t_other, cfg.target.quantization, hp)
    d_bytes = estimated_bytes(d_lin, d_other, cfg.drafter.quantization, hp)
    tq, dq = cfg.target.quantization, cfg.drafter.quantization
    stages = [
        StagePlan("target", "target", (f"quantize {src.target_path} to {tq.upper()} (ModelOpt HF format, "
                                       f"{cfg.calibration_samples} calibration prompts)") if tq != "none"
                  else f"link {src.target_path} unchanged", est_bytes=t_bytes),
        StagePlan("drafter", "drafter", (f"quantize the drafter {src.drafter_path} to FP8 (fc and norms kept)"
                                         if dq != "none" else f"link the drafter {src.drafter_path} unchanged"),
                  est_bytes=d_bytes),
    ]
    p = cfg.parallel
    if needs_shards(cfg):
        ep = f", EP {p.ep} x MoE-TP {p.tp // p.ep}" if cfg.is_moe else ""
        stages.append(StagePlan("shard", "shards/target",
                                f"shard target/ into a TensorRT-LLM legacy checkpoint: TP {p.tp}{ep}, PP {p.pp} "
                                f"-> {p.ranks} x rank{{N}}.safetensors", est_bytes=t_bytes))
    if cfg.backend == "trtllm-engine":
        cmd = trtllm.trtllm_build_argv(cfg, out / "shards" / "target", out / "engine",
                                       out / "engine" / trtllm.MODEL_CLASS_FILE)
        stages.append(StagePlan("engine", "engine",
                                f"trtllm-build (TensorRT-LLM {trtllm.ENGINE_TRTLLM_SERIES}x) with the tapped layers' "
                                f"hidden states marked as engine outputs ({trtllm.MODEL_CLASS_NAME})",
                                commands=(trtllm.shell_line(cmd),), est_bytes=t_bytes))
    if cfg.serve.triton:
        stages.append(StagePlan("triton", "triton", f"Triton model repository (python backend, model "
                                f"'{cfg.serve.triton_model_name}')", cached=False))
    launch = [trtllm.shell_line(trtllm.serve_argv(cfg, out)), trtllm.shell_line(trtllm.mpirun_argv(cfg, out))]
    if cfg.backend != "torch":
        launch.append(trtllm.shell_line(trtllm.srun_argv(cfg, out)))
    stages.append(StagePlan("deploy", "llm_api_options.yaml, launch/",
                            "LLM-API options for `--config` and launch scripts", commands=tuple(launch), cached=False))
    stages.append(StagePlan("manifest", "manifest.json", "versions, source hashes, config, stages, taps",
                            cached=False))
    return BuildPlan(cfg, out, src, tuple(stages))


def format_plan(plan: BuildPlan) -> str:
    cfg, src = plan.config, plan.sources
    p = cfg.parallel
    lines = [
        f"build plan '{cfg.name}' -> {plan.out}",
        f"  backend {cfg.backend} on {cfg.gpu_arch} ({GPU_ARCHS[cfg.gpu_arch][0]}); "
        f"TP {p.tp} x PP {p.pp} (EP {p.ep}) = {p.ranks} ranks on {p.nodes} node(s) x {p.gpus_per_node} GPUs",
        f"  target  {src.target_path} [{cfg.target.architecture}, {cfg.target.num_hidden_layers} layers"
        f"{f', {cfg.target.num_experts} experts' if cfg.is_moe else ''}] "
        f"{'found' if src.target_exists else 'NOT FOUND here (checked when building)'}",
        f"  drafter {src.drafter_path} {'found' if src.drafter_exists else 'NOT FOUND here (checked when building)'}",
        f"  limits: max_batch_size {cfg.max_batch_size}, max_seq_len {cfg.max_seq_len}, "
        f"max_draft_len {cfg.max_draft_len}, kv_cache_dtype {cfg.kv_cache_dtype}",
        "stages:",
    ]
    for i, s in enumerate(plan.stages, 1):
        size = f"  ~{human_bytes(s.est_bytes)}" if s.est_bytes is not None else ""
        lines.append(f"  {i}. {s.name:<8} -> {s.output or '-'}{size}")
        lines.append(f"       {s.what}")
        lines.extend(f"       $ {c}" for c in s.commands)
    total = sum(s.est_bytes for s in plan.stages if s.est_bytes is not None and s.name in ("target", "drafter"))
    lines.append(f"estimated output size: ~{human_bytes(total)} (target + drafter; shards/engine hold "
                 "another copy of the target when present)")
    if src.drafter_config is None:
        lines.append("  (drafter size assumes 5 layers: its config is not on this machine)")
    return "\n".join(lines)
