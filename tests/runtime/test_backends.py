"""Both backends behind the engine seam: the same requests through the torch engine and the TensorRT-LLM
adapter give the same results under the same contract (validation, generate, the scheduler's events,
cancellation).

TensorRT-LLM cannot be installed here, so the adapter runs against `FakeLLM`, a stand-in for
`tensorrt_llm.LLM` that records how it was built and what it was asked, and streams, like
TensorRT-LLM's `generate_async(streaming=True)` does (one response per iteration; cumulative
`outputs[0].token_ids`; `finished`; `abort()`), the tokens our torch engine commits per step for the
same request. tests/gpu/test_trtllm_backend.py runs the real one.
"""
from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest

from dflash_trt.cli import main
from dflash_trt.config import DrafterConfig
from dflash_trt.engine import CPU_DRAFT_CONFIDENCE, Engine, EngineConfig, SamplingParams
from dflash_trt.errors import BackendUnavailableError, ConfigError, ContextLengthError, InputError
from dflash_trt.models.tiny import save_tiny_checkpoint
from dflash_trt.runtime.scheduler import ErrorEvent, FinalEvent, Scheduler, TokenEvent
from dflash_trt.runtime.factory import LoadConfig, TrtllmOptions, load_backend
from dflash_trt.runtime.trtllm import (TrtllmApi, dflash_attention_backend, llm_arguments, load_trtllm,
                                      speculative_config)

BLOCK, NEW, MAX_SEQ = 4, 12, 128
PROMPTS = [[1, 5, 6, 7, 8], [3, 9, 10]]


class FakeSamplingParams:
    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs


class FakeOutput:
    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None


class FakeResult:
    """One streaming request: each next() delivers the next chunk."""

    def __init__(self, chunks: list[list[int]], finish_reason: str) -> None:
        self.chunks, self.reason = list(chunks), finish_reason
        self.outputs, self.finished, self.aborted = [FakeOutput()], False, False

    def __next__(self) -> "FakeResult":
        if self.finished:
            raise StopIteration
        self.outputs[0].token_ids.extend(self.chunks.pop(0))
        if not self.chunks:
            self.finished, self.outputs[0].finish_reason = True, self.reason
        return self

    def abort(self) -> None:
        self.aborted, self.finished, self.outputs[0].finish_reason = True, True, "cancelled"


class FakeLLM:
    """Records LLM(**kwargs) and generate_async calls; answers with the torch oracle's steps."""

    made: list["FakeLLM"] = []

    def __init__(self, **kwargs) -> None:
        self.kwargs, self.requests, self.results, self.closed = kwargs, [], [], False
        spec = kwargs.get("speculative_config")
        load = LoadConfig(Path(kwargs["model"]), Path(spec["speculative_model"]) if spec else None, dtype="float64")
        config = EngineConfig(block_size=spec["max_draft_len"] + 1 if spec else None, max_batch_size=1,
                              max_seq_len=kwargs["max_seq_len"], speculative=spec is not None,
                              draft_confidence=0.0)  # TensorRT-LLM verifies every draft it proposes
        self.oracle = load_backend("torch", load).engine(config)
        FakeLLM.made.append(self)

    def generate_async(self, inputs, sampling_params, streaming: bool) -> FakeResult:
        assert streaming and isinstance(inputs, list)
        self.requests.append((list(inputs), sampling_params.kwargs))
        kw = sampling_params.kwargs
        params = SamplingParams(max_new_tokens=kw["max_tokens"], ignore_eos=kw["ignore_eos"])
        seq = self.oracle.make_sequence(inputs, params)
        chunks = [out.new_tokens for out in self.oracle.add([seq])]
        while not seq.finished:
            chunks += [out.new_tokens for out in self.oracle.step()]
        self.results.append(FakeResult(chunks, seq.finish_reason))
        return self.results[-1]

    def shutdown(self) -> None:
        self.closed = True


FAKE_API = TrtllmApi(LLM=FakeLLM, SamplingParams=FakeSamplingParams, update_llm_args=lambda base, extra: base | extra,
                     device_capability=lambda: (9, 0))  # a Hopper GPU: the drafter gets VANILLA attention


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("backends"), "qwen3", block_size=BLOCK)


def open_models(backend: str, ckpt):
    load = LoadConfig(ckpt[0], ckpt[1], dtype="float64")
    return load_backend("torch", load) if backend == "torch" else load_trtllm(load, TrtllmOptions(), api=FAKE_API)


@pytest.fixture(scope="module")
def engines(ckpt):
    # whole blocks on both (the torch engine's CPU default truncates drafts; TensorRT-LLM never does), so
    # the two give the same steps, not only the same tokens
    config = EngineConfig(max_batch_size=2, max_seq_len=MAX_SEQ, draft_confidence=0.0)
    out = {b: open_models(b, ckpt).engine(config) for b in ("torch", "trtllm")}
    yield out
    for engine in out.values():
        engine.shutdown()


@pytest.mark.parametrize("backend", ["torch", "trtllm"])
def test_both_engines_validate_requests_alike(engines, backend):
    engine = engines[backend]
    assert isinstance(engine, Engine) and engine.speculative and engine.block_size == BLOCK
    with pytest.raises(InputError, match="the prompt is empty"):
        engine.make_sequence([], SamplingParams())
    with pytest.raises(InputError, match="outside the vocabulary"):
        engine.make_sequence([10**6], SamplingParams())
    with pytest.raises(ContextLengthError, match="lower max_new_tokens to at most 123"):
        engine.make_sequence(PROMPTS[0], SamplingParams(max_new_tokens=500))


def test_draft_confidence_defaults_follow_the_device(ckpt):
    """Unset, draft_confidence is CPU_DRAFT_CONFIDENCE on a CPU torch engine and the whole block with
    TensorRT-LLM (which has no such setting); a value set is kept on the torch engine."""
    default = EngineConfig(max_batch_size=1, max_seq_len=MAX_SEQ)
    torch_models, trt_models = open_models("torch", ckpt), open_models("trtllm", ckpt)
    assert default.draft_confidence is None
    assert torch_models.engine(default).config.draft_confidence == CPU_DRAFT_CONFIDENCE > 0
    trt = trt_models.engine(default)
    assert trt.config.draft_confidence == 0.0
    trt.shutdown()
    assert torch_models.engine(replace(default, draft_confidence=0.0)).config.draft_confidence == 0.0
    assert torch_models.engine(replace(default, draft_confidence=0.3)).config.draft_confidence == 0.3
    assert default.on_device("cuda").draft_confidence == 0.0 and default.on_device("cpu").draft_confidence > 0


def test_the_same_requests_give_the_same_results(engines, ckpt):
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    torch_res, trt_res = (engines[b].generate(PROMPTS, params) for b in ("torch", "trtllm"))
    for a, b in zip(torch_res, trt_res):
        assert a.tokens == b.tokens and len(a.tokens) == NEW
        assert a.steps == b.steps  # drafted / accepted per verification step, from the streamed chunk sizes
        assert a.finish_reason == b.finish_reason == "length"
        assert a.prompt_tokens == b.prompt_tokens
    llm = engines["trtllm"].llm  # the LLM this engine made (other tests make more)
    drafter = DrafterConfig.load(ckpt[1])
    assert llm.kwargs == {"model": str(ckpt[0].absolute()), "backend": "pytorch", "max_batch_size": 2,
                          "max_seq_len": MAX_SEQ,
                          "speculative_config": speculative_config(ckpt[1].absolute(), drafter, BLOCK - 1,
                                                                   attention_backend="VANILLA")}
    assert llm.kwargs["speculative_config"]["target_layer_ids"] == list(drafter.target_layer_ids)
    assert [r[0] for r in llm.requests[-2:]] == PROMPTS
    assert llm.requests[-1][1] == {"max_tokens": NEW, "temperature": 0.0, "top_k": None, "top_p": 1.0, "seed": None,
                                   "stop_token_ids": None, "stop": None, "ignore_eos": True}


@pytest.mark.parametrize("backend", ["torch", "trtllm"])
def test_the_scheduler_drives_either_engine_and_cancels(ckpt, backend):
    models = open_models(backend, ckpt)
    engine = models.engine(EngineConfig(max_batch_size=2, max_seq_len=MAX_SEQ))
    scheduler = Scheduler(engine)
    done = scheduler.submit(PROMPTS[0], SamplingParams(max_new_tokens=6, ignore_eos=True))
    cancelled = scheduler.submit(PROMPTS[1], SamplingParams(max_new_tokens=40, ignore_eos=True))
    scheduler.run_once()
    cancelled.cancel()
    for _ in range(20):
        scheduler.run_once()
    events = {}
    for name, handle in (("done", done), ("cancelled", cancelled)):
        got = handle.drain()
        assert not any(isinstance(e, ErrorEvent) for e in got)
        assert all(isinstance(e, TokenEvent) for e in got[:-1]) and isinstance(got[-1], FinalEvent)
        events[name] = got[-1].result
    assert events["done"].finish_reason == "length" and len(events["done"].tokens) == 6
    assert events["cancelled"].finish_reason == "cancelled" and len(events["cancelled"].tokens) < 40
    assert not engine.active
    if backend == "trtllm":
        assert FakeLLM.made[-1].results[-1].aborted  # the cancel reached TensorRT-LLM
    engine.shutdown()


def test_llm_arguments_keep_one_place_per_setting(ckpt):
    load = LoadConfig(ckpt[0], ckpt[1])
    drafter = DrafterConfig.load(ckpt[1])
    config = EngineConfig(max_batch_size=4, max_seq_len=256, acceptance="rejection")
    base, extra = llm_arguments(load, config, TrtllmOptions({"tensor_parallel_size": 8}), (drafter, BLOCK), (10, 3))
    assert extra["tensor_parallel_size"] == 8 and base["max_seq_len"] == 256  # max_seq_len always explicit
    assert extra["speculative_config"] == {**speculative_config(ckpt[1].absolute(), drafter, BLOCK - 1),
                                           "use_rejection_sampling": True, "attention_backend": "TRTLLM"}
    # a file's extra DFlash keys join the adapter's mapping; its own keys must agree
    given = {"speculative_config": {"max_concurrency": 4, "attention_backend": "VANILLA"}}
    _, extra = llm_arguments(load, config, TrtllmOptions(given), (drafter, BLOCK), (10, 0))
    assert extra["speculative_config"]["max_concurrency"] == 4
    assert extra["speculative_config"]["attention_backend"] == "VANILLA"
    with pytest.raises(ConfigError, match="speculative_config .'max_draft_len'. disagree"):
        llm_arguments(load, config, TrtllmOptions({"speculative_config": {"max_draft_len": 1}}), (drafter, BLOCK), (9, 0))
    with pytest.raises(ConfigError, match="max_batch_size"):
        llm_arguments(load, config, TrtllmOptions({"max_batch_size": 16}), (drafter, BLOCK), (9, 0))
    with pytest.raises(ConfigError, match="autoregressive"):
        llm_arguments(load, config, TrtllmOptions({"speculative_config": {}}), None, (9, 0))
    with pytest.raises(ConfigError, match="max_draft_len"):
        speculative_config(ckpt[1], drafter, 0)
    # torch-only draft-length settings are refused, not dropped
    for setting, message in [({"draft_confidence": 0.1}, "torch-backend setting"), ({"ngram_lookup": 3}, "torch-backend setting"),
                             ({"draft_len_schedule": ((1, 3), (4, 0))}, "not translated")]:
        with pytest.raises(ConfigError, match=message):
            llm_arguments(load, replace(config, **setting), TrtllmOptions({}), (drafter, BLOCK), (9, 0))


@pytest.mark.parametrize("capability, requested, expected", [
    ((10, 0), None, "TRTLLM"), ((10, 3), None, "TRTLLM"),  # B200 / B300
    ((9, 0), None, "VANILLA"), ((12, 0), None, "VANILLA"), ((8, 9), None, "VANILLA"),  # never a blanket TRTLLM
    ((9, 0), "FA4", "FA4"), ((10, 0), "VANILLA", "VANILLA"),
    ((9, 0), "TRTLLM", "needs a Blackwell SM100/SM103 GPU"), ((10, 0), "FLASHINFER", "must be one of"),
])
def test_the_drafter_attention_backend_follows_the_gpu(capability, requested, expected):
    if expected.isupper() and " " not in expected:
        assert dflash_attention_backend(capability, requested) == expected
    else:
        with pytest.raises(ConfigError, match=expected):
            dflash_attention_backend(capability, requested)


def test_the_trtllm_backend_refuses_a_quantized_drafter(ckpt, tmp_path):
    """TensorRT-LLM's DFlash draft model runs unscaled weights: --backend trtllm with an FP8
    drafter stops before any LLM is made, saying what to use."""
    from dflash_trt.checkpoint.modelopt_hf import write_drafter
    from dflash_trt.errors import CheckpointError
    from dflash_trt.models.drafter import DFlashDrafter

    fp8 = write_drafter(DFlashDrafter.from_pretrained(ckpt[1]), tmp_path / "fp8", "FP8")
    with pytest.raises(CheckpointError, match="needs the BF16 \\(unquantized\\) drafter"):
        load_trtllm(LoadConfig(ckpt[0], fp8), TrtllmOptions(), api=FAKE_API)


def test_max_draft_len_must_fit_the_drafter_block(ckpt):
    """Upstream's DFlashWorker refuses max_draft_len + 1 > the drafter's block_size."""
    drafter = DrafterConfig.load(ckpt[1])
    assert speculative_config(ckpt[1], drafter, drafter.block_size - 1)["max_draft_len"] == drafter.block_size - 1
    with pytest.raises(ConfigError, match=f"lower max_draft_len to at most {drafter.block_size - 1}"):
        speculative_config(ckpt[1], drafter, drafter.block_size)
    with pytest.raises(ConfigError, match="at most"):
        llm_arguments(LoadConfig(ckpt[0], ckpt[1]), EngineConfig(block_size=drafter.block_size + 1), TrtllmOptions(),
                      (drafter, drafter.block_size + 1), (9, 0))


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None, reason="TensorRT-LLM is installed")
@pytest.mark.parametrize("command", ["generate", "serve", "bench", "triton-repo"])
def test_trtllm_backend_without_tensorrt_llm_is_one_line_exit_2(command, capsys, tmp_path):
    args = {"generate": ["--prompt-ids", "1,2"], "serve": [], "bench": ["--output", str(tmp_path)],
            "triton-repo": ["--output", str(tmp_path)]}[command]
    assert main([command, "--backend", "trtllm", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the trtllm backend needs TensorRT-LLM" in err[0] and "--backend torch" in err[0]
    with pytest.raises(BackendUnavailableError):
        load_backend("trtllm", LoadConfig(tmp_path, None))


def test_an_mpi_session_reaches_the_llm(ckpt):
    """The Triton model's `mpi: world` leader hands its MpiCommSession to TensorRT-LLM as `_mpi_session`
    (as upstream's LLM-API Triton model does); without one the LLM spawns its own workers."""
    session = object()
    load = LoadConfig(ckpt[0], ckpt[1], dtype="float64")
    engine = load_trtllm(load, TrtllmOptions(mpi_session=session), api=FAKE_API).engine(EngineConfig(max_seq_len=MAX_SEQ))
    assert FakeLLM.made[-1].kwargs["_mpi_session"] is session
    engine.shutdown()
    engine = load_trtllm(load, TrtllmOptions(), api=FAKE_API).engine(EngineConfig(max_seq_len=MAX_SEQ))
    assert "_mpi_session" not in FakeLLM.made[-1].kwargs
    engine.shutdown()
