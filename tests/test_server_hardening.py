"""Server hardening: no head-of-line blocking, API keys, body limits, loud engine faults.

The prompt-length bound is checked against real tokenization (it must never refuse a prompt that
fits); latency under a huge prompt is judged against a baseline measured in the same test; the
engine fault runs the real `serve()` in its own process and checks that it answers everyone,
exits non-zero and leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import (
    LiveServer,
    assert_idle,
    metric_samples,
    processes_in_group,
    sse_events,
    start_server,
    wait_for_health,
    wait_until,
)
from tokenizers import Regex, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tandem.models.default_model import SPECIAL_TOKENS, build_tokenizer
from tandem.server.frontend.json_count import Count, JSONCounter
from tandem.server.frontend.token_bound import PromptBound, prompt_bound
from tandem.server.generation import prepare

KEY = "tandem-test-key"
UNSET = object()
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# --------------------------------------------------------- the prompt bound
@pytest.fixture(scope="module")
def default_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    """The built-in default model's tokenizer (same corpus, same 2048-entry vocabulary)."""
    path = tmp_path_factory.mktemp("default-tokenizer")
    build_tokenizer(path, vocab_size=2048)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_llama: Path) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def llama3_style_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    """A regex split before byte-level mapping (Llama 3's layout), merges ignored for whole
    words, and added tokens longer than any vocabulary entry, so they set the bound."""
    path = tmp_path_factory.mktemp("llama3-style")
    build_tokenizer(path, vocab_size=512)
    spec = json.loads((path / "tokenizer.json").read_text())
    spec["model"]["ignore_merges"] = True
    (path / "tokenizer.json").write_text(json.dumps(spec))
    tok = AutoTokenizer.from_pretrained(path)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|begin_of_text|>", "<|eot_id|>"]})
    tok.add_tokens(["ünïcödé-added"])
    return tok


def adversarial_text(rng: random.Random, words: list[str]) -> str:
    """Mixtures that stress a byte bound: the vocabulary's own longest entries, added tokens
    written literally, multi-byte characters, combining marks, whitespace runs, digits."""
    pieces = [
        lambda: rng.choice(words),
        lambda: " " + rng.choice(words),
        lambda: rng.choice([*SPECIAL_TOKENS, "<|begin_of_text|>", "<|eot_id|>", "ünïcödé-added"]),
        lambda: rng.choice(
            ["é", "中文", "😀", "e\u0301", "\u1100\u1161\u11a8", "ﬁ", "Ω", "\u00a0"]
        ),
        lambda: " " * rng.randint(1, 40),
        lambda: "\n" * rng.randint(1, 5) + "\t",
        lambda: str(rng.randint(0, 10**12)),
        lambda: chr(rng.randint(0x20, 0x2FFF)),
        lambda: chr(rng.randint(0x10000, 0x10FFFF)),
        lambda: "".join(
            rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 30))
        ),
    ]
    return "".join(rng.choice(pieces)() for _ in range(rng.randint(1, 100)))


def check_never_over(tok: PreTrainedTokenizerFast, bound: PromptBound, text: str) -> None:
    for special in (True, False):
        actual = len(tok(text, add_special_tokens=special).input_ids)
        assert bound.min_tokens(text, special) <= actual, (text, special)


@pytest.mark.parametrize("name", ["default_tokenizer", "tiny_tokenizer", "llama3_style_tokenizer"])
def test_prompt_bound_never_exceeds_real_token_count(
    name: str, request: pytest.FixtureRequest
) -> None:
    """The bound is a true lower bound, so a prompt it refuses could never have fit; and it is
    tight: a text made of the longest entry reaches it exactly."""
    tok = request.getfixturevalue(name)
    bound, why_not = prompt_bound(tok)
    assert bound is not None, why_not
    assert bound.num_special_tokens == 1  # the BOS the post-processor adds
    vocab = tok.backend_tokenizer.get_vocab(with_added_tokens=False)
    words = sorted(vocab, key=len)[-200:]  # byte-level strings of the longest entries
    decoded = [tok.convert_tokens_to_string([w]) for w in words]
    rng = random.Random(0)
    for _ in range(600):
        check_never_over(tok, bound, adversarial_text(rng, decoded))

    # Tight: some text reaches the bound exactly (the longest entry, repeated).
    added = [t.content for t in tok.backend_tokenizer.get_added_tokens_decoder().values()]
    longest = [s for s in [*decoded, *added] if len(s.encode()) == bound.max_token_bytes]
    assert longest, "no entry is as long as the bound says"
    assert any(bound.min_tokens(s * 50) == len(tok(s * 50).input_ids) == 51 for s in longest)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(min_size=1, max_size=400))
def test_prompt_bound_on_arbitrary_unicode(
    default_tokenizer: PreTrainedTokenizerFast, text: str
) -> None:
    bound, _ = prompt_bound(default_tokenizer)
    assert bound is not None
    check_never_over(default_tokenizer, bound, text)


def test_prompt_bound_refuses_what_it_cannot_prove(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    """Each stage that may drop or merge bytes turns the bound off (prompts are then tokenized
    before being judged) instead of risking refusing a prompt that fits."""
    spec = json.loads(tiny_tokenizer.backend_tokenizer.to_str())
    backend_type = type(tiny_tokenizer.backend_tokenizer)

    def variant(edit) -> PreTrainedTokenizerFast:
        data = json.loads(json.dumps(spec))
        edit(data)
        return PreTrainedTokenizerFast(tokenizer_object=backend_type.from_str(json.dumps(data)))

    def pre(*steps) -> dict:
        return json.loads(pre_tokenizers.Sequence(list(steps)).__getstate__())

    def added_token(data: dict, **options) -> None:
        data["added_tokens"].append({"id": len(data["model"]["vocab"]), "content": "<mask>",
            "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
            "special": True, **options})  # fmt: skip

    cases = {
        "normalizer": lambda d: d.update(normalizer={"type": "NFC"}),
        "not byte-level": lambda d: d.update(pre_tokenizer=pre(pre_tokenizers.Metaspace())),
        "Whitespace": lambda d: d.update(
            pre_tokenizer=pre(pre_tokenizers.Whitespace(), pre_tokenizers.ByteLevel())
        ),
        "removes": lambda d: d.update(
            pre_tokenizer=pre(pre_tokenizers.Split(" ", "removed"), pre_tokenizers.ByteLevel())
        ),
        "strips": lambda d: added_token(d, lstrip=True),
        "lacks": lambda d: d["model"]["vocab"].pop("Ā"),  # byte 0 in the byte-level alphabet
    }
    for expected, edit in cases.items():
        bound, why_not = prompt_bound(variant(edit))
        assert bound is None and expected in why_not, (expected, why_not)
    assert prompt_bound(variant(lambda d: added_token(d)))[0] is not None


# --------------------------------------------------- the start-up heap frozen
# Before the module's shared server starts: a freeze is the process's, whichever server made it.
def test_startup_heap_is_frozen_while_serving(tiny_llama: Path) -> None:
    """A full garbage collection holds the GIL for as long as it walks the tracked objects (0.3 s
    over this test process's 600k): while the server runs it walks only what came after start-up,
    and once the server has stopped the start-up objects can be collected again."""
    gc.collect()
    tracked_before = len(gc.get_objects())
    live = start_server(tiny_llama)
    try:
        body = completion_body(live, "a request while frozen")
        assert httpx.post(f"{live.url}/v1/completions", json=body, timeout=60).status_code == 200
        tracked = {id(o) for o in gc.get_objects()}  # generations 0-2: what a collection walks
        assert id(live.model) not in tracked and id(live.model.tokenizer) not in tracked
        assert len(tracked) < tracked_before / 10, (len(tracked), tracked_before)
        assert gc.get_freeze_count() >= tracked_before
    finally:
        live.stop()
    assert gc.get_freeze_count() == 0
    assert any(o is live.model for o in gc.get_objects())


# ----------------------------------------------------------------- harness
def app_of(live: LiveServer):
    return live.server.config.app


def completion_body(live: LiveServer, prompt: str, max_tokens: int = 2, **extra) -> dict:
    return {"model": live.model.model_path.name, "prompt": prompt, "max_tokens": max_tokens,
            "ignore_eos": True, **extra}  # fmt: skip


def timed_post(client: httpx.Client, url: str, body: dict) -> float:
    start = time.perf_counter()
    r = client.post(url, json=body)
    assert r.status_code == 200, r.text
    return time.perf_counter() - start


# A small request during a flood stays within 10x its baseline, or this: at a 4 ms baseline 10x
# is one scheduling hiccup on two busy cores (55 ms seen), while a small request held behind a
# huge body's parsing or tokenizing waits seconds.
HICCUP_S = 0.25


def small_latencies(live: LiveServer, n: int) -> list[float]:
    url = f"{live.url}/v1/completions"
    with httpx.Client(timeout=60) as client:
        return [timed_post(client, url, completion_body(live, f"small {i}")) for i in range(n)]


@pytest.fixture(scope="module")
def guarded_server(tiny_llama: Path) -> Iterator[LiveServer]:
    live = start_server(tiny_llama, {"max_model_len": 256}, max_request_bytes=32 << 20)
    yield live
    live.stop()


@pytest.fixture
def guarded(guarded_server: LiveServer) -> Iterator[LiveServer]:
    """The module's server with room for 10 MB bodies; what a test changes in its front end
    (the tokenizer's entry point, the prompt bound, the intake lanes' limits) is put back
    afterwards."""
    live = guarded_server
    intake = live.service.intake
    preparer = app_of(live).state.preparer
    saved = [
        (obj, name, vars(obj).get(name, UNSET))
        for obj, names in (
            (live.model.intake, ["tokenize"]),
            (preparer, ["bound"]),
            (intake, ["max_bulk", "bulk_threshold"]),
        )
        for name in names
    ]
    yield live
    for obj, name, value in saved:
        if value is UNSET:
            vars(obj).pop(name, None)
        else:
            setattr(obj, name, value)
    assert_idle(live)


# -------------------------------------------------- no head-of-line blocking
def test_huge_prompt_refused_without_holding_up_others(guarded: LiveServer) -> None:
    """While 10 MB prompts (about 2 million tokens) are refused back to back, small requests
    from another client keep their latency; the huge prompts are never tokenized."""
    live = guarded
    tokenized: list[int] = []
    real_tokenize = live.model.intake.tokenize

    def recording_tokenize(prompt):
        tokenized.append(len(prompt))
        return real_tokenize(prompt)

    live.model.intake.tokenize = recording_tokenize
    small_latencies(live, 3)  # warm-up
    baseline = statistics.median(small_latencies(live, 9))

    huge = json.dumps(completion_body(live, "hello world " * 900_000)).encode()
    refusals: list[httpx.Response] = []
    stop = threading.Event()

    def flood() -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                refusals.append(
                    client.post(
                        f"{live.url}/v1/completions",
                        content=huge,
                        headers={"content-type": "application/json"},
                    )
                )

    flooder = threading.Thread(target=flood)
    flooder.start()
    try:
        wait_until(lambda: refusals, 30, "a first refusal")
        during = small_latencies(live, 15)
    finally:
        stop.set()
        flooder.join(60)
    assert len(refusals) >= 2
    for r in refusals:
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "prompt" and "at least" in error["message"]
    assert max(tokenized) < 1000  # only the small prompts were tokenized
    assert statistics.median(during) <= 3 * baseline, (baseline, during)
    assert max(during) <= max(10 * baseline, HICCUP_S), (baseline, during)
    assert_idle(live)


def test_unprovable_tokenizer_tokenizes_in_the_bulk_lane(guarded: LiveServer) -> None:
    """Without a bound, a large prompt is tokenized before being refused, in the bulk lane:
    small requests do not queue behind it, and a second large one is refused with 503 rather
    than queued without limit."""
    live = guarded
    app_of(live).state.preparer.bound = None
    intake = live.service.intake
    intake.max_bulk = 1
    small_latencies(live, 3)
    baseline = statistics.median(small_latencies(live, 9))

    big = completion_body(live, "hello world " * 150_000)  # 1.8 MB: about a second to tokenize
    with ThreadPoolExecutor(1) as pool:
        start = time.perf_counter()
        first = pool.submit(httpx.post, f"{live.url}/v1/completions", json=big, timeout=60)
        wait_until(lambda: intake.bulk_pending == 1, 30, "the bulk lane to be busy")
        second = httpx.post(f"{live.url}/v1/completions", json=big, timeout=60)
        assert second.status_code == 503 and "retry-after" in second.headers
        assert "large requests" in second.json()["error"]["message"]
        during = []
        while intake.bulk_pending and len(during) < 50:
            during.extend(small_latencies(live, 1))
        refused = first.result()
        busy = time.perf_counter() - start
    assert refused.status_code == 400
    message = refused.json()["error"]["message"]  # the engine's, after tokenizing
    assert message.startswith("prompt is too long: ") and "at least" not in message
    assert during, "the large prompt was tokenized faster than one small request"
    assert statistics.median(during) <= 3 * baseline, (baseline, during)
    # None waited for the tokenization: the lane's thread takes the GIL for moments (tens of
    # ms on two busy cores), never for the prompt's whole second.
    assert max(during) <= max(10 * baseline, busy / 4), (baseline, busy, during)
    assert_idle(live)


def test_many_tiny_json_values_do_not_stall_the_server(guarded: LiveServer) -> None:
    """pydantic holds the GIL for a whole validation, so a body of 150,000 tiny chat messages
    would stall every thread for a second; it is counted by a GIL-friendly parser instead and
    refused, while small requests keep their latency."""
    live = guarded
    small_latencies(live, 3)
    baseline = statistics.median(small_latencies(live, 9))
    messages = [{"role": "user", "content": "x"}] * 150_000
    body = {"model": live.model.model_path.name, "messages": messages}
    intake = live.service.intake
    with ThreadPoolExecutor(1) as pool:
        flood = pool.submit(httpx.post, f"{live.url}/v1/chat/completions", json=body, timeout=60)
        wait_until(lambda: intake.bulk_pending == 1, 30, "the bulk lane to be busy")
        during = []
        while intake.bulk_pending and len(during) < 50:
            during.extend(small_latencies(live, 1))
        refused = flood.result()
    assert during, "the body was refused faster than one small request"
    assert statistics.median(during) <= 3 * baseline, (baseline, during)
    assert max(during) <= max(10 * baseline, HICCUP_S), (baseline, during)
    assert refused.status_code == 400
    assert "holds 450003 JSON values" in refused.json()["error"]["message"]


def test_json_counter_process() -> None:
    counter = JSONCounter()
    try:
        assert counter.count(b'{"a": [1, 2, {"b": null}], "c": "x,y,[z"}') == Count(7)
        error = counter.count(b'{"a": ')
        assert error is not None and error.values == 0 and "Expecting value" in error.error
        assert "recursion" in counter.count(b"[" * 100_000).error
        first = counter._proc
        first.kill()
        first.wait()
        assert counter.count(b"[1, 2]") == Count(3)  # a dead helper is replaced
        second = counter._proc
        assert second is not first and second.poll() is None
    finally:
        counter.close()
    assert second.poll() is not None and counter.count(b"[]") is None


# ------------------------------------------------------------ request limits
def test_oversized_body_gets_413_without_being_read(tiny_llama: Path) -> None:
    live = start_server(tiny_llama, max_request_bytes=64 * 1024)
    try:
        url = f"{live.url}/v1/completions"
        client = live.client()
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=live.model.model_path.name, prompt="x" * 100_000)
        assert info.value.status_code == 413
        assert info.value.body["code"] == "request_too_large"
        assert "--max-request-bytes" in info.value.body["message"]

        def chunked(size: int) -> Iterator[bytes]:
            data = json.dumps(completion_body(live, "y" * size)).encode()
            for i in range(0, len(data), 8192):
                yield data[i : i + 8192]

        # A body far larger than the socket buffers: the client is still writing when it is
        # refused, and must read the 413, not a connection reset.
        big = json.dumps(completion_body(live, "z" * 8_000_000)).encode()

        async def uploads() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as aclient:
                return await asyncio.gather(*(aclient.post(url, content=big) for _ in range(4)))

        assert [r.status_code for r in asyncio.run(uploads())] == [413] * 4

        r = httpx.post(url, content=chunked(100_000))
        assert r.status_code == 413 and set(r.json()["error"]) == {
            "message", "type", "param", "code"}  # fmt: skip
        assert r.json()["error"]["type"] == "invalid_request_error"
        # A chunked body under the limit reaches the route whole.
        assert httpx.post(url, content=chunked(100)).status_code == 200

        # A declared length over the limit is refused before any of the body arrives, and a
        # chunked body as soon as the limit is passed, though the client never finishes either.
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        for headers, body in (
            (b"Content-Length: 1000000000\r\n\r\n", b"{"),
            (b"Transfer-Encoding: chunked\r\n\r\n", b"10000\r\n" + b"z" * 0x10000 + b"\r\n"),
        ):
            port = int(live.url.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(head + headers + body)
                if b"chunked" in headers:
                    sock.sendall(b"1\r\nz\r\n")  # one byte over the limit
                assert sock.recv(65536).startswith(b"HTTP/1.1 413 ")
        assert_idle(live)
    finally:
        live.stop()


def test_api_key(tiny_llama: Path) -> None:
    live = start_server(tiny_llama, api_key=KEY)
    try:
        model = live.model.model_path.name
        base = f"{live.url}/v1"

        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=base, api_key=key, max_retries=0)

        no_key = {"Authorization": openai.Omit()}  # the client sends no Authorization at all
        for kwargs, key, word in ((
            {"extra_headers": no_key}, "placeholder", "missing"), ({}, "wrong-key", "incorrect"),
            ({}, KEY[:-1], "incorrect"),
        ):  # fmt: skip
            with pytest.raises(openai.AuthenticationError) as info:
                client(key).completions.create(model=model, prompt="hi", max_tokens=2, **kwargs)
            assert info.value.status_code == 401
            assert info.value.body["code"] == "invalid_api_key"
            assert word in info.value.body["message"]
            with pytest.raises(openai.AuthenticationError):
                client(key).models.list(**kwargs)

        out = client(KEY).completions.create(model=model, prompt="hi", max_tokens=2)
        assert out.usage.completion_tokens <= 2
        chunks = list(
            client(KEY).chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
            )
        )
        assert chunks[-1].choices[0].finish_reason in {"length", "stop"}
        assert [m.id for m in client(KEY).models.list().data] == [model]
        # Not a Bearer token: refused too.
        r = httpx.post(f"{base}/completions", headers={"Authorization": f"Basic {KEY}"}, json={})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        # Anthropic's header carries the key too (its SDK sends no Authorization), and each
        # API's refusal comes in its own shape.
        assert httpx.get(f"{base}/models", headers={"X-Api-Key": KEY}).status_code == 200
        assert httpx.get(f"{base}/models", headers={"X-Api-Key": "no"}).status_code == 401
        hi = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        claude = anthropic.Anthropic(base_url=live.url, api_key=KEY, max_retries=0)
        assert claude.messages.create(**hi).usage.output_tokens >= 1
        with pytest.raises(anthropic.AuthenticationError) as info:
            claude.with_options(api_key="wrong").messages.create(**hi)
        assert info.value.body["error"]["type"] == "authentication_error"
        refused = httpx.get(f"{live.url}/api/tags")
        assert refused.status_code == 401 and "missing API key" in refused.json()["error"]
        keyed = ollama.Client(host=live.url, headers={"Authorization": f"Bearer {KEY}"})
        assert [m.model for m in keyed.list().models] == [model]
        # The pages are open (they ask for the key); the data they read needs it.
        for page in ("/", "/dashboard", "/static/chat.html"):
            assert httpx.get(f"{live.url}{page}").status_code == 200, page
        for data in ("/chat/settings", "/dashboard/data"):
            refused = httpx.get(f"{live.url}{data}")
            assert (
                refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
            )
            assert httpx.get(f"{live.url}{data}", headers={"X-Api-Key": KEY}).status_code == 200
        # /health is always open; /metrics is open unless protect_metrics.
        assert httpx.get(f"{live.url}/health").status_code == 200
        assert httpx.get(f"{live.url}/metrics").status_code == 200
    finally:
        live.stop()

    live = start_server(tiny_llama, api_key=KEY, protect_metrics=True)
    try:
        assert httpx.get(f"{live.url}/metrics").status_code == 401
        ok = httpx.get(f"{live.url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and "tandem_kv_blocks_total" in ok.text
        assert httpx.get(f"{live.url}/health").status_code == 200
    finally:
        live.stop()


def _aborted(live: LiveServer) -> float:
    return metric_samples(live.url).get(
        ("tandem_requests_finished_total", (("finish_reason", "abort"),)), 0.0
    )


def test_client_timeouts_abort_on_the_server(tiny_llama: Path) -> None:
    """A client whose own timeout fires is gone: its request is aborted, running or queued."""
    live = start_server(tiny_llama, {"max_num_seqs": 1, "max_model_len": 2048})
    try:
        model = live.model.model_path.name
        quick = openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0, timeout=0.3)
        with pytest.raises(openai.APITimeoutError):
            quick.completions.create(
                model=model, prompt="long", max_tokens=1500, extra_body={"ignore_eos": True}
            )
        assert_idle(live)
        wait_until(lambda: _aborted(live) == 1, 5, "the abort")

        # A stream that times out while queued behind a running request never runs.
        url = f"{live.url}/v1/completions"
        body = completion_body(live, "busy", 1500, stream=True)
        with httpx.Client(timeout=60) as client, client.stream("POST", url, json=body) as r:
            events = sse_events(r.iter_lines())
            next(events)
            with pytest.raises((openai.APITimeoutError, httpx.ReadTimeout)):
                list(quick.completions.create(model=model, prompt="queued", stream=True))
            wait_until(lambda: _aborted(live) == 2, 5, "the queued request's abort")
            assert live.stats.num_running == 1 and live.stats.num_waiting == 0
        assert_idle(live)
        wait_until(lambda: _aborted(live) == 3, 5, "the running stream's abort")
    finally:
        live.stop()


# ------------------------------------------------------------ engine faults
FAULTS = Path(__file__).parent / "faults"


@pytest.fixture
def fault_trigger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A file whose existence makes every engine step raise in cores started from now on."""
    trigger = tmp_path / "fail-now"
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(FAULTS), path])))
    monkeypatch.setenv("TANDEM_TEST_FAULT_FILE", str(trigger))
    return trigger


def test_engine_fault_answers_everyone_at_once(tiny_llama: Path, fault_trigger: Path) -> None:
    """A fault in a core's step ends running streams with an error, answers queued and
    still-preparing requests with 503 at once, and leaves no thread behind once stopped."""
    threads_before = set(threading.enumerate())
    live = start_server(tiny_llama, {"max_num_seqs": 1, "max_model_len": 2048}, core_start="spawn")
    try:
        url = f"{live.url}/v1/completions"
        preparer = app_of(live).state.preparer
        release = threading.Event()
        real_parse = preparer.parse

        def stuck_parse(body_type, raw: bytes, bulk: bool, endpoint: str):
            if b"stuck" in raw:  # a preparation outliving the engine
                release.wait(30)
            return real_parse(body_type, raw, bulk, endpoint)

        preparer.parse = stuck_parse

        async def scenario() -> tuple[list, httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                running = completion_body(live, "running", 1500, stream=True)
                async with client.stream("POST", url, json=running) as r:
                    lines = r.aiter_lines()
                    while not (await lines.__anext__()).startswith("data:"):
                        pass
                    queued = asyncio.ensure_future(
                        client.post(url, json=completion_body(live, "queued", 5))
                    )
                    preparing = asyncio.ensure_future(
                        client.post(url, json=completion_body(live, "stuck", 5))
                    )
                    while live.stats.num_waiting != 1 or live.service._admitting != 1:
                        await asyncio.sleep(0.01)

                    fault_trigger.touch()
                    rest = [line async for line in lines]
                    return rest, await queued, await preparing

        rest, queued, preparing = asyncio.run(scenario())
        events = list(sse_events(iter(rest)))
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["type"] == "server_error"
        assert "device on fire" in events[-2]["error"]["message"]
        assert queued.status_code == 503 and "device on fire" in queued.json()["error"]["message"]
        assert preparing.status_code == 503 and not release.is_set()  # answered, not waited for
        assert httpx.get(f"{live.url}/health").status_code == 503
        release.set()
    finally:
        release.set()
        live.stop()
    wait_until(lambda: set(threading.enumerate()) <= threads_before, 10, "threads to end")


FAULTY_SERVE = """
import sys, threading

from tandem import EngineConfig
from tandem.server.serve import serve

port, model = int(sys.argv[1]), sys.argv[2]
try:
    serve(EngineConfig(model=model, dtype="float32", device="cpu", num_kv_blocks=128,
                       max_model_len=1024, max_num_seqs=2, cpu_threads=1), port=port, max_waiting=4)
finally:
    left = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    print("THREADS LEFT:", left, flush=True)
"""


def test_engine_fault_exits_nonzero_after_answering(tiny_llama: Path, fault_trigger: Path) -> None:
    """The real `serve()` with a fault injected into its core's Engine.step: streams end with
    an error event, queued requests get 503, the process exits 1, nothing is left."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TANDEM_API_KEY": KEY}
    proc = subprocess.Popen(
        [sys.executable, "-c", FAULTY_SERVE, str(port), str(tiny_llama)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: whatever it spawns is findable
    )
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        wait_for_health(proc, url, 120)  # a loaded machine is slow
        model = httpx.get(f"{url}/v1/models", headers=auth).json()["data"][0]["id"]
        assert httpx.get(f"{url}/v1/models").status_code == 401  # the key came from the env
        # A large body starts the JSON counting helper, which must not outlive the server.
        big = {"model": model, "prompt": "word " * 40_000}
        refused = httpx.post(f"{url}/v1/completions", json=big, headers=auth)
        assert refused.status_code == 400 and "at least" in refused.json()["error"]["message"]
        # The server, its engine core (forked: no multiprocessing resource tracker), the
        # counting helper.
        assert len(processes_in_group(proc.pid)) == 3
        body = {"model": model, "prompt": "fault", "max_tokens": 900, "ignore_eos": True}
        with (
            httpx.Client(timeout=30, headers=auth) as client,
            ThreadPoolExecutor(2) as pool,
            client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as a,
            client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as b,
        ):
            streams = [sse_events(a.iter_lines()), sse_events(b.iter_lines())]
            for events in streams:
                next(events)  # both are running
            queued = [
                pool.submit(client.post, f"{url}/v1/completions", json={**body, "max_tokens": 5})
                for _ in range(2)
            ]

            def waiting() -> float:
                samples = metric_samples(url)
                return samples[("tandem_requests_waiting", (("engine", "0"),))]

            wait_until(lambda: waiting() == 2, 10, "two queued requests")
            fault_trigger.touch()
            rests = [list(events) for events in streams]
            answers = [f.result(30) for f in queued]
        for rest in rests:
            assert rest[-1] == "[DONE]"
            assert "injected fault" in rest[-2]["error"]["message"]
        for r in answers:
            assert r.status_code == 503
            assert "injected fault" in r.json()["error"]["message"]
        assert proc.wait(120) == 1
        out = proc.stdout.read().decode()
        assert "THREADS LEFT: []" in out, out
        assert "EngineFailure" in out
        # Children die by their parent-death signal, which a loaded machine delivers late.
        wait_until(lambda: processes_in_group(proc.pid) == [], 10, "every process to exit")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ------------------------------------------------- n > 1 and prompt lists
def _choices(chunks) -> tuple[dict[int, str], dict[int, list]]:
    """Streamed text per choice index, and each choice's finish reasons in order."""
    texts: dict[int, str] = {}
    reasons: dict[int, list] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                reasons.setdefault(choice.index, []).append(choice.finish_reason)
    return texts, reasons


def test_prompt_list_with_n_through_the_intake_lanes(guarded: LiveServer) -> None:
    """A prompt list with n = 2, streamed through the official client, is parsed and tokenized
    in an intake lane (the fast one, then the bulk one after the counting helper) and gets the
    same seeded answer either way, and non-streamed; the exact bound and the sequence limit
    apply to each prompt before any prompt is tokenized."""
    live = guarded
    intake = live.service.intake
    tokenized: list[tuple[str, object]] = []
    real_tokenize = live.model.intake.tokenize

    def recording_tokenize(prompt):  # text prompts (ids are only checked against the vocabulary)
        if isinstance(prompt, str):
            tokenized.append((threading.current_thread().name, prompt))
        return real_tokenize(prompt)

    live.model.intake.tokenize = recording_tokenize
    client = live.client()
    prompts = ["Once upon a time", "The quick brown fox", "Hello"]
    kwargs = {"model": live.model.model_path.name, "prompt": prompts, "n": 2, "max_tokens": 6,
              "seed": 5, "extra_body": {"ignore_eos": True}}  # fmt: skip

    def streamed() -> dict[int, str]:
        chunks = list(
            client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
        )
        assert len({c.id for c in chunks}) == 1
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6 * 6
        texts, reasons = _choices(chunks[:-1])
        assert reasons == {i: ["length"] for i in range(6)}
        return texts

    fast = streamed()
    assert sorted(fast) == list(range(6))
    lanes = {name.rsplit("_", 1)[0] for name, _ in tokenized}
    assert lanes == {"tandem-intake"} and [p for _, p in tokenized] == prompts

    tokenized.clear()
    intake.bulk_threshold = 0  # every body is bulk now: counted out of process, then parsed
    assert streamed() == fast
    assert {name.rsplit("_", 1)[0] for name, _ in tokenized} == {"tandem-intake-bulk"}
    assert intake.counter._proc is not None and intake.counter._proc.poll() is None
    whole = client.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == list(range(6))
    assert [c.text for c in whole.choices] == [fast[i] for i in range(6)]

    # Refused before any of its prompts is tokenized: one prompt over the bound, or more
    # sequences than the server holds (prompts x n).
    tokenized.clear()
    url = f"{live.url}/v1/completions"
    too_long = {**completion_body(live, ""), "prompt": ["hi", "hello world " * 2000]}
    r = httpx.post(url, json=too_long)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["message"].startswith("prompt 1: prompt is too long: at least ")
    too_many = {**completion_body(live, ""), "prompt": ["a"] * 4, "n": 128}
    r = httpx.post(url, json=too_many)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert "512 sequences" in r.json()["error"]["message"]
    assert tokenized == []
    assert_idle(live)


def test_engine_fault_ends_every_choice(tiny_llama: Path, fault_trigger: Path) -> None:
    """A fault while an n = 2 stream runs ends both of its choices (no closing chunk, one error
    event, [DONE]); a queued prompt list gets 503 at once; nothing stays in flight."""
    live = start_server(tiny_llama, {"max_num_seqs": 2, "max_model_len": 2048}, core_start="spawn")
    try:
        url = f"{live.url}/v1/completions"

        async def scenario() -> tuple[list, httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                running = completion_body(live, "running", 1500, stream=True, n=2)
                async with client.stream("POST", url, json=running) as r:
                    lines = r.aiter_lines()
                    started: set[int] = set()
                    while started != {0, 1}:  # both choices have produced text
                        line = await lines.__anext__()
                        if line.startswith("data: "):
                            for choice in json.loads(line[6:])["choices"]:
                                if choice["text"]:
                                    started.add(choice["index"])
                    queued = asyncio.ensure_future(
                        client.post(
                            url, json={**completion_body(live, "", 5), "prompt": ["a", "b"]}
                        )
                    )
                    while live.stats.num_waiting != 2:
                        await asyncio.sleep(0.01)

                    fault_trigger.touch()
                    rest = [line async for line in lines]
                    return rest, await queued

        rest, queued = asyncio.run(scenario())
        events = list(sse_events(iter(rest)))
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert error["type"] == "server_error" and error["code"] == "aborted"
        assert "device on fire" in error["message"]
        assert all(c["finish_reason"] is None for e in events[:-2] for c in e["choices"])
        assert queued.status_code == 503 and "device on fire" in queued.json()["error"]["message"]
        assert httpx.get(f"{live.url}/health").status_code == 503
        # Every sequence ended as an abort: both samples of the stream, both queued prompts.
        assert _aborted(live) == 4
        assert live.service.num_in_flight == 0 and not live.service._streams
    finally:
        live.stop()


def test_client_timeouts_abort_every_sample(tiny_llama: Path) -> None:
    """A client whose timeout fires on an n = 2 request aborts both samples, running or queued
    (a streamed prompt list of two, four sequences), and every KV block comes back."""
    live = start_server(tiny_llama, {"max_num_seqs": 2, "max_model_len": 2048})
    try:
        model = live.model.model_path.name
        quick = openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0, timeout=0.3)
        with pytest.raises(openai.APITimeoutError):
            quick.completions.create(
                model=model, prompt="long", n=2, max_tokens=1500, extra_body={"ignore_eos": True}
            )
        assert_idle(live)
        wait_until(lambda: _aborted(live) == 2, 5, "both samples' aborts")

        url = f"{live.url}/v1/completions"
        body = completion_body(live, "busy", 1500, stream=True, n=2)
        with httpx.Client(timeout=60) as client, client.stream("POST", url, json=body) as r:
            events = sse_events(r.iter_lines())
            next(events)
            wait_until(lambda: live.stats.num_running == 2, 5, "both samples running")
            with pytest.raises((openai.APITimeoutError, httpx.ReadTimeout)):
                list(
                    quick.completions.create(
                        model=model, prompt=["queued", "too"], n=2, max_tokens=5, stream=True
                    )
                )
            wait_until(lambda: _aborted(live) == 6, 5, "the queued samples' aborts")
            assert live.stats.num_running == 2 and live.stats.num_waiting == 0
        assert_idle(live)
        wait_until(lambda: _aborted(live) == 8, 5, "the running stream's aborts")
    finally:
        live.stop()


def test_sampling_extras_with_n_through_the_bulk_lane(
    guarded: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """logit_bias, penalties and logprobs with n = 2 (and a prompt list) through the bulk lane:
    the counting helper's limit leaves room for a logit_bias on every vocabulary id, every choice
    carries its own tokens' logprobs, and an id outside the vocabulary is a 400 naming
    logit_bias, not a prompt."""
    live = guarded
    monkeypatch.setattr(prepare, "OTHER_VALUES", 0)  # the limit: max_model_len + vocabulary
    intake = live.service.intake
    intake.bulk_threshold = 0  # every body is counted out of process, then parsed
    vocab = live.model.vocab_size
    assert vocab > live.model.max_model_len + 50  # so the bias alone outgrows the prompt term
    tokenizer = live.model.tokenizer
    only = next(
        t for t in range(8, vocab) if (s := tokenizer.decode([t])).isascii() and s.isalpha()
    )
    text = tokenizer.decode([only])
    bias = {str(t): (0 if t == only else -100) for t in range(vocab)}  # only `only` can be sampled
    client = live.client()
    model = live.model.model_path.name

    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=5,
        logit_bias=bias, presence_penalty=0.5, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    assert [c.index for c in chat.choices] == [0, 1]
    for choice in chat.choices:
        assert choice.message.content == text * 5
        assert [t.token for t in choice.logprobs.content] == [text] * 5
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)  # raw logprobs

    chunks = list(
        client.completions.create(
            model=model, prompt=["one", "two"], n=2, max_tokens=4, logit_bias=bias, logprobs=1,
            frequency_penalty=0.5, stream=True,
        )
    )  # fmt: skip
    tokens: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.logprobs is not None:
                tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
    assert tokens == {i: [text] * 4 for i in range(4)}
    assert intake.counter._proc is not None  # both bodies were counted

    r = httpx.post(
        f"{live.url}/v1/completions",
        json={"model": model, "prompt": ["one", "two"], "logit_bias": {str(vocab + 5): 1}},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    assert r.json()["error"]["message"].startswith("logit_bias token id")
    assert_idle(live)
