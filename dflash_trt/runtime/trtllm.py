"""THE TensorRT-LLM adapter: the `trtllm` backend behind the engine seam (dflash_trt/engine.py).

TensorRT-LLM runs DFlash in its PyTorch backend (`speculative_config: {decoding_type: DFlash, ...}`).
This module holds the one function that builds that mapping (`speculative_config`, also written
into trtllm-serve `--config` files by the builder and into Triton model settings), the
`tensorrt_llm.LLM` arguments (`llm_arguments`, a pure function tested everywhere) and
`TrtllmEngine`, an `Engine` over `LLM.generate_async(..., streaming=True)` that the scheduler,
the OpenAI server, the Triton model and the bench drive exactly like the torch engine.

Upstream files checked (NVIDIA/TensorRT-LLM):
- tensorrt_llm/llmapi/llm.py: `LLM.generate_async(inputs, sampling_params, streaming=False)`;
  token-id lists are accepted as inputs;
- tensorrt_llm/executor/result.py: the returned result iterates synchronously (`__next__` blocks
  for the next response), `finished`, `abort()`, `outputs[0].token_ids` (cumulative) and
  `outputs[0].finish_reason` in {stop, length, timeout, cancelled};
- tensorrt_llm/llmapi/llm_utils.py (llm_args.py in newer releases):
  `update_llm_args_with_extra_dict(llm_args, extra)` turns a `speculative_config` mapping into
  its DecodingBaseConfig (keyed by decoding_type), as trtllm-serve does with `--config`;
- the DFlash rules the mapping obeys (pinned release: dflash_trt/trtllm_release.py):
  `max_draft_len + 1 <= drafter block_size` (tensorrt_llm/_torch/speculative/dflash.py
  @00679c66c3e38f6d2651ad0a5bef0f94d862e36c, DFlashWorker raises otherwise);
  `attention_backend` VANILLA by default, TRTLLM only on SM100/SM103 (`is_sm_100f`,
  tensorrt_llm/_torch/speculative/dflash_attention.py @0352547de78ebe7ff7657f801631ca5ce04d888c),
  so it is picked from the GPU (`dflash_attention_backend`), never as a blanket default;
  the drafter's context arena is sized by `max_seq_len`, so it is always passed explicitly.
Multi-rank models (the Triton model's `mpi: world`), as TensorRT-LLM's LLM-API Triton model does
(triton_backend/all_models/llmapi/tensorrt_llm/1/model.py @044a90d209e380c95e23e8ae42f3583fa05ada78):
rank 0 of MPI COMM_WORLD builds `MpiCommSession(comm=COMM_WORLD, n_workers=size)` and passes it
as the LLM's `_mpi_session`; every other rank serves it from `MPICommExecutor(COMM_WORLD)` until
the leader shuts down. A single process instead drops the MPI job variables it inherited (the
same set upstream clears) so TensorRT-LLM can spawn its own workers.
Step statistics: TensorRT-LLM streams one response per iteration (stream_interval 1, its default),
so a response of n new tokens after the first is one verification step with n - 1 accepted drafts.
NOT EXECUTED in this project's CI: TensorRT-LLM cannot be installed there. The tests drive this
module with a stand-in `LLM` (tests/runtime/test_backends.py); tests/gpu/ runs the real one.
"""
from __future__ import annotations

import importlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, MutableMapping, Sequence as Seq

from dflash_trt.config import DrafterConfig, TargetInfo, check_block_size
from dflash_trt.engine import (EngineConfig, GenerationResult, SamplingParams, Sequence, StepOutput, StepStat,
                               check_request, run_to_completion, stamp_finished)
from dflash_trt.errors import BackendUnavailableError, CheckpointError, ConfigError, DFlashError, InputError
from dflash_trt.runtime.factory import LoadConfig, TrtllmOptions, load_tokenizer
from dflash_trt.trtllm_release import DECODING_TYPE, pinned

log = logging.getLogger(__name__)

# MPI job state a process inherits from mpirun / srun (config variables such as OMPI_MCA_* stay)
MPI_JOB_ENV = frozenset({
    "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_NODE_RANK", "OMPI_UNIVERSE_SIZE", "OMPI_FIRST_RANKS", "OMPI_APP_CTX_NUM_PROCS",
    "PMIX_RANK", "PMIX_NAMESPACE", "PMIX_SERVER_URI", "PMIX_SERVER_URI2", "PMIX_SERVER_URI21", "PMIX_SERVER_URI3",
    "PMIX_SERVER_TMPDIR", "PMIX_SYSTEM_TMPDIR", "PMIX_SECURITY_MODE", "PMIX_GDS_MODULE", "PMIX_BFROPS_MODULE",
    "PMIX_PTL_MODULE", "PMIX_VERSION", "PMIX_HOSTNAME", "PMI_RANK", "PMI_SIZE", "PMI_FD", "PMI_SPAWNED", "PMI_APPNUM",
})
MPI_JOB_ENV_PREFIXES = ("OMPI_MCA_orte_", "ORTE_")
TRTLLM_ATTENTION_SM = ((10, 0), (10, 3))  # DFlash attention_backend TRTLLM: Blackwell B200/GB200, B300/GB300
TRTLLM_FINISH = ("stop", "length", "timeout", "cancelled")  # CompletionOutput.finish_reason; passed through
KV_ITEMSIZE = 2  # bytes per KV element in TensorRT-LLM (bf16/fp16 caches): the default max_seq_len budget


def dflash_attention_backend(capability: tuple[int, int], requested: str | None = None) -> str:
    """DFlashDecodingConfig.attention_backend for a GPU of compute `capability`: TRTLLM on SM100 /
    SM103, VANILLA (upstream's default) elsewhere; a requested one is checked against the pinned
    release's values and TRTLLM against the GPU."""
    allowed = pinned().allowed("DFlashDecodingConfig.attention_backend")
    if requested is None:
        return "TRTLLM" if tuple(capability) in TRTLLM_ATTENTION_SM else "VANILLA"
    if requested not in allowed:
        raise ConfigError(f"speculative_config.attention_backend must be one of {', '.join(allowed)}, "
                          f"got '{requested}'")
    if requested == "TRTLLM" and tuple(capability) not in TRTLLM_ATTENTION_SM:
        raise ConfigError(f"DFlash attention_backend TRTLLM needs a Blackwell SM100/SM103 GPU (B200/GB200, "
                          f"B300/GB300); this one is SM{capability[0]}{capability[1]}: use VANILLA")
    return requested


def speculative_config(drafter_dir: Path, drafter: DrafterConfig, max_draft_len: int, *,
                       use_rejection_sampling: bool = False, attention_backend: str | None = None) -> dict:
    """THE `speculative_config` mapping TensorRT-LLM reads (LLM API, trtllm-serve --config YAML).

    mask_token_id and target_layer_ids are the drafter's own (they are trained in);
    use_rejection_sampling is written when asked for; attention_backend when the caller picked
    one for its GPU (dflash_attention_backend). max_draft_len + 1 must fit the drafter's block."""
    if max_draft_len < 1:
        raise ConfigError(f"max_draft_len must be >= 1, got {max_draft_len}")
    check_block_size(max_draft_len + 1, drafter.block_size, str(drafter_dir))
    cfg = {"decoding_type": DECODING_TYPE, "max_draft_len": max_draft_len, "speculative_model": str(drafter_dir),
           "mask_token_id": drafter.mask_token_id, "target_layer_ids": list(drafter.target_layer_ids)}
    if use_rejection_sampling:
        cfg["use_rejection_sampling"] = True
    if attention_backend is not None:
        allowed = pinned().allowed("DFlashDecodingConfig.attention_backend")
        if attention_backend not in allowed:
            raise ConfigError(f"attention_backend must be one of {', '.join(allowed)}, got '{attention_backend}'")
        cfg["attention_backend"] = attention_backend
    return cfg


def drop_inherited_mpi_job(environ: MutableMapping[str, str]) -> list[str]:
    """Remove the inherited MPI job variables from `environ` (before mpi4py or tensorrt_llm is
    imported in this process); returns the names removed."""
    gone = sorted(k for k in environ if k in MPI_JOB_ENV or k.startswith(MPI_JOB_ENV_PREFIXES))
    for key in gone:
        del environ[key]
    return gone


def mpi_world() -> tuple[int, int]:
    """(rank, size) of MPI COMM_WORLD for this process."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise BackendUnavailableError(f"mpi: world needs mpi4py ({exc}): pip install mpi4py") from exc
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def serve_mpi_leader() -> None:
    """A non-leader rank: run the tasks rank 0's MPI session sends until the leader shuts it down."""
    from mpi4py import MPI
    from mpi4py.futures import MPICommExecutor

    with MPICommExecutor(MPI.COMM_WORLD) as executor:
        if executor is not None:
            raise DFlashError(f"rank {MPI.COMM_WORLD.Get_rank()} got the MPI executor: only rank 0 leads")


def leader_mpi_session(size: int):
    """Rank 0's TensorRT-LLM session over the whole MPI world (the LLM's `_mpi_session`)."""
    from mpi4py import MPI

    llmapi = importlib.import_module("tensorrt_llm.llmapi")
    return llmapi.MpiCommSession(comm=MPI.COMM_WORLD, n_workers=size)


@dataclass(frozen=True)
class TrtllmApi:
    """The TensorRT-LLM entry points the adapter calls (`import_tensorrt_llm` fills it)."""

    LLM: Callable[..., Any]
    SamplingParams: Callable[..., Any]
    update_llm_args: Callable[[dict, dict], dict]  # update_llm_args_with_extra_dict
    device_capability: Callable[[], tuple[int, int]]  # of the GPU the LLM runs on (torch.cuda)


def import_tensorrt_llm() -> TrtllmApi:
    """TensorRT-LLM's entry points; BackendUnavailableError (one line) without the package or a GPU."""
    try:
        trtllm = importlib.import_module("tensorrt_llm")
        llm_utils = importlib.import_module("tensorrt_llm.llmapi.llm_utils")
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the trtllm backend needs TensorRT-LLM (import failed: {exc}); run on a CUDA machine with it "
            "(e.g. the nvcr.io/nvidia/tensorrt-llm/release image, docker/Dockerfile) or use --backend torch") from exc
    import torch

    if not torch.cuda.is_available():
        raise BackendUnavailableError("the trtllm backend needs a CUDA GPU and none is visible: use --backend torch")
    return TrtllmApi(trtllm.LLM, trtllm.SamplingParams, llm_utils.update_llm_args_with_extra_dict,
                     lambda: tuple(torch.cuda.get_device_capability(0)))


def llm_arguments(load: LoadConfig, config: EngineConfig, options: TrtllmOptions,
                  draft: tuple[DrafterConfig, int] | None, capability: tuple[int, int]) -> tuple[dict, dict]:
    """(base, extra) for `update_llm_args_with_extra_dict` -> `tensorrt_llm.LLM(**args)`. `draft` is
    (drafter config, block size) when speculative; `capability` is the GPU's compute capability
    (it picks the drafter's attention backend). A key in options.llm_args that this adapter sets
    from the engine config must agree with it (one place for every setting); a partial
    `speculative_config` there adds DFlashDecodingConfig keys (max_concurrency, attention_backend...)
    to the adapter's own mapping. max_seq_len is always passed (it sizes the drafter's context arena)."""
    if config.draft_confidence:  # 0: the whole block, what TensorRT-LLM verifies
        raise ConfigError(f"draft_confidence {config.draft_confidence} is a torch-backend setting: TensorRT-LLM's "
                          "DFlash verifies every draft it proposes; drop --draft-confidence with --backend trtllm")
    if config.ngram_lookup:
        raise ConfigError(f"ngram_lookup {config.ngram_lookup} is a torch-backend setting: TensorRT-LLM's DFlash "
                          "drafts with the drafter only; drop --ngram-lookup with --backend trtllm")
    if config.draft_len_schedule is not None:
        # upstream's key convention is not one across versions: keys as lower bounds ({1: 7, 4: 3, 8: 0};
        # _torch/speculative/drafter.py get_draft_len_for_batch_size, "largest threshold <= batch_size") in
        # some, keys as upper bounds ({4: 4, 8: 2, 32: 1} = 4 drafts up to 4 rows, 0 above 32; the
        # DecodingBaseConfig.draft_len_schedule description in llmapi/llm_args.py, where max_concurrency N
        # becomes {N: max_draft_len}) in others; so ours is not translated
        raise ConfigError("draft_len_schedule is not translated for TensorRT-LLM (its key convention differs between "
                          "releases): set speculative_config.draft_len_schedule in the serve --config YAML in the "
                          "convention of your release, and drop --draft-len-schedule")
    base = {"model": str(Path(load.target).absolute()), "backend": "pytorch",
            "max_batch_size": config.max_batch_size, "max_seq_len": config.max_seq_len}
    extra = {k: v for k, v in options.llm_args.items() if k != "speculative_config"}
    given = dict(options.llm_args["speculative_config"]) if "speculative_config" in options.llm_args else {}
    own = dict(base)
    if draft is not None:
        drafter, block = draft
        requested = given["attention_backend"] if "attention_backend" in given else None
        spec = speculative_config(
            Path(load.drafter).absolute(), drafter, block - 1, use_rejection_sampling=config.acceptance == "rejection",
            attention_backend=dflash_attention_backend(capability, requested))
        spec_clashes = [k for k in given if k in spec and given[k] != spec[k]]
        if spec_clashes:
            raise ConfigError(f"llm_args speculative_config {spec_clashes} disagree with the engine and drafter "
                              f"({ {k: spec[k] for k in spec_clashes} }): set them in one place")
        extra["speculative_config"] = spec | given
    elif "speculative_config" in options.llm_args:
        raise ConfigError("llm_args sets speculative_config but the engine is autoregressive: give a drafter "
                          "and leave speculative_config to the adapter")
    clashes = [k for k in own if k in extra and extra[k] != own[k]]
    if clashes:
        raise ConfigError(f"llm_args {clashes} disagree with the engine settings ({ {k: own[k] for k in clashes} }): "
                          "set them in one place (the engine config, the drafter, the target path)")
    return base, {k: v for k, v in extra.items() if k not in base}


@dataclass
class TrtllmModels:
    """The trtllm backend, loaded: what this process needs around TensorRT-LLM (tokenizer, target
    sizes); the weights are loaded by `tensorrt_llm.LLM` when an engine is made."""

    backend: ClassVar[str] = "trtllm"
    load: LoadConfig
    api: TrtllmApi
    info: TargetInfo
    tokenizer: object | None
    options: TrtllmOptions

    def engine(self, config: EngineConfig) -> "TrtllmEngine":
        return TrtllmEngine(self.api, self.load, self.info, config, self.options,
                            self.detokenize if self.tokenizer is not None else None)

    def detokenize(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise ConfigError("this target has no tokenizer")
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def shutdown(self) -> None:
        """Each engine owns its LLM (TrtllmEngine.shutdown)."""


def load_trtllm(load: LoadConfig, options: TrtllmOptions, api: TrtllmApi | None = None) -> TrtllmModels:
    """Check the backend can run (before anything is read), then the checkpoint directories."""
    api = api if api is not None else import_tensorrt_llm()
    if load.target_backend != "native":
        raise ConfigError("--target-backend hf is a torch-backend option: drop it with --backend trtllm")
    from dflash_trt.models.target import load_hf_config

    if load.drafter is not None:
        if not (Path(load.drafter) / "config.json").is_file():
            raise CheckpointError(f"drafter directory {load.drafter} has no config.json")
        from dflash_trt.checkpoint.layout import check_unscaled_drafter

        check_unscaled_drafter(Path(load.drafter))  # TensorRT-LLM's DFlash drafter runs unscaled weights
    info = TargetInfo.from_hf_config(load_hf_config(Path(load.target)))
    log.info("trtllm backend: TensorRT-LLM picks the weights' dtype itself (dtype %s applies to the torch backend)",
             load.dtype)
    return TrtllmModels(load=load, api=api, info=info, tokenizer=load_tokenizer(Path(load.target)), options=options)


class TrtllmEngine:
    """The trtllm backend's `Engine`: requests run in TensorRT-LLM's own in-flight batcher; `add` and
    `step` collect each active request's next streamed response."""

    def __init__(self, api: TrtllmApi, load: LoadConfig, info: TargetInfo, config: EngineConfig,
                 options: TrtllmOptions, detokenize: Callable[[list[int]], str] | None) -> None:
        drafter = DrafterConfig.load(Path(load.drafter)) if config.speculative and load.drafter is not None else None
        if config.speculative and drafter is None and config.block_size not in (None, 1):
            raise ConfigError("speculative decoding needs a drafter (or run with speculative=False)")
        # TensorRT-LLM runs on a GPU and verifies every draft it proposes: the whole block (on_device)
        config = config.for_models(info, None if drafter is None else drafter.block_size, KV_ITEMSIZE).on_device("cuda")
        self.api, self.info, self.config, self.detokenize = api, info, config, detokenize
        self.speculative = drafter is not None and config.block_size != 1
        self.block_size = (config.block_size or drafter.block_size) if self.speculative else 1
        base, extra = llm_arguments(load, config, options, (drafter, self.block_size) if self.speculative else None,
                                    api.device_capability())
        log.info("starting tensorrt_llm.LLM with %s + %s", base, extra)
        session = {} if options.mpi_session is None else {"_mpi_session": options.mpi_session}
        self.llm = api.LLM(**api.update_llm_args(base, extra), **session)
        self.active: list[Sequence] = []
        self._results: dict[int, Any] = {}  # id(sequence) -> TensorRT-LLM's streaming result
        self._ids = 0

    @property
    def free_rows(self) -> int:
        return self.config.max_batch_size - len(self.active)

    def make_sequence(self, prompt: Seq[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        prompt, max_new = check_request(prompt, params, self.info.vocab_size, self.config.max_seq_len,
                                        self.detokenize is not None)
        self._ids += 1
        return Sequence(request_id=request_id or f"req-{self._ids}", prompt=prompt, params=params,
                        max_new_tokens=max_new)

    def _sampling_params(self, s: Sequence):
        p = s.params
        return self.api.SamplingParams(
            max_tokens=s.max_new_tokens, temperature=p.temperature, top_k=p.top_k or None, top_p=p.top_p,
            seed=p.seed, stop_token_ids=list(p.stop_token_ids) or None, stop=list(p.stop) or None,
            ignore_eos=p.ignore_eos)

    def add(self, seqs: list[Sequence]) -> list[StepOutput]:
        """Submit the requests, then wait for each one's first response (its prefill token)."""
        if len(seqs) > self.free_rows:
            raise InputError(f"{len(seqs)} sequences do not fit: {self.free_rows} free rows")
        for s in seqs:
            self._results[id(s)] = self.llm.generate_async(s.prompt, sampling_params=self._sampling_params(s),
                                                           streaming=True)
            self.active.append(s)
        outputs = [StepOutput(s, self._advance(s, first=True)) for s in seqs]
        self._retire()
        return outputs

    def step(self) -> list[StepOutput]:
        outputs = [StepOutput(s, self._advance(s, first=False)) for s in list(self.active)]
        self._retire()
        return outputs

    def _advance(self, s: Sequence, first: bool) -> list[int]:
        result = self._results[id(s)]
        if result.finished:
            return []
        next(result)  # blocks until this request's next response
        out = result.outputs[0]
        new = [int(t) for t in out.token_ids[len(s.tokens):]]
        s.tokens.extend(new)
        if first:
            s.first_token_s = time.perf_counter()
        elif new:
            s.steps.append(StepStat(draft_tokens=self.block_size - 1, accepted=len(new) - 1))
        if result.finished:
            if out.finish_reason not in TRTLLM_FINISH:
                raise DFlashError(f"TensorRT-LLM finished request {s.request_id} without a known finish reason "
                                  f"({out.finish_reason!r}; expected one of {TRTLLM_FINISH})")
            s.finish_reason = out.finish_reason
        return new

    def cancel(self, s: Sequence) -> None:
        if s.finished:
            return
        self._results[id(s)].abort()
        s.finish_reason = "cancelled"
        self._retire()

    def _retire(self) -> None:
        for s in stamp_finished(self.active):
            del self._results[id(s)]
        self.active = [s for s in self.active if not s.finished]

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams] = SamplingParams(),
                 progress: Callable[[int], None] | None = None) -> list[GenerationResult]:
        return run_to_completion(self, prompts, params, progress)

    def shutdown(self) -> None:
        self.llm.shutdown()


__all__ = ["DECODING_TYPE", "TRTLLM_ATTENTION_SM", "TrtllmApi", "TrtllmEngine", "TrtllmModels",
           "dflash_attention_backend", "drop_inherited_mpi_job", "import_tensorrt_llm", "leader_mpi_session",
           "mpi_world", "serve_mpi_leader", "llm_arguments", "load_trtllm", "speculative_config"]
