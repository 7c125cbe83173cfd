"""Logprobs and penalties through the server, with the official `openai` client, streamed and
not: the same tokens and logprobs as the offline `LLM.generate`, in OpenAI's shapes."""

from __future__ import annotations

import httpx
import openai
import pytest
from test_server import LiveServer, chat_prompt_ids, server_fixtures

from tandem import LLM, SamplingParams

PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Name a colour."}]


live, offline, model = server_fixtures("module")


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def approx(values):
    return pytest.approx(values, abs=1e-4)


def test_completion_logprobs(live: LiveServer, model: str, offline: LLM) -> None:
    ref = offline.generate(PROMPT, greedy(10, logprobs=3))[0]
    sampled = [next(iter(e.values())) for e in ref.logprobs]
    kwargs = {"model": model, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "logprobs": 3}
    out = live.client().completions.create(**kwargs, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text == ref.text
    assert lp.tokens == [s.decoded_token for s in sampled]
    assert "".join(lp.tokens) == ref.text  # the tokens spell the text
    assert lp.token_logprobs == approx([s.logprob for s in sampled])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    for top, entry in zip(lp.top_logprobs, ref.logprobs, strict=True):
        expected = {e.decoded_token: e.logprob for e in entry.values()}
        assert top.keys() == expected.keys() and 1 <= len(top) <= 4
        assert list(top.values()) == approx(list(expected.values()))

    chunks = list(
        live.client().completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True})
    )
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.token_logprobs for s in streamed), []) == approx(lp.token_logprobs)
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset
    assert sum((s.top_logprobs for s in streamed), []) == lp.top_logprobs
    assert "".join(c.choices[0].text for c in chunks) == ref.text


def test_completion_without_logprobs_has_none(live: LiveServer, model: str) -> None:
    out = live.client().completions.create(model=model, prompt=PROMPT, max_tokens=3)
    assert out.choices[0].logprobs is None


def test_chat_logprobs(live: LiveServer, model: str, offline: LLM) -> None:
    prompt = chat_prompt_ids(live.model, MESSAGES)
    ref = offline.generate([prompt], greedy(8, logprobs=2))[0]
    client = live.client()
    kwargs = {"model": model, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    extra = {"ignore_eos": True}
    out = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2, extra_body=extra)
    content = out.choices[0].logprobs.content
    assert len(content) == 8
    for item, entry in zip(content, ref.logprobs, strict=True):
        sampled = next(iter(entry.values()))
        assert item.token == sampled.decoded_token
        assert item.logprob == approx(sampled.logprob)
        assert item.bytes == list(item.token.encode())
        top = sorted(entry.values(), key=lambda e: e.rank)[:2]
        assert [t.token for t in item.top_logprobs] == [e.decoded_token for e in top]
        assert [t.logprob for t in item.top_logprobs] == approx([e.logprob for e in top])
        assert item.top_logprobs[0].logprob == approx(item.logprob)  # greedy: the best one

    chunks = list(
        client.chat.completions.create(
            **kwargs, logprobs=True, top_logprobs=2, stream=True, extra_body=extra
        )
    )
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    # The same tokens; logprobs up to rounding: the second request finds the prompt cached and
    # computes only its tail, whose few rows take another GEMM than the whole prompt's.
    assert len(streamed) == len(content)
    for s, c in zip(streamed, content, strict=True):
        assert (s.token, s.bytes) == (c.token, c.bytes)
        assert [t.token for t in s.top_logprobs] == [t.token for t in c.top_logprobs]
        assert s.logprob == approx(c.logprob)
        assert [t.logprob for t in s.top_logprobs] == approx([t.logprob for t in c.top_logprobs])

    # logprobs without top_logprobs: the sampled token's only.
    out = client.chat.completions.create(**kwargs, logprobs=True, extra_body=extra)
    assert [x.top_logprobs for x in out.choices[0].logprobs.content] == [[]] * 8
    out = client.chat.completions.create(**kwargs, extra_body=extra)
    assert out.choices[0].logprobs is None


def test_penalties_through_the_client(live: LiveServer, model: str, offline: LLM) -> None:
    """Each penalty changes the answer, and the server's equals the offline engine's."""
    client = live.client()
    plain = offline.generate(PROMPT, greedy(16))[0].token_ids
    cases = [
        ({"presence_penalty": 1.5}, {}),
        ({"frequency_penalty": 2.0}, {}),
        ({"logit_bias": {str(plain[2]): -100, "77": 8}}, {}),
        ({}, {"repetition_penalty": 1.8}),
        (
            {"presence_penalty": 0.5, "frequency_penalty": 0.5},
            {"repetition_penalty": 1.2, "min_tokens": 4},
        ),
    ]
    for openai_kwargs, vllm_extra in cases:
        bias = {int(k): float(v) for k, v in openai_kwargs.get("logit_bias", {}).items()}
        params = greedy(16, **{**openai_kwargs, "logit_bias": bias or None}, **vllm_extra)
        ref = offline.generate(PROMPT, params)[0]
        assert ref.token_ids != plain, (openai_kwargs, vllm_extra)
        kwargs = {"model": model, "max_tokens": 16, "temperature": 0, **openai_kwargs}
        extra = {"ignore_eos": True, **vllm_extra}
        out = client.completions.create(prompt=PROMPT, **kwargs, extra_body=extra)
        assert out.choices[0].text == ref.text
        chunks = client.completions.create(prompt=PROMPT, **kwargs, stream=True, extra_body=extra)
        assert "".join(c.choices[0].text for c in chunks) == ref.text

    chat_ref = offline.generate(
        [chat_prompt_ids(live.model, MESSAGES)], greedy(8, presence_penalty=2.0, logprobs=0)
    )[0]
    out = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=8, temperature=0, presence_penalty=2.0,
        logprobs=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert out.choices[0].message.content == chat_ref.text
    logprobs = [x.logprob for x in out.choices[0].logprobs.content]
    assert logprobs == approx([next(iter(e.values())).logprob for e in chat_ref.logprobs])


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"logprobs": -1}, "logprobs"),
        ("completions", {"presence_penalty": 3}, "presence_penalty"),
        ("completions", {"frequency_penalty": "high"}, "frequency_penalty"),
        ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
        ("completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
        ("completions", {"logit_bias": {"5": -101}}, "logit_bias"),
        ("completions", {"logit_bias": {"99999": 1}}, "logit_bias"),  # outside the vocabulary
        ("completions", {"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ("completions", {"min_tokens": -1}, "min_tokens"),
        ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat/completions", {"top_logprobs": 3}, "top_logprobs"),  # without logprobs
        ("chat/completions", {"logprobs": 1}, "logprobs"),  # a bool, not a count
    ],
)
def test_bad_values_are_refused(live: LiveServer, model: str, path, body, param) -> None:
    if path == "completions":
        body = {"model": model, "prompt": PROMPT, **body}
    else:
        body = {"model": model, "messages": MESSAGES, **body}
    r = httpx.post(f"{live.url}/v1/{path}", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"]
    # The server keeps serving.
    ok = live.client().completions.create(model=model, prompt=PROMPT, max_tokens=2, logprobs=1)
    assert len(ok.choices[0].logprobs.tokens) == ok.usage.completion_tokens


def test_bad_values_through_the_client(live: LiveServer, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        live.client().completions.create(
            model=model, prompt=PROMPT, max_tokens=4, logit_bias={"1024": 5}
        )
    assert info.value.body["param"] == "logit_bias"
    assert "outside the vocabulary" in info.value.body["message"]


def seeded(n: int, max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(
        n=n, max_tokens=max_tokens, temperature=1.0, seed=5, ignore_eos=True, **kw
    )


def by_choice(chunks, get) -> dict[int, list]:
    """Per choice index, the concatenation of what `get` takes from each streamed choice."""
    out: dict[int, list] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            out.setdefault(choice.index, []).extend(get(choice))
    return out


def test_completion_logprobs_with_n_and_prompt_lists(
    live: LiveServer, model: str, offline: LLM
) -> None:
    """Choice prompt_index * n + sample_index carries that sample's own logprobs, its text
    offsets starting at 0, streamed (each chunk its own choice's tokens) and not."""
    prompts = [PROMPT, "The quick brown fox"]
    expected = offline.generate(prompts, seeded(2, 6, logprobs=2))
    samples = [s for out in expected for s in out.outputs]
    assert len({tuple(s.token_ids) for s in samples}) == 4
    kwargs = {"model": model, "prompt": prompts, "max_tokens": 6, "n": 2, "seed": 5, "logprobs": 2}
    extra = {"ignore_eos": True}
    out = live.client().completions.create(**kwargs, extra_body=extra)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for choice, sample in zip(out.choices, samples, strict=True):
        lp = choice.logprobs
        sampled = [next(iter(e.values())) for e in sample.logprobs]
        assert choice.text == sample.text
        assert lp.tokens == [s.decoded_token for s in sampled]
        assert lp.token_logprobs == approx([s.logprob for s in sampled])
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
        for top, entry in zip(lp.top_logprobs, sample.logprobs, strict=True):
            assert top.keys() == {e.decoded_token for e in entry.values()}

    chunks = list(live.client().completions.create(**kwargs, stream=True, extra_body=extra))
    texts = by_choice(chunks, lambda c: [c.text])
    tokens = by_choice(chunks, lambda c: c.logprobs.tokens if c.logprobs else [])
    values = by_choice(chunks, lambda c: c.logprobs.token_logprobs if c.logprobs else [])
    offsets = by_choice(chunks, lambda c: c.logprobs.text_offset if c.logprobs else [])
    for i, choice in enumerate(out.choices):
        assert "".join(texts[i]) == choice.text
        assert tokens[i] == choice.logprobs.tokens
        assert values[i] == approx(choice.logprobs.token_logprobs)
        assert offsets[i] == choice.logprobs.text_offset


def test_chat_logprobs_with_n(live: LiveServer, model: str, offline: LLM) -> None:
    prompt = chat_prompt_ids(live.model, MESSAGES)
    samples = offline.generate([prompt], seeded(2, 6, logprobs=2))[0].outputs
    assert samples[0].token_ids != samples[1].token_ids
    client = live.client()
    kwargs = {
        "model": model, "messages": MESSAGES, "max_tokens": 6, "n": 2, "seed": 5,
        "logprobs": True, "top_logprobs": 2, "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    out = client.chat.completions.create(**kwargs)
    assert [c.index for c in out.choices] == [0, 1]
    for choice, sample in zip(out.choices, samples, strict=True):
        assert choice.message.content == sample.text
        content = choice.logprobs.content
        assert [x.logprob for x in content] == approx(
            [next(iter(e.values())).logprob for e in sample.logprobs]
        )
        for item, entry in zip(content, sample.logprobs, strict=True):
            top = sorted(entry.values(), key=lambda e: e.rank)[:2]
            assert [t.token for t in item.top_logprobs] == [e.decoded_token for e in top]

    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = by_choice(chunks, lambda c: c.logprobs.content if c.logprobs else [])
    for i, choice in enumerate(out.choices):
        assert [x.model_dump() for x in streamed[i]] == [
            x.model_dump() for x in choice.logprobs.content
        ]
