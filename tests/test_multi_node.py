"""Tensor parallelism over two machines (`--nnodes 2`): node 0 runs the engine (here `LLM` in
this process, or `tandem serve`) and its rank, node 1 runs `tandem serve --headless`, each on
its own address as two machines would be (Linux routes all of 127.0.0.0/8 to loopback; gloo's
own traffic stays on `lo`). Outputs equal one process's, token for token, greedy and seeded, in
both loops; and the failures come loud and fast: a node killed mid-stream or hung, node 0
killed, a node never started, a node started with other settings."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from test_server import metric_samples, processes_in_group, sse_events, wait_until
from test_server_processes import (
    KV_BLOCKS,
    MODEL_LEN,
    OFFLINE_OPTIONS,
    Served,
    clean_up,
    cmdline,
    free_port,
    process_name,
    sockets_of,
    spawn,
    tcp_sockets,
    wait_healthy,
)

from tandem import LLM, SamplingParams
from tandem.cli import main, node_topology
from tandem.config import EngineConfig
from tandem.execution.cluster import heartbeat_timeout_s
from tandem.execution.executor import WorkerFailure
from tandem.execution.rendezvous import RendezvousError
from tests.shared_tp import ranks_from_a_fork_server  # noqa: F401

HEAD, NODE = "127.0.0.2", "127.0.0.3"  # two "machines"
PROMPTS = ["Hello world", "The quick brown fox", "Once upon a time, in a land far away"]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
HEARTBEAT_TIMEOUT = "3"
DETECTED_S = 10.0  # every failure is detected within this
SYNC = {"sync": ("--no-async",), "async": ()}  # every node runs with node 0's settings
HUNG = {  # how node 0 names each hang
    "node": r"rank 1 died \(no heartbeat for 3 s \(hung, or the network between is down\); node 1",
    "rank": r"rank 1 died \(no heartbeat for 3 s: hung on .*; node 1",
}


TP2 = ("--tensor-parallel-size", "2")  # a rank on each node
PP2 = ("--pipeline-parallel-size", "2")  # a stage on each node


def nodes(port: int, layout: tuple[str, ...] = TP2) -> tuple[str, ...]:
    return ("--nnodes", "2", "--master-addr", HEAD, "--master-port", str(port), *layout,
            "--cpu-threads", "1")  # fmt: skip


def start_headless(
    model: Path, log: Path, port: int, *flags: str, layout: tuple[str, ...] = TP2
) -> Served:
    """`tandem serve --headless` as node 1, on its own address."""
    os.environ["TANDEM_HOST_IP"] = NODE  # spawn's environment; the test process ignores it
    try:
        return spawn(model, log, *nodes(port, layout), "--node-rank", "1", "--headless", *flags)
    finally:
        del os.environ["TANDEM_HOST_IP"]


def rank_process(node: Served) -> int:
    """The pid of the rank a headless node's agent forked (it names itself)."""
    return next(
        pid
        for pid in processes_in_group(node.pgid)
        if pid != node.proc.pid and process_name(pid) == "tandem-rank-1"
    )


def sockets_to(port: int) -> set[str]:
    """The TCP sockets connected to `port`, on any loopback address."""
    return {name for _, remote, _, name in tcp_sockets() if remote == port}


def head_llm(model: Path, port: int, **options) -> LLM:
    options = {**OFFLINE_OPTIONS, "num_kv_blocks": KV_BLOCKS, "tensor_parallel_size": 2,
               **options}  # fmt: skip
    return LLM(str(model), nnodes=2, master_addr=HEAD, master_port=port, **options)


def tokens(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def exits(server: Served, timeout: float) -> int:
    return server.proc.wait(timeout)


@pytest.fixture(autouse=True)
def quick_failures(monkeypatch) -> None:
    for name, value in (("TANDEM_HEARTBEAT_TIMEOUT", HEARTBEAT_TIMEOUT),
                        ("TANDEM_RENDEZVOUS_TIMEOUT", "60")):  # fmt: skip
        monkeypatch.setenv(name, value)  # this process (node 0) and the nodes it spawns


@pytest.fixture(scope="module")
def one_process(tiny_llama: Path) -> dict[str, list[list[int]]]:
    llm = LLM(str(tiny_llama), **OFFLINE_OPTIONS)
    try:
        return {"greedy": tokens(llm, GREEDY), "seeded": tokens(llm, SEEDED)}
    finally:
        llm.close()


@pytest.mark.parametrize(("loop", "hangs"), [("sync", None), ("async", "node"), ("async", "rank")])
def test_two_nodes_equal_one_process_then_a_hung_node_or_rank_fails_the_engine(
    tiny_llama, tmp_path, one_process, loop, hangs
) -> None:
    """Then node 1 hangs (stopped, agent and rank): node 0 hears no heartbeat from it; or only
    its rank hangs: its agent hears none, and tells node 0. Either way the engine fails."""
    port = free_port()
    node = start_headless(tiny_llama, tmp_path / "node1.log", port, *SYNC[loop])
    try:
        llm = head_llm(tiny_llama, port, async_scheduling=loop == "async")
        try:
            assert tokens(llm, GREEDY) == one_process["greedy"]
            assert tokens(llm, SEEDED) == one_process["seeded"]
            if hangs is not None:
                if hangs == "node":
                    os.killpg(node.pgid, signal.SIGSTOP)
                else:
                    rank = rank_process(node)
                    # Forked (its command line is its agent's) after its agent connected to
                    # node 0: it holds no copy of that end.
                    assert cmdline(rank) == cmdline(node.proc.pid)
                    agents = sockets_of(node.proc.pid) & sockets_to(port + 1)
                    assert agents and not agents & sockets_of(rank)
                    os.kill(rank, signal.SIGSTOP)
                began = time.monotonic()
                with pytest.raises(WorkerFailure, match=HUNG[hangs]):
                    tokens(llm, GREEDY)
                assert time.monotonic() - began < DETECTED_S
                return
        finally:
            llm.close()
        assert exits(node, 30) == 0, node.output()  # node 0 stopped cleanly: so does node 1
        assert "node 0 stopped; every rank finished" in node.output()
        wait_until(lambda: not processes_in_group(node.pgid), 10, "node 1's ranks to exit")
    finally:
        clean_up(node)


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_two_pipeline_stages_on_two_nodes_equal_one_process(
    tiny_llama, tmp_path, one_process, loop
) -> None:
    """The layers split over the nodes: node 0 embeds and runs the first layer, node 1 the
    second and samples; the stream goes over to node 1, the ids come back to node 0. Then
    (async) node 1 is killed while node 0's stage waits for its ids: the engine fails."""
    port = free_port()
    node = start_headless(tiny_llama, tmp_path / "node1.log", port, *SYNC[loop], layout=PP2)
    try:
        llm = head_llm(tiny_llama, port, async_scheduling=loop == "async", tensor_parallel_size=1,
                       pipeline_parallel_size=2)  # fmt: skip
        try:
            assert "pipeline parallel: 2 stages" in llm.engine.execution.describe()
            assert tokens(llm, GREEDY) == one_process["greedy"]
            assert tokens(llm, SEEDED) == one_process["seeded"]
            if loop == "async":
                os.killpg(node.pgid, signal.SIGKILL)
                began = time.monotonic()
                with pytest.raises(WorkerFailure, match="rank 1 died"):
                    tokens(llm, GREEDY)
                assert time.monotonic() - began < DETECTED_S
                return
        finally:
            llm.close()
        assert exits(node, 30) == 0, node.output()
    finally:
        clean_up(node)


def test_a_server_over_two_nodes_streams_then_a_killed_node_fails_every_request(
    tiny_llama, tmp_path
) -> None:
    offline = LLM(str(tiny_llama), **OFFLINE_OPTIONS)
    refs = [o.text for o in offline.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0,
                                                                     ignore_eos=True))]  # fmt: skip
    offline.close()
    port = free_port()
    head = spawn(tiny_llama, tmp_path / "node0.log", *nodes(port), "--host", HEAD,
                 "--max-num-seqs", "1")  # fmt: skip
    node = start_headless(tiny_llama, tmp_path / "node1.log", port, "--max-num-seqs", "1")
    url = f"http://{HEAD}:{head.port}"
    try:
        wait_healthy(head, url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        for prompt, ref in zip(PROMPTS, refs, strict=True):
            stream = client.completions.create(model=model, prompt=prompt, max_tokens=12,
                                               temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})  # fmt: skip
            assert "".join(c.choices[0].text for c in stream if c.choices) == ref
        body = {"model": model, "prompt": "long", "max_tokens": MODEL_LEN - 64, "ignore_eos": True}
        with (
            httpx.Client(timeout=30) as http,
            ThreadPoolExecutor(1) as pool,
            http.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r,
        ):
            events = sse_events(r.iter_lines())
            next(events)  # it runs, in the one running slot
            queued = pool.submit(http.post, f"{url}/v1/completions", json=body)
            waiting = ("tandem_requests_waiting", (("engine", "0"),))
            wait_until(lambda: metric_samples(url)[waiting] == 1, 10, "a queued request")
            os.killpg(node.pgid, signal.SIGKILL)  # node 1, its agent and its rank
            began = time.monotonic()
            rest = list(events)
            answer = queued.result(30)
            assert time.monotonic() - began < DETECTED_S
        assert rest[-1] == "[DONE]" and "rank 1 died" in rest[-2]["error"]["message"]
        assert answer.status_code == 503 and "rank 1 died" in answer.json()["error"]["message"]
        assert exits(head, 30) == 1
        wait_until(lambda: not processes_in_group(head.pgid), 10, "node 0's processes to exit")
    finally:
        clean_up(head)
        clean_up(node)


def test_a_headless_node_exits_when_node_0_is_killed(tiny_llama, tmp_path) -> None:
    port = free_port()
    head = spawn(tiny_llama, tmp_path / "node0.log", *nodes(port), "--host", HEAD)
    node = start_headless(tiny_llama, tmp_path / "node1.log", port)
    try:
        wait_healthy(head, f"http://{HEAD}:{head.port}")
        os.killpg(head.pgid, signal.SIGKILL)
        began = time.monotonic()
        assert exits(node, DETECTED_S) == 1
        assert time.monotonic() - began < DETECTED_S
        assert "node 1: node 0 is gone" in node.output()
        wait_until(lambda: not processes_in_group(node.pgid), 10, "node 1's ranks to exit")
    finally:
        clean_up(head)
        clean_up(node)


def test_a_node_never_started_is_named_and_a_node_alone_names_node_0(
    tiny_llama, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("TANDEM_RENDEZVOUS_TIMEOUT", "1.5")
    lonely = start_headless(tiny_llama, tmp_path / "node1.log", free_port())
    try:
        port = free_port()
        began = time.monotonic()
        with pytest.raises(WorkerFailure, match=f"rank 1 of 2 did not join at {HEAD}:{port} within 1.5 s"):  # fmt: skip
            head_llm(tiny_llama, port)
        assert time.monotonic() - began < 1.5 + DETECTED_S
        assert exits(lonely, 30) == 1
        assert f"node 1 could not reach node 0 at {HEAD}:" in lonely.output()
    finally:
        clean_up(lonely)


def test_nodes_with_other_settings_stop_with_the_difference(tiny_llama, tmp_path) -> None:
    port = free_port()
    node = start_headless(tiny_llama, tmp_path / "node1.log", port, "--block-size", "32")
    try:
        with pytest.raises(WorkerFailure, match="block_size: 16 != 32"):
            head_llm(tiny_llama, port)
        assert exits(node, 30) == 1
        assert "block_size: 16 != 32" in node.output()
    finally:
        clean_up(node)


# ------------------------------------------------------------ flags and the launcher's env
def flags(**given) -> argparse.Namespace:
    names = ("nnodes", "node_rank", "master_addr", "master_port")
    return argparse.Namespace(
        **{n: given.get(n) for n in names}, headless=given.get("headless", False)
    )


def test_node_flags_come_from_torchrun_when_not_given() -> None:
    args = flags()  # the same command on every node: node 1 is headless
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "10.0.0.2",
           "MASTER_PORT": "29400"}  # fmt: skip
    node_topology(args, env)
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port) == (
        2, 1, "10.0.0.2", 29400)  # fmt: skip
    assert args.headless
    args = flags(master_port=1234)
    node_topology(args, {})
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port) == (
        1, 0, "127.0.0.1", 1234)  # fmt: skip
    with pytest.raises(ValueError, match="one `tandem serve` per node"):
        node_topology(flags(), {**env, "LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="node 1 runs with --headless"):
        node_topology(flags(node_rank=1, nnodes=2), {})
    with pytest.raises(ValueError, match="--headless runs nodes 1..N-1"):
        node_topology(flags(headless=True), {})


def test_node_settings_are_checked(tiny_llama, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_HEARTBEAT_TIMEOUT", "0.5")  # a heartbeat comes every second
    with pytest.raises(ValueError, match="TANDEM_HEARTBEAT_TIMEOUT must be seconds > 1, got '0.5'"):
        heartbeat_timeout_s()
    split = r"{} ranks \(tensor_parallel_size {} x pipeline_parallel_size {}\) do not split over"
    with pytest.raises(ValueError, match=split.format(3, 3, 1) + " nnodes 2"):
        EngineConfig(tensor_parallel_size=3, nnodes=2)
    with pytest.raises(ValueError, match=split.format(6, 2, 3) + " nnodes 4"):
        EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=3, nnodes=4)
    EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=4)  # a node per rank
    with pytest.raises(ValueError, match="node_rank in 0..nnodes-1"):
        EngineConfig(tensor_parallel_size=2, nnodes=2, node_rank=2)
    with pytest.raises(ValueError, match="launcher places the ranks"):
        EngineConfig(
            tensor_parallel_size=2, nnodes=2, distributed_executor_backend="external_launcher"
        )
    with pytest.raises(ValueError, match="runs no engine: start it with `tandem serve --headless`"):
        LLM(str(tiny_llama), tensor_parallel_size=2, nnodes=2, node_rank=1)


def test_a_port_in_use_on_node_0_is_named(tiny_llama) -> None:
    with (
        socket.create_server(("127.0.0.1", 0)) as taken,
        pytest.raises(RendezvousError, match=r"node 0 could not listen at 127\.0\.0\.1:\d+"),
    ):
        LLM(str(tiny_llama), tensor_parallel_size=2, nnodes=2, master_port=taken.getsockname()[1])


def test_the_cli_runs_a_headless_node_only_with_its_flags(capsys) -> None:
    assert main(["serve", "--headless", "--model", "x"]) == 2
    assert "--headless runs nodes 1..N-1" in capsys.readouterr().err
