"""Tensor parallelism over several machines, node 0's side and the wire the nodes share.

Node 0 runs the engine and its own ranks (pipes, as on one machine); every other node runs
`tandem serve --headless` (`node.py`), whose ranks connect back to node 0. Node 0 hosts the
rendezvous store at master_addr:master_port (the ranks meet there, `rendezvous.meet`: a missing
rank named, settings compared) and listens at master_port + 1 for two kinds of connection, each
opened with a hello carrying the token node 0 put in the store:
- one per remote rank, duplex: the engine's pickled steps to it, its errors back (rank 0, on
  node 0, sends the results), as a local rank's pipes do;
- one per headless node: heartbeats both ways every second, a rank's death reported by its node
  agent, and a clean stop from node 0. A node silent for `heartbeat_timeout_s()` (hung, or the
  network between is down) fails the engine as a dead rank does, and a node whose head goes
  silent or away stops its ranks and exits non-zero.
The ports are as trusting as torch.distributed's: run them on a network of the cluster's own.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import torch.distributed as dist

from tandem.config import EngineConfig
from tandem.execution.rendezvous import (
    RendezvousError,
    open_store,
    rendezvous_timeout_s,
    seconds_setting,
)

logger = logging.getLogger("tandem")

HEAD_KEY = "tandem/head"  # in the store: the token a connection's hello must carry
HEARTBEAT = b"\x01"
NODE_STOP = b"\x00"  # node 0 closes cleanly: the node's ranks were sent STOP and exit 0
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 5.0  # TANDEM_HEARTBEAT_TIMEOUT: silence after which a peer is taken as lost


@dataclass(frozen=True)
class ClusterAddress:
    """Where a rank of a multi-node engine meets the others (picklable for spawn)."""

    addr: str  # node 0: the store at port, its listener at port + 1
    port: int
    remote: bool  # a headless node's rank: its steps come over a connection to node 0
    timeout_s: float  # the rendezvous's, as its node read it (a forked rank's environment is old)


def heartbeat_timeout_s() -> float:
    return seconds_setting("TANDEM_HEARTBEAT_TIMEOUT", HEARTBEAT_TIMEOUT_S, HEARTBEAT_INTERVAL_S)


class Heartbeats:
    """When each peer (a rank, a node) last beat; which one has been silent too long. A peer is
    watched from its first beat: until then other timeouts bound it (the rendezvous, start-up)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._last: dict[int, float] = {}

    def beat(self, peer: int) -> None:
        self._last[peer] = time.monotonic()

    def read(self, pipes: dict[Connection, int], pipe: Connection) -> None:
        """A beat from a peer's pipe, readable now; a pipe closed by its process's end leaves
        `pipes` (the process's own sentinel says how it ended)."""
        try:
            pipe.recv_bytes()
            self.beat(pipes[pipe])
        except (EOFError, OSError):
            del pipes[pipe]

    def silent(self) -> int | None:
        now = time.monotonic()
        return next((p for p, last in self._last.items() if now - last > self.timeout_s), None)


def send_heartbeats(conn: Connection) -> None:
    """A rank's thread: a beat a second until its supervisor is gone (it needs the GIL only
    between the steps' kernels, which release it)."""
    while True:
        try:
            conn.send_bytes(HEARTBEAT)
        except OSError:
            return
        time.sleep(HEARTBEAT_INTERVAL_S)


def connect_to_head(
    store: dist.Store, addr: str, port: int, hello: dict, timeout_s: float
) -> Connection:
    """A connection to node 0's listener, introduced by `hello` (with the store's token); from
    TANDEM_HOST_IP when set, so the address node 0 sees is the one this node logged."""
    token = json.loads(store.get(HEAD_KEY))["token"]
    source = os.environ.get("TANDEM_HOST_IP")
    try:
        sock = socket.create_connection(
            (addr, port + 1), timeout=timeout_s,
            source_address=(source, 0) if source else None,
        )  # fmt: skip
    except OSError as exc:
        raise RendezvousError(f"could not connect to node 0's listener at {addr}:{port + 1} "
                              f"({exc})") from None  # fmt: skip
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # steps are small and urgent
    conn = Connection(sock.detach())
    conn.send_bytes(json.dumps({**hello, "token": token}).encode())
    if conn.recv_bytes() != b"ok":
        raise RendezvousError(f"node 0 at {addr}:{port + 1} refused {hello}")
    return conn


class HeadSide:
    """Node 0's end of the other nodes: the store they meet in, their ranks' connections and
    their agents' heartbeats."""

    def __init__(self, config: EngineConfig):
        self.addr, self.port = config.master_addr, config.master_port
        self.per_node = config.ranks_per_node
        self.nodes = config.nnodes
        self.timeout_s = heartbeat_timeout_s()
        self.rendezvous_s = rendezvous_timeout_s()
        self.store = open_store(self.addr, self.port, True, self.rendezvous_s, "node 0")
        try:
            self._listener = socket.create_server((self.addr, self.port + 1))
        except OSError as exc:
            raise RendezvousError(f"node 0 could not listen at {self.addr}:{self.port + 1} "
                                  f"(--master-port + 1): {exc}") from None  # fmt: skip
        self._token = secrets.token_hex(16)  # in the store once the listener is up to meet it
        self.store.set(HEAD_KEY, json.dumps({"token": self._token}))
        self.rank_conns: dict[int, Connection] = {}
        self.node_conns: dict[int, Connection] = {}
        self.node_address: dict[int, str] = {}
        self.reasons: dict[int, str] = {}  # a lost node's account, by node
        self._send_lock = threading.Lock()
        self._closed = False
        self.failed = False  # set by the executor: close without telling nodes to stop cleanly

    def address(self) -> ClusterAddress:
        return ClusterAddress(self.addr, self.port, remote=False, timeout_s=self.rendezvous_s)

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def accept(self, sentinels: dict) -> int | None:
        """Every other node's agent and ranks connected; or the local rank whose process ended
        first (its pipe holds why). Bounded by the rendezvous timeout, after which the missing
        nodes are named."""
        ranks = set(range(self.per_node, self.per_node * self.nodes))
        nodes = set(range(1, self.nodes))
        deadline = time.monotonic() + self.rendezvous_s + 5.0
        while ranks - set(self.rank_conns) or nodes - set(self.node_conns):
            left = deadline - time.monotonic()
            ready = wait([self._listener, *sentinels], timeout=max(0.0, left))
            if not ready:
                missing = nodes - set(self.node_conns)
                missing |= {self.node_of(r) for r in ranks - set(self.rank_conns)}
                raise RendezvousError(
                    f"node(s) {', '.join(map(str, sorted(missing)))} did not connect to node 0 at "
                    f"{self.addr}:{self.port + 1} within {self.rendezvous_s:g} s"
                )
            for obj in ready:
                if obj in sentinels:
                    return sentinels[obj]
                self._accept_one(ranks, nodes)
        self._listener.close()
        return None

    def _accept_one(self, ranks: set[int], nodes: set[int]) -> None:
        sock, (peer, _) = self._listener.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Connection(sock.detach())
        try:
            if not conn.poll(5.0):
                raise ValueError("no hello")
            hello = json.loads(conn.recv_bytes(4096))
            if not isinstance(hello, dict):
                raise ValueError("no hello")
            if not hmac.compare_digest(str(hello.get("token", "")), self._token):
                raise ValueError("a wrong token")
            rank, node = hello.get("rank"), hello.get("node")
            if rank in ranks and rank not in self.rank_conns:
                self.rank_conns[rank] = conn
            elif node in nodes and node not in self.node_conns:
                self.node_conns[node] = conn
                self.node_address[node] = f"{hello.get('host', '?')} ({peer})"
            else:
                raise ValueError(f"an unexpected hello {hello}")
            conn.send_bytes(b"ok")
        except (ValueError, TypeError, OSError, EOFError) as exc:  # a stray or stale connection
            logger.warning("node 0 refused a connection from %s: %s", peer, exc)
            conn.close()

    def start_watching(self) -> None:
        """Every node is watched from now: it joined, and node 0 beats to it."""
        self.alive = Heartbeats(self.timeout_s)
        for node in self.node_conns:
            self.alive.beat(node)
        self._sent = 0.0

    def read(self, conn: Connection) -> int | None:
        """A node's message: a heartbeat (None), or the rank lost (`reasons` says why)."""
        node = next(n for n, c in self.node_conns.items() if c is conn)
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return self._lost(node, "its connection closed")
        if data == HEARTBEAT:
            self.alive.beat(node)
            return None
        report = json.loads(data)  # its agent saw one of its ranks die or hang
        return self._lost(node, report["reason"], report["rank"])

    def tick(self) -> int | None:
        """A heartbeat to every node once a second; the first rank of a silent or gone node."""
        node = self.alive.silent()
        if node is not None:
            return self._lost(node, f"no heartbeat for {self.timeout_s:g} s (hung, or the "
                                    "network between is down)")  # fmt: skip
        now = time.monotonic()
        if now - self._sent >= HEARTBEAT_INTERVAL_S:
            self._sent = now
            for node in self.node_conns:
                if not self.send(node, HEARTBEAT):
                    return self._lost(node, "its connection closed")
        return None

    def _lost(self, node: int, why: str, rank: int | None = None) -> int | None:
        if self._closed:
            return None
        self.reasons[node] = f"{why}; node {node}, {self.node_address.get(node, '?')}"
        return node * self.per_node if rank is None else rank

    def reason(self, rank: int) -> str:
        node = self.node_of(rank)
        return self.reasons.get(
            node, f"its connection closed; node {node}, {self.node_address.get(node, '?')}"
        )

    def send(self, node: int, data: bytes) -> bool:
        with self._send_lock:
            try:
                self.node_conns[node].send_bytes(data)
                return True
            except OSError:
                return False

    def close(self) -> None:
        """Tell every node to stop (unless the engine failed: they see the connection close and
        exit non-zero), then close every connection."""
        if self._closed:
            return
        if not self.failed:
            for node in list(self.node_conns):
                self.send(node, NODE_STOP)
        self._closed = True
        with self._send_lock:
            for conn in [*self.node_conns.values(), *self.rank_conns.values()]:
                with contextlib.suppress(OSError):
                    conn.close()
        with contextlib.suppress(OSError):
            self._listener.close()
