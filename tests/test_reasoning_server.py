"""A reasoning model served, through each API's official client: the thinking comes apart from
the answer (chat completions' `reasoning_content` and `reasoning`, Anthropic's thinking blocks,
the Responses API's reasoning items, Ollama's `thinking`), before it in every stream; each API's
thinking setting bounds or turns off the thinking; a schema and a required tool call hold after
it. Texts equal the offline engine's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import jsonschema
import ollama
import pytest
from test_server import LiveServer, assert_idle, start_server

from tandem import SamplingParams

from helpers import make_llm

OPTIONS = {"max_model_len": 512, "cpu_threads": 1}  # the server's compute threads offline too
DEFAULT_BUDGET = 3  # the server's, for requests that set none
SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}},
    "required": ["colour"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def live(thinking_qwen3: Path) -> Iterator[LiveServer]:
    override = {"override_generation_config": {"thinking_token_budget": DEFAULT_BUDGET}}
    server = start_server(thinking_qwen3, {**OPTIONS, **override})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def model(live: LiveServer) -> str:
    return live.model.model_path.name


@pytest.fixture(scope="module")
def offline(thinking_qwen3: Path):
    llm = make_llm(thinking_qwen3, **OPTIONS)
    yield llm
    llm.close()


def expected(offline, budget: int, max_tokens: int = 12, **template) -> tuple[str, str]:
    """(thinking, answer) of the offline engine, greedy, for HI."""
    tok = offline.get_tokenizer()
    text = tok.apply_chat_template(HI, tokenize=False, add_generation_prompt=True, **template)
    ids = tok(text, add_special_tokens=False).input_ids
    params = SamplingParams(max_tokens=max_tokens, temperature=0, thinking_token_budget=budget)
    out = offline.generate([ids], params)[0]
    return out.reasoning, out.text


def test_chat_completions_separate_the_thinking(live: LiveServer, model: str, offline) -> None:
    """Whole and streamed: `reasoning_content` and `reasoning` hold the thinking, `content` the
    answer, no tags anywhere; every reasoning delta comes before the first content delta; the
    server's default budget applies where a request sets none."""
    thinking, answer = expected(offline, DEFAULT_BUDGET)
    assert thinking and answer
    client = live.client()
    out = client.chat.completions.create(model=model, messages=HI, max_tokens=12, temperature=0)
    message = out.choices[0].message
    assert message.content == answer and message.model_extra["reasoning_content"] == thinking
    assert message.model_extra["reasoning"] == thinking and "think>" not in message.content
    chunks = list(
        client.chat.completions.create(
            model=model, messages=HI, max_tokens=12, temperature=0, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    kinds = ["thinking" if (d.model_extra or {}).get("reasoning_content") else "content"
             for d in deltas if d.content or (d.model_extra or {}).get("reasoning_content")]  # fmt: skip
    assert kinds == sorted(kinds, key=lambda k: k != "thinking") and "thinking" in kinds
    assert "".join((d.model_extra or {}).get("reasoning", "") for d in deltas) == thinking
    assert "".join(d.content or "" for d in deltas) == answer
    own = client.chat.completions.create(
        model=model, messages=HI, max_tokens=12, temperature=0,
        extra_body={"thinking_token_budget": 1},
    )  # fmt: skip
    assert (
        own.choices[0].message.model_extra["reasoning_content"],
        own.choices[0].message.content,
    ) == expected(offline, 1)


def test_thinking_off_through_the_template(live: LiveServer, model: str, offline) -> None:
    """chat_template_kwargs reach the template: Qwen3's enable_thinking false writes the block
    closed, and the answer is all there is."""
    out = live.client().chat.completions.create(
        model=model, messages=HI, max_tokens=12, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    message = out.choices[0].message
    assert message.content == expected(offline, DEFAULT_BUDGET, enable_thinking=False)[1]
    assert "reasoning_content" not in (message.model_extra or {})
    bad = live.client().with_options(max_retries=0)
    with pytest.raises(Exception) as info:
        bad.chat.completions.create(model=model, messages=HI, max_tokens=2,
                                    extra_body={"chat_template_kwargs": {"tokenize": True}})  # fmt: skip
    assert "chat_template_kwargs may not set tokenize" in str(info.value)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("stream", [False, True])
def test_schema_and_required_tool_call_after_the_thinking(
    live: LiveServer, model: str, temperature: float, stream: bool
) -> None:
    """The constraint starts where the thinking ends: the answer is valid, the thinking is as
    long as its budget; greedy and seeded; streamed says what whole says."""
    client = live.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}
    common = {"model": model, "messages": HI, "max_tokens": 60, "temperature": temperature,
              "seed": 4, "extra_body": {"thinking_token_budget": 5}}  # fmt: skip
    if stream:
        chunks = list(client.chat.completions.create(**common, response_format=fmt, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        out = client.chat.completions.create(**common, response_format=fmt)
        text = out.choices[0].message.content
        assert out.choices[0].message.model_extra["reasoning_content"]
    jsonschema.validate(json.loads(text), SCHEMA)
    calls = client.chat.completions.create(**common, tools=[WEATHER], tool_choice="required")
    message = calls.choices[0].message
    assert (
        calls.choices[0].finish_reason == "tool_calls" and message.model_extra["reasoning_content"]
    )
    for call in message.tool_calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert_idle(live)


def test_anthropic_thinking_blocks(live: LiveServer, model: str, offline) -> None:
    client = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0)
    kwargs = {"model": model, "max_tokens": 12, "messages": HI, "extra_body": {"temperature": 0}}
    out = client.messages.create(**kwargs, thinking={"type": "enabled", "budget_tokens": 2})
    thinking, answer = expected(offline, 2)
    assert [b.type for b in out.content] == ["thinking", "text"]
    assert (out.content[0].thinking, out.content[1].text) == (thinking, answer)
    with client.messages.stream(**kwargs, thinking={"type": "enabled", "budget_tokens": 2}) as s:
        events = list(s)
        final = s.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in out.content]
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas == sorted(deltas, key=lambda d: d != "thinking_delta")
    off = client.messages.create(**kwargs, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]
    assert off.content[0].text == expected(offline, 0, enable_thinking=False)[1]
    count = client.messages.count_tokens(model=model, messages=HI, thinking={"type": "disabled"})
    assert count.input_tokens == off.usage.input_tokens


def test_responses_reasoning_items(live: LiveServer, model: str, offline) -> None:
    client = live.client()
    kwargs = {"model": model, "input": "Hi", "max_output_tokens": 12, "temperature": 0}
    thinking, answer = expected(offline, DEFAULT_BUDGET)
    out = client.responses.create(**kwargs)
    assert [o.type for o in out.output] == ["reasoning", "message"]
    assert out.output[0].content[0].text == thinking and out.output_text == answer
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    first_text = kinds.index("response.output_text.delta")
    assert "response.reasoning_text.delta" in kinds[:first_text]
    assert "response.reasoning_text.delta" not in kinds[first_text:]
    assert events[-1].response.output_text == answer
    off = client.responses.create(**kwargs, reasoning={"effort": "none"})
    assert [o.type for o in off.output] == ["message"]


def test_ollama_thinking(live: LiveServer, model: str, offline) -> None:
    client = ollama.Client(host=live.url)
    options = {"num_predict": 12, "temperature": 0}
    thinking, answer = expected(offline, DEFAULT_BUDGET)
    out = client.chat(model=model, messages=HI, options=options, stream=False)
    assert (out.message.thinking, out.message.content) == (thinking, answer)
    parts = list(client.chat(model=model, messages=HI, options=options, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == thinking
    assert "".join(p.message.content for p in parts) == answer
    off = client.chat(model=model, messages=HI, options=options, stream=False, think=False)
    assert off.message.thinking is None
    assert off.message.content == expected(offline, 0, enable_thinking=False)[1]


def test_bad_thinking_settings_are_refused_by_name(live: LiveServer, model: str) -> None:
    """Each API refuses a negative budget or an unknown effort with its own error shape, naming
    the field; the server serves the next request."""
    openai_client = live.client().with_options(max_retries=0)
    with pytest.raises(Exception) as info:
        openai_client.chat.completions.create(
            model=model, messages=HI, max_tokens=2, extra_body={"thinking_token_budget": -1}
        )
    assert info.value.status_code == 400 and "thinking_token_budget" in str(info.value)
    with pytest.raises(Exception) as info:
        openai_client.responses.create(model=model, input="Hi", reasoning={"effort": "lots"})
    assert info.value.status_code == 400 and "effort" in str(info.value)
    claude = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=model, max_tokens=2, messages=HI,
                               thinking={"type": "enabled", "budget_tokens": -5})  # fmt: skip
    assert "budget_tokens" in str(info.value)
    with pytest.raises(ollama.ResponseError) as info:
        ollama.Client(host=live.url).chat(model=model, messages=HI, think="lots")
    assert "think" in str(info.value), str(info.value)
    out = openai_client.chat.completions.create(model=model, messages=HI, max_tokens=2)
    assert out.choices[0].finish_reason == "length"
    assert_idle(live)
