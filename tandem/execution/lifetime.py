"""Processes that never outlive their parent: a child of a SIGKILLed parent is killed too."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading

from tandem.config import EngineConfig


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent exits; exit now if it already has
    (`parent_pid` 0: no such check, for a child forked by a fork server)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    if parent_pid and os.getppid() != parent_pid:
        os._exit(1)


def child_start_method(config: EngineConfig) -> str:
    """How a server or a headless node starts the engine's processes: "fork" on the CPU, where
    the child starts with what its parent imported and read once for all of them (seconds of
    CPU time a fresh interpreter spends again); the parent must not have computed (an OpenMP
    team does not survive a fork): the command line's process, which has only read configs.
    "spawn" on CUDA, which a forked child cannot use once its parent has touched it, and where
    this process runs other threads (a fork copies only the calling thread, and any lock
    another one held)."""
    alone = threading.active_count() == 1
    return "fork" if config.torch_device.type == "cpu" and alone else "spawn"


def close_inherited(fds: tuple[int, ...]) -> None:
    """In a forked child: close the parent's file descriptors it must not hold (a listening
    socket, a connection whose end its peer watches)."""
    for fd in fds:
        os.close(fd)


def name_process(name: str) -> None:
    """Name this process as `ps -o comm`, `top` and /proc/PID/comm show it (at most 15 bytes):
    a forked child would otherwise show its parent's name and command line."""
    if sys.platform.startswith("linux"):
        pr_set_name = 15
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_name, name.encode()[:15])


def exit_reason(proc: mp.process.BaseProcess) -> str:
    """How a child ended, as a log says it: "killed by signal 9", "exit code 1"."""
    proc.join(timeout=1.0)
    code = proc.exitcode
    if code is None:
        return "still running"
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"
