"""One rank: a spawned process that holds its shard and runs every step.

The engine's process schedules; each worker receives every step's inputs (pickled once by the
engine, one pipe per worker), launches it on its own stream and, on the sampling rank, sends the
sampled ids back. Every rank of a tensor-parallel group samples the same ids (the sampler is a
pure function of the logits, which the all-gather makes identical on every rank) and scatters
them into its own token table, so no rank waits for another's tokens. Under pipeline
parallelism rank r is tensor-parallel rank r % tp of stage r // tp; only the last stage samples
(its first rank reports), and the stages before get the ids from it (`pipeline.py`). A worker
launches step N+1 before it waits for step N, so on a GPU its device never idles between the two.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import threading
import traceback
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tandem.config import EngineConfig
from tandem.execution.cluster import (
    HEARTBEAT,
    ClusterAddress,
    connect_to_head,
    send_heartbeats,
)
from tandem.execution.lifetime import close_inherited, die_with_parent, name_process
from tandem.execution.pipeline import StageLinks
from tandem.execution.rendezvous import meet, settings_of
from tandem.models.parallel import TensorParallel, pipeline_stage

logger = logging.getLogger("tandem")

STOP = b""  # on the input pipe: finish the steps in flight and exit
HEAD_GONE = object()  # a headless node's rank read EOF from node 0: fail, not a clean stop


@dataclass(frozen=True)
class WorkerArgs:
    """Everything a rank needs to build its part of the engine (picklable for spawn)."""

    rank: int
    world_size: int
    init_method: str  # tcp://host:port of the rendezvous
    backend: str  # "gloo" (CPU) or "nccl" (CUDA)
    model_path: str
    config: EngineConfig  # the engine's: dtype, device type, cache budget, eager, graphs ...
    threads: int | None  # CPU: compute threads of this process
    timeout_s: float
    local_rank: int | None = None  # its device on this machine; None: its rank
    cluster: ClusterAddress | None = None  # several machines: where the ranks meet
    parent_pid: int = 0  # a headless node's agent: die with it


class HeadGone(RuntimeError):
    """A headless node's rank lost its connection to node 0 without being told to stop."""


def run_worker(
    args: WorkerArgs,
    inputs: Connection | None,
    outputs: Connection | None,
    beats: Connection | None = None,
    close_in_child: tuple[int, ...] = (),
) -> None:
    """Process entry point: any failure is reported to the engine, named by rank, then exits.
    A headless node's rank gets no step pipes: it connects to node 0 itself. Once it serves, it
    beats on `beats` every second, so that its supervisor notices when it hangs. A forked rank
    first closes `close_in_child`, its parent's descriptors it must not hold."""
    close_inherited(close_in_child)
    name_process(f"tandem-rank-{args.rank}")
    if args.parent_pid:
        die_with_parent(args.parent_pid)
    worker = _Worker(args, inputs, outputs, beats)
    try:
        worker.serve()
    except BaseException as exc:  # noqa: BLE001 - reported to the engine, which raises it
        text = "".join(traceback.format_exception(exc))
        if args.cluster is not None and args.cluster.remote:  # the node's own log says it too
            logger.error("rank %d failed:\n%s", args.rank, text)
        if worker.outputs is not None:
            with contextlib.suppress(OSError):  # the engine may be gone
                worker.outputs.send(("error", args.rank, f"{type(exc).__name__}: {exc}", text))
        os._exit(1)  # skip destructors that could wait on peers that are gone
    os._exit(0)


class _Worker:
    def __init__(
        self,
        args: WorkerArgs,
        inputs: Connection | None,
        outputs: Connection | None,
        beats: Connection | None,
    ):
        self.args = args
        self.inputs = inputs
        self.outputs = outputs
        self.beats = beats

    def serve(self) -> None:
        from tandem.execution import fast_path
        from tandem.execution.runner import build_runner, cache_capacity
        from tandem.models.loader import build_model, read_config

        a, config = self.args, self.args.config
        if a.threads is not None:
            torch.set_num_threads(a.threads)
        device_type = config.torch_device.type
        index = a.rank if a.local_rank is None else a.local_rank
        device = torch.device(device_type, index if device_type == "cuda" else None)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self._join_group()
        tp = self._tensor_parallel()
        path, spec, hf_config = read_config(a.model_path)
        stage = pipeline_stage(a.rank // tp.world_size, self.num_stages, spec)
        dtype = config.torch_dtype
        model = build_model(
            path, spec, hf_config, dtype, device, config.max_model_len, tp, config.load_format,
            config.seed, config.weight_quantization, config.int8_activations, stage=stage,
        )  # fmt: skip
        plan = fast_path.prepare(model, device, dtype, config.enforce_eager)
        if config.enable_lora:
            model.enable_lora(config.max_loras, config.max_lora_rank, device)
        self.outputs.send(("loaded", a.rank, cache_capacity(model, config, device)))
        num_blocks, table_rows, max_model_len = self.inputs.recv()
        runner = build_runner(model, config, device, num_blocks, table_rows, max_model_len)
        if self.num_stages > 1:
            hidden = spec.hidden_size
            runner.links = StageLinks(stage, a.rank, tp.world_size, hidden, dtype, device)
        self.samples = stage.is_last
        plan.cuda_graph_sizes = runner.graph_sizes  # every rank captures alike
        plan.cuda_graph_histories = runner.graph_histories
        plan.cuda_graph_verify_tokens = runner.graph_verify_tokens
        plan.cpu_threads = torch.get_num_threads() if device.type == "cpu" else None
        if self.beats is not None:  # its first beat before "ready": a rank that serves is watched
            self.beats.send_bytes(HEARTBEAT)
            threading.Thread(target=send_heartbeats, args=(self.beats,), daemon=True).start()
        self.outputs.send(("ready", a.rank, plan))
        try:
            self._run_steps(runner)
        finally:
            runner.close()

    @property
    def num_stages(self) -> int:
        return self.args.config.pipeline_parallel_size

    @property
    def reports(self) -> bool:
        """Whether this rank sends the sampled ids: the last stage's first rank."""
        return self.args.rank == self.args.world_size - self.args.config.tensor_parallel_size

    def _tensor_parallel(self) -> TensorParallel:
        """This rank's place in its stage's tensor-parallel group (each stage has a group of
        its own; every rank creates every group, in order, as torch.distributed requires)."""
        size, rank = self.args.config.tensor_parallel_size, self.args.rank
        if self.num_stages == 1 or size == 1:
            return TensorParallel(rank % size, size)
        groups = [
            dist.new_group(list(range(s * size, (s + 1) * size))) for s in range(self.num_stages)
        ]
        return TensorParallel(rank % size, size, groups[rank // size])

    def _join_group(self) -> None:
        """On one machine, at the engine's address; over several, in node 0's store (a missing
        rank or other settings named), a headless node's rank then connecting to node 0."""
        a = self.args
        timeout = timedelta(seconds=a.timeout_s)
        if a.cluster is None:
            dist.init_process_group(a.backend, init_method=a.init_method, rank=a.rank,
                                    world_size=a.world_size, timeout=timeout)  # fmt: skip
            return
        settings = settings_of(a.config, Path(a.model_path))
        c = a.cluster
        store = meet(a.rank, a.world_size, a.backend, settings, c.addr, c.port, host_store=False,
                     timeout_s=c.timeout_s)  # fmt: skip
        if c.remote:
            hello = {"rank": a.rank}
            self.inputs = self.outputs = connect_to_head(store, c.addr, c.port, hello, c.timeout_s)
        dist.init_process_group(a.backend, store=store, rank=a.rank, world_size=a.world_size,
                                timeout=timeout)  # fmt: skip

    def _run_steps(self, runner) -> None:
        inbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        threading.Thread(target=self._read, args=(inbox,), daemon=True).start()
        pending: deque = deque()
        awaiting_bitmask = None  # a launched step with grammar rows: its bitmask comes next
        while True:
            try:
                data = inbox.get(block=not pending)
            except queue.Empty:  # nothing new: finish the oldest step in flight
                self._finish(pending.popleft())
                continue
            if data == STOP:
                break
            if data is HEAD_GONE:
                raise HeadGone("the connection to node 0 closed without a stop")
            message = pickle.loads(data)
            if isinstance(message, np.ndarray):  # the bitmask of the step just launched
                if not self.samples:
                    continue  # a pipeline stage before the last: its part of the step is done
                handle = runner.sample_constrained(awaiting_bitmask, torch.from_numpy(message))
                awaiting_bitmask = None
            else:
                handle = runner.launch(message)
                if message.sampler.grammar is not None and self.samples:
                    awaiting_bitmask = handle
                    if message.sampler.drafts_to_host and self.reports:
                        self.outputs.send(("drafts", runner.step_drafts(handle)))
                    continue
            pending.append(handle)
            while len(pending) > 1:
                self._finish(pending.popleft())
        while pending:
            self._finish(pending.popleft())

    def _read(self, inbox: queue.SimpleQueue) -> None:
        """Drain the input pipe as steps arrive, so the engine's send never waits on a step."""
        try:
            while (data := self.inputs.recv_bytes()) != STOP:
                inbox.put(data)
        except (EOFError, OSError):  # the engine's process (or node 0) is gone
            remote = self.args.cluster is not None and self.args.cluster.remote
            inbox.put(HEAD_GONE if remote else STOP)
            return
        inbox.put(STOP)

    def _finish(self, handle) -> None:
        result = handle.wait()  # raises what the step raised
        if self.reports:
            self.outputs.send(("step", result.numpy(), handle.device_span, handle.device_wait))
