"""A benchmarked server as a process: started in its own process group on a free port, waited
for until /health answers, paused (SIGSTOP) while another one is measured so its idle threads
take no CPU, and stopped with everything it started."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Server:
    """One server to benchmark: how to start it ("{port}" in `command` is filled in) and, once
    started, its process."""

    name: str
    label: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    reads_idle_gauge: bool = False  # Tandem's: its /metrics has the device idle gauge
    offline: bool = False  # `command` runs once per cell and prints output tok/s, no server
    port: int = 0
    process: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy for loopback


def get(url: str, timeout: float = 5) -> bytes:
    with _LOCAL.open(url, timeout=timeout) as reply:
        return reply.read()


def _healthy(url: str) -> bool:
    try:
        with _LOCAL.open(f"{url}/health", timeout=5) as reply:
            return reply.status == 200
    except (OSError, urllib.error.URLError):
        return False


async def start(server: Server, timeout_s: float, log_dir: Path) -> None:
    """Starts the server in its own process group (so it can be paused and stopped as one) and
    waits until /health says 200."""
    server.port = free_port()
    command = [part.replace("{port}", str(server.port)) for part in server.command]
    server.log_path = log_dir / f"{server.name}.log"
    print(f"{server.name}: starting: {shlex.join(command)}", file=sys.stderr)
    print(f"{server.name}: log: {server.log_path}", file=sys.stderr, flush=True)
    with server.log_path.open("w") as log:
        server.process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **server.env},
            cwd=log_dir,  # not a checkout, so PYTHONPATH alone decides which tandem runs
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"exited with {server.process.returncode}: {log_tail(server)}")
        if await asyncio.to_thread(_healthy, server.url):
            return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"no 200 from /health within {timeout_s:.0f} s: {log_tail(server)}")


def log_lines(server: Server) -> list[str]:
    if server.log_path is None or not server.log_path.is_file():
        return []
    return server.log_path.read_text(errors="replace").splitlines()


def execution_lines(server: Server) -> list[str]:
    """Tandem's start-up report of how it executes (the line naming its compute threads)."""
    marker = "execution: "
    return [line.split(marker, 1)[1] for line in log_lines(server) if marker in line]


def log_tail(server: Server, lines: int = 15) -> str:
    tail = log_lines(server)[-lines:]
    return "\n" + "\n".join(tail) if tail else ""


def signal_group(server: Server, sig: signal.Signals) -> None:
    if server.process is not None and server.process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, sig)


def stop(server: Server) -> None:
    """SIGTERM to the whole process group (resumed first, in case it was paused), then SIGKILL
    for whatever is still there after a grace period."""
    if server.process is None:
        return
    signal_group(server, signal.SIGCONT)
    signal_group(server, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.process.wait(timeout=15)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.process.pid, signal.SIGKILL)  # stragglers in the group, if any
    server.process.wait()
    server.process = None
