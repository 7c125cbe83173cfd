"""The OpenAI-compatible server, end to end: a real engine-core process, a front end (a real
uvicorn server on 127.0.0.1, run on a thread of this process so tests can look inside it), real
clients. `test_server_processes.py` runs `tandem serve` itself, every part its own process.

Greedy answers must equal the offline `LLM.generate`; streams must be well formed under
concurrency; a client that leaves must give its KV blocks back; bad input, overload and shutdown
must each get their documented status, and the server must keep serving afterwards.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from tandem import LLM, EngineConfig, SamplingParams
from tandem.models.generation_defaults import CHAT_SAMPLING
from tandem.server.app import create_app
from tandem.server.core import process as core_process
from tandem.server.core import wire
from tandem.server.core.client import CoreClient, CoreEndpoint
from tandem.server.core.process import CoreOptions, stop_core
from tandem.server.frontend.served_model import ServedModel, load_tokenizer
from tandem.server.frontend.service import GenerationService

# One compute thread, fixed: the offline engine and the server's core then add up every dot
# product in the same order, and no engine times the thread counts at start-up (tested on its
# own, and by the `tandem serve` processes of test_server_processes.py).
ENGINE_OPTIONS = {
    "dtype": "float32",
    "device": "cpu",
    "num_kv_blocks": 256,
    "max_model_len": 256,
    "cpu_threads": 1,
}
PROMPTS = ["Hello world", "The quick brown fox", "Once upon a time, in a land far away"]


# ----------------------------------------------------------------- harness
@dataclass
class LiveServer:
    """An engine-core process, and a front end (uvicorn on a free loopback port) on a thread."""

    url: str
    core: multiprocessing.Process
    model: ServedModel
    server: uvicorn.Server
    thread: threading.Thread
    service: GenerationService

    @property
    def stats(self) -> wire.CoreStats:
        """The core's state after its latest step (exact once it is idle)."""
        stats = self.service.client.stats[0]
        assert stats is not None
        return stats

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def run_in_server_loop(self, coro) -> object:
        """Schedule a coroutine on the server's event loop; returns its concurrent future."""
        return asyncio.run_coroutine_threadsafe(coro, self.service._aloop)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "the server thread did not stop"
        stop_core(self.core)


def start_core(
    config: EngineConfig, start_method: str = "forkserver"
) -> tuple[multiprocessing.Process, CoreClient, ServedModel]:
    """A core process for `config`, and a client connected to it. Forked from a fork server by
    default (it imports torch once for the whole suite); "spawn" for a core that must see this
    process's current environment (fault injection)."""
    address = f"ipc://{tempfile.mkdtemp(prefix='tandem-test-')}/core"
    parent = os.getpid() if start_method == "spawn" else 0  # a forked core's parent: the server
    core = core_process.start_core(CoreOptions(config, address, parent_pid=parent), start_method)
    client = CoreClient([CoreEndpoint(address, core.pid)])
    ready = client.connect(timeout_s=120)
    return core, client, ServedModel(ready, load_tokenizer(ready.model_path), config.model)


def start_server(
    model: Path, engine_options: dict | None = None, core_start: str = "forkserver", **app_options
) -> LiveServer:
    options = {**ENGINE_OPTIONS, **(engine_options or {})}
    core, client, served = start_core(EngineConfig(model=str(model), **options), core_start)
    app = create_app(client, served, **app_options)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "server start")
    return LiveServer(f"http://127.0.0.1:{port}", core, served, server, thread, app.state.service)


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def wait_for_health(proc: subprocess.Popen, url: str, timeout: float) -> None:
    """Until a server process answers /health with 200; its output if it exits first."""

    def healthy() -> bool:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            return httpx.get(f"{url}/health").status_code == 200
        except httpx.TransportError:
            return False

    wait_until(healthy, timeout, "server process health")


def processes(where: Callable[[list[str]], bool]) -> list[int]:
    """Pids whose /proc stat fields after the name (state, ppid, pgrp, ...) satisfy `where`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if where(stat[stat.rindex(")") + 2 :].split()):
                found.append(int(entry.name))
    return found


def processes_in_group(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`."""
    return processes(lambda f: int(f[2]) == pgid and f[0] != "Z")


def metric_samples(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, keyed by (name, sorted labels); the text must parse."""
    text = httpx.get(f"{url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sse_events(lines: Iterator[str]) -> Iterator[dict | str]:
    """Decoded `data:` payloads of an event stream; "[DONE]" is returned as the string."""
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else json.loads(data)
        else:
            assert line == "", f"unexpected SSE line {line!r}"


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def chat_prompt_ids(model: ServedModel, messages: list[dict]) -> list[int]:
    tok = model.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


def server_fixtures(scope: str):
    """The `live` server, an `offline` LLM with the same options, and the served `model` name,
    as fixtures of `scope`: test modules that need a fresh server take them per module."""

    @pytest.fixture(scope=scope)
    def live(tiny_llama: Path) -> Iterator[LiveServer]:
        server = start_server(tiny_llama)
        yield server
        server.stop()

    @pytest.fixture(scope=scope)
    def offline(tiny_llama: Path) -> Iterator[LLM]:
        llm = LLM(str(tiny_llama), **ENGINE_OPTIONS)
        yield llm
        llm.close()

    @pytest.fixture
    def model(live: LiveServer) -> str:
        return live.model.model_path.name

    return live, offline, model


live, offline, model = server_fixtures("session")


def assert_idle(live: LiveServer, timeout: float = 5.0) -> None:
    """Every KV block back in the core and nothing in flight (the block count's idle value)."""

    def idle() -> bool:
        s = live.stats
        return (
            s.kv_blocks_used == 0
            and s.num_running == s.num_waiting == 0
            and live.service.num_in_flight == 0
        )

    wait_until(idle, timeout, f"idle engine ({live.stats})")


# ------------------------------------------------------------------- tests
def test_models_and_health(live: LiveServer, model: str) -> None:
    assert httpx.get(f"{live.url}/health").status_code == 200
    models = live.client().models.list()
    assert [m.id for m in models.data] == [model]
    # The checkpoint's path is accepted as the model name too.
    out = live.client().completions.create(
        model=str(live.model.model_path), prompt="Hi", max_tokens=2
    )
    assert out.model == model


def test_completions_match_offline(live: LiveServer, model: str, offline: LLM) -> None:
    client = live.client()
    token_prompt = offline.get_tokenizer()("A list of token ids").input_ids
    prompts: list[str | list[int]] = [*PROMPTS, token_prompt]
    expected = offline.generate(prompts, greedy(12))
    for prompt, ref in zip(prompts, expected, strict=True):
        kwargs = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        out = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
        assert out.choices[0].text == ref.text
        assert out.choices[0].finish_reason == "length"
        assert out.usage.completion_tokens == len(ref.token_ids) == 12
        assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert out.usage.total_tokens == out.usage.prompt_tokens + 12

        chunks = list(
            client.completions.create(
                **kwargs,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
        assert {c.id for c in chunks} == {chunks[0].id}


def test_chat_matches_offline(live: LiveServer, model: str, offline: LLM) -> None:
    client = live.client()
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ]
    ref = offline.generate([chat_prompt_ids(live.model, messages)], greedy(10))[0]
    kwargs = {"model": model, "messages": messages, "temperature": 0, "seed": 1}
    out = client.chat.completions.create(
        **kwargs, max_completion_tokens=10, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == 10

    stream = client.chat.completions.create(
        **kwargs, max_tokens=10, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no usage chunk unless asked for


def test_stop_string_and_natural_stop(live: LiveServer, model: str, offline: LLM) -> None:
    client = live.client()
    full = offline.generate(PROMPTS[0], greedy(20))[0].text
    stop = full[5:8]
    out = client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=20, temperature=0, stop=[stop]
    )
    assert out.choices[0].finish_reason == "stop"
    assert stop not in out.choices[0].text and full.startswith(out.choices[0].text)


def test_stop_strings_end_choices_as_offline(live: LiveServer, model: str, offline: LLM) -> None:
    """Stop strings are found by the front end, which detokenizes: every choice's text, token
    count and finish reason equal the offline engine's (which finds them in its own loop), with
    n = 3 samples stopping at different tokens, streamed or not, with and without min_tokens;
    the samples the front end ended are aborted in the core, so every block comes back."""
    sampling = {"n": 3, "seed": 11, "temperature": 1.0, "ignore_eos": True}
    free = offline.generate(PROMPTS[1], SamplingParams(max_tokens=30, **sampling))[0]
    stop = [free.outputs[1].text[12:14], free.outputs[2].text[20:22]]
    client = live.client()
    for min_tokens in (0, 8):
        params = SamplingParams(max_tokens=30, stop=stop, min_tokens=min_tokens, **sampling)
        expected = offline.generate(PROMPTS[1], params)[0].outputs
        assert {o.finish_reason for o in expected} >= {"stop"}
        kwargs = {"model": model, "prompt": PROMPTS[1], "max_tokens": 30, "stop": stop,
                  "n": 3, "seed": 11, "temperature": 1.0,
                  "extra_body": {"ignore_eos": True, "min_tokens": min_tokens}}  # fmt: skip
        whole = client.completions.create(**kwargs)
        assert [c.text for c in whole.choices] == [o.text for o in expected]
        assert [c.finish_reason for c in whole.choices] == [o.finish_reason for o in expected]
        assert whole.usage.completion_tokens == sum(len(o.token_ids) for o in expected)
        texts: dict[int, str] = {}
        reasons: dict[int, str] = {}
        for chunk in client.completions.create(**kwargs, stream=True):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
                if c.finish_reason:
                    reasons[c.index] = c.finish_reason
        assert [texts[i] for i in range(3)] == [o.text for o in expected]
        assert [reasons[i] for i in range(3)] == [o.finish_reason for o in expected]
    assert_idle(live)


def test_64_concurrent_streams(live: LiveServer, model: str, offline: LLM) -> None:
    n = 64
    prompts = [f"Client {i} says hello to {i % 7} friends" for i in range(n)]
    lengths = [8 + i % 17 for i in range(n)]
    refs = offline.generate(prompts, [greedy(m) for m in lengths])

    async def one(client: openai.AsyncOpenAI, i: int) -> None:
        stream = await client.completions.create(
            model=model,
            prompt=prompts[i],
            max_tokens=lengths[i],
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
        body, last = chunks[:-1], chunks[-1]
        assert {c.id for c in chunks} == {chunks[0].id}
        assert all(len(c.choices) == 1 and c.usage is None for c in body)
        assert all(c.choices[0].finish_reason is None for c in body[:-1])
        assert body[-1].choices[0].finish_reason == "length"
        assert "".join(c.choices[0].text for c in body) == refs[i].text
        assert last.choices == []
        assert last.usage.completion_tokens == lengths[i]
        assert last.usage.prompt_tokens == len(refs[i].prompt_token_ids)
        assert last.usage.total_tokens == lengths[i] + len(refs[i].prompt_token_ids)

    async def main() -> None:
        async with live.async_client() as client:
            await asyncio.gather(*(one(client, i) for i in range(n)))

    asyncio.run(main())
    assert_idle(live)


def test_the_load_client_counts_what_was_served(live: LiveServer, model: str) -> None:
    """`tandem bench serve`'s client (tandem.bench.serve.run_load), the one the serving figures
    come from: every streamed request counted with its tokens and a first token; a refused
    request counted as an error with its status, not as served tokens. (Gaps between chunks are
    not asserted: a tiny model can finish a request before the front end streams its second
    chunk, which then carries the rest.) The same greedy load through each API serves the same
    tokens (EOS left on: only OpenAI's endpoints take vLLM's ignore_eos)."""
    from tandem.bench.serve import LoadConfig, random_prompts, run_load
    from tandem.bench.serve_client import APIS, Sampling

    prompts = random_prompts(0, 6, 32)
    served = {}
    for api in APIS:
        for ignore_eos in (True, False):
            config = LoadConfig(api, Sampling(5, 0.0, ignore_eos), max_concurrency=3)
            run = asyncio.run(run_load(live.url, prompts, config))
            summary = run.summary()
            assert run.model == model
            assert (summary["completed"], summary["failed"]) == (6, 0), (api, summary)
            assert summary["median_ttft_ms"] > 0
            if api in ("completions", "chat") and ignore_eos:
                assert summary["total_output_tokens"] == 30
            served[api] = summary["total_output_tokens"]
    assert served["messages"] == served["responses"] == served["ollama"] == served["chat"]
    config = LoadConfig(sampling=Sampling(max_tokens=100000), max_concurrency=3)  # past the context
    summary = asyncio.run(run_load(live.url, prompts, config)).summary()
    assert (summary["completed"], summary["total_output_tokens"]) == (0, 0)
    assert summary["error_kinds"] == {"HTTP 400": 6}
    assert_idle(live)


def test_tandem_bench_serve_reports_what_was_served(live: LiveServer, tmp_path: Path) -> None:
    """The installed command, `tandem bench serve`, against the server: its saved result counts
    every request and every token the server's /metrics counted, has the percentiles asked for,
    and goodput: every request meets a loose objective, none a tight one."""
    from tandem.cli import main

    flags = ["bench", "serve", "--base-url", live.url, "--max-concurrency", "4",
             "--random-output-len", "6", "--request-rate", "400", "--burstiness", "0.5",
             "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99.9",
             "--save-result", "--save-detailed", "--result-dir", str(tmp_path)]  # fmt: skip
    before = metric_samples(live.url)
    loose = [*flags, "--num-prompts", "8", "--goodput", "e2el:600000", "itl:600000",
             "--result-filename", "loose.json", "--plot", str(tmp_path / "load.png")]  # fmt: skip
    assert main(loose) == 0
    after = metric_samples(live.url)
    counted = {k: after[f"tandem_{k}_total", ()] - before[f"tandem_{k}_total", ()]
               for k in ("generation_tokens", "prompt_tokens")}  # fmt: skip
    result = json.loads((tmp_path / "loose.json").read_text())
    assert (result["num_prompts"], result["completed"], result["failed"]) == (8, 8, 0)
    assert result["total_output_tokens"] == 48 == counted["generation_tokens"]
    assert result["total_input_tokens"] == counted["prompt_tokens"]
    assert result["output_lens"] == [6] * 8
    for metric in ("ttft", "tpot", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99.9"):
            assert result[f"{stat}_{metric}_ms"] > 0, (stat, metric)
    assert result["p99.9_e2el_ms"] >= result["p50_e2el_ms"] >= result["p50_ttft_ms"]
    assert result["good_requests"] == 8
    assert result["request_goodput"] == result["request_throughput"]
    assert (tmp_path / "load.png").stat().st_size > 0
    tight = [*flags, "--num-prompts", "4", "--goodput", "ttft:0.001", "--result-filename", "t.json"]
    assert main(tight) == 0
    result = json.loads((tmp_path / "t.json").read_text())
    assert (result["completed"], result["good_requests"], result["request_goodput"]) == (4, 0, 0)
    assert_idle(live)


def test_tandem_bench_serve_replays_agent_sessions(tiny_llama: Path, capsys) -> None:
    """`--dataset-name agent`: each session's turns through chat completions, every answer
    exactly its length, the later turns' prompts partly served from the prefix cache. (A
    server of its own: the shortest session outgrows the shared one's 256-token context.)"""
    from tandem.cli import main

    live = start_server(tiny_llama, {"max_model_len": 512})
    try:
        flags = ["bench", "serve", "--base-url", live.url, "--dataset-name", "agent",
                 "--sessions", "2", "--turns", "2", "--head-len", "16", "--tool-result-len", "8",
                 "--random-output-len", "4", "--json"]  # fmt: skip
        assert main(flags) == 0
        result = json.loads(capsys.readouterr().out)
        assert (result["api"], result["completed"], result["failed"]) == ("chat", 4, 0)
        assert result["total_output_tokens"] == 16
        assert result["short_turns"] == 0
        assert result["first_ttft_p50_ms"] > 0 and result["later_ttft_p50_ms"] > 0
        assert 0 < result["cached_share"] < 1
        assert_idle(live)
    finally:
        live.stop()


def _abort_count(url: str) -> float:
    key = ("tandem_requests_finished_total", (("finish_reason", "abort"),))
    return metric_samples(url).get(key, 0.0)


def test_disconnect_mid_stream_frees_blocks(live: LiveServer, model: str) -> None:
    assert_idle(live)
    aborted = _abort_count(live.url)
    body = {"model": model, "prompt": PROMPTS[2], "max_tokens": 200, "ignore_eos": True}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{live.url}/v1/completions", json={**body, "stream": True}) as r,
    ):
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
        first, second = next(events), next(events)
        assert first["choices"][0]["finish_reason"] is None and second["choices"]
        wait_until(lambda: live.stats.kv_blocks_used > 0, 5, "blocks in use")
    # Closing the response closed the connection: the request is aborted, its blocks freed.
    assert_idle(live)
    assert _abort_count(live.url) == aborted + 1

    # A non-streaming client that gives up is noticed too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.05))
    assert_idle(live)
    wait_until(lambda: _abort_count(live.url) == aborted + 2, 5, "abort counted")


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("completions", "{not json", 400, None),
        ("completions", {"model": "M", "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
        ("completions", {"model": "M", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ("completions", {"model": "M", "prompt": 42}, 400, "prompt"),
        ("completions", {"model": "M"}, 400, "prompt"),
        ("completions", ["not", "an", "object"], 400, None),
        ("completions", {"model": "M", "prompt": "x", "temperature": -1}, 400, "temperature"),
        ("completions", {"model": "M", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
        ("completions", {"model": "M", "prompt": "x", "top_k": 2**40}, 400, "top_k"),
        ("completions", {"model": "M", "prompt": "x", "stop": [""]}, 400, "stop"),
        ("completions", {"model": "M", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("completions", {"model": "M", "prompt": "x", "max_tokens": 300}, 400, "max_tokens"),
        ("completions", {"model": "M", "prompt": "x " * 600}, 400, "prompt"),
        ("completions", {"model": "M", "prompt": ""}, 400, "prompt"),
        ("completions", {"model": "M", "prompt": [5, 99999]}, 400, "prompt"),
        ("completions", {"model": "M", "prompt": ["a", ""]}, 400, "prompt"),
        ("completions", {"model": "M", "prompt": ["a", [5]]}, 400, "prompt"),
        ("completions", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("completions", {"model": "M", "prompt": "x", "n": 0}, 400, "n"),
        ("completions", {"model": "M", "prompt": "x", "n": 129}, 400, "n"),
        ("completions", {"model": "M", "prompt": "x", "best_of": 3}, 400, "best_of"),
        ("completions", {"model": "M", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ("completions", {"model": "M", "prompt": "x", "echo": True}, 400, "echo"),
        ("completions", {"model": "M", "prompt": "x", "suffix": "y"}, 400, "suffix"),
        (
            "completions",
            {"model": "M", "prompt": "x", "presence_penalty": 2.5},
            400,
            "presence_penalty",
        ),
        ("completions", {"model": "M", "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
        ("completions", {"model": "M", "prompt": "x", "stream_options": {}}, 400, "stream_options"),
        ("chat/completions", {"model": "M", "messages": []}, 400, "messages"),
        (
            "chat/completions",
            {"model": "M", "messages": [{"role": "x", "content": "y"}]},
            400,
            "messages[0].role",
        ),  # fmt: skip
        (
            "chat/completions",
            {
                "model": "M",
                "messages": [{"role": "user", "content": "y"}],
                "tools": [{"type": "function"}],
            },
            400,
            "tools",
        ),  # fmt: skip
        (
            "chat/completions",
            {
                "model": "M",
                "messages": [{"role": "user", "content": "y"}],
                "frequency_penalty": -2.5,
            },
            400,
            "frequency_penalty",
        ),  # fmt: skip
        (
            "chat/completions",
            {
                "model": "M",
                "messages": [{"role": "user", "content": "y"}],
                "max_completion_tokens": -3,
            },
            400,
            "max_completion_tokens",
        ),  # fmt: skip
    ],
)
def test_bad_input(
    live: LiveServer, model: str, path: str, body: object, status: int, param: str | None
) -> None:
    if isinstance(body, dict) and body.get("model") == "M":
        body = {**body, "model": model}
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(
        f"{live.url}/v1/{path}", content=content, headers={"content-type": "application/json"}
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["param"] == param
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert param.split("[")[0] in error["message"]


def test_unknown_fields_are_accepted_and_logged_once(live: LiveServer, model: str, caplog) -> None:
    """A field the server does not know changes nothing: the answer is the one without it, and
    its name is logged the first time it is seen, at any depth."""
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0}
    plain = httpx.post(f"{live.url}/v1/completions", json=body).json()["choices"][0]["text"]
    odd = {**body, "made_up": 1, "stream_options": None, "client_metadata": {"a": 1}}
    with caplog.at_level("INFO", logger="tandem.server"):
        for _ in range(2):
            r = httpx.post(f"{live.url}/v1/completions", json=odd)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain
        messages = [{"role": "user", "content": "hi", "name_x": "me"}]
        r = httpx.post(
            f"{live.url}/v1/chat/completions",
            json={"model": model, "messages": messages, "max_tokens": 2},
        )
        assert r.status_code == 200
    logged = [r.getMessage() for r in caplog.records if "ignoring the field" in r.getMessage()]
    assert sorted(logged) == sorted(
        [
            "/v1/completions: ignoring the field 'made_up', which this server does not use",
            "/v1/completions: ignoring the field 'client_metadata', which this server does not use",
            "/v1/chat/completions: ignoring the field 'messages.name_x', which this server does not use",
        ]
    ), logged


def test_server_keeps_serving_after_errors(live: LiveServer, model: str) -> None:
    client = live.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="x", best_of=3)
    assert info.value.body["param"] == "best_of"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    # Defaults the client sends explicitly are accepted, not refused.
    out = client.completions.create(
        model=model, prompt="x", max_tokens=3, n=1, echo=False, presence_penalty=0, best_of=1
    )
    assert out.usage.completion_tokens <= 3
    assert httpx.get(f"{live.url}/health").status_code == 200


def test_chat_without_template_is_refused(live: LiveServer, model: str) -> None:
    tokenizer = live.model.tokenizer
    template, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        with pytest.raises(openai.BadRequestError) as info:
            live.client().chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}]
            )
        assert "chat template" in info.value.body["message"]
    finally:
        tokenizer.chat_template = template


def test_metrics_move_with_requests(live: LiveServer, model: str) -> None:
    before = metric_samples(live.url)
    out = live.client().completions.create(
        model=model, prompt=PROMPTS[1], max_tokens=7, extra_body={"ignore_eos": True}
    )
    after = metric_samples(live.url)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("tandem_requests_finished_total", finish_reason="length") == 1
    assert delta("tandem_generation_tokens_total") == 7
    assert delta("tandem_prompt_tokens_total") == out.usage.prompt_tokens
    assert delta("tandem_time_to_first_token_seconds_count") == 1
    assert delta("tandem_inter_token_latency_seconds_count") == 6
    engine = (("engine", "0"),)
    assert after[("tandem_kv_blocks_total", engine)] == live.model.num_kv_blocks
    for gauge in ("running", "waiting"):
        assert (f"tandem_requests_{gauge}", engine) in after
    assert ("tandem_requests_in_flight", ()) in after
    assert 0.0 <= after[("tandem_device_idle_fraction", engine)] <= 1.0


def test_dashboard_data_follows_the_steps_and_matches_metrics(live: LiveServer, model: str) -> None:
    """`/dashboard/data`: each engine's steps after the step asked for (none twice, none lost,
    in order, each with its device span and host phases on the core's clock), its state as
    /metrics shows it, and the server's counters as /metrics sums them; a bad `after` is a 400
    naming it. `/chat/settings`: the model, its context and the sampling a chat starts from."""
    first = httpx.get(f"{live.url}/dashboard/data").json()
    (engine,) = first["engines"]
    steps = engine["timeline"]["steps"]
    last = steps[-1][0] if steps else -1
    prompt = "A prompt only this test sends, so that no prefix of it is cached"
    out = live.client().completions.create(
        model=model, prompt=prompt, max_tokens=9, extra_body={"ignore_eos": True}
    )
    assert_idle(live)
    data = httpx.get(f"{live.url}/dashboard/data", params={"after": str(last)}).json()
    (engine,) = data["engines"]
    timeline = engine["timeline"]
    new = timeline["steps"]
    ids = [step[0] for step in new]
    assert ids == list(range(last + 1, last + 1 + len(ids))) and len(ids) >= 9  # prefill + 8
    assert ids[-1] == engine["stats"]["num_steps"] - 1
    assert sum(step[1] for step in new) == out.usage.prompt_tokens + 8  # tokens computed
    for _, _, seqs, (start, end), wait, skipped, host in new:
        assert seqs == 1 and not skipped and wait == 0.0
        assert start <= end <= timeline["now"]
        assert {"schedule", "build", "launch"} <= set(host)
        assert all(a <= b for a, b in host.values())
    again = httpx.get(f"{live.url}/dashboard/data", params={"after": str(ids[-1])}).json()
    assert again["engines"][0]["timeline"]["steps"] == []

    metrics = metric_samples(live.url)
    label = (("engine", "0"),)
    stats = engine["stats"]
    for name, field in (("tandem_requests_running", "num_running"),
                        ("tandem_requests_waiting", "num_waiting"),
                        ("tandem_kv_blocks_used", "kv_blocks_used"),
                        ("tandem_kv_blocks_cached", "kv_blocks_cached"),
                        ("tandem_kv_blocks_total", "kv_blocks_total"),
                        ("tandem_engine_generation_tokens_total", "generation_tokens")):  # fmt: skip
        assert metrics[(name, label)] == stats[field], name
    for name, value in data["server"].items():
        assert metrics[(name, ())] == value, name
    assert data["server"]["tandem_generation_tokens_total"] >= 9
    assert data["model"] == model and data["max_model_len"] == live.model.max_model_len

    for bad in ("x", "1,2"):
        refused = httpx.get(f"{live.url}/dashboard/data", params={"after": bad})
        assert refused.status_code == 400 and "after" in refused.json()["error"]["message"]
    settings = httpx.get(f"{live.url}/chat/settings").json()
    assert settings["model"] == model and settings["max_model_len"] == live.model.max_model_len
    assert settings["sampling"] == CHAT_SAMPLING and not settings["reasoning"]
    for path in ("/", "/dashboard", "/static/chat.html"):
        page = httpx.get(f"{live.url}{path}")
        assert page.status_code == 200 and "<html" in page.text.lower(), path
        assert page.headers["content-type"].startswith("text/html"), path
    assert httpx.head(live.url).status_code == 200  # Ollama's clients' "is it running?"
    for outside in ("/static/..%2Froutes.py", "/static/routes.py", "/static/nothing.js"):
        assert httpx.get(f"{live.url}{outside}").status_code in (400, 404), outside


def test_admission_control(tiny_llama: Path) -> None:
    """Capacity is max_num_seqs + max_waiting = 4: a burst of 16 gets 503s, the rest finish."""
    live = start_server(tiny_llama, {"max_num_seqs": 2}, max_waiting=2)
    try:
        model = live.model.model_path.name
        body = {"model": model, "prompt": "burst", "max_tokens": 100, "ignore_eos": True}

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as client:
                calls = [client.post("/v1/completions", json=body) for _ in range(16)]
                return await asyncio.gather(*calls)

        responses = asyncio.run(burst())
        accepted = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code != 200]
        assert 4 <= len(accepted) < 16 and refused
        for r in refused:
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "service_unavailable"
        for r in accepted:
            assert r.json()["usage"]["completion_tokens"] == 100
        rejected = metric_samples(live.url)[("tandem_requests_rejected_total", ())]
        assert rejected == len(refused)
        # Once the burst has drained, requests are accepted again.
        assert httpx.post(f"{live.url}/v1/completions", json=body, timeout=30).status_code == 200
        assert_idle(live)
    finally:
        live.stop()


def test_graceful_shutdown_in_process(tiny_llama: Path) -> None:
    """Draining: 503 to new requests and /health, in-flight requests finish within the grace
    period, a request still running when it ends is aborted with an in-stream error."""
    live = start_server(tiny_llama, {"max_model_len": 2048, "num_kv_blocks": 160})
    try:
        model = live.model.model_path.name
        url = f"{live.url}/v1/completions"
        short = {"model": model, "prompt": "short", "max_tokens": 40, "ignore_eos": True}
        long = {**short, "prompt": "long", "max_tokens": 2000}
        with (
            httpx.Client(timeout=60) as a,
            httpx.Client(timeout=60) as b,
            a.stream("POST", url, json={**short, "stream": True}) as rs,
            b.stream("POST", url, json={**long, "stream": True}) as rl,
        ):
            short_events, long_events = sse_events(rs.iter_lines()), sse_events(rl.iter_lines())
            next(short_events), next(long_events)  # both are running
            drained = live.run_in_server_loop(live.service.shutdown(0.5))

            health = httpx.get(f"{live.url}/health")
            assert health.status_code == 503 and "retry-after" in health.headers
            refused = httpx.post(url, json=short)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"

            rest = list(short_events)
            assert rest[-1] == "[DONE]"
            assert rest[-2]["choices"][0]["finish_reason"] == "length"
            long_rest = list(long_events)
            assert long_rest[-1] == "[DONE]"
            assert long_rest[-2]["error"]["code"] == "aborted"
        drained.result(10)
        assert_idle(live)
    finally:
        live.stop()


def test_core_death_fails_requests_cleanly(tiny_llama: Path) -> None:
    """If the engine-core process dies, open streams end with an error event at once (not after
    the hang timeout) and the server says 503."""
    live = start_server(tiny_llama)
    try:
        model = live.model.model_path.name
        url = f"{live.url}/v1/completions"
        body = {"model": model, "prompt": "crash", "max_tokens": 200, "ignore_eos": True}
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", url, json={**body, "stream": True}) as r,
        ):
            events = sse_events(r.iter_lines())
            next(events)
            killed = time.monotonic()
            os.kill(live.core.pid, signal.SIGKILL)
            rest = list(events)
            assert time.monotonic() - killed < 5
        assert rest[-1] == "[DONE]"
        error = rest[-2]["error"]
        assert error["type"] == "server_error" and "exited" in error["message"]
        assert httpx.get(f"{live.url}/health").status_code == 503
        refused = httpx.post(url, json=body)
        assert refused.status_code == 503 and "not running" in refused.json()["error"]["message"]
    finally:
        live.stop()


def _read_response(conn: socket.socket) -> bytes:
    """One whole HTTP/1.1 response (status line, headers, a Content-Length body); b"" if the
    server closed the connection first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":")[1] for line in head.lower().split(b"\r\n")
                      if line.startswith(b"content-length:")))  # fmt: skip
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return b""
        body += chunk
    return head + b"\r\n\r\n" + body


def _reuses_an_idle_connection(port: int, idle_s: float) -> bool:
    """Whether a keep-alive connection still answers after `idle_s` seconds of silence."""
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(request)
        first = _read_response(conn)
        time.sleep(idle_s)
        conn.sendall(request)
        return first.startswith(b"HTTP/1.1 200") and _read_response(conn).startswith(
            b"HTTP/1.1 200"
        )


def test_a_drained_front_end_stops_accepting_before_it_exits() -> None:
    """The drain's end: this process's listening socket closes first, and the server exits
    ACCEPTED_LINGER_S later, so a connection accepted just before still gets its 503 (uvicorn's
    shutdown closes connections whose request has not arrived)."""
    from tandem.server.frontend_process import ACCEPTED_LINGER_S, GracefulServer

    events = []

    class Service:
        on_failure = None

        async def shutdown(self, grace: float) -> None:
            events.append(("drained", grace, server.should_exit))

    class Listening:
        def close(self) -> None:
            events.append(("stop accepting", server.should_exit))

    server = GracefulServer(uvicorn.Config(app=None), Service(), grace_period=3.0)
    server.servers = [Listening()]
    start = time.perf_counter()
    asyncio.run(server._drain(3.0))
    assert events == [("drained", 3.0, False), ("stop accepting", False)]
    assert server.should_exit and time.perf_counter() - start >= ACCEPTED_LINGER_S


def test_sigterm_drains_and_exits_cleanly(tiny_llama: Path) -> None:
    """The real path: `serve()` in its own process, SIGTERM while a request streams. First, an
    idle connection outlives a client's pool expiry (httpx's 5 s): it is still served, not
    closed under the client's next request."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "from tandem.server.serve import serve; from tandem import EngineConfig; "
        f"serve(EngineConfig(model={str(tiny_llama)!r}, dtype='float32', device='cpu', "
        f"num_kv_blocks=64, max_model_len=512, cpu_threads=1), port={port}, grace_period=20)"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(proc, url, 60)
        assert _reuses_an_idle_connection(port, httpx.Limits().keepalive_expiry + 0.5)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "drain me", "max_tokens": 400, "ignore_eos": True}
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r,
        ):
            events = sse_events(r.iter_lines())
            next(events)
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: httpx.get(f"{url}/health").status_code == 503, 10, "503 health")
            assert httpx.post(f"{url}/v1/completions", json=body).status_code == 503
            rest = list(events)
        assert rest[-1] == "[DONE]" and rest[-2]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
