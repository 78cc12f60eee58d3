"""The DFlash Triton Python-backend model (decoupled: streams responses through response senders).

Loaded by the `model.py` that `dflash-trt triton-repo` writes into the model repository; it only
runs inside Triton's Python backend stub (it imports `triton_python_backend_utils`).

- initialize(): reads the model settings (config.pbtxt parameter `dflash_model_yaml`, relative to
  the model folder) and opens the backend (backends.py: the factory's engine + the Scheduler).
- execute(): validates each request (protocol.parse_request); a bad request gets one error
  response with the FINAL flag and the model carries on; a good one is submitted to the shared
  Scheduler (continuous batching across clients) and a worker thread streams its responses.
  Clients that cancel (gRPC stream closed / request cancelled) have their sequence dropped at
  the next decode step; an input `stop=true` cancels running requests with the same request id.
- finalize(): shuts the scheduler down (waiting requests get an error), joins the workers.
"""
from __future__ import annotations

import json
import queue
import threading
import time
from pathlib import Path

import triton_python_backend_utils as pb_utils

from dflash_trt.errors import ConfigError, InputError
from dflash_trt.runtime.scheduler import ErrorEvent, FinalEvent, QueueFullError, TokenEvent
from dflash_trt.serve.triton.backends import ModelBackend, final_stats
from dflash_trt.serve.text import TextStream
from dflash_trt.serve.triton.protocol import FinalStats, output_arrays, parse_request
from dflash_trt.serve.triton.repo import YAML_PARAMETER
from dflash_trt.serve.triton.settings import TritonSettings

POLL_S = 0.1  # how often a waiting worker checks whether its client cancelled
JOIN_S = 10.0


def _response(text: str, stats: FinalStats | None):
    tensors = [pb_utils.Tensor(name, value) for name, value in output_arrays(text, stats).items()]
    return pb_utils.InferenceResponse(output_tensors=tensors)


def _send(sender, response, final: bool) -> None:
    flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
    try:
        sender.send(response, flags=flags)
    except pb_utils.TritonModelException as exc:  # the client went away; nothing left to tell it
        pb_utils.Logger.log_warn(f"dflash: could not send a response: {exc}")


def _error(message: str, code):
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise ConfigError("the DFlash model streams: set model_transaction_policy { decoupled: true }")
        if YAML_PARAMETER not in config["parameters"]:
            raise ConfigError(f"config.pbtxt lacks the parameter '{YAML_PARAMETER}' (the model settings YAML)")
        path = Path(args["model_repository"]) / config["parameters"][YAML_PARAMETER]["string_value"]
        self.settings = TritonSettings.load(path)
        self.backend = ModelBackend(self.settings)
        self.lock = threading.Lock()
        self.workers: dict[int, tuple[threading.Thread, object, str]] = {}  # id -> (thread, handle, request id)
        self.next_worker = 0
        pb_utils.Logger.log_info(f"dflash: model '{self.settings.model_name}' ready ({self.settings.backend} backend, "
                                 f"target {self.settings.target}, drafter {self.settings.drafter})")

    def execute(self, requests) -> None:
        for request in requests:
            self._start(request)
        return None

    def _start(self, request) -> None:
        sender = request.get_response_sender()
        request_id = request.request_id()
        try:
            parsed = parse_request({t.name(): t.as_numpy() for t in request.inputs()}, self.settings.default_max_tokens)
            if parsed.stop:
                self._stop_requests(request_id, sender)
                return
            handle = self.backend.submit(parsed.prompt, parsed.params, request_id or None)
        except InputError as exc:
            _send(sender, _error(str(exc), pb_utils.TritonError.INVALID_ARG), final=True)
            return
        except QueueFullError as exc:
            _send(sender, _error(str(exc), pb_utils.TritonError.UNAVAILABLE), final=True)
            return
        with self.lock:
            key, self.next_worker = self.next_worker, self.next_worker + 1
            thread = threading.Thread(target=self._respond, args=(key, handle, sender, parsed.streaming),
                                      name=f"dflash-triton-{key}", daemon=True)
            self.workers[key] = (thread, handle, request_id)
        thread.start()

    def _respond(self, key: int, handle, sender, streaming: bool) -> None:
        text = TextStream(self.backend.detokenize)
        cancelled = False
        checked = time.monotonic()
        try:
            while True:
                try:
                    event = handle.get(timeout=POLL_S)
                except queue.Empty:
                    event = None
                if not cancelled and time.monotonic() - checked >= POLL_S:
                    checked = time.monotonic()
                    if sender.is_cancelled():
                        cancelled = True
                        handle.cancel()
                        pb_utils.Logger.log_info(f"dflash: request {key} cancelled by the client")
                if event is None:
                    continue
                if isinstance(event, TokenEvent):
                    piece = text.push(event.tokens)
                    if streaming and piece:
                        _send(sender, _response(piece, None), final=False)
                elif isinstance(event, FinalEvent):
                    rest = text.finish()
                    if cancelled:
                        _send(sender, _error("request cancelled by the client", pb_utils.TritonError.CANCELLED), True)
                    else:
                        _send(sender, _response(rest if streaming else text.text, final_stats(event.result)), final=True)
                    return
                else:
                    assert isinstance(event, ErrorEvent), f"unexpected scheduler event {event!r}"
                    _send(sender, _error(event.message, pb_utils.TritonError.INTERNAL), final=True)
                    return
        finally:
            with self.lock:
                self.workers.pop(key, None)

    def _stop_requests(self, request_id: str, sender) -> None:
        if not request_id:
            raise InputError("'stop' cancels the running requests with this request's id: set a request id")
        with self.lock:
            handles = [handle for _, handle, rid in self.workers.values() if rid == request_id]
        for handle in handles:
            handle.cancel()
        pb_utils.Logger.log_info(f"dflash: stop for request id '{request_id}' cancelled {len(handles)} request(s)")
        _send(sender, _response("", FinalStats("cancelled", 0, 0)), final=True)

    def finalize(self) -> None:
        self.backend.shutdown()  # running and waiting requests end with an error event
        with self.lock:
            threads = [thread for thread, _, _ in self.workers.values()]
        for thread in threads:
            thread.join(JOIN_S)
        pb_utils.Logger.log_info("dflash: model finalized")
