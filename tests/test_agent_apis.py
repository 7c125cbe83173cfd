"""The APIs agents and their tools speak, through their official clients: Anthropic's Messages
(`anthropic`), OpenAI's Responses (`openai`, and the OpenAI Agents SDK running an agent), and
Ollama's (`ollama`), against a real engine-core process and a real front end.

Greedy text through each API equals /v1/chat/completions' for the same conversation; a stream
says what the whole answer says; tool calls come out in each API's shape and their results go
back in; bad input gets the API's own error shape and leaves the server serving.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest
from agents import RunResult
from pydantic import BaseModel
from test_server import ENGINE_OPTIONS, LiveServer, assert_idle, start_server

from tandem.server.responses.store import ResponseStore

SYSTEM = "You answer briefly."
QUESTION = "Hello there"
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def live(tiny_llama: Path) -> Iterator[LiveServer]:
    server = start_server(tiny_llama)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def model(live: LiveServer) -> str:
    return live.model.model_path.name


def chat(
    live: LiveServer, model: str, messages: list[dict], max_tokens: int
) -> tuple[str, str, int]:
    """(text, finish_reason, prompt tokens) of /v1/chat/completions, greedy."""
    out = live.client().chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0
    )
    return out.choices[0].message.content, out.choices[0].finish_reason, out.usage.prompt_tokens


def claude(live: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0)


def ollama_client(live: LiveServer) -> ollama.Client:
    return ollama.Client(host=live.url)


# ------------------------------------------------------------- Anthropic
def test_messages_equal_chat_completions(live: LiveServer, model: str) -> None:
    """System prompt and user turn: the text, the stop reason and the prompt's tokens are chat
    completions'; count_tokens is the message's input_tokens."""
    expected, finish, prompt_tokens = chat(
        live,
        model,
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        8,
    )
    messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    out = claude(live).messages.create(
        model=model, max_tokens=8, system=system, messages=messages, extra_body=GREEDY
    )
    assert [b.type for b in out.content] == ["text"] and out.content[0].text == expected
    assert out.stop_reason == ("max_tokens" if finish == "length" else "end_turn")
    assert out.usage.input_tokens == prompt_tokens and out.role == "assistant"
    count = claude(live).messages.count_tokens(model=model, system=system, messages=messages)
    assert count.input_tokens == prompt_tokens
    # Claude Code's billing line is not part of the prompt.
    billing = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"}]
    again = claude(live).messages.create(
        model=model, max_tokens=8, system=billing + system, messages=messages, extra_body=GREEDY
    )
    assert again.content[0].text == expected and again.usage.input_tokens == prompt_tokens


def test_conversations_become_turns_a_template_takes() -> None:
    """System messages lead; a later one is a user turn in place; consecutive turns of one role
    are one; tool results and calls stay messages of their own."""
    from tandem.server.generation.request import Message, ToolCall, as_turns

    call = ToolCall("c1", "f", "{}")
    messages = [
        Message("system", "S1"), Message("system", "S2"), Message("user", "U1"),
        Message("system", "reminder"), Message("assistant", "A1"), Message("assistant", "A2"),
        Message("assistant", "", (call,)), Message("tool", "R1", tool_call_id="c1"),
        Message("tool", "R2", tool_call_id="c1"), Message("user", "U2"), Message("user", ""),
    ]  # fmt: skip
    assert as_turns(messages) == [
        Message("system", "S1\n\nS2"), Message("user", "U1\n\nreminder"),
        Message("assistant", "A1\n\nA2"), Message("assistant", "", (call,)),
        Message("tool", "R1", tool_call_id="c1"), Message("tool", "R2", tool_call_id="c1"),
        Message("user", "U2"),
    ]  # fmt: skip


def test_messages_mid_conversation_system_is_a_user_turn(live: LiveServer, model: str) -> None:
    """Claude Code's shape: a system message after the user's, then more turns; the prompt is
    chat completions' with the two as one user turn."""
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "system", "content": "Be kind."},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": [{"type": "text", "text": "More?"}]},
    ]
    expected, _, prompt_tokens = chat(
        live,
        model,
        [{"role": "user", "content": QUESTION + "\n\nBe kind."},
         {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "More?"}],
        6,
    )  # fmt: skip
    out = claude(live).messages.create(
        model=model, max_tokens=6, messages=messages, extra_body=GREEDY
    )
    assert out.content[0].text == expected and out.usage.input_tokens == prompt_tokens


def test_messages_stream_says_what_the_message_says(live: LiveServer, model: str) -> None:
    kwargs = {"model": model, "max_tokens": 10, "messages": [{"role": "user", "content": QUESTION}],
              "extra_body": GREEDY}  # fmt: skip
    whole = claude(live).messages.create(**kwargs)
    events = list(claude(live).messages.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    with claude(live).messages.stream(**kwargs) as stream:  # the SDK's own accumulator
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text
    assert_idle(live)


@pytest.mark.parametrize("stream", [False, True])
def test_messages_tool_use_and_result(live: LiveServer, model: str, stream: bool) -> None:
    """A named tool's input follows its schema (the grammar makes it so); the tool_use block's
    id comes back with the result, which the template renders in the tool role."""
    tools = [{"name": "get_weather", "description": "Weather now.", "input_schema": CITY}]
    kwargs = {"model": model, "max_tokens": 30, "tools": tools,
              "messages": [{"role": "user", "content": "Weather in Paris?"}]}  # fmt: skip
    choice = {"type": "tool", "name": "get_weather"}
    if stream:
        with claude(live).messages.stream(**kwargs, tool_choice=choice) as s:
            out = s.get_final_message()
    else:
        out = claude(live).messages.create(**kwargs, tool_choice=choice)
    assert out.stop_reason == "tool_use" and [b.type for b in out.content] == ["tool_use"]
    call = out.content[0]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, CITY)
    turn = [
        *kwargs["messages"],
        {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": [{"type": "text", "text": "Sunny."}]}]},
    ]  # fmt: skip
    after = claude(live).messages.create(**{**kwargs, "messages": turn}, extra_body=GREEDY)
    count = claude(live).messages.count_tokens(model=model, tools=tools, messages=turn)
    assert after.usage.input_tokens == count.input_tokens > out.usage.input_tokens
    expected, _, _ = chat(
        live,
        model,
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(call.input)}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny."},
        ],
        30,
    )  # fmt: skip
    assert after.content[0].text == expected
    any_tool = claude(live).messages.create(**kwargs, tool_choice={"type": "any"})
    assert any_tool.stop_reason in ("tool_use", "max_tokens")
    assert_idle(live)


def test_messages_stop_sequence_and_clamped_max_tokens(live: LiveServer, model: str) -> None:
    """A stop sequence ends the text before it and is named; a max_tokens past the context is
    lowered to what fits (the answer then ends with max_tokens at the context's end)."""
    messages = [{"role": "user", "content": QUESTION}]
    whole = claude(live).messages.create(
        model=model, max_tokens=12, messages=messages, extra_body=GREEDY
    )
    text = whole.content[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = claude(live).messages.create(
        model=model, max_tokens=12, messages=messages, stop_sequences=[stop], extra_body=GREEDY
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]
    extra = {**GREEDY, "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
             "context_management": {"edits": []}, "metadata": {"user_id": "u"}}  # fmt: skip
    with claude(live).messages.stream(  # so large a max_tokens: the SDK insists on streaming
        model=model, max_tokens=32000, messages=messages, extra_body=extra
    ) as stream:
        long = stream.get_final_message()
    used = long.usage.input_tokens + long.usage.output_tokens
    assert used <= ENGINE_OPTIONS["max_model_len"]
    assert long.stop_reason == "end_turn" or used == ENGINE_OPTIONS["max_model_len"]


def test_messages_structured_output(live: LiveServer, model: str) -> None:
    out = claude(live).messages.create(
        model=model, max_tokens=40, messages=[{"role": "user", "content": "A city?"}],
        output_config={"format": {"type": "json_schema", "schema": CITY}},
    )  # fmt: skip
    jsonschema.validate(json.loads(out.content[0].text), CITY)


@pytest.mark.parametrize(
    ("body", "status", "kind", "words"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
         "invalid_request_error", "image content blocks are not supported"),
        ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
        ({"model": "claude-opus-4"}, 404, "not_found_error", "'claude-opus-4' does not exist"),
        ({"messages": [{"role": "user", "content": "x " * 600}]}, 400, "invalid_request_error",
         "prompt is too long"),
        ({"tool_choice": {"type": "tool"}}, 400, "invalid_request_error", "tool's name"),
        ({"tools": [{"name": "f", "input_schema": {"type": "nonsense"}}],
          "tool_choice": {"type": "any"}}, 400, "invalid_request_error", "tools[0]"),
    ],
)  # fmt: skip
def test_messages_bad_input(live: LiveServer, model: str, body, status, kind, words) -> None:
    """Anthropic's error shape, which its SDK reads; the server keeps serving."""
    request = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    request = {k: v for k, v in {**request, **body}.items() if v is not None}
    r = httpx.post(f"{live.url}/v1/messages", json=request)
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind
    assert words in r.json()["error"]["message"], r.json()
    if "max_tokens" in request:  # the SDK itself refuses to send a message without it
        with pytest.raises(anthropic.APIStatusError) as info:
            claude(live).messages.create(**request)
        assert info.value.status_code == status and words in info.value.message
    ok = claude(live).messages.create(
        model=model, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
    )
    assert ok.usage.output_tokens >= 1
    assert_idle(live)


def test_thinking_settings_for_a_model_that_does_not_think(live: LiveServer, model: str) -> None:
    """Each API's own thinking setting is a hint where the model has no reasoning parser (the
    answer is the one without it); vLLM's explicit thinking_token_budget is refused."""
    hi = [{"role": "user", "content": "hi"}]
    plain = claude(live).messages.create(model=model, max_tokens=4, messages=hi, extra_body=GREEDY)
    hinted = claude(live).messages.create(
        model=model, max_tokens=4, messages=hi, extra_body=GREEDY,
        thinking={"type": "enabled", "budget_tokens": 2},
    )  # fmt: skip
    assert hinted.content[0].text == plain.content[0].text
    assert (
        responses(live)
        .responses.create(model=model, input="hi", max_output_tokens=2, reasoning={"effort": "low"})
        .output
    )
    with pytest.raises(openai.BadRequestError) as info:
        live.client().chat.completions.create(
            model=model, messages=hi, max_tokens=2, extra_body={"thinking_token_budget": 3}
        )
    assert "thinking_token_budget needs a reasoning model" in info.value.message


def test_messages_server_tools_are_ignored_with_a_warning(live: LiveServer, model: str) -> None:
    web = {"type": "web_search_20250305", "name": "web_search"}
    raw = claude(live).messages.with_raw_response.create(
        model=model, max_tokens=3, tools=[web], messages=[{"role": "user", "content": "hi"}]
    )
    assert "web_search_20250305" in raw.headers["warning"] and raw.parse().content


# -------------------------------------------------------------- Responses
def responses(live: LiveServer) -> openai.OpenAI:
    return live.client()


def test_responses_equal_chat_completions(live: LiveServer, model: str) -> None:
    expected, finish, prompt_tokens = chat(
        live,
        model,
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        8,
    )
    out = responses(live).responses.create(
        model=model, instructions=SYSTEM, input=QUESTION, max_output_tokens=8, temperature=0
    )
    assert out.output_text == expected and out.usage.input_tokens == prompt_tokens
    assert out.status == ("incomplete" if finish == "length" else "completed")
    if finish == "length":
        assert out.incomplete_details.reason == "max_output_tokens"
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": SYSTEM}]},
             {"role": "user", "content": QUESTION}]  # fmt: skip
    assert (
        responses(live)
        .responses.create(model=model, input=items, max_output_tokens=8, temperature=0)
        .output_text
        == expected
    )


def test_responses_stream_events(live: LiveServer, model: str) -> None:
    kwargs = {"model": model, "input": QUESTION, "max_output_tokens": 9, "temperature": 0}
    whole = responses(live).responses.create(**kwargs)
    events = list(responses(live).responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_responses_function_calls_and_stored_conversations(
    live: LiveServer, model: str, stream: bool
) -> None:
    """A named function's call, its output sent back with previous_response_id (the stored
    conversation continues), retrieval and deletion."""
    client = responses(live)
    tools = [{"type": "function", "name": "get_weather", "parameters": CITY, "strict": True}]
    kwargs = {"model": model, "input": "Weather?", "tools": tools, "max_output_tokens": 30,
              "tool_choice": {"type": "function", "name": "get_weather"}}  # fmt: skip
    if stream:
        events = list(client.responses.create(**kwargs, stream=True))
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.delta" in kinds
        assert "response.function_call_arguments.done" in kinds
        first = events[-1].response
    else:
        first = client.responses.create(**kwargs)
    [call] = first.output
    assert (
        call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    )
    jsonschema.validate(json.loads(call.arguments), CITY)
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."}
    second = client.responses.create(
        model=model,
        previous_response_id=first.id,
        input=[output],
        max_output_tokens=5,
        temperature=0,
    )
    expected, _, prompt_tokens = chat(
        live,
        model,
        [{"role": "user", "content": "Weather?"},
         {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
          "function": {"name": "get_weather", "arguments": call.arguments}}]},
         {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny."}],
        5,
    )  # fmt: skip
    assert second.output_text == expected and second.usage.input_tokens == prompt_tokens
    assert client.responses.retrieve(second.id).output_text == expected
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=model, previous_response_id=second.id, input="again")
    assert info.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=model, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_responses_text_format_and_hosted_tools(live: LiveServer, model: str) -> None:
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}
    raw = responses(live).responses.with_raw_response.create(
        model=model, input="A city?", text=fmt, max_output_tokens=40,
        tools=[{"type": "web_search"}], include=["reasoning.encrypted_content"],
        reasoning={"effort": "low"}, extra_body={"client_metadata": {"x": 1}},
    )  # fmt: skip
    assert "tools[0] (web_search)" in raw.headers["warning"]
    jsonschema.validate(json.loads(raw.parse().output_text), CITY)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         400, "input[0][0]"),
        ({"model": "gpt-5"}, 404, "model"),
        ({"max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": "x " * 600}, 400, "input"),
        ({"tool_choice": {"type": "web_search_preview"}}, 400, "tool_choice"),
    ],
)  # fmt: skip
def test_responses_bad_input(live: LiveServer, model: str, body, status, param) -> None:
    request = {"model": model, "input": "x", "max_output_tokens": 2, **body}
    r = httpx.post(f"{live.url}/v1/responses", json=request)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert responses(live).responses.create(model=model, input="hi", max_output_tokens=2).output
    assert_idle(live)


def test_agents_sdk_runs_an_agent_with_a_function_tool(live: LiveServer, model: str) -> None:
    """The OpenAI Agents SDK, on the Responses API: the first turn must call the tool (named
    tool_choice), the SDK runs it and sends its output back, and the next turn gives the final
    output, a typed answer (the SDK's text.format: its grammar ends the random model's turn)."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # no traces uploaded anywhere
    calls: list[str] = []

    class Answer(BaseModel):
        city: Literal["Paris", "Rome"]

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}."

    async def run() -> RunResult:
        client = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        agent = Agent(
            name="weather",
            instructions=SYSTEM,
            tools=[get_weather],
            output_type=Answer,
            model=OpenAIResponsesModel(model=model, openai_client=client),
            model_settings=ModelSettings(tool_choice="get_weather", max_tokens=40),
        )
        try:
            return await Runner.run(agent, "Weather in Paris?", max_turns=3)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert len(calls) == 1 and isinstance(result.final_output, Answer)
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]


# ----------------------------------------------------------------- Ollama
def test_ollama_chat_and_generate(live: LiveServer, model: str) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    expected, finish, prompt_tokens = chat(live, model, messages, 8)
    options = {"temperature": 0, "num_predict": 8, "num_ctx": 4096}
    client = ollama_client(live)
    out = client.chat(model=model, messages=messages, options=options, stream=False)
    assert out.message.content == expected and out.message.role == "assistant"
    assert out.done and out.done_reason == ("length" if finish == "length" else "stop")
    assert out.prompt_eval_count == prompt_tokens and out.eval_count >= 1
    parts = list(
        client.chat(model=f"{model}:latest", messages=messages, options=options, stream=True)
    )
    assert "".join(p.message.content for p in parts) == expected
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].eval_count == out.eval_count and parts[-1].total_duration > 0
    generated = client.generate(model=model, prompt=QUESTION, system=SYSTEM, options=options)
    assert generated.response == expected
    raw = client.generate(model=model, prompt="Once upon", raw=True, options=options)
    completion = live.client().completions.create(
        model=model, prompt="Once upon", max_tokens=8, temperature=0
    )
    assert raw.response == completion.choices[0].text
    assert client.generate(model=model).done_reason == "load"


def test_ollama_listing_and_format(live: LiveServer, model: str) -> None:
    client = ollama_client(live)
    [listed] = client.list().models
    assert listed.model == model and listed.details.family == "llama"
    shown = client.show(model)
    assert shown.modelinfo["llama.context_length"] == ENGINE_OPTIONS["max_model_len"]
    assert httpx.get(f"{live.url}/api/version").json()["version"]
    assert client.ps().models[0].context_length == ENGINE_OPTIONS["max_model_len"]
    out = client.chat(
        model=model, messages=[{"role": "user", "content": "A city?"}], format=CITY,
        options={"num_predict": 40}, stream=False,
    )  # fmt: skip
    jsonschema.validate(json.loads(out.message.content), CITY)
    turn = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
             "arguments": {"city": "Rome"}}}]},
            {"role": "tool", "content": "Sunny.", "tool_name": "get_weather"}]  # fmt: skip
    assert client.chat(model=model, messages=turn, options={"num_predict": 2}).message


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("chat", {"model": "llama3"}, 404, "'llama3' does not exist"),
        (
            "chat",
            {"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
            400,
            "images",
        ),
        ("chat", {"options": {"temperature": -1}}, 400, "options.temperature"),
        ("generate", {"template": "{{ .Prompt }}"}, 400, "template"),
    ],
)
def test_ollama_bad_input(live: LiveServer, model: str, path, body, status, words) -> None:
    prompt = {"messages": [{"role": "user", "content": "x"}]} if path == "chat" else {"prompt": "x"}
    request = {"model": model, **prompt, "stream": False, "options": {"num_predict": 2}, **body}
    r = httpx.post(f"{live.url}/api/{path}", json=request)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and words in r.json()["error"]
    with pytest.raises(ollama.ResponseError) as info:
        getattr(ollama_client(live), path)(**{k: v for k, v in request.items() if k != "stream"})
    assert info.value.status_code == status
    assert ollama_client(live).chat(model=model, messages=[{"role": "user", "content": "hi"}],
                                    options={"num_predict": 2}).done  # fmt: skip
    assert_idle(live)


# ------------------------------------------------ what every API shares
@pytest.fixture(scope="module")
def capped(tiny_llama: Path) -> Iterator[LiveServer]:
    """A server with an output cap, another name for the model and a store of two responses."""
    server = start_server(
        tiny_llama,
        {"override_generation_config": {"max_new_tokens": 5}},
        served_model_name=["claude-test", "tiny"],
        response_store=ResponseStore(max_count=2),
    )
    yield server
    server.stop()


def test_output_cap_names_and_store_bound(capped: LiveServer) -> None:
    """The server-wide cap is the default of a request that sets none and bounds one that sets
    more, in every API; the served names are the model's; the third stored response evicts
    the first."""
    client = capped.client()
    assert [m.id for m in client.models.list().data] == ["claude-test"]
    body = {"prompt": "Hello", "extra_body": {"ignore_eos": True}}
    assert (
        client.completions.create(model="tiny", max_tokens=None, **body).usage.completion_tokens
        == 5
    )
    assert (
        client.completions.create(model="tiny", max_tokens=50, **body).usage.completion_tokens <= 5
    )
    with claude(capped).messages.stream(
        model="claude-test", max_tokens=64000, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        assert stream.get_final_message().usage.output_tokens <= 5
    ids = [client.responses.create(model="tiny", input="hi").id for _ in range(3)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[2]).usage.output_tokens <= 5


def test_tokenize_and_detokenize(live: LiveServer, model: str) -> None:
    """vLLM's shapes: a prompt's ids, or a conversation's through the chat template (the ids
    chat completions counts), and back to text."""
    r = httpx.post(f"{live.url}/tokenize", json={"model": model, "prompt": QUESTION}).json()
    assert r["tokens"] == live.model.tokenizer(QUESTION).input_ids and r["count"] == len(
        r["tokens"]
    )
    assert r["max_model_len"] == ENGINE_OPTIONS["max_model_len"] and r["token_strs"] is None
    messages = [{"role": "user", "content": QUESTION}]
    counted = httpx.post(f"{live.url}/tokenize", json={"messages": messages}).json()["count"]
    assert counted == chat(live, model, messages, 1)[2]
    text = httpx.post(f"{live.url}/detokenize", json={"tokens": r["tokens"]}).json()["prompt"]
    assert text == live.model.tokenizer.decode(r["tokens"])
    bad = httpx.post(f"{live.url}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_the_response_store_keeps_its_bounds() -> None:
    """At most max_count responses and max_bytes (a body's JSON and its conversation's text),
    the oldest evicted first; one larger than the whole bound is not kept."""
    from tandem.server.generation.request import Message

    def put(store: ResponseStore, response_id: str, pad: int) -> None:
        store.put({"id": response_id, "pad": "x" * pad}, [Message("user", "y" * pad)])

    store = ResponseStore(max_count=3, max_bytes=850)
    for response_id in "abcd":
        put(store, response_id, 10)
    assert [store.get(i) is not None for i in "abcd"] == [False, True, True, True]
    put(store, "e", 400)  # 819 bytes: b goes for the count, c and d to make room
    assert len(store) == 1 and store.get("e").size == store.num_bytes <= 850
    put(store, "f", 600)  # larger than the bound on its own
    assert store.get("f") is None and store.get("e") is not None
    assert store.delete("e") and not store.delete("e") and store.num_bytes == 0


def test_unknown_field_names_are_remembered_up_to_a_bound(monkeypatch, caplog) -> None:
    """A client inventing names cannot grow the server's memory or its log without end."""
    from tandem.server.generation import fields

    monkeypatch.setattr(fields, "MAX_REPORTED", 3)
    monkeypatch.setattr(fields, "_reported", set())
    with caplog.at_level("INFO", logger="tandem.server"):
        fields.log_ignored("/x", [f"f{i}" for i in range(10)])
        fields.log_ignored("/x", ["f0", "g"])
    logged = [r.getMessage() for r in caplog.records]
    assert [m for m in logged if "ignoring" in m] == [
        f"/x: ignoring the field 'f{i}', which this server does not use" for i in range(3)
    ]
    assert logged[-1] == "3 unknown field names logged: no more will be"
    assert len(fields._reported) == 4
