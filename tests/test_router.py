"""Data parallelism across machines behind a router that exists: vLLM's `vllm-router` (from
PyPI, its real binary) in front of two `tandem serve` processes bound to two addresses, as two
machines would be (Linux routes all of 127.0.0.0/8 to loopback), driven by the `openai`
client: every request answered, as the servers answer directly, and spread over both; each
server's /metrics carries the gauges routers and llm-d read under vLLM's names."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from test_server import metric_samples, wait_until
from test_server_processes import STARTUP_S, Served, clean_up, every, free_port, spawn

MODEL = "tiny"
ADDRESSES = ("127.0.0.2", "127.0.0.3")  # two "machines"


def url_of(server: Served, address: str) -> str:
    return f"http://{address}:{server.port}"


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


@contextlib.contextmanager
def router(workers: list[str], policy: str) -> Iterator[str]:
    """vllm-router on 127.0.0.1 in front of `workers`; its base URL."""
    port = free_port()
    binary = shutil.which("vllm-router")
    command = [binary] if binary else [sys.executable, "-m", "vllm_router.launch_router"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
                "--policy", policy, "--log-level", "warning", "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(free_port())]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(every(0.2, lambda: proc.poll() is not None or healthy(url)), 60, "the router")
        assert proc.poll() is None, proc.stderr.read().decode(errors="replace")
        yield url
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def two_servers(tiny_llama: Path, tmp_path_factory) -> Iterator[list[str]]:
    """`tandem serve` on each address, one compute thread each; their base URLs."""
    logs = tmp_path_factory.mktemp("router")
    servers = [
        spawn(
            tiny_llama,
            logs / f"{address}.log",
            "--host",
            address,
            "--served-model-name",
            MODEL,
            "--cpu-threads",
            "1",
        )  # fmt: skip
        for address in ADDRESSES
    ]
    try:
        urls = [url_of(s, a) for s, a in zip(servers, ADDRESSES, strict=True)]
        for server, url in zip(servers, urls, strict=True):

            def up(server=server, url=url) -> bool:
                assert server.proc.poll() is None, f"the server exited:\n{server.output()}"
                return healthy(url)

            wait_until(every(0.2, up), STARTUP_S, f"the server at {url}")
        yield urls
    finally:
        for server in servers:
            clean_up(server)


def finished(url: str) -> float:
    """Sequences the server finished, whatever the reason."""
    samples = metric_samples(url).items()
    return sum(v for (name, _), v in samples if name == "tandem_requests_finished_total")


def test_vllm_router_spreads_requests_over_two_servers(two_servers):
    direct = openai.OpenAI(base_url=f"{two_servers[0]}/v1", api_key="unused", max_retries=0)
    prompts = [f"Request {i}: tell me about the sea" for i in range(8)]
    expected = [
        direct.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)
        .choices[0]
        .text
        for p in prompts
    ]
    before = [finished(url) for url in two_servers]
    with router(two_servers, "round_robin") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        texts = [
            client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)
            .choices[0]
            .text
            for p in prompts
        ]
        assert texts == expected  # the router's added fields change nothing
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6
        )
        assert chat.choices[0].finish_reason in ("stop", "length")
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=6,
            stream=True,
        )  # fmt: skip
        assert any(c.choices and c.choices[0].delta.content for c in stream)
    served = [finished(u) - b for u, b in zip(two_servers, before, strict=True)]
    assert sum(served) == len(prompts) + 2 and all(n >= 4 for n in served), served


def test_the_gauges_routers_read(two_servers):
    """vLLM's names for requests running and waiting and the KV cache's use, per engine."""
    for url in two_servers:
        samples = metric_samples(url)
        engine = (("engine", "0"),)
        assert (
            samples[("vllm:num_requests_running", engine)]
            == samples[("tandem_requests_running", engine)]
        )
        assert (
            samples[("vllm:num_requests_waiting", engine)]
            == samples[("tandem_requests_waiting", engine)]
        )
        usage = (
            samples[("tandem_kv_blocks_used", engine)] / samples[("tandem_kv_blocks_total", engine)]
        )
        assert samples[("vllm:kv_cache_usage_perc", engine)] == pytest.approx(usage)


def test_cache_aware_routing_meets_the_prefix_cache(two_servers):
    """vllm-router's cache_aware policy sends prompts that share a long head to the server that
    saw it, where Tandem's prefix cache serves the head."""
    head = "You are a careful assistant. " * 40

    def hits(url: str) -> float:
        return metric_samples(url)[("tandem_prefix_cache_hits_total", (("engine", "0"),))]

    before = [(finished(u), hits(u)) for u in two_servers]
    with router(two_servers, "cache_aware") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        for i in range(4):
            client.completions.create(model=MODEL, prompt=f"{head}Question {i}?", max_tokens=4)
    after = [(finished(u), hits(u)) for u in two_servers]
    served = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    saved = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    assert sorted(served) == [0, 4], served  # one server took the head's every request
    assert max(saved) >= 3 * 200, saved  # and served the head from its cache three times
