"""TensorRT-LLM glue for the builder: the LLM-API options YAML, the trtllm-serve / mpirun / srun
command lines, and the 1.2.x engine path (`trtllm-build` with a custom model class that exposes
the tapped layers' hidden states as engine outputs).

tensorrt_llm is imported lazily and only by `engine_preflight`; nothing here needs it to plan.
Key names follow TensorRT-LLM's LLM API (`TorchLlmArgs`, `DFlashDecodingConfig`, `KvCacheConfig`,
`CudaGraphConfig`, `MoeConfig`), which `trtllm-serve --config` (alias --extra_llm_api_options) reads.
"""
from __future__ import annotations

import importlib
import logging
import shlex
import shutil
from pathlib import Path

from dflash_trt.builder.config import BuildConfig
from dflash_trt.config import DrafterConfig
from dflash_trt.errors import BackendUnavailableError
from dflash_trt.runtime.trtllm import speculative_config  # THE builder of the mapping (adapter, Triton use it too)

log = logging.getLogger(__name__)

ENGINE_TRTLLM_SERIES = "1.2."  # the last release line that ships trtllm-build
CAPABILITY = {"sm_80": (8, 0), "sm_89": (8, 9), "sm_90": (9, 0), "sm_100": (10, 0), "sm_103": (10, 3),
              "sm_120": (12, 0)}
MODEL_CLASS_NAME = "DFlashTapTarget"
MODEL_CLASS_FILE = "dflash_tap_model.py"
# TensorRT-LLM 1.2.x model classes by transformers model_type (gpt_oss is absent on purpose).
ENGINE_BASE_CLASSES = {"llama": ("tensorrt_llm.models", "LLaMAForCausalLM"),
                       "qwen3": ("tensorrt_llm.models", "QWenForCausalLM"),
                       "qwen2": ("tensorrt_llm.models", "QWenForCausalLM")}


def llm_api_options(cfg: BuildConfig, drafter_dir: Path, drafter: DrafterConfig) -> dict:
    """The YAML for `trtllm-serve --config` (and `dflash-trt serve --config` on the torch backend)."""
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
    if cfg.backend == "trtllm-pytorch":
        if cfg.cuda_graph_batch_sizes:
            opts["cuda_graph_config"] = {"batch_sizes": sorted(cfg.cuda_graph_batch_sizes), "enable_padding": True}
        if cfg.moe_backend is not None:
            opts["moe_config"] = {"backend": cfg.moe_backend}
        opts["speculative_config"] = speculative_config(drafter_dir, drafter, cfg.max_draft_len)
    return opts


def serve_argv(cfg: BuildConfig, out: Path) -> list[str]:
    """The serving command for one process (rank 0 under MPI) on the built directory `out`."""
    s = cfg.serve
    if cfg.backend == "torch":
        argv = ["dflash-trt", "serve", str(out / "target"), "--config", str(out / "llm_api_options.yaml")]
        if cfg.parallel.tp > 1:
            argv += ["--tp", str(cfg.parallel.tp)]
        return argv + ["--host", s.host, "--port", str(s.port)]
    model = out / "target" if cfg.backend == "trtllm-pytorch" else out / "engine"
    argv = ["trtllm-serve", str(model), "--config", str(out / "llm_api_options.yaml"),
            "--host", s.host, "--port", str(s.port),
            "--backend", "pytorch" if cfg.backend == "trtllm-pytorch" else "tensorrt",
            "--tp_size", str(cfg.parallel.tp), "--pp_size", str(cfg.parallel.pp)]
    if cfg.is_moe:
        argv += ["--ep_size", str(cfg.parallel.ep)]
    if cfg.backend == "trtllm-engine":
        argv += ["--tokenizer", str(out / "target")]
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


def trtllm_build_argv(cfg: BuildConfig, checkpoint_dir: Path, engine_dir: Path, model_cls_file: Path) -> list[str]:
    """`trtllm-build` for the target: the engine verifies externally drafted tokens in-engine and
    returns the tapped hidden states as extra outputs (custom model class)."""
    argv = ["trtllm-build", "--checkpoint_dir", str(checkpoint_dir), "--output_dir", str(engine_dir),
            "--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", str(cfg.max_draft_len),
            "--max_batch_size", str(cfg.max_batch_size), "--max_seq_len", str(cfg.max_seq_len),
            "--model_cls_file", str(model_cls_file), "--model_cls_name", MODEL_CLASS_NAME,
            "--gather_generation_logits", "--use_paged_context_fmha", "enable"]
    if cfg.max_num_tokens is not None:
        argv += ["--max_num_tokens", str(cfg.max_num_tokens)]
    if cfg.kv_cache_dtype == "fp8":
        argv += ["--use_fp8_context_fmha", "enable"]
    return argv


def shell_line(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


def engine_preflight(cfg: BuildConfig) -> str:
    """Check that the engine path can run here; return the TensorRT-LLM version or raise
    BackendUnavailableError naming exactly what is missing."""
    missing = []
    try:
        trtllm = importlib.import_module("tensorrt_llm")
    except ImportError as exc:  # also covers the PyPI placeholder that fails on import
        trtllm = None
        missing.append(f"`import tensorrt_llm` failed ({exc}); install TensorRT-LLM {ENGINE_TRTLLM_SERIES}x "
                       "(e.g. the nvcr.io/nvidia/tensorrt-llm/release:1.2.0 container)")
    version = str(trtllm.__version__) if trtllm is not None else "absent"
    if trtllm is not None and not version.startswith(ENGINE_TRTLLM_SERIES):
        missing.append(f"TensorRT-LLM {version} is installed, the engine path needs {ENGINE_TRTLLM_SERIES}x "
                       "(trtllm-build was removed after 1.2)")
    import torch

    if not torch.cuda.is_available():
        missing.append("no CUDA device is visible (torch.cuda.is_available() is False); trtllm-build needs the "
                       f"target GPU ({cfg.gpu_arch})")
    elif torch.cuda.get_device_capability(0) != CAPABILITY[cfg.gpu_arch]:
        cap = torch.cuda.get_device_capability(0)
        missing.append(f"GPU 0 has compute capability {cap[0]}.{cap[1]}, the config targets {cfg.gpu_arch}: "
                       "build on the deployment GPU")
    if shutil.which("trtllm-build") is None:
        missing.append("`trtllm-build` is not on PATH")
    if missing:
        raise BackendUnavailableError("backend trtllm-engine cannot build here: " + "; ".join(missing)
                                      + ". Use --dry-run to see the plan, or backend trtllm-pytorch.")
    return version


def model_class_source(cfg: BuildConfig, target_layer_ids: tuple[int, ...]) -> str:
    """Python source of the custom TensorRT-LLM 1.2.x model class given to trtllm-build: the
    architecture's own class, with the decoder layers in `target_layer_ids` marking their output hidden state as
    an engine output named `dflash_hidden_<layer>` (read per request through
    OutputConfig.additional_model_outputs). Not executable here: it needs TensorRT-LLM."""
    module, base = ENGINE_BASE_CLASSES[cfg.target.architecture]
    return f'''"""Generated by dflash_trt for build '{cfg.name}': {base} + DFlash hidden-state outputs.

trtllm-build --model_cls_file {MODEL_CLASS_FILE} --model_cls_name {MODEL_CLASS_NAME}
Tapped target layers (0-based, outputs of the decoder layer): {list(target_layer_ids)}.
"""
from {module} import {base}

DFLASH_TAPS = {tuple(target_layer_ids)!r}


class {MODEL_CLASS_NAME}({base}):
    def __init__(self, config):
        super().__init__(config)
        first = self.transformer.layers[0].layer_idx if len(self.transformer.layers) else 0
        for layer in self.transformer.layers:
            if layer.layer_idx in DFLASH_TAPS:
                self._tap(layer, layer.layer_idx)
        self._dflash_first_local_layer = first

    def _tap(self, layer, index):
        inner = layer.forward
        dtype = self.config.dtype

        def forward(*args, **kwargs):
            out = inner(*args, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
            hidden.mark_output(f"dflash_hidden_{{index}}", dtype)
            return out

        layer.forward = forward
'''
