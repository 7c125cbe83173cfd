"""`tandem serve` as real processes: front ends, engine cores and the supervisor, end to end.

Each server runs `python -m tandem serve` in a process group of its own, so that every process
it starts can be found (and none can hide). Answers through several front ends and several
data-parallel cores must equal the offline `LLM.generate`, and the synchronous loop's answers
the asynchronous loop's; counters must be summed over the front ends; a client that leaves must
free its KV blocks in the core. Faults: a core killed or hung, a front end killed, the server killed
with SIGKILL, a model that does not exist; each must answer the open requests, exit with the
documented status and leave no process behind. A SIGTERM must drain and exit 0.

The servers' context is 2048 tokens (not the usual 512): a token of this model reaches the client
every 1-3 ms, so a 1900-token stream lasts a few seconds, long enough to be caught mid-stream
on a loaded machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx
import openai
import pytest
import torch
from test_server import (
    metric_samples,
    processes,
    processes_in_group,
    sse_events,
    wait_until,
)

from tandem import LLM, EngineConfig, SamplingParams
from tandem.execution import lifetime
from tandem.execution.lifetime import child_start_method
from tandem.models.default_model import build_checkpoint

MODEL_LEN = 2048
KV_BLOCKS = 128  # 2048 tokens of 16 per block: room for one long stream
LONG = 1900  # output tokens of a stream that a fault interrupts
STARTUP_S = 240  # several interpreters importing torch on two busy cores
PROMPTS = ["Hello world", "The quick brown fox", "Once upon a time, in a land far away"]
# One compute thread everywhere: the offline engine, each data-parallel core and the synchronous
# server then add up every dot product in the same order (a near tie cannot go two ways).
OFFLINE_OPTIONS = {
    "dtype": "float32",
    "device": "cpu",
    "num_kv_blocks": KV_BLOCKS,
    "max_model_len": MODEL_LEN,
    "cpu_threads": 1,
}
ENGINES = ("0", "1")
# Where the thread count does not matter to a test: no core times the counts at start-up (the
# cores of test_front_end_killed_mid_stream still do).
ONE_THREAD = ("--cpu-threads", "1")


# ----------------------------------------------------------------- harness
@dataclass
class Served:
    """A `tandem serve` process (the leader of its own process group) and its log."""

    proc: subprocess.Popen
    port: int
    log_path: Path
    log: IO[bytes]
    model: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pgid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def logged_pids(self, what: str) -> list[int]:
        """The pids the server logged for "engine core" or "front end", in index order."""
        found = re.findall(rf"{what} (\d+): pid (\d+)", self.output())
        return [int(pid) for _, pid in sorted(found, key=lambda f: int(f[0]))]

    @property
    def cores(self) -> list[int]:
        return self.logged_pids("engine core")

    @property
    def frontends(self) -> list[int]:
        return self.logged_pids("front end")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60
        )

    def long_body(self, **extra) -> dict:
        body = {"model": self.model, "prompt": "tell me everything", "max_tokens": LONG}
        return {**body, "ignore_eos": True, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(model: Path | str, log_path: Path, *flags: str) -> Served:
    """Start `tandem serve` (not waiting for it), its output going to `log_path`. One compute
    thread unless `flags` say otherwise: no start-up spent timing thread counts."""
    port = free_port()
    command = [
        sys.executable, "-m", "tandem", "serve", "--model", str(model), "--port", str(port),
        "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", str(KV_BLOCKS),
        "--max-model-len", str(MODEL_LEN), "--cpu-threads", "1", *flags,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    log = log_path.open("wb")
    proc = subprocess.Popen(
        command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    return Served(proc, port, log_path, log)


def every(seconds: float, condition: Callable[[], bool]) -> Callable[[], bool]:
    """`condition` for `wait_until`, checked at most every `seconds` (a scrape costs the
    server CPU time that its two cores share with the test)."""

    def check() -> bool:
        if condition():
            return True
        time.sleep(seconds)
        return False

    return check


def wait_healthy(server: Served, url: str | None = None) -> None:
    """Until the server's /health (at `url`, default its own) says 200; then its model's name."""
    url = url or server.url

    def healthy() -> bool:
        assert server.proc.poll() is None, f"the server exited:\n{server.output()}"
        try:
            return httpx.get(f"{url}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(every(0.2, healthy), STARTUP_S, f"the server's /health at {url}")
    server.model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]


def clean_up(server: Served) -> None:
    """Kill whatever of the group is left (a stopped core too), reap the leader."""
    if processes_in_group(server.pgid):
        for sig in (signal.SIGCONT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pgid, sig)
    if server.proc.poll() is None:
        server.proc.kill()
    server.proc.wait(30)
    server.log.close()


@contextlib.contextmanager
def serving(model: Path, log_path: Path, *flags: str) -> Iterator[Served]:
    """A healthy server for the block; whatever is left of its group is killed afterwards."""
    with healthy(spawn(model, log_path, *flags)) as server:
        yield server


@contextlib.contextmanager
def healthy(server: Served) -> Iterator[Served]:
    """`server` (spawned already), once healthy, for the block; whatever is left of its group
    is killed afterwards."""
    try:
        wait_healthy(server)
        yield server
    finally:
        clean_up(server)


def nothing_left(server: Served, timeout: float = 10.0) -> None:
    """No live process of the server's group within `timeout` (the leader has been reaped)."""

    def empty() -> bool:
        return not processes_in_group(server.pgid)

    wait_until(every(0.1, empty), timeout, "the process group to empty")


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def process_name(pid: int) -> str:
    """What `ps -o comm` shows: a core names itself "tandem-core-N"."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """A process, not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def children(pid: int) -> list[int]:
    return processes(lambda f: int(f[1]) == pid and f[0] != "Z")


def sockets_of(pid: int) -> set[str]:
    """The sockets a process holds, as /proc names them ("socket:[inode]")."""
    links = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            links.add(os.readlink(fd))
    return {link for link in links if link.startswith("socket:")}


def tcp_sockets() -> list[tuple[int, int, str, str]]:
    """Every IPv4 TCP socket: local port, remote port, state ("0A": listening) and its /proc
    name ("socket:[inode]")."""
    rows = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = (int(a.rsplit(":", 1)[1], 16) for a in fields[1:3])
        rows.append((local, remote, fields[3], f"socket:[{fields[9]}]"))
    return rows


def listening_holders(port: int, pids: list[int]) -> list[int]:
    """Which of `pids` hold the TCP socket listening on `port`."""
    inodes = {name for local, _, state, name in tcp_sockets() if local == port and state == "0A"}
    return [pid for pid in pids if sockets_of(pid) & inodes]


def connection_owner(server_port: int, client_port: int, pids: list[int]) -> int:
    """Which of `pids` holds the server side of the loopback connection from `client_port`."""
    names = [
        n for local, remote, _, n in tcp_sockets() if (local, remote) == (server_port, client_port)
    ]
    assert names, "no server side for this connection"
    for pid in pids:
        if names[-1] in sockets_of(pid):
            return pid
    raise AssertionError(f"none of {pids} holds the connection")


def finished(samples: dict, reason: str | None = None) -> float:
    """tandem_requests_finished_total, for one finish reason or all."""
    return sum(
        value
        for (name, labels), value in samples.items()
        if name == "tandem_requests_finished_total"
        and (reason is None or ("finish_reason", reason) in labels)
    )


def engine_value(samples: dict, name: str, engine: str) -> float:
    return samples[(name, (("engine", engine),))]


def engines_idle(url: str) -> bool:
    samples = metric_samples(url)
    return all(
        engine_value(samples, name, e) == 0
        for e in ENGINES
        for name in ("tandem_requests_running", "tandem_requests_waiting", "tandem_kv_blocks_used")
    )


def core_load(server: Served) -> tuple[float, float]:
    """Requests running and waiting on a one-core server's core."""
    samples = metric_samples(server.url)
    return tuple(
        engine_value(samples, f"tandem_requests_{what}", "0") for what in ("running", "waiting")
    )


def texts_by_index(chunks) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    return texts


def seeded(n: int, max_tokens: int = 8, seed: int = 5) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)


def greedy_texts(server: Served, max_tokens: int = 8) -> list[str]:
    with server.client() as client:
        out = client.completions.create(
            model=server.model,
            prompt=PROMPTS,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    assert all(c.finish_reason == "length" for c in out.choices)
    return [c.text for c in sorted(out.choices, key=lambda c: c.index)]


def seeded_texts(server: Served, n: int = 2, stream: bool = False) -> list[str]:
    kwargs = {"model": server.model, "prompt": "Hello world", "max_tokens": 8, "n": n}
    kwargs |= {"temperature": 1.0, "seed": 5, "extra_body": {"ignore_eos": True}}
    with server.client() as client:
        if stream:
            texts = texts_by_index(client.completions.create(**kwargs, stream=True))
            return [texts[i] for i in range(n)]
        out = client.completions.create(**kwargs)
    return [c.text for c in sorted(out.choices, key=lambda c: c.index)]


# ------------------------------------- two front ends, two data-parallel cores
class Reusable:
    """A server that several tests share. A test that ends it comes after the others in this
    file; should any test still want it afterwards, a fresh one is started."""

    def __init__(self, model: Path, log_dir: Path, *flags: str):
        self.model, self.log_dir, self.flags = model, log_dir, flags
        self.server: Served | None = None
        self.starts = 0

    def get(self) -> Served:
        if self.server is not None and self.server.proc.poll() is None:
            return self.server
        self.close()
        self.starts += 1
        server = spawn(self.model, self.log_dir / f"serve-{self.starts}.log", *self.flags)
        try:
            wait_healthy(server)
        except BaseException:
            clean_up(server)
            raise
        self.server = server
        return server

    def close(self) -> None:
        if self.server is not None:
            clean_up(self.server)
            self.server = None


@pytest.fixture(scope="module")
def farms(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reusable]:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two data-parallel cores need two CPU cores")
    flags = ("--api-server-count", "2", "--data-parallel-size", "2", "--cpu-threads", "1")
    reusable = Reusable(tiny_llama, tmp_path_factory.mktemp("farm"), *flags)
    yield reusable
    reusable.close()


@pytest.fixture
def farm(farms: Reusable) -> Served:
    """Two front ends before two data-parallel cores (one compute thread each)."""
    return farms.get()


@pytest.fixture(scope="module")
def sync_servers(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reusable]:
    flags = ("--no-async", "--cpu-threads", "1")
    reusable = Reusable(tiny_llama, tmp_path_factory.mktemp("sync"), *flags)
    yield reusable
    reusable.close()


@pytest.fixture
def sync_server(sync_servers: Reusable) -> Served:
    """One front end before one core running the synchronous loop (one compute thread)."""
    return sync_servers.get()


@pytest.fixture(scope="module")
def offline(tiny_llama: Path) -> Iterator[LLM]:
    llm = LLM(str(tiny_llama), **OFFLINE_OPTIONS)
    yield llm
    llm.close()


def test_cores_fork_on_the_cpu_unless_other_threads_run(monkeypatch) -> None:
    """A CPU server forks its cores; CUDA, or a process running other threads, spawns them (this
    test process runs threads of its own: their count is set here)."""
    config = EngineConfig(device="cpu")
    threads = [1]
    monkeypatch.setattr(lifetime.threading, "active_count", lambda: threads[0])
    assert child_start_method(config) == "fork"
    threads[0] = 2
    assert child_start_method(config) == "spawn"
    threads[0] = 1
    monkeypatch.setattr(EngineConfig, "torch_device", property(lambda _: torch.device("cuda")))
    assert child_start_method(config) == "spawn"


def test_process_group_is_supervisor_front_ends_cores(farm: Served) -> None:
    """The group holds exactly the supervisor, its two front ends, its two cores and the
    multiprocessing resource tracker, all children of the supervisor; nothing else."""
    cores, frontends = farm.cores, farm.frontends
    assert len(cores) == 2 and len(frontends) == 2
    trackers = [
        pid
        for pid in processes_in_group(farm.pgid)
        if "multiprocessing.resource_tracker" in cmdline(pid)
    ]
    assert len(trackers) == 1
    expected = {farm.pgid, *trackers, *cores, *frontends}
    assert len(processes_in_group(farm.pgid)) == 6
    assert set(processes_in_group(farm.pgid)) == expected
    assert set(children(farm.pgid)) == expected - {farm.pgid}
    assert sorted(process_name(pid) for pid in cores) == ["tandem-core-0", "tandem-core-1"]
    assert all("multiprocessing.spawn" in cmdline(pid) for pid in frontends)


def test_greedy_through_two_front_ends_and_two_cores_matches_offline(
    farm: Served, offline: LLM
) -> None:
    """Greedy completions of a prompt list (its prompts spread over both cores), whole and
    streamed, equal the offline engine's token for token."""
    expected = [
        o.outputs[0].text
        for o in offline.generate(
            PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        )
    ]
    assert greedy_texts(farm) == expected
    with farm.client() as client:
        chunks = client.completions.create(
            model=farm.model,
            prompt=PROMPTS,
            max_tokens=8,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        texts = texts_by_index(chunks)
    assert [texts[i] for i in range(len(PROMPTS))] == expected


def test_seeded_n_through_the_farm_matches_offline(farm: Served, offline: LLM) -> None:
    """n = 2 with a seed: two distinct samples, equal to the offline engine's, whole or
    streamed, whichever front end and core serve them."""
    expected = [o.text for o in offline.generate(["Hello world"], seeded(2))[0].outputs]
    assert len(set(expected)) == 2
    assert seeded_texts(farm) == expected
    assert seeded_texts(farm, stream=True) == expected


def test_concurrent_requests_and_metrics_summed_over_front_ends(farm: Served) -> None:
    """16 concurrent requests (half streamed) all succeed; /metrics, from whichever front end
    answers, labels every engine gauge engine="0" and engine="1", shows both cores served some,
    and counts every finished sequence and generated token once, summed over the front ends."""
    before = metric_samples(farm.url)
    n, max_tokens = 16, 4

    async def one(client: openai.AsyncOpenAI, i: int) -> None:
        kwargs = {"model": farm.model, "prompt": f"request {i}", "max_tokens": max_tokens}
        kwargs |= {"temperature": 0, "extra_body": {"ignore_eos": True}}
        if i % 2:
            chunks = [c async for c in await client.completions.create(**kwargs, stream=True)]
            assert chunks[-1].choices[0].finish_reason == "length"
        else:
            out = await client.completions.create(**kwargs)
            assert out.choices[0].finish_reason == "length"
            assert out.usage.completion_tokens == max_tokens

    async def main() -> None:
        async with farm.async_client() as client:
            await asyncio.gather(*(one(client, i) for i in range(n)))

    asyncio.run(main())
    wait_until(every(0.1, lambda: engines_idle(farm.url)), 10, "both engines idle")
    for _ in range(6):  # new connections: either front end may answer each
        after = metric_samples(farm.url)
        assert finished(after) - finished(before) == n
        assert finished(after, "length") - finished(before, "length") == n
        generated = "tandem_generation_tokens_total"
        assert after[(generated, ())] - before[(generated, ())] == n * max_tokens
        assert after[("tandem_requests_in_flight", ())] == 0
        for name in (
            "tandem_requests_running",
            "tandem_requests_waiting",
            "tandem_kv_blocks_used",
            "tandem_kv_blocks_total",
        ):
            assert {dict(labels).get("engine") for (m, labels) in after if m == name} == {*ENGINES}
        for e in ENGINES:
            assert engine_value(after, "tandem_kv_blocks_total", e) == KV_BLOCKS
            queries = "tandem_prefix_cache_queries_total"
            assert engine_value(after, queries, e) > engine_value(before, queries, e)


def test_disconnect_aborts_in_the_core(farm: Served) -> None:
    """A client that closes a long stream after two chunks: its core aborts the request (the
    summed counter gains one "abort"), and every engine is back to no running request and no
    KV block in use within seconds."""
    before = metric_samples(farm.url)
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{farm.url}/v1/completions", json=farm.long_body(stream=True)) as r,
    ):
        events = sse_events(r.iter_lines())
        next(events), next(events)
    wait_until(every(0.1, lambda: engines_idle(farm.url)), 5, "the aborted request's blocks")
    after = metric_samples(farm.url)
    assert finished(after, "abort") - finished(before, "abort") == 1
    assert finished(after) - finished(before) == 1


# ------------------------------------------------------ sync and async loops
def test_sync_loop_serves_what_the_async_loop_serves(farm: Served, sync_server: Served) -> None:
    """A server with --no-async (one front end, one core) gives the same greedy texts and the
    same seeded samples as the default asynchronous loop (the two-core server)."""
    assert greedy_texts(sync_server) == greedy_texts(farm)
    assert greedy_texts(sync_server, max_tokens=40) == greedy_texts(farm, max_tokens=40)
    assert seeded_texts(sync_server) == seeded_texts(farm)
    assert seeded_texts(sync_server, stream=True) == seeded_texts(farm, stream=True)


# ------------------------------------------------------------------ faults
@pytest.fixture(scope="module")
def slower_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama whose decode steps take milliseconds, not tiny_llama's fraction of one: two
    long requests then run for seconds, long enough for a third to queue behind them."""
    return build_checkpoint(
        tmp_path_factory.mktemp("slower-llama"), hidden_size=512, intermediate_size=1536,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
    )  # fmt: skip


@pytest.fixture(scope="module")
def started_together(
    tiny_llama: Path, slower_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Served]]:
    """The servers that the fault tests end and the starts that are refused, by test, all
    spawned when the first of those tests runs: a start is mostly one process importing at a
    time, so theirs overlap, and each test waits for its own. (The broken checkpoints:
    `test_unreadable_config_is_refused_and_the_cores_stopped`'s and
    `test_core_that_fails_to_start_says_why`'s.)"""
    root = tmp_path_factory.mktemp("started-together")
    unreadable = root / "unknown-type"
    unreadable.mkdir()
    (unreadable / "config.json").write_text('{"model_type": "no_such_architecture"}')
    no_weights = root / "no-weights"
    no_weights.mkdir()
    for source in tiny_llama.iterdir():
        if source.suffix != ".safetensors":
            shutil.copy(source, no_weights / source.name)
    two = ("--api-server-count", "2")
    commands = {
        "core killed": (slower_llama, "--max-num-seqs", "2", *ONE_THREAD),
        "core hung": (tiny_llama, "--engine-timeout", "2", *ONE_THREAD),
        "front end killed": (tiny_llama, *two, "--grace-period", "60"),
        "missing model": ("/nonexistent", *two),
        "unreadable config": (unreadable, *two),
        "no weights": (no_weights, *two),
    }
    servers: dict[str, Served] = {}
    try:
        for name, (model, *flags) in commands.items():
            servers[name] = spawn(model, root / f"{name.replace(' ', '-')}.log", *flags)
        yield servers
    finally:
        for server in servers.values():
            clean_up(server)


def test_core_killed_mid_stream(started_together: dict[str, Served]) -> None:
    """SIGKILL the core while a stream and a whole-answer request run and a third request waits
    (--max-num-seqs 2): at once, not after the 60 s engine timeout, the stream ends with an
    error event then [DONE], the running request gets 500 and the waiting one 503 (it can be
    retried as it is); /health says 503 while the front end is still up; the server exits 1
    and leaves no process behind. The core, forked after the port was bound, holds no copy of
    the listening socket."""
    with healthy(started_together["core killed"]) as server:
        [core] = server.cores
        assert core in children(server.pgid) and process_name(core) == "tandem-core-0"
        # Forked from the server (the same command line) after it bound the port: the core
        # closed its copy.
        assert cmdline(core) == cmdline(server.pgid)
        assert listening_holders(server.port, [server.pgid, core]) == [server.pgid]
        url = f"{server.url}/v1/completions"
        with (
            httpx.Client(timeout=30) as client,
            ThreadPoolExecutor(2) as pool,
            client.stream("POST", url, json=server.long_body(stream=True)) as r,
        ):
            events = sse_events(r.iter_lines())
            first = [next(events), next(events)]
            running = pool.submit(httpx.post, url, json=server.long_body(), timeout=30)
            wait_until(every(0.05, lambda: core_load(server) == (2, 0)), 10, "two running")
            waiting = pool.submit(httpx.post, url, json=server.long_body(max_tokens=4), timeout=30)
            wait_until(every(0.05, lambda: core_load(server) == (2, 1)), 10, "one waiting")
            os.kill(core, signal.SIGKILL)
            killed = time.monotonic()
            rest = list(events)
            ended = time.monotonic() - killed
            answers = running.result(30), waiting.result(30)
            with contextlib.suppress(httpx.TransportError):  # it may be gone already
                assert httpx.get(f"{server.url}/health").status_code == 503
        assert all(e["choices"][0]["finish_reason"] is None for e in first)
        assert rest[-1] == "[DONE]", rest[-3:]
        assert "error" in rest[-2], rest[-3:]
        message = rest[-2]["error"]["message"]
        assert "engine core 0" in message and "exited" in message, message
        assert ended < 5
        assert [a.status_code for a in answers] == [500, 503], [a.text for a in answers]
        assert all("engine core 0" in a.json()["error"]["message"] for a in answers)
        assert server.proc.wait(15) == 1
        nothing_left(server)
        assert "tandem serve: the engine failed: engine core 0" in server.output()


def test_core_hung_mid_stream(started_together: dict[str, Served]) -> None:
    """SIGSTOP the core mid-stream with --engine-timeout 2: within ~5 s the stream ends with an
    error naming the timeout, then [DONE]; the server kills the stopped core, exits 1 and
    leaves no process behind."""
    core = None
    try:
        with healthy(started_together["core hung"]) as server:
            [core] = server.cores
            with (
                httpx.Client(timeout=30) as client,
                client.stream(
                    "POST", f"{server.url}/v1/completions", json=server.long_body(stream=True)
                ) as r,
            ):
                events = sse_events(r.iter_lines())
                next(events), next(events)
                os.kill(core, signal.SIGSTOP)
                stopped = time.monotonic()
                rest = list(events)
                ended = time.monotonic() - stopped
            assert rest[-1] == "[DONE]", rest[-3:]
            message = rest[-2]["error"]["message"]
            assert "--engine-timeout 2" in message and "sent nothing" in message, message
            assert 1.5 < ended < 5
            assert server.proc.wait(20) == 1
            nothing_left(server)
            assert "tandem serve: the engine failed: engine core 0 has sent nothing" in (
                server.output()
            )
    finally:
        if core is not None and alive(core):
            with contextlib.suppress(ProcessLookupError):
                os.kill(core, signal.SIGCONT)
                os.kill(core, signal.SIGKILL)


def test_front_end_killed_mid_stream(started_together: dict[str, Served]) -> None:
    """With two front ends, SIGKILL the one not serving an open stream: the supervisor stops
    the other at once (the stream is aborted: an error event, then [DONE]), exits 1 and leaves
    no process behind."""
    with healthy(started_together["front end killed"]) as server:
        with (
            httpx.Client(timeout=30) as client,
            client.stream(
                "POST", f"{server.url}/v1/completions", json=server.long_body(stream=True)
            ) as r,
        ):
            events = sse_events(r.iter_lines())
            next(events), next(events)
            client_port = r.extensions["network_stream"].get_extra_info("client_addr")[1]
            serving_it = connection_owner(server.port, client_port, server.frontends)
            [other] = [pid for pid in server.frontends if pid != serving_it]
            os.kill(other, signal.SIGKILL)
            killed = time.monotonic()
            rest = list(events)
            ended = time.monotonic() - killed
        assert rest[-1] == "[DONE]", rest[-3:]
        assert "error" in rest[-2], f"not aborted: {rest[-3:]}"
        assert "shutting down" in rest[-2]["error"]["message"]
        assert ended < 5
        assert server.proc.wait(15) == 1
        nothing_left(server)
        assert "tandem serve: front end tandem-api-" in server.output()


def test_sigterm_drains_two_front_ends(farm: Served) -> None:
    """SIGTERM on the supervisor of two front ends (and two cores) while a request streams: new
    requests and /health get 503 during the drain, the stream runs to its end (finish_reason
    "length"), the supervisor exits 0 and leaves no process behind. (It ends the shared
    server: it comes after the other tests that use it.)"""
    server = farm
    with (
        httpx.Client(timeout=60) as client,
        client.stream(
            "POST", f"{server.url}/v1/completions", json=server.long_body(stream=True)
        ) as r,
    ):
        events = sse_events(r.iter_lines())
        next(events)
        server.proc.send_signal(signal.SIGTERM)

        def refusing() -> bool:
            return httpx.get(f"{server.url}/health").status_code == 503

        wait_until(every(0.05, refusing), 10, "/health 503")
        body = {**server.long_body(), "max_tokens": 4}
        for _ in range(3):  # either front end may take each connection
            refused = httpx.post(f"{server.url}/v1/completions", json=body)
            assert refused.status_code == 503, refused.text
            assert "shutting down" in refused.json()["error"]["message"]
        rest = list(events)
    assert rest[-1] == "[DONE]"
    assert rest[-2]["choices"][0]["finish_reason"] == "length", rest[-3:]
    assert server.proc.wait(30) == 0
    nothing_left(server)


def test_sigkill_of_the_server_takes_its_core_along(sync_server: Served) -> None:
    """SIGKILL the server (its only front end) mid-stream: the client sees the connection
    drop, and the core and every other process of the group die with it within seconds. (It
    ends the synchronous-loop server: it comes after the test that compares with it.)"""
    server = sync_server
    [core] = server.cores
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST", f"{server.url}/v1/completions", json=server.long_body(stream=True)
        ) as r,
    ):
        events = sse_events(r.iter_lines())
        next(events), next(events)
        server.proc.kill()
        with pytest.raises(httpx.TransportError):
            list(events)
    assert server.proc.wait(10) == -signal.SIGKILL
    nothing_left(server, timeout=5)
    assert not alive(core)


def refused(server: Served, status: int) -> tuple[str, str]:
    """`tandem serve --model MODEL --api-server-count 2` that does not start: it exits with
    `status`, leaving no process; its final `tandem serve:` line and its whole output."""
    try:
        assert server.proc.wait(STARTUP_S) == status
        nothing_left(server)
        out = server.output()
    finally:
        clean_up(server)
    [summary] = [line for line in out.splitlines() if line.startswith("tandem serve:")]
    return summary, out


def test_missing_model_is_refused_before_any_process_starts(
    started_together: dict[str, Served],
) -> None:
    """`tandem serve --model /nonexistent`: refused by the main process in about a second, with
    the usage error status (2) and the reason, before any core or front end is spawned."""
    summary, out = refused(started_together["missing model"], 2)
    assert "model folder '/nonexistent' does not exist" in summary, out
    assert "engine core" not in out  # nothing was started


def test_unreadable_config_is_refused_and_the_cores_stopped(
    started_together: dict[str, Served],
) -> None:
    """A config.json that transformers cannot read (`{"model_type": "no_such_architecture"}`):
    the main process reads it in full while the cores load, so it refuses it then (usage error
    status 2, the reason) and stops them."""
    summary, out = refused(started_together["unreadable config"], 2)
    assert "cannot read" in summary and "no_such_architecture" in summary, out


def test_core_that_fails_to_start_says_why(started_together: dict[str, Served]) -> None:
    """A checkpoint whose config reads but whose weights are missing (tiny_llama's files but
    its safetensors): the core fails while loading, every front end and the supervisor exit
    (status 1), the final `tandem serve:` line gives the core's reason (not only "a front end
    exited"), and no process is left."""
    summary, out = refused(started_together["no weights"], 1)
    assert "failed to start" in summary and "safetensors" in summary, out


# Per process, what its first imports bring in: a module that must be there, and what must not.
IMPORTS = {
    "import tandem": ((), ("torch", "transformers", "fastapi", "tandem.engine.engine")),
    # The command line's parser: torch (its config checks the device), no model code.
    "from tandem.cli import build_parser; build_parser()": (
        ("torch",),
        ("transformers", "fastapi", "tandem.engine.engine", "tandem.models.loader"),
    ),
    # What `tandem serve` imports before it spawns the cores: the front end comes after.
    "import tandem.server.serve": (
        ("tandem.server.core.process",),
        (
            "transformers",
            "fastapi",
            "uvicorn",
            "tandem.engine.engine",
            "tandem.server.frontend_process",
        ),
    ),
    # A spawned core unpickles its target: no HTTP stack in the engine's process.
    "import tandem.server.core.process": ((), ("fastapi", "uvicorn", "tandem.server.app")),
}


def test_each_process_imports_only_what_it_needs() -> None:
    """A server's start is its processes' imports one after another: `tandem serve` spawns the
    engine cores after importing little (no model code, no HTTP stack), then imports the front
    end while they load; the cores import no HTTP stack.

    One interpreter runs the statements in the order listed: what a statement adds to the
    modules loaded so far must hold what it needs, and nothing it must not import is loaded by
    then (by it or a statement before it)."""
    code = "import json, sys\nfor statement in sys.argv[1:]:\n"
    code += "    exec(statement)\n    print(json.dumps(sorted(sys.modules)), flush=True)\n"
    done = subprocess.run(
        [sys.executable, "-c", code, *IMPORTS], capture_output=True, text=True, timeout=120,
        check=True,
    )  # fmt: skip
    loaded: set[str] = set()
    for statement, line in zip(IMPORTS, done.stdout.splitlines(), strict=True):
        needed, unwanted = IMPORTS[statement]
        modules = set(json.loads(line))
        assert set(needed) <= modules - loaded, statement
        assert not set(unwanted) & modules, (statement, set(unwanted) & modules)
        loaded = modules
