"""The DFlash Triton Python-backend model, a drop-in for TensorRT-LLM's LLM-API Triton model.

Loaded by the `1/model.py` that `dflash-trt triton-repo` writes (it binds the model folder:
`TritonPythonModel = model_class(<its folder>)`); it only runs inside Triton's Python backend
stub (it imports `triton_python_backend_utils`). It follows upstream's model
(triton_backend/all_models/llmapi/tensorrt_llm/1/model.py @044a90d209e380c95e23e8ae42f3583fa05ada78):

- auto_complete_config(): max_batch_size and the transaction policy come from `1/model.yaml`
  `triton_config` (unary by default, `decoupled: true` streams), not from config.pbtxt;
- initialize(): reads the settings, then for backend trtllm either drops the inherited MPI job
  variables (`mpi: spawn`: TensorRT-LLM spawns its workers) or joins the MPI world (`mpi: world`:
  rank 0 leads with an MpiCommSession, the other ranks serve it and return); then opens the
  backend (backends.py: the factory's engine + the Scheduler);
- execute(): validates each request (protocol.parse_request); a bad one gets one error response
  with the FINAL flag and the model carries on; a good one joins the shared Scheduler (continuous
  batching across clients) and a worker thread answers it through its response sender: one
  response (unary) or one per decode step (streaming, decoupled models only), each with the whole
  text so far. Clients that cancel have their sequence dropped at the next decode step; an input
  `stop=true` cancels the running requests with the same request id;
- finalize(): shuts the scheduler down (waiting requests get an error), joins the workers.
"""
from __future__ import annotations

import json
import os
import queue
import threading
import time
from pathlib import Path

import triton_python_backend_utils as pb_utils

from dflash_trt.errors import ConfigError, InputError
from dflash_trt.runtime.scheduler import ErrorEvent, FinalEvent, QueueFullError, TokenEvent
from dflash_trt.serve.text import TextStream
from dflash_trt.serve.triton.backends import ModelBackend, final_stats
from dflash_trt.serve.triton.protocol import ParsedRequest, matched_stop, output_arrays, parse_request
from dflash_trt.serve.triton.repo import settings_path
from dflash_trt.serve.triton.settings import TritonSettings

JOIN_S = 10.0


def _response(text: str, stats, request: ParsedRequest):
    tensors = [pb_utils.Tensor(name, value) for name, value in output_arrays(text, stats, request).items()]
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
    model_dir: Path | None = None  # set by model_class() for the model folder the repository holds

    @classmethod
    def auto_complete_config(cls, auto_complete_model_config):
        """max_batch_size and the transaction policy from model.yaml's triton_config (as upstream)."""
        config = auto_complete_model_config.as_dict()
        settings = TritonSettings.load(settings_path(cls._folder(), config["parameters"]))
        auto_complete_model_config.set_max_batch_size(settings.triton_config.max_batch_size)
        auto_complete_model_config.set_model_transaction_policy(dict(decoupled=settings.triton_config.decoupled))
        return auto_complete_model_config

    @classmethod
    def _folder(cls) -> Path:
        if cls.model_dir is None:
            raise ConfigError("the repository's model.py must bind its folder: "
                              "TritonPythonModel = model_class(Path(__file__).resolve().parent)")
        return cls.model_dir

    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        self.settings = TritonSettings.load(settings_path(Path(args["model_repository"]), config["parameters"]))
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        if self.decoupled != self.settings.triton_config.decoupled:
            raise ConfigError(f"config.pbtxt says decoupled={self.decoupled} but model.yaml triton_config says "
                              f"{self.settings.triton_config.decoupled}: set it in model.yaml only")
        self.backend = None
        self.lock = threading.Lock()
        self.workers: dict[int, tuple[threading.Thread, object, str]] = {}  # id -> (thread, handle, request id)
        self.next_worker = 0
        session = self._join_mpi()
        if self.settings.mpi == "world" and session is None:
            return  # a non-leader rank: it served rank 0's MPI session until that shut down
        self.backend = ModelBackend(self.settings, session)
        pb_utils.Logger.log_info(f"dflash: model '{self.settings.model_name}' ready ({self.settings.backend} backend, "
                                 f"{'streaming' if self.decoupled else 'unary'}, target {self.settings.target}, "
                                 f"drafter {self.settings.drafter})")

    def _join_mpi(self):
        """Backend trtllm: the leader's MPI session (mpi: world, rank 0), or None."""
        if self.settings.backend != "trtllm":
            return None
        from dflash_trt.runtime.factory import join_trtllm_mpi

        role = join_trtllm_mpi(self.settings.mpi, os.environ)
        if role.note:
            pb_utils.Logger.log_info(f"dflash: {role.note}")
        return role.session

    def execute(self, requests) -> None:
        for request in requests:
            self._start(request)
        return None

    def _start(self, request) -> None:
        sender = request.get_response_sender()
        request_id = request.request_id()
        arrival_ns = time.time_ns()
        try:
            if self.backend is None:
                raise InputError("this MPI rank serves the leader (rank 0) only: send requests to rank 0")
            parsed = parse_request({t.name(): t.as_numpy() for t in request.inputs()}, self.settings.default_max_tokens)
            if parsed.stop:
                self._stop_requests(request_id)
                _send(sender, _error("request cancelled by client", pb_utils.TritonError.CANCELLED), final=True)
                return
            if parsed.streaming and not self.decoupled:
                raise InputError("streaming is only supported in decoupled mode: set triton_config.decoupled: true "
                                 "in model.yaml (dflash-trt triton-repo --decoupled) or send streaming=false")
            ids = self.backend.encode(parsed.prompt)
            handle = self.backend.submit(ids, parsed.params, request_id or None)
        except InputError as exc:
            _send(sender, _error(str(exc), pb_utils.TritonError.INVALID_ARG), final=True)
            return
        except QueueFullError as exc:
            _send(sender, _error(str(exc), pb_utils.TritonError.UNAVAILABLE), final=True)
            return
        with self.lock:
            key, self.next_worker = self.next_worker, self.next_worker + 1
            thread = threading.Thread(target=self._respond, args=(key, handle, sender, parsed, ids, arrival_ns),
                                      name=f"dflash-triton-{key}", daemon=True)
            self.workers[key] = (thread, handle, request_id)
        thread.start()

    def _respond(self, key: int, handle, sender, parsed: ParsedRequest, ids: list[int], arrival_ns: int) -> None:
        detokenize = self.backend.detokenize
        text = TextStream(detokenize, parsed.params.stop)
        shown = "" if parsed.exclude_input_from_output else detokenize(ids)  # the prompt leads, as upstream
        poll_s = self.settings.triton_config.cancellation_check_period_ms / 1000
        cancelled = False
        times = {"arrival_time_ns": arrival_ns, "first_token_time_ns": 0, "last_token_time_ns": 0}
        tokens: list[int] = []
        try:
            while True:
                try:
                    event = handle.get(timeout=poll_s)
                except queue.Empty:
                    event = None
                if not cancelled and sender.is_cancelled():
                    cancelled = True
                    handle.cancel()
                    pb_utils.Logger.log_info(f"dflash: request {key} cancelled by the client")
                if event is None:
                    continue
                if isinstance(event, TokenEvent):
                    now = time.time_ns()
                    if event.tokens:
                        times["first_token_time_ns"] = times["first_token_time_ns"] or now
                        times["last_token_time_ns"] = now
                    tokens += event.tokens
                    piece = text.push(event.tokens)
                    shown += piece
                    if piece and parsed.streaming and not cancelled:
                        _send(sender, _response(shown, None, parsed), final=False)  # cumulative, as upstream
                elif isinstance(event, FinalEvent):
                    shown += text.finish()
                    if cancelled:
                        _send(sender, _error("request cancelled by client", pb_utils.TritonError.CANCELLED), True)
                        return
                    stop = matched_stop(detokenize(tokens), parsed.params.stop) \
                        if event.result.finish_reason == "stop" else None
                    times["first_scheduled_time_ns"] = handle.admitted_ns or 0
                    _send(sender, _response(shown, final_stats(event.result, stop, times), parsed), final=True)
                    return
                else:
                    assert isinstance(event, ErrorEvent), f"unexpected scheduler event {event!r}"
                    _send(sender, _error(event.message, pb_utils.TritonError.INTERNAL), final=True)
                    return
        finally:
            with self.lock:
                self.workers.pop(key, None)

    def _stop_requests(self, request_id: str) -> None:
        if not request_id:
            raise InputError("'stop' cancels the running requests with this request's id: set a request id")
        with self.lock:
            handles = [handle for _, handle, rid in self.workers.values() if rid == request_id]
        for handle in handles:
            handle.cancel()
        pb_utils.Logger.log_info(f"dflash: stop for request id '{request_id}' cancelled {len(handles)} request(s)")

    def finalize(self) -> None:
        if self.backend is not None:
            self.backend.shutdown()  # running and waiting requests end with an error event
        with self.lock:
            threads = [thread for thread, _, _ in self.workers.values()]
        for thread in threads:
            thread.join(JOIN_S)
        pb_utils.Logger.log_info("dflash: model finalized")


def model_class(model_dir: Path) -> type[TritonPythonModel]:
    """The model class for the model folder `model_dir` (auto_complete_config runs before initialize
    and gets no repository path, so the repository's model.py binds it)."""
    return type("TritonPythonModel", (TritonPythonModel,), {"model_dir": Path(model_dir)})
