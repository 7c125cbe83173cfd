"""A headless node (`tandem serve --headless`): this machine's ranks of an engine whose node 0 runs
elsewhere. No API, no scheduler: the agent starts its ranks (each connects to node 0 and runs
the steps it is sent, `worker.py`), trades heartbeats with node 0 (`cluster.py`), and exits:
0 once node 0 stops cleanly; 1 when one of its ranks dies (node 0 is told which and how), or when
node 0 goes away or falls silent. Restarting is left to the launcher.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import signal
import socket
import time
from multiprocessing.connection import wait
from types import FrameType

from tandem.config import EngineConfig, usable_cores
from tandem.execution.cluster import (
    HEARTBEAT,
    HEARTBEAT_INTERVAL_S,
    NODE_STOP,
    ClusterAddress,
    Heartbeats,
    connect_to_head,
    heartbeat_timeout_s,
)
from tandem.execution.executor import COLLECTIVE_TIMEOUT_S
from tandem.execution.lifetime import child_start_method, exit_reason
from tandem.execution.rendezvous import open_store, rendezvous_timeout_s
from tandem.execution.worker import WorkerArgs, run_worker

logger = logging.getLogger("tandem")

STOP_WAIT_S = 10.0  # after node 0's clean stop, how long this node's ranks get to finish


class _Stopped(Exception):
    """SIGINT or SIGTERM reached the agent."""


def run_headless_node(config: EngineConfig, model_path: str) -> int:
    """Serve node `config.node_rank`'s ranks until node 0 stops (0) or something fails (1)."""
    if config.nnodes < 2 or config.node_rank == 0:
        raise ValueError(
            "--headless runs a node other than node 0 (--nnodes N, --node-rank 1..N-1)"
        )
    node, per = config.node_rank, config.ranks_per_node
    addr, port = config.master_addr, config.master_port
    timeout_s = rendezvous_timeout_s()
    store = open_store(addr, port, False, timeout_s, f"node {node}")
    hello = {"node": node, "host": socket.gethostname()}
    head = connect_to_head(store, addr, port, hello, timeout_s)
    ranks = range(node * per, (node + 1) * per)
    logger.info("node %d of %d: ranks %d..%d of %d, node 0 at %s:%d", node, config.nnodes,
                ranks[0], ranks[-1], config.world_size, addr, port)  # fmt: skip
    start_method = child_start_method(config)
    ctx = mp.get_context(start_method)
    inherited: tuple[int, ...] = ()
    if start_method == "fork":  # what each rank would import and read first, done here once
        from tandem.execution import fast_path, runner  # noqa: F401
        from tandem.models.loader import read_config

        read_config(model_path)
        inherited = (head.fileno(),)  # node 0 must see this agent's end close when it exits
    threads = config.cpu_threads or max(1, usable_cores() // per)
    procs, beats = {}, {}
    for local, rank in enumerate(ranks):
        args = WorkerArgs(
            rank=rank, world_size=config.world_size, init_method="",
            backend="nccl" if config.torch_device.type == "cuda" else "gloo",
            model_path=model_path, config=config,
            threads=threads if config.torch_device.type == "cpu" else None,
            timeout_s=COLLECTIVE_TIMEOUT_S, local_rank=local, parent_pid=os.getpid(),
            cluster=ClusterAddress(addr, port, remote=True, timeout_s=timeout_s),
        )  # fmt: skip
        beats[rank], beats_send = ctx.Pipe(duplex=False)
        procs[rank] = ctx.Process(target=run_worker,
                                  args=(args, None, None, beats_send, inherited),
                                  name=f"tandem-tp{rank}")  # fmt: skip
        procs[rank].start()
        beats_send.close()

    def stop(signum: int, frame: FrameType | None) -> None:
        raise _Stopped

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)
    try:
        return _supervise(head, procs, beats, node)
    except _Stopped:
        logger.info("node %d: stopped by a signal", node)
        return 0
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
            proc.join(5.0)
        head.close()


def _supervise(head, procs: dict, beats: dict, node: int) -> int:
    """Heartbeats both ways, and from every rank; the first death, silence or stop decides the
    exit code."""
    timeout_s = heartbeat_timeout_s()
    sentinels = {proc.sentinel: rank for rank, proc in procs.items()}
    rank_of = {conn: rank for rank, conn in beats.items()}
    ranks_alive = Heartbeats(timeout_s)
    heard = None  # node 0 starts its heartbeats once every node has joined
    sent = 0.0
    while True:
        for obj in wait([head, *sentinels, *rank_of], timeout=HEARTBEAT_INTERVAL_S):
            if obj is head:
                try:
                    data = head.recv_bytes()
                except (EOFError, OSError):
                    logger.error("node %d: node 0 is gone (its connection closed); stopping", node)
                    return 1
                if data == NODE_STOP:
                    return _finish(procs, node)
                heard = time.monotonic()
            elif obj in rank_of:
                ranks_alive.read(rank_of, obj)
            else:
                rank = sentinels.pop(obj)
                procs[rank].join(1.0)
                if procs[rank].exitcode == 0:  # node 0 sent it STOP; NODE_STOP follows
                    continue
                return _report(head, node, rank, exit_reason(procs[rank]))
        rank = ranks_alive.silent()
        if rank is not None:
            return _report(head, node, rank, f"no heartbeat for {timeout_s:g} s: hung")
        now = time.monotonic()
        if heard is not None and now - heard > timeout_s:
            logger.error("node %d: no heartbeat from node 0 for %g s; stopping", node, timeout_s)
            return 1
        if now - sent >= HEARTBEAT_INTERVAL_S:
            try:
                head.send_bytes(HEARTBEAT)
            except OSError:
                logger.error("node %d: node 0 is gone (its connection closed); stopping", node)
                return 1
            sent = now


def _report(head, node: int, rank: int, reason: str) -> int:
    """Tell node 0 which rank is lost and how; this node then stops (1)."""
    logger.error("node %d: rank %d lost (%s); stopping the node", node, rank, reason)
    report = {"rank": rank, "reason": f"{reason} on {socket.gethostname()}"}
    with contextlib.suppress(OSError):  # node 0 may be gone already
        head.send_bytes(json.dumps(report).encode())
    return 1


def _finish(procs: dict, node: int) -> int:
    """Node 0 stopped cleanly: its ranks were sent STOP and finish what they hold."""
    deadline = time.monotonic() + STOP_WAIT_S
    for proc in procs.values():
        proc.join(max(0.0, deadline - time.monotonic()))
    codes = {rank: proc.exitcode for rank, proc in procs.items()}
    if all(code == 0 for code in codes.values()):
        logger.info("node %d: node 0 stopped; every rank finished", node)
        return 0
    logger.error("node %d: node 0 stopped, but ranks ended so: %s", node, codes)
    return 1
