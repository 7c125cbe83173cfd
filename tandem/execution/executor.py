"""The engine's side of tensor and pipeline parallelism: start the ranks, hand them each step,
read the sampling rank (rank 0, or the last pipeline stage's first).

`MultiprocExecutor` has the interface of `ModelRunner` that the engine uses (`launch` returns a
handle at once; `handle.wait()` yields the sampled ids), so the loop, sync or async, is the
same code at any tensor-parallel size. The scheduler runs once, here; a step's inputs are pickled
once and written to every worker's pipe (a reader thread in each worker drains it at once, so a
launch never waits for the workers).

A worker that dies or raises fails the engine fast: every wait watches each worker's process and
pipe, and the error names the rank. The surviving workers are then stopped, so no process stays.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

import numpy as np
import torch

from tandem.config import EngineConfig, usable_cores
from tandem.execution.batch import StepInputs
from tandem.execution.cluster import (
    HEARTBEAT_INTERVAL_S,
    HeadSide,
    Heartbeats,
    heartbeat_timeout_s,
)
from tandem.execution.lifetime import exit_reason
from tandem.execution.rendezvous import RendezvousError
from tandem.execution.streams import StepHandle
from tandem.execution.worker import STOP, WorkerArgs, run_worker

logger = logging.getLogger("tandem")

# How ranks start: "spawn", each a fresh interpreter with no state from this one. A process that
# starts many engines (a test suite) may set "forkserver": each rank is then forked from a server
# process that has imported the worker once (with the environment that process started with).
START_METHOD = "spawn"
# The engine and a config class of transformers', which brings in what every architecture's
# config imports: as for a server's forked cores (`start_core`), whose fork server is the same.
FORKSERVER_PRELOAD = [
    "tandem.engine.engine",
    "tandem.server.core.process",
    "transformers.models.llama.configuration_llama",
]
FAILURE_GRACE_S = 1.0  # after a first failure, how long to gather the others (to name the cause)
COLLECTIVE_TIMEOUT_S = 600.0  # a collective whose peer hangs (alive, silent) raises after this


class WorkerFailure(RuntimeError):
    """A tensor-parallel worker died or raised: the engine cannot continue."""


class _Handle(StepHandle):
    def __init__(self, executor: MultiprocExecutor, index: int):
        self._executor = executor
        self._index = index
        self._span = (0.0, 0.0)
        self._wait = 0.0

    def wait(self) -> torch.Tensor:
        ids, self._span, self._wait = self._executor._result(self._index)
        return torch.from_numpy(ids)

    @property
    def device_span(self) -> tuple[float, float]:
        return self._span

    @property
    def device_wait(self) -> float:
        return self._wait


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, model_path: str):
        world = config.world_size
        device = config.torch_device
        local = config.ranks_per_node  # ranks 0..local-1 here; over several nodes, the rest there
        if device.type == "cuda" and torch.cuda.device_count() < local:
            raise ValueError(
                f"{local} tensor-parallel ranks on this machine need {local} GPUs; "
                f"{torch.cuda.device_count()} visible"
            )
        self.threads_per_rank = config.cpu_threads or max(1, usable_cores() // local)
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.config = config
        self.world_size = world
        self.cluster = HeadSide(config) if config.nnodes > 1 else None
        init_method = _rendezvous() if self.cluster is None else ""
        # A forked CUDA or OpenMP runtime is unsafe in the child: never plain "fork".
        ctx = mp.get_context(START_METHOD)
        if START_METHOD == "forkserver":
            ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        self._procs: dict[int, mp.process.BaseProcess] = {}  # this machine's ranks
        self._inputs: dict[int, Connection] = {}  # every rank's: a pipe, or a node's connection
        self._outputs: dict[int, Connection] = {}
        self._beats: dict[int, Connection] = {}  # each local rank's heartbeats, once it serves
        self._hung: dict[int, str] = {}  # a local rank that fell silent: why it is taken as lost
        self.heartbeat_timeout_s = heartbeat_timeout_s()
        for rank in range(local):
            args = WorkerArgs(
                rank=rank,
                world_size=world,
                init_method=init_method,
                backend=self.backend,
                model_path=model_path,
                config=config,
                threads=self.threads_per_rank if device.type == "cpu" else None,
                timeout_s=COLLECTIVE_TIMEOUT_S,
                cluster=self.cluster.address() if self.cluster else None,
            )
            in_recv, in_send = ctx.Pipe(duplex=False)
            out_recv, out_send = ctx.Pipe(duplex=False)
            beats_recv, beats_send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=run_worker, args=(args, in_recv, out_send, beats_send),
                               name=f"tandem-tp{rank}")  # fmt: skip
            proc.daemon = True  # never outlives the engine's process
            proc.start()
            for end in (in_recv, out_send, beats_send):
                end.close()  # the child holds these ends now; ours would hide its exit
            self._procs[rank] = proc
            self._inputs[rank] = in_send
            self._outputs[rank] = out_recv
            self._beats[rank] = beats_recv
        self._failure: WorkerFailure | None = None
        self._results: dict[int, tuple[np.ndarray, tuple[float, float], float]] = {}
        self._drafts: deque[np.ndarray] = deque()  # rank 0's, for `step_drafts`
        self._launched = 0
        self._received = 0
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._inputs, self.cluster)
        if self.cluster is not None:
            self._join_nodes()
        self._exited = threading.Event()  # set by the watcher when any rank is lost
        self._exited_rank = -1  # which one (valid once _exited is set)
        # ... and readable then, so that a wait for results wakes (a hung node sends nothing)
        self._alarm, self._raise_alarm = mp.Pipe(duplex=False)
        self.on_exit: Callable[[], None] | None = None  # e.g. wake an idle engine loop
        threading.Thread(target=self._watch, name="tandem-tp-watch", daemon=True).start()
        loaded = self._gather("loaded")
        self.num_kv_blocks = min(loaded.values())  # every rank must hold every block
        self.plan = None

    def start(self, num_blocks: int, table_rows: int, max_model_len: int) -> None:
        """Allocate every rank's KV cache and token table; returns when all are ready."""
        for conn in self._inputs.values():
            conn.send((num_blocks, table_rows, max_model_len))
        self.plan = self._gather("ready")[0]
        self.plan.tensor_parallel_size = self.config.tensor_parallel_size
        self.plan.pipeline_parallel_size = self.config.pipeline_parallel_size
        self.plan.backend = self.backend

    def check_health(self) -> None:
        """Raise WorkerFailure if a worker has exited, even while no step is in flight."""
        if self._failure is not None:
            raise self._failure
        if self._exited.is_set() and not self._closed:
            raise self._fail(self._last_words(self._exited_rank))

    @property
    def skips_stopped_steps(self) -> bool:
        """No: every rank would have to decide alike; the ranks run every step."""
        return False

    def launch(self, inputs: StepInputs) -> StepHandle:
        self.check_health()
        self._send_all(pickle.dumps(inputs.for_ranks(), protocol=pickle.HIGHEST_PROTOCOL))
        handle = _Handle(self, self._launched)
        self._launched += 1
        return handle

    def step_drafts(self, first: StepHandle) -> np.ndarray:
        """The drafts of the step just launched, which rank 0 sends once it has made them
        (before or after the results of earlier steps)."""
        while not self._drafts:
            self._keep(self._next_message())
        return self._drafts.popleft()

    def sample_constrained(self, first: StepHandle, bitmask: torch.Tensor) -> StepHandle:
        """Every rank finishes the step just launched with its grammar rows' bitmask."""
        self._send_all(pickle.dumps(bitmask.numpy(), protocol=pickle.HIGHEST_PROTOCOL))
        return first

    def close(self) -> None:
        """Finish the steps in flight, stop every worker and wait for them to exit."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()
        self._alarm.close()  # its other end is the watcher's, which closes it as it ends

    # ------------------------------------------------------------------ internals
    def _send_all(self, payload: bytes) -> None:
        for rank, conn in self._inputs.items():
            try:
                conn.send_bytes(payload)
            except OSError:
                self._fail_from(rank, "its input pipe closed")

    def _join_nodes(self) -> None:
        """Every other node's agent and ranks connected (their steps go to the connections);
        a local rank that ended first (a rendezvous error, say) fails the engine with its cause."""
        sentinels = {p.sentinel: rank for rank, p in self._procs.items()}
        try:
            ended = self.cluster.accept(sentinels)
        except RendezvousError:
            self.cluster.failed = True
            self._finalizer()
            raise
        if ended is not None:
            raise self._fail(self._last_words(ended))
        for rank, conn in self.cluster.rank_conns.items():
            self._inputs[rank] = self._outputs[rank] = conn

    def _watch(self) -> None:
        """Until a rank is lost (its process ended or fell silent, or its node is lost,
        `HeadSide`); an idle engine learns of it at once."""
        with self._raise_alarm:
            try:
                lost = self._first_lost()
            finally:
                for conn in self._beats.values():
                    conn.close()
            if lost is None:  # closed
                return
            self._exited_rank = lost
            self._exited.set()
            with contextlib.suppress(OSError):  # closed: nobody waits any more
                self._raise_alarm.send_bytes(b"")
        if not self._closed and self.on_exit is not None:
            self.on_exit()

    def _first_lost(self) -> int | None:
        # The rank comes from its sentinel: is_alive() can still say True for a moment after the
        # sentinel fires (the process closes its pipes before it can be reaped).
        sentinels = {p.sentinel: rank for rank, p in self._procs.items()}
        beats = {conn: rank for rank, conn in self._beats.items()}
        nodes = list(self.cluster.node_conns.values()) if self.cluster else []
        alive = Heartbeats(self.heartbeat_timeout_s)
        if self.cluster is not None:
            self.cluster.start_watching()
        while not self._closed:
            try:
                ready = wait([*sentinels, *beats, *nodes], timeout=HEARTBEAT_INTERVAL_S)
            except (OSError, ValueError):  # closed under us
                return None
            for obj in ready:
                if obj in sentinels:
                    return sentinels[obj]
                if obj in beats:
                    alive.read(beats, obj)
                    continue
                lost = self.cluster.read(obj)
                if lost is not None:
                    return lost
            rank = alive.silent()
            if rank is not None:
                self._hung[rank] = f"no heartbeat for {alive.timeout_s:g} s: hung"
                return rank
            lost = self.cluster.tick() if self.cluster is not None else None
            if lost is not None:
                return lost
        return None

    def _result(self, index: int) -> tuple[np.ndarray, tuple[float, float], float]:
        while index not in self._results:
            self._keep(self._next_message())
        return self._results.pop(index)

    def _keep(self, message: tuple) -> None:
        """File a step's result or drafts where their reader looks; anything else is a failure."""
        if message[0] == "drafts":
            self._drafts.append(message[1])
            return
        if message[0] != "step":
            raise self._fail(message)
        self._results[self._received] = message[1:]
        self._received += 1

    def _gather(self, kind: str) -> dict[int, object]:
        """One `kind` message from every rank (start-up handshakes), by rank."""
        got: dict[int, object] = {}
        while len(got) < self.world_size:
            message = self._next_message()
            if message[0] != kind:
                raise self._fail(message)
            got[message[1]] = message[2]
        return got

    def _next_message(self) -> tuple:
        """The next message from any worker; a worker's death is a ("died", rank) message."""
        if self._failure is not None:
            raise self._failure
        sentinels = {p.sentinel: rank for rank, p in self._procs.items()}
        ranks = {conn: rank for rank, conn in self._outputs.items()}
        while True:
            for conn in wait([*ranks, *sentinels, self._alarm]):
                if conn in sentinels:
                    return self._last_words(sentinels[conn])
                if conn is self._alarm:
                    return self._last_words(self._exited_rank)
                try:
                    return conn.recv()
                except (EOFError, OSError):
                    return ("died", ranks[conn])

    def _last_words(self, rank: int) -> tuple:
        """What a lost rank sent last (its error, say), or ("died", rank)."""
        conn = self._outputs[rank]
        with contextlib.suppress(EOFError, OSError):
            if conn.poll():
                return conn.recv()
        return ("died", rank)

    def _fail(self, first: tuple) -> WorkerFailure:
        """Gather what else fails within a moment, name the cause, stop every worker."""
        failures = [first]
        procs = self._procs.values()
        deadline = time.monotonic() + FAILURE_GRACE_S
        while (left := deadline - time.monotonic()) > 0 and any(p.is_alive() for p in procs):
            ready = wait([p.sentinel for p in procs if p.is_alive()], timeout=left)
            if not ready:
                break
        for rank, conn in self._outputs.items():
            while _readable(conn):
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    break
                if message[0] == "error":
                    failures.append(message)
            proc = self._procs.get(rank)
            if proc and not proc.is_alive() and not any(f[1] == rank for f in failures):
                failures.append(("died", rank))
        self._failure = WorkerFailure(self._describe(failures))
        for message in failures:
            if message[0] == "error":
                logger.error("tensor-parallel rank %d failed:\n%s", message[1], message[3])
        for proc in procs:  # the survivors may be stuck in a collective with the dead
            proc.kill()
        if self.cluster is not None:  # the other nodes see their connections close, and stop
            self.cluster.failed = True
        self._finalizer()
        return self._failure

    def _fail_from(self, rank: int, why: str) -> None:
        raise self._fail(("died", rank)) from OSError(f"rank {rank}: {why}")

    def _describe(self, failures: list[tuple]) -> str:
        """Killed ranks first (a killed peer makes the others' collectives fail), then errors."""

        def order(message: tuple) -> tuple[int, int]:
            return (0 if message[0] == "died" else 1, message[1])

        parts = []
        for message in sorted(failures, key=order):
            rank = message[1]
            if message[0] == "died":
                proc = self._procs.get(rank)
                reason = self._hung.get(rank) or (
                    exit_reason(proc) if proc else self.cluster.reason(rank)
                )
                parts.append(f"rank {rank} died ({reason})")
            else:
                parts.append(f"rank {rank} raised {message[2]}")
        return "tensor-parallel worker " + "; ".join(dict.fromkeys(parts))


def _readable(conn: Connection) -> bool:
    try:
        return conn.poll()
    except (EOFError, OSError):
        return False


def _stop(procs: dict, inputs: dict[int, Connection], cluster: HeadSide | None) -> None:
    """Ask every worker to stop, then make sure: no process outlives the engine (the other
    nodes' agents are told to stop, or see their connections close)."""
    for conn in inputs.values():
        with contextlib.suppress(OSError):
            conn.send_bytes(STOP)
    deadline = time.monotonic() + 5.0
    for proc in procs.values():
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs.values():
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5.0)
    if cluster is not None:
        cluster.close()
    for conn in inputs.values():
        conn.close()


def _rendezvous() -> str:
    """MASTER_ADDR/MASTER_PORT when given (torchrun's names), else a free local port."""
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = os.environ.get("MASTER_PORT")
    if port is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
            port = s.getsockname()[1]
    return f"tcp://{addr}:{port}"
