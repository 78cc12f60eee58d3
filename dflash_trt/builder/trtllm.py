"""TensorRT-LLM glue for the builder: the LLM-API options YAML and the trtllm-serve / mpirun / srun
command lines. Nothing here imports tensorrt_llm.
Key names follow TensorRT-LLM's LLM API (`TorchLlmArgs`, `DFlashDecodingConfig`, `KvCacheConfig`,
`CudaGraphConfig`, `MoeConfig`), which `trtllm-serve --config` (alias --extra_llm_api_options) reads.
"""
from __future__ import annotations

import logging
import shlex
from pathlib import Path

from dflash_trt.builder.config import BuildConfig
from dflash_trt.config import DrafterConfig
from dflash_trt.runtime.trtllm import dflash_attention_backend, speculative_config  # THE builder of the mapping

log = logging.getLogger(__name__)

CAPABILITY = {"sm_80": (8, 0), "sm_89": (8, 9), "sm_90": (9, 0), "sm_100": (10, 0), "sm_103": (10, 3),
              "sm_120": (12, 0)}


def llm_api_options(cfg: BuildConfig, drafter_dir: Path, drafter: DrafterConfig) -> dict:
    """The YAML for `trtllm-serve --config` (and `dflash-trt serve --config` on the torch backend).
    Every key is a field of the pinned TensorRT-LLM release (dflash_trt/trtllm_release.py; the
    tests walk this output against it); max_seq_len is always written (TensorRT-LLM sizes the
    drafter's context arena by it); the drafter's attention backend follows the config's GPU
    (TRTLLM on sm_100 / sm_103, VANILLA elsewhere: runtime.trtllm.dflash_attention_backend)."""
    p = cfg.parallel
    opts: dict = {
        "tensor_parallel_size": p.tp,
        "max_batch_size": cfg.max_batch_size,
        "max_seq_len": cfg.max_seq_len,
    }
    if cfg.backend == "torch":
        opts["speculative_config"] = speculative_config(drafter_dir, drafter, cfg.max_draft_len)
        return opts
    opts["pipeline_parallel_size"] = p.pp
    if cfg.max_num_tokens is not None:
        opts["max_num_tokens"] = cfg.max_num_tokens
    if cfg.is_moe:
        opts["moe_expert_parallel_size"] = p.ep
        opts["moe_tensor_parallel_size"] = p.tp // p.ep
    opts["kv_cache_config"] = {"dtype": cfg.kv_cache_dtype,
                               "free_gpu_memory_fraction": cfg.serve.free_gpu_memory_fraction}
    if cfg.cuda_graph_batch_sizes:
        opts["cuda_graph_config"] = {"batch_sizes": sorted(cfg.cuda_graph_batch_sizes), "enable_padding": True}
    if cfg.moe_backend is not None:
        opts["moe_config"] = {"backend": cfg.moe_backend}
    opts["speculative_config"] = speculative_config(
        drafter_dir, drafter, cfg.max_draft_len, attention_backend=dflash_attention_backend(CAPABILITY[cfg.gpu_arch]))
    return opts


def serve_argv(cfg: BuildConfig, out: Path) -> list[str]:
    """The serving command for one process (rank 0 under MPI) on the built directory `out`. Both servers
    announce the build's name as the model id (`--served-model-name` ours, `--served_model_name` in
    trtllm-serve's click options, TensorRT-LLM docs: commands/trtllm-serve), not the directory's path."""
    s = cfg.serve
    if cfg.backend == "torch":
        argv = ["dflash-trt", "serve", str(out / "target"), "--config", str(out / "llm_api_options.yaml"),
                "--served-model-name", cfg.name]
        if cfg.parallel.tp > 1:
            argv += ["--tp", str(cfg.parallel.tp)]
        return argv + ["--host", s.host, "--port", str(s.port)]
    argv = ["trtllm-serve", str(out / "target"), "--config", str(out / "llm_api_options.yaml"),
            "--host", s.host, "--port", str(s.port), "--backend", "pytorch", "--served_model_name", cfg.name,
            "--tp_size", str(cfg.parallel.tp), "--pp_size", str(cfg.parallel.pp)]
    if cfg.is_moe:
        argv += ["--ep_size", str(cfg.parallel.ep)]
    return argv


def mpirun_argv(cfg: BuildConfig, out: Path) -> list[str]:
    """Single-node MPI launch: TensorRT-LLM spawns its own workers from one process unless started
    under MPI; trtllm-llmapi-launch makes every MPI rank a worker with rank 0 serving HTTP."""
    ranks = str(cfg.parallel.ranks)
    if cfg.backend == "torch":
        return ["mpirun", "-n", ranks, "--oversubscribe", *serve_argv(cfg, out)]
    return ["mpirun", "-n", ranks, "--allow-run-as-root", "trtllm-llmapi-launch", *serve_argv(cfg, out)]


def srun_argv(cfg: BuildConfig, out: Path) -> list[str]:
    p = cfg.parallel
    return ["srun", "--mpi=pmix", f"--nodes={p.nodes}", f"--ntasks={p.ranks}",
            f"--ntasks-per-node={min(p.ranks, p.gpus_per_node)}",
            f"--container-image={cfg.serve.container_image}", f"--container-mounts={out}:{out}",
            "trtllm-llmapi-launch", *serve_argv(cfg, out)]


def shell_line(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)
