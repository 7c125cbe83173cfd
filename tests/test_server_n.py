"""The server's `n`, prompt lists and cache metrics, through the official `openai` client.

Choices are numbered prompt-major (`prompt_index * n + sample_index`), as OpenAI does; each must
equal the offline engine's sample with the same seed, streamed or not.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from test_server import (
    LiveServer,
    assert_idle,
    chat_prompt_ids,
    metric_samples,
    server_fixtures,
    sse_events,
    start_server,
    wait_until,
)

from tandem import LLM, SamplingParams

SYSTEM = "You are a careful assistant who answers every question in full sentences. " * 4


live, offline, model = server_fixtures("module")


def seeded(n: int, max_tokens: int = 10, seed: int = 5) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)


def texts_by_index(chunks, field: str = "text") -> tuple[dict[int, str], dict[int, list]]:
    """Streamed text per choice index, and each choice's finish reasons in order."""
    texts: dict[int, str] = {}
    reasons: dict[int, list] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            part = choice.text if field == "text" else (choice.delta.content or "")
            texts[choice.index] = texts.get(choice.index, "") + part
            if choice.finish_reason is not None:
                reasons.setdefault(choice.index, []).append(choice.finish_reason)
    return texts, reasons


def test_completions_n(live: LiveServer, model: str, offline: LLM) -> None:
    client = live.client()
    expected = offline.generate(["Hello world"], seeded(3))[0].outputs
    kwargs = {"model": model, "prompt": "Hello world", "max_tokens": 10, "n": 3, "seed": 5}
    out = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [e.text for e in expected]
    assert len({c.text for c in out.choices}) == 3  # distinct samples
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 30
    assert out.usage.prompt_tokens == len(offline.get_tokenizer()("Hello world").input_ids)

    chunks = list(
        client.completions.create(
            **kwargs,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert all(len(c.choices) == 1 for c in chunks[:-1])
    texts, reasons = texts_by_index(chunks)
    assert texts == {i: e.text for i, e in enumerate(expected)}
    assert reasons == {0: ["length"], 1: ["length"], 2: ["length"]}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    assert_idle(live)


def test_completions_prompt_lists(live: LiveServer, model: str, offline: LLM) -> None:
    """Strings, token-id lists: choice index = prompt_index * n + sample_index."""
    client = live.client()
    tokenizer = offline.get_tokenizer()
    strings = ["Once upon a time", "The quick brown fox", "Hello"]
    token_lists = [tokenizer(s).input_ids for s in strings]
    expected = offline.generate(strings, seeded(2, max_tokens=8))
    want = [sample.text for out in expected for sample in out.outputs]
    for prompt in (strings, token_lists):
        out = client.completions.create(
            model=model, prompt=prompt, max_tokens=8, n=2, seed=5, extra_body={"ignore_eos": True}
        )
        assert [c.index for c in out.choices] == list(range(6))
        assert [c.text for c in out.choices] == want
        assert out.usage.prompt_tokens == sum(len(t) for t in token_lists)
        assert out.usage.completion_tokens == 6 * 8

        stream = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=8,
            n=2,
            seed=5,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        assert len({c.id for c in chunks}) == 1
        texts, reasons = texts_by_index(chunks)
        assert texts == dict(enumerate(want))
        assert reasons == {i: ["length"] for i in range(6)}
    # One prompt in a list is a list of one: a single choice.
    single = client.completions.create(model=model, prompt=["Hello"], max_tokens=4, temperature=0)
    assert [c.index for c in single.choices] == [0]
    assert_idle(live)


def test_chat_n(live: LiveServer, model: str, offline: LLM) -> None:
    client = live.client()
    messages = [{"role": "user", "content": "Name three colours."}]
    expected = offline.generate([chat_prompt_ids(live.model, messages)], seeded(2))[0].outputs
    kwargs = {"model": model, "messages": messages, "max_tokens": 10, "n": 2, "seed": 5}
    out = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.message.content for c in out.choices] == [e.text for e in expected]
    assert all(c.message.role == "assistant" for c in out.choices)
    assert out.usage.completion_tokens == 20

    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True})
    )
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]  # each choice opens with its role
    texts, reasons = texts_by_index(chunks, field="delta")
    assert texts == {0: expected[0].text, 1: expected[1].text}
    assert reasons == {0: ["length"], 1: ["length"]}
    assert_idle(live)


def test_n_and_lists_are_bounded(live: LiveServer, model: str) -> None:
    """More sequences than the server can ever hold is a 400, not an endless 503."""
    body = {"model": model, "prompt": ["a"] * 4, "n": 128, "max_tokens": 2}
    r = httpx.post(f"{live.url}/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert "512 sequences" in r.json()["error"]["message"]


def test_disconnect_frees_every_sample(live: LiveServer, model: str) -> None:
    body = {"model": model, "prompt": ["one", "two"], "n": 3, "max_tokens": 200}
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST", f"{live.url}/v1/completions", json={**body, "stream": True, "ignore_eos": True}
        ) as r,
    ):
        events = sse_events(r.iter_lines())
        next(events), next(events)
        assert live.service.num_in_flight == 6
        wait_until(lambda: live.stats.num_running + live.stats.num_waiting == 6, 5, "6 running")
    assert_idle(live)


def test_metrics_count_cache_hits_and_preemptions(tiny_llama: Path) -> None:
    """Few blocks: a burst of requests over one long system prompt hits the cache and preempts."""
    live = start_server(tiny_llama, {"num_kv_blocks": 24, "block_size": 8, "max_model_len": 192})
    try:
        model = live.model.model_path.name
        before = metric_samples(live.url)

        async def burst() -> None:
            async with live.async_client() as client:
                await asyncio.gather(
                    *(
                        client.completions.create(
                            model=model,
                            prompt=f"{SYSTEM} Question {i}:",
                            max_tokens=40,
                            extra_body={"ignore_eos": True},
                        )
                        for i in range(6)
                    )
                )

        asyncio.run(burst())
        assert_idle(live)
        after = metric_samples(live.url)
        stats = live.stats  # the core's own counters, as its last step message carried them
        engine = (("engine", "0"),)

        def delta(name: str) -> float:
            return after[(name, engine)] - before.get((name, engine), 0.0)

        assert delta("tandem_prefix_cache_hits_total") == stats.prefix_hit_tokens > 0
        assert delta("tandem_prefix_cache_queries_total") == stats.prefix_query_tokens
        assert delta("tandem_prefix_cache_hit_requests_total") == stats.prefix_hit_requests > 0
        assert delta("tandem_preemptions_total") == stats.num_preemptions > 0
        assert after[("tandem_prefix_cache_hit_rate", engine)] == pytest.approx(
            stats.prefix_hit_rate
        )
        assert after[("tandem_kv_blocks_cached", engine)] > 0  # idle, the prefix stays cached
        assert after[("tandem_kv_blocks_used", engine)] == 0
    finally:
        live.stop()
