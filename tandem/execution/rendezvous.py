"""Joining the ranks a launcher started, loud and fast where multi-node runs usually fail quietly:
a rank that never comes (named, after a bounded wait, not a hang of half an hour), a rank started
with other settings (the difference printed field by field, on every rank), a node that picks the
wrong network interface (each rank logs the address and interface it uses).

The ranks meet in a TCP store on rank 0 (MASTER_ADDR:MASTER_PORT), or in node 0's engine
(`cluster.py`), each writing its host, address and settings under its own key; the process group
is then built on that store.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import socket
import struct
import time
from dataclasses import dataclass, fields
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tandem.config import EngineConfig

logger = logging.getLogger("tandem")

RENDEZVOUS_TIMEOUT_S = 120.0  # TANDEM_RENDEZVOUS_TIMEOUT: how long the ranks wait for each other
# Settings that may differ between nodes: paths, and sizes the ranks agree on after joining
# (the KV cache is the smallest any rank holds) or that only size a node's own threads.
PER_NODE = frozenset({"model", "generation_config", "num_kv_blocks", "kv_cache_memory_gib",
                      "gpu_memory_utilization", "cpu_threads", "detokenize",
                      "node_rank"})  # fmt: skip
SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


class RendezvousError(RuntimeError):
    """The ranks did not all meet, or met with different settings: the message says which."""


@dataclass(frozen=True)
class Endpoint:
    """Where this rank talks to the others from."""

    host: str
    address: str
    interface: str | None


def seconds_setting(name: str, default: float, above: float = 0.0) -> float:
    """An environment variable of seconds, more than `above`; a ValueError names a bad one."""
    text = os.environ.get(name)
    try:
        value = float(text) if text else default
    except ValueError:
        value = above - 1.0
    if not value > above:
        raise ValueError(f"{name} must be seconds > {above:g}, got {text!r}")
    return value


def rendezvous_timeout_s() -> float:
    return seconds_setting("TANDEM_RENDEZVOUS_TIMEOUT", RENDEZVOUS_TIMEOUT_S)


def interface_of(address: str) -> str | None:
    """The network interface that holds this IPv4 address (Linux), if any."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(s.fileno(), SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def local_endpoint(master_addr: str, backend: str) -> Endpoint:
    """This rank's address: TANDEM_HOST_IP, else the one the route to rank 0 leaves from; its
    interface: the backend's own setting (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME) when given,
    else the one holding the address, which gloo is then told to use as well."""
    address = os.environ.get("TANDEM_HOST_IP")
    if not address:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((socket.gethostbyname(master_addr), 9))  # no packet is sent
                address = s.getsockname()[0]
        except OSError as exc:  # an unknown name, or no route to it
            raise RendezvousError(
                f"the rendezvous address {master_addr!r} cannot be reached (MASTER_ADDR or "
                f"--master-addr): {exc}"
            ) from None
    setting = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    interface = os.environ.get(setting) or interface_of(address)
    if interface and backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = interface  # not the hostname's address: this one
    return Endpoint(socket.gethostname(), address, interface)


def model_digest(path: Path) -> str:
    """The checkpoint's identity across machines (paths may differ): its config.json, or a
    single file's size and first MiB."""
    path = Path(path)
    if path.is_dir():
        data = (path / "config.json").read_bytes() if (path / "config.json").is_file() else b""
    else:
        with path.open("rb") as f:
            data = f.read(1 << 20) + str(path.stat().st_size).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def settings_of(config: EngineConfig, model_path: Path) -> dict[str, str]:
    """What every rank must run with alike: versions, the model, and the engine's settings."""
    import transformers

    import tandem

    settings = {
        "tandem": getattr(tandem, "__version__", "?"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": f"{Path(model_path).name} ({model_digest(model_path)})",
    }
    for f in fields(config):
        if f.name not in PER_NODE:
            settings[f.name] = repr(getattr(config, f.name))
    return settings


def settings_diff(theirs: dict[str, str], ours: dict[str, str]) -> list[str]:
    """`field: rank 0's value != this rank's`, one line per field that differs."""
    names = list(theirs) + [name for name in ours if name not in theirs]
    return [
        f"{name}: {theirs.get(name, '(unset)')} != {ours.get(name, '(unset)')}"
        for name in names
        if theirs.get(name) != ours.get(name)
    ]


def wait_for_every_rank(store: dist.Store, keys: list[str], timeout_s: float, where: str) -> None:
    """Until every rank's key is in the store; RendezvousError names the ranks still missing."""
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [str(r) for r, key in enumerate(keys) if not store.check([key])]
            joined = [
                f"{r} ({json.loads(store.get(key))['address']})"
                for r, key in enumerate(keys)
                if str(r) not in missing
            ]
            raise RendezvousError(
                f"{'ranks' if len(missing) > 1 else 'rank'} {', '.join(missing)} of {len(keys)} "
                f"did not join at {where} within {timeout_s:g} s (joined: {', '.join(joined)}); "
                "TANDEM_RENDEZVOUS_TIMEOUT waits longer"
            )
        time.sleep(0.05)


def open_store(addr: str, port: int, is_master: bool, timeout_s: float, who: str) -> dist.Store:
    """The rendezvous store: hosted here, or reached within the timeout; RendezvousError says
    which address failed and what to check."""
    try:
        return dist.TCPStore(addr, port, is_master=is_master,
                             timeout=timedelta(seconds=timeout_s), wait_for_workers=False)  # fmt: skip
    except dist.DistError as exc:
        if is_master:
            raise RendezvousError(
                f"{who} could not listen at {addr}:{port}: is the port in use, and is {addr} "
                f"this node's address? ({exc})"
            ) from None
        raise RendezvousError(
            f"{who} could not reach node 0 at {addr}:{port} within {timeout_s:g} s: is node 0 "
            f"running, and is that its address (MASTER_ADDR and MASTER_PORT, or --master-addr "
            f"and --master-port)? ({exc})"
        ) from None


def meet(
    rank: int,
    world: int,
    backend: str,
    settings: dict[str, str],
    addr: str,
    port: int,
    host_store: bool | None = None,
    timeout_s: float | None = None,
) -> dist.Store:
    """Every rank's key in the store at addr:port within the timeout, each with rank 0's
    settings; the store the process group is then built on. The store lives in rank 0 unless
    `host_store` says otherwise (node 0's engine holds it for its own ranks). RendezvousError
    names what went wrong. `timeout_s` defaults to TANDEM_RENDEZVOUS_TIMEOUT's."""
    timeout_s = timeout_s or rendezvous_timeout_s()
    endpoint = local_endpoint(addr, backend)
    logger.info(
        "rank %d of %d on %s: address %s, interface %s; rendezvous at %s:%d",
        rank, world, endpoint.host, endpoint.address, endpoint.interface or "(unknown)", addr,
        port,
    )  # fmt: skip
    is_master = rank == 0 if host_store is None else host_store
    store = open_store(addr, port, is_master, timeout_s, f"rank {rank}")
    keys = [f"tandem/rank/{r}" for r in range(world)]
    store.set(keys[rank], json.dumps({"host": endpoint.host, "address": endpoint.address,
                                      "settings": settings}))  # fmt: skip
    try:
        wait_for_every_rank(store, keys, timeout_s, f"{addr}:{port}")
        head = json.loads(store.get(keys[0]))
        others = [json.loads(store.get(key)) for key in keys[1:]]
    except dist.DistError as exc:  # rank 0, and with it the store, gave up first
        raise RendezvousError(f"rank 0 at {addr}:{port} left the rendezvous ({exc})") from None
    for r, other in enumerate(others, start=1):
        diff = settings_diff(head["settings"], other["settings"])
        if diff:  # every rank reads the same keys, so every rank stops here
            raise RendezvousError(
                f"rank {r} on {other['host']} ({other['address']}) runs with other settings than "
                f"rank 0 on {head['host']} ({head['address']}); rank 0's != rank {r}'s:\n  "
                + "\n  ".join(diff)
            )
    return store
