"""Counting a large JSON body's values in a helper process, so that no server thread waits on it.

A worker thread shares the GIL with the event loop, and every JSON parser available here (json,
pydantic) holds the GIL for a whole parse, whose cost grows with the number of values: 15 MB of
tiny chat messages freezes every thread of the process for seconds, wherever the parse runs.
So a large body is first parsed and counted by a small child process (the standard library only,
started on first use, one at a time); the server refuses it if it is not JSON or holds more
values than a request that fits the model can, and only a body that passes reaches pydantic.
The child reads its requests from a pipe and exits when the pipe closes, so it never outlives
the server.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import threading
from dataclasses import dataclass

logger = logging.getLogger("tandem.server")

_CHILD = r"""
import json, sys
read, write = sys.stdin.buffer, sys.stdout.buffer
while True:
    header = read.readline()
    if not header:
        break
    raw = read.read(int(header))
    try:
        stack, count = [json.loads(raw)], 0
    except (ValueError, RecursionError) as exc:
        write.write(b"error " + str(exc).replace("\n", " ").encode() + b"\n")
    else:
        while stack:
            item = stack.pop()
            count += 1
            if isinstance(item, dict):
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)
        write.write(b"%d\n" % count)
    del raw, stack
    write.flush()
"""


@dataclass(frozen=True)
class Count:
    values: int  # JSON values, object keys not counted
    error: str | None = None  # why the body is not JSON


class JSONCounter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._closed = False

    def count(self, raw: bytes) -> Count | None:
        """The body's value count, or None if the helper process is unavailable."""
        with self._lock:
            for _ in range(2):  # a dead helper is replaced once
                proc = self._process()
                if proc is None:
                    return None
                try:
                    assert proc.stdin is not None and proc.stdout is not None
                    proc.stdin.write(b"%d\n" % len(raw))
                    proc.stdin.write(raw)
                    proc.stdin.flush()
                    line = proc.stdout.readline().decode().rstrip("\n")
                except (OSError, ValueError):
                    line = ""
                if line.startswith("error "):
                    return Count(0, line.removeprefix("error "))
                if line.isdigit():
                    return Count(int(line))
                logger.warning("the JSON counting process failed; starting another")
                self._stop()
            return None

    def _process(self) -> subprocess.Popen | None:
        if self._closed:
            return None
        if self._proc is None or self._proc.poll() is not None:
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _CHILD],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                )
            except OSError as exc:
                logger.warning("cannot start the JSON counting process: %s", exc)
                return None
        return self._proc

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        try:
            proc.wait(2)  # it exits at the end of its input
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """Stop the helper at once (a count in progress returns None); idempotent."""
        self._closed = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if self._lock.acquire(blocking=False):  # else the counting thread tidies up
            try:
                self._stop()
            finally:
                self._lock.release()
