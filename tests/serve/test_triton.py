"""A REAL Triton Inference Server (nvidia-pytriton's bundled tritonserver + Python backend) serving
two DFlash models written by `dflash-trt triton-repo` for a tiny float64 checkpoint: `tiny`, unary
(upstream's default, decoupled: false) and `tiny_stream` (--decoupled). Requests use the input
names of TensorRT-LLM's LLM-API Triton model, as a client written for it would.

One server for the module, on free loopback ports. Budget: ~60-120 s, mostly server start-up
(the Python stubs import torch and load the models). The stubs import dflash_trt from the
working directory first (Triton's Python stub runs isolated: '' leads sys.path, PYTHONPATH is
ignored), so run the tests from the repository root.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pytriton", reason="nvidia-pytriton is not installed: pip install -e '.[triton]'")
grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is not installed: pip install -e '.[triton]'")

from dflash_trt import cli  # noqa: E402

MODEL = "tiny"  # unary
STREAM = "tiny_stream"  # decoupled
PROMPT = "Hello there, Triton!"
TOKENS = 24
MAX_SEQ_LEN = 256
SHM = Path("/dev/shm")
READY_TIMEOUT_S = 240


@contextlib.contextmanager
def one_thread():
    """In-process references use one torch thread: on a busy 2-core machine two spinning OpenMP
    threads per process make a tiny model ~20x slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Triton:
    process: subprocess.Popen  # `dflash-trt triton-serve` (which runs tritonserver)
    output: Path  # its stdout + stderr
    log: Path  # tritonserver's log
    http_port: int
    grpc_port: int
    target: Path
    drafter: Path
    model_flags: list[str]
    shm_before: set[str]

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v2/models/{MODEL}"

    @property
    def http_stream(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v2/models/{STREAM}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def shm_prefix(self) -> str:  # launcher.TritonServer's default for the CLI's pid and HTTP port
        return f"dflash_trt_{self.process.pid}_{self.http_port}_"

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/v2/health/ready", timeout=5) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.is_file() else ""


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    from dflash_trt.models.tiny import save_tiny_checkpoint

    tmp = tmp_path_factory.mktemp("triton")
    target, drafter = save_tiny_checkpoint(tmp / "ckpt", "llama", block_size=4)
    flags = ["--target", str(target), "--drafter", str(drafter), "--dtype", "float64", "--max-seq-len", str(MAX_SEQ_LEN)]
    for name, extra in ((MODEL, []), (STREAM, ["--decoupled"])):
        assert cli.main(["triton-repo", "--output", str(tmp / "repo"), "--model-name", name, "--max-batch-size", "4",
                         "--default-max-tokens", "16", "--torch-threads", "1", *extra, *flags]) == 0
    ports = set()
    while len(ports) < 3:
        ports.add(free_port())
    http, grpc, metrics = sorted(ports)
    shm_before = set(os.listdir(SHM))
    output, log = tmp / "triton-serve.out", tmp / "tritonserver.log"
    with open(output, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "dflash_trt.cli", "triton-serve", str(tmp / "repo"), "--http-port", str(http),
             "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--server-dir", str(tmp / "tritonserver"),
             "--log-file", str(log), "--ready-timeout", str(READY_TIMEOUT_S), "--exit-timeout", "10"],
            stdout=out, stderr=subprocess.STDOUT)
    triton = Triton(process, output, log, http, grpc, target, drafter, flags, shm_before)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S + 60
        while "ready: HTTP" not in output.read_text(errors="replace"):
            why = "exited" if process.poll() is not None else "is not ready" if time.monotonic() > deadline else None
            if why:
                pytest.fail(f"triton-serve {why}:\n{output.read_text()}\n--- tritonserver log ---\n{triton.log_text()[-4000:]}")
            time.sleep(0.25)
        yield triton
    finally:
        _stop(process)


def reference(triton: Triton, capsys, prompt: str, tokens: int) -> dict:
    """`dflash-trt generate --json` on the same checkpoint and engine flags, plus the prompt as the
    tokenizer decodes it (upstream's text_output leads with the input unless it is excluded)."""
    from transformers import AutoTokenizer

    capsys.readouterr()
    with one_thread():
        assert cli.main(["generate", "--prompt", prompt, "--max-new-tokens", str(tokens), "--json", *triton.model_flags]) == 0
    ref = json.loads(capsys.readouterr().out)
    tok = AutoTokenizer.from_pretrained(str(triton.target))
    ref["prompt_text"] = tok.decode(tok.encode(prompt), skip_special_tokens=True)
    return ref


def tensor(name: str, value, dtype: str):
    """One input as upstream's clients build it: a 1-element tensor (strings as BYTES)."""
    array = np.array([value.encode() if isinstance(value, str) else value],
                     dtype=np.object_ if isinstance(value, str) else None)
    t = grpcclient.InferInput(name, [1], dtype)
    t.set_data_from_numpy(array)
    return t


def inputs(prompt: str | None, **named) -> list:
    """named: input name -> (value, Triton dtype), e.g. sampling_param_max_tokens=(np.int32(8), "INT32")."""
    out = [tensor("text_input", prompt, "BYTES")] if prompt is not None else []
    return out + [tensor(name, value, dtype) for name, (value, dtype) in named.items()]


ASK_ALL = {"return_finish_reason": (True, "BOOL"), "return_stop_reason": (True, "BOOL"),
           "sampling_param_return_perf_metrics": (True, "BOOL")}
FINAL = ("finish_reason", "stop_reason", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens",
         "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")


def grpc_stream(triton: Triton, request: list, request_id: str = "", timeout: float = 60.0):
    """Send one request on a gRPC stream to the streaming model; returns (text of each response,
    final outputs dict, error or None)."""
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        client.async_stream_infer(STREAM, request, request_id=request_id, enable_empty_final_response=True)
        texts = []
        while True:
            result, error = events.get(timeout=timeout)
            if error is not None:
                return texts, None, error
            response = result.get_response()
            text = result.as_numpy("text_output")
            if text is not None:
                texts.append(text[0].decode())
            if response.parameters["triton_final_response"].bool_param:
                return texts, {name: result.as_numpy(name) for name in FINAL}, None
    finally:
        client.stop_stream()
        client.close()


def grpc_unary(triton: Triton, request: list, timeout: float = 60.0):
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    try:
        return client.infer(MODEL, request, client_timeout=timeout)
    finally:
        client.close()


def post(url: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_the_transaction_policy_comes_from_model_yaml(triton):
    for model, decoupled in ((MODEL, False), (STREAM, True)):
        with urllib.request.urlopen(f"http://127.0.0.1:{triton.http_port}/v2/models/{model}/config", timeout=10) as r:
            config = json.loads(r.read())
        assert config["max_batch_size"] == 0 and config["model_transaction_policy"]["decoupled"] is decoupled


def test_unary_http_request_like_upstream(triton, capsys):
    ref = reference(triton, capsys, PROMPT, TOKENS)
    body = {"text_input": PROMPT, "sampling_param_max_tokens": TOKENS, "return_finish_reason": True,
            "return_stop_reason": True, "sampling_param_return_perf_metrics": True}
    status, text = post(f"{triton.http}/generate", body)
    assert status == 200, text
    out = json.loads(text)
    assert out["text_output"] == ref["prompt_text"] + ref["text"]  # the input leads (upstream's default)
    assert out["finish_reason"] == ref["finish_reason"] and out["stop_reason"] == "None"
    drafted, accepted = out["total_draft_tokens"], out["total_accepted_draft_tokens"]
    assert drafted == sum(s["draft_tokens"] for s in ref["steps"]) and accepted == sum(s["accepted"] for s in ref["steps"])
    assert out["acceptance_rate"] == pytest.approx(accepted / drafted if drafted else 0.0)
    times = [out[k] for k in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")]
    assert times == sorted(times) and times[0] > 1.7e18  # wall-clock ns, in order
    status, text = post(f"{triton.http}/generate", {"text_input": PROMPT, "sampling_param_max_tokens": TOKENS,
                                                    "sampling_param_exclude_input_from_output": True})
    assert status == 200 and json.loads(text)["text_output"] == ref["text"]
    assert set(json.loads(text)) == {"model_name", "model_version", "text_output"}  # nothing unasked for


def test_unary_grpc_request_with_a_stop_string(triton, capsys):
    ref = reference(triton, capsys, PROMPT, TOKENS)
    stop = ref["text"][len(ref["text"]) // 2:][:2]
    assert stop, "the reference answer is long enough to stop inside it"
    result = grpc_unary(triton, inputs(PROMPT, sampling_param_max_tokens=(np.int32(TOKENS), "INT32"),
                                       sampling_param_exclude_input_from_output=(True, "BOOL"), **ASK_ALL) +
                        [_strings("sampling_param_stop", [stop])])
    text = result.as_numpy("text_output")[0].decode()
    assert text == ref["text"][:ref["text"].find(stop)]  # cut before the stop string
    assert result.as_numpy("finish_reason")[0] == b"stop" and result.as_numpy("stop_reason")[0].decode() == stop


def _strings(name: str, values: list[str]):
    t = grpcclient.InferInput(name, [len(values)], "BYTES")
    t.set_data_from_numpy(np.array([v.encode() for v in values], dtype=np.object_))
    return t


def test_streaming_responses_are_cumulative(triton, capsys):
    ref = reference(triton, capsys, PROMPT, TOKENS)
    texts, final, error = grpc_stream(triton, inputs(PROMPT, streaming=(True, "BOOL"),
                                                     sampling_param_max_tokens=(np.int32(TOKENS), "INT32"), **ASK_ALL))
    assert error is None and len(texts) > 2, "the answer arrives in several responses"
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), "each response carries the whole text so far"
    assert texts[-1] == ref["prompt_text"] + ref["text"] and texts[0].startswith(ref["prompt_text"])
    assert final["finish_reason"][0].decode() == ref["finish_reason"]
    assert int(final["total_draft_tokens"][0]) == sum(s["draft_tokens"] for s in ref["steps"])
    status, body = post(f"{triton.http_stream}/generate_stream",
                        {"text_input": PROMPT, "sampling_param_max_tokens": TOKENS, "streaming": True,
                         "sampling_param_exclude_input_from_output": True, "return_finish_reason": True})
    assert status == 200, body
    events = [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]
    assert len(events) > 2 and events[-1]["text_output"] == ref["text"]
    assert events[-1]["finish_reason"] == ref["finish_reason"] and "finish_reason" not in events[0]


def test_streaming_on_the_unary_model_is_refused(triton):
    status, text = post(f"{triton.http}/generate", {"text_input": "hi", "streaming": True})
    assert status == 400 and "only supported in decoupled mode" in json.loads(text)["error"]


def test_concurrent_unary_clients_all_complete(triton):
    import torch

    from dflash_trt.runtime.factory import LoadConfig, load_torch
    from dflash_trt.engine import EngineConfig, SamplingParams

    prompts = [f"client {i}: {'abc' * i}" for i in range(6)]
    models = load_torch(LoadConfig(target=triton.target, drafter=triton.drafter, dtype="float64"))
    engine = models.engine(EngineConfig(max_seq_len=MAX_SEQ_LEN, max_batch_size=1))
    with torch.inference_mode(), one_thread():
        expected = [models.detokenize(engine.generate([models.tokenizer.encode(p)], SamplingParams(max_new_tokens=20))[0].tokens)
                    for p in prompts]
    results: dict[int, str] = {}

    def client(i: int) -> None:
        result = grpc_unary(triton, inputs(prompts[i], sampling_param_max_tokens=(np.int32(20), "INT32"),
                                           sampling_param_exclude_input_from_output=(True, "BOOL")), timeout=120)
        results[i] = result.as_numpy("text_output")[0].decode()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == dict(enumerate(expected)), "every client gets its own greedy answer while sharing the batch"


@pytest.mark.parametrize("body, message", [
    ({"sampling_param_max_tokens": 4}, "text_input"),
    ({"text_input": "hi", "sampling_param_temperature": -1.0}, "temperature"),
    ({"text_input": "hi", "sampling_param_top_p": 0.0}, "top_p"),
    ({"text_input": "hi", "sampling_param_top_k": -3}, "top_k"),
    ({"text_input": "hi", "sampling_param_max_tokens": 0}, "max_new_tokens"),
    ({"text_input": "hi", "sampling_param_max_tokens": 100000}, "max_new_tokens"),
    ({"text_input": ""}, "empty"),
    # upstream inputs this model cannot honour: accepted by the schema, refused with the reason
    ({"text_input": "hi", "sampling_param_best_of": 3}, "best_of is 3"),
    ({"text_input": "hi", "sampling_param_presence_penalty": 0.5}, "penalties"),
    ({"text_input": "hi", "return_cumulative_logprob": True}, "no log-probabilities"),
    ({"text_input": "hi", "lora_name": "a", "lora_id": 1, "lora_path": "/x"}, "LoRA"),
    ({"text_input": "hi", "image_url": ["https://example.com/cat.png"]}, "text-only"),
])
def test_bad_http_requests_get_errors(triton, body, message):
    status, text = post(f"{triton.http}/generate", body)
    assert status == 400 and message in json.loads(text)["error"], text
    assert triton.is_ready()


def test_bad_grpc_requests_get_errors_and_the_model_stays_healthy(triton):
    _, _, error = grpc_stream(triton, inputs(None, sampling_param_max_tokens=(np.int32(4), "INT32")))
    assert error is not None and "text_input" in str(error)
    _, _, error = grpc_stream(triton, inputs("hi", sampling_param_temperature=(np.float64(0.5), "FP64")))
    assert error is not None and "FP32" in str(error)  # Triton checks dtypes against config.pbtxt
    two = grpcclient.InferInput("text_input", [2], "BYTES")
    two.set_data_from_numpy(np.array([b"a", b"b"], dtype=np.object_))
    _, _, error = grpc_stream(triton, [two])
    assert error is not None and "exactly one prompt" in str(error)
    _, final, error = grpc_stream(triton, inputs("still alive?", sampling_param_max_tokens=(np.int32(4), "INT32"),
                                                 return_finish_reason=(True, "BOOL")))
    assert error is None and final["finish_reason"][0] in (b"length", b"stop")
    assert triton.is_ready()


def test_stop_input_cancels_a_running_request(triton):
    result: dict = {}
    long = threading.Thread(target=lambda: result.update(out=grpc_stream(
        triton, inputs("a long answer", streaming=(True, "BOOL"), sampling_param_max_tokens=(np.int32(200), "INT32"),
                       return_finish_reason=(True, "BOOL")), request_id="long-1")))
    long.start()
    cancelled = False
    for _ in range(100):  # send stop until the long request is running
        _, _, error = grpc_stream(triton, inputs(None, stop=(True, "BOOL")), request_id="long-1")
        assert error is not None and "cancelled" in str(error).lower()  # as upstream: a CANCELLED answer
        long.join(timeout=0.2)
        if not long.is_alive():
            cancelled = True
            break
    assert cancelled
    texts, final, error = result["out"]
    assert error is None and final["finish_reason"][0] == b"cancelled"
    assert not texts or len(texts[-1].encode()) < 200 + len("a long answer")


def test_client_cancel_drops_the_request(triton):
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    client.async_stream_infer(STREAM, inputs("cancel me", streaming=(True, "BOOL"),
                                             sampling_param_max_tokens=(np.int32(220), "INT32")))
    result, error = events.get(timeout=60)
    assert error is None and result.as_numpy("text_output") is not None  # it is streaming
    client.stop_stream(cancel_requests=True)
    client.close()
    deadline = time.monotonic() + 30
    while "cancelled by the client" not in triton.log_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "cancelled by the client" in triton.log_text()
    _, final, error = grpc_stream(triton, inputs("after a cancel", sampling_param_max_tokens=(np.int32(4), "INT32"),
                                                 return_finish_reason=(True, "BOOL")))
    assert error is None and final["finish_reason"][0] in (b"length", b"stop")


def test_sigterm_shuts_down_cleanly_and_frees_shared_memory(triton):
    prefix = triton.shm_prefix
    assert any(name.startswith(prefix) for name in os.listdir(SHM)), "the Python backend should be using /dev/shm"
    triton.process.send_signal(signal.SIGTERM)  # forwarded by triton-serve to tritonserver
    assert triton.process.wait(timeout=90) == 0, triton.output.read_text()
    assert "tritonserver stopped (exit code 0)" in triton.output.read_text()
    left = set(os.listdir(SHM)) - triton.shm_before
    assert not [name for name in left if name.startswith(prefix)], left
    log = triton.log_text()
    assert "dflash: model finalized" in log and f"successfully unloaded '{MODEL}'" in log
    assert not triton.is_ready()
