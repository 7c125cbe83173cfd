"""Structured outputs and tool calls through the server, with the official `openai` client,
streamed and not. The test model is random: only the grammar keeps its output valid, so every
output is checked against its constraint (jsonschema, json.loads, re.fullmatch, the choices).

Strings are bounded by `pattern`, not `maxLength`: xgrammar 0.2.9 compiles a length-bounded
string to a character class that admits raw control characters, which is not JSON
(mlc-ai/xgrammar#800), and a random model finds them."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Annotated, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from test_server import LiveServer, assert_idle, server_fixtures

live, offline, model = server_fixtures("module")

MESSAGES = [{"role": "user", "content": "Describe a colour."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
        "colour": {"enum": ["red", "green", "blue"]},
        "bright": {"type": "boolean"},
        "code": {"type": "string", "pattern": "^[0-9]{3}$"},
    },
    "required": ["name", "colour", "bright", "code"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe"]
GRAMMAR = 'root ::= "The answer is " ("red" | "green" | "blue") "."'
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time.", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
# A Hermes-style template (Qwen's syntax) small enough for the test server's 256 positions.
HERMES_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|im_start|>system\nTools:"
    "{% for t in tools %} {{ t.function.name }}{% endfor %}. Call one as "
    '<tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def check(kind: str, text: str) -> None:
    """`text` is a complete output of the constraint `kind`."""
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(r"The answer is (red|green|blue)\.", text), text


SPECS = {"json": SCHEMA, "regex": REGEX, "choice": CHOICES, "grammar": GRAMMAR}


def create(live: LiveServer, endpoint: str, **kwargs):
    client = live.client()
    if endpoint == "chat":
        return client.chat.completions.create(messages=MESSAGES, **kwargs)
    return client.completions.create(prompt="Describe a colour:", **kwargs)


def texts_and_reasons(endpoint: str, out, stream: bool) -> tuple[dict, dict]:
    """Every choice's text and finish reason, by index, from a response or a stream."""
    if not stream:
        pick = (lambda c: c.message.content) if endpoint == "chat" else (lambda c: c.text)
        return {c.index: pick(c) for c in out.choices}, {
            c.index: c.finish_reason for c in out.choices
        }
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in out:
        for c in chunk.choices:
            piece = (c.delta.content or "") if endpoint == "chat" else c.text
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return texts, reasons


def streamed_chat(live: LiveServer, **kwargs) -> dict[int, dict]:
    """Per choice of a streamed chat: content, tool calls (assembled), finish reason."""
    out: dict[int, dict] = {}
    for chunk in live.client().chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            choice = out.setdefault(c.index, {"content": "", "calls": {}, "reason": None})
            choice["content"] += c.delta.content or ""
            for entry in c.delta.tool_calls or []:
                call = choice["calls"].get(entry.index)
                if call is None:  # a call's first entry names it
                    assert entry.id.startswith("call_") and entry.type == "function"
                    call = choice["calls"][entry.index] = {"name": entry.function.name}
                    call["arguments"] = ""
                else:
                    assert entry.id is None and entry.function.name is None
                call["arguments"] += entry.function.arguments or ""
            if c.finish_reason:
                choice["reason"] = c.finish_reason
    for choice in out.values():
        choice["calls"] = [choice["calls"][i] for i in sorted(choice["calls"])]
    return out


def whole_calls(message) -> list[dict]:
    calls = message.tool_calls or []
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
    assert len({c.id for c in calls}) == len(calls)
    return [{"name": c.function.name, "arguments": c.function.arguments} for c in calls]


def check_calls(calls: list[dict], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call["name"] in names
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.fixture
def hermes_template(live: LiveServer) -> Iterator[None]:
    """The front end's tokenizer speaks Hermes' tool-call syntax for the test (the core never
    renders templates)."""
    tokenizer = live.model.tokenizer
    template, tokenizer.chat_template = tokenizer.chat_template, HERMES_TEMPLATE
    try:
        yield
    finally:
        tokenizer.chat_template = template


# ------------------------------------------------------ structured outputs
@pytest.mark.parametrize(("endpoint", "stream"), [("chat", False), ("chat", True),
                                                 ("completions", False)])  # fmt: skip
def test_response_format_json_schema(
    live: LiveServer, model: str, endpoint: str, stream: bool
) -> None:
    """Chat's response_format, which /v1/completions takes too (as vLLM's does)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "colour", "schema": SCHEMA}}
    out = create(
        live, endpoint, model=model, n=3, temperature=1.0, seed=5, max_tokens=80, stream=stream,
        **({"response_format": fmt} if endpoint == "chat" else {"extra_body": {"response_format": fmt}}),
    )  # fmt: skip
    texts, reasons = texts_and_reasons(endpoint, out, stream)
    assert sorted(texts) == [0, 1, 2] and set(reasons.values()) == {"stop"}
    for text in texts.values():
        check("json", text)
    assert_idle(live)


class Colour(BaseModel):
    name: Annotated[str, Field(pattern="^[a-z ]{1,8}$")]
    colour: Literal["red", "green", "blue"]
    bright: bool


def test_client_parse_helper(live: LiveServer, model: str) -> None:
    """The official client's structured outputs: a pydantic model in, a parsed instance out."""
    out = live.client().chat.completions.parse(
        model=model, messages=MESSAGES, response_format=Colour, max_tokens=60, seed=1
    )
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Colour) and out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_object(live: LiveServer, model: str, stream: bool) -> None:
    """Any JSON object. '"' and "}" are favoured so that the random model closes its strings
    and objects in time (the grammar still decides where they may go: the bias alone would
    start with "}")."""
    ids = live.model.tokenizer.convert_tokens_to_ids(['"', "}"])
    out = create(
        live, "chat", model=model, response_format={"type": "json_object"}, temperature=1.0,
        seed=3, n=2, max_tokens=120, logit_bias={str(i): 4 for i in ids}, stream=stream,
    )  # fmt: skip
    texts, reasons = texts_and_reasons("chat", out, stream)
    assert reasons == {0: "stop", 1: "stop"}
    for text in texts.values():
        check("json_object", text)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("kind", sorted(SPECS))
def test_structured_outputs_extra_body(
    live: LiveServer, model: str, endpoint: str, kind: str
) -> None:
    """vLLM's structured_outputs, on both endpoints, streamed and not, seeded samples."""
    body = {"structured_outputs": {kind: SPECS[kind]}}
    for stream in (False, True):
        out = create(
            live, endpoint, model=model, max_tokens=80, n=2, temperature=1.0, seed=2,
            stream=stream, extra_body=body,
        )  # fmt: skip
        texts, reasons = texts_and_reasons(endpoint, out, stream)
        assert sorted(texts) == [0, 1] and set(reasons.values()) == {"stop"}, reasons
        for text in texts.values():
            check(kind, text)


def test_schema_as_text_and_a_text_response_format(live: LiveServer, model: str) -> None:
    """A schema may come as JSON text; response_format "text" constrains nothing, so it goes
    with structured_outputs."""
    out = create(
        live, "chat", model=model, max_tokens=80, seed=7, response_format={"type": "text"},
        extra_body={"structured_outputs": {"json": json.dumps(SCHEMA)}},
    )  # fmt: skip
    assert out.choices[0].finish_reason == "stop"
    check("json", out.choices[0].message.content)


@pytest.mark.parametrize("stream", [False, True])
def test_grammar_cut_by_max_tokens(live: LiveServer, model: str, stream: bool) -> None:
    """A grammar that cannot end within max_tokens ends with "length" and the partial text."""
    out = create(
        live, "completions", model=model, max_tokens=4, temperature=0, stream=stream,
        extra_body={"structured_outputs": {"regex": "(ab){40}"}},
    )  # fmt: skip
    texts, reasons = texts_and_reasons("completions", out, stream)
    assert reasons == {0: "length"}
    assert texts[0] and ("ab" * 40).startswith(texts[0])
    assert_idle(live)


# ------------------------------------------------------------- tool calls
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_named_function(live: LiveServer, model: str) -> None:
    kwargs = {"model": model, "messages": MESSAGES, "tools": TOOLS, "tool_choice": NAMED,
              "max_tokens": 80, "temperature": 0}  # fmt: skip
    out = live.client().chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    calls = whole_calls(choice.message)
    check_calls(calls, {"get_weather"})
    assert len(calls) == 1
    streamed = streamed_chat(live, **kwargs)[0]
    assert streamed["content"] == "" and streamed["reason"] == "tool_calls"
    assert streamed["calls"] == calls  # greedy: the same arguments, streamed piece by piece


def test_named_function_cut_by_max_tokens(live: LiveServer, model: str) -> None:
    kwargs = {"model": model, "messages": MESSAGES, "tools": TOOLS, "tool_choice": NAMED,
              "max_tokens": 3, "temperature": 0}  # fmt: skip
    choice = live.client().chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "length"
    (call,) = whole_calls(choice.message)
    assert call["name"] == "get_weather" and '{"city": "'.startswith(call["arguments"])
    streamed = streamed_chat(live, **kwargs)[0]
    assert streamed["reason"] == "length" and streamed["calls"] == [call]


@pytest.mark.parametrize("parallel", [None, False])
def test_required(live: LiveServer, model: str, parallel: bool | None) -> None:
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    kwargs = {"model": model, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
              "max_tokens": 150, "temperature": 1.0, "seed": 4, "n": 2, **extra}  # fmt: skip
    out = live.client().chat.completions.create(**kwargs)
    streamed = streamed_chat(live, **kwargs)
    for choice in out.choices:
        assert choice.message.content is None and choice.finish_reason == "tool_calls"
        calls = whole_calls(choice.message)
        check_calls(calls, set(SCHEMAS))
        if parallel is False:
            assert len(calls) == 1
        # Seeded: the stream samples the same calls; each came out once complete.
        assert streamed[choice.index]["calls"] == calls
        assert streamed[choice.index]["reason"] == "tool_calls"
        assert streamed[choice.index]["content"] == ""


class Point(BaseModel):
    x: Literal[1, 2, 3]
    y: Literal[1, 2, 3]


class Move(BaseModel):
    to: Point
    fast: bool


def test_pydantic_tools_with_references(live: LiveServer, model: str) -> None:
    """The client's pydantic_function_tool writes nested models as `$defs`: they still resolve
    once the tool's schema sits inside "required"'s array."""
    tools = [TOOLS[1], openai.pydantic_function_tool(Move)]
    out = live.client().chat.completions.create(
        model=model, messages=MESSAGES, tools=tools, tool_choice="required",
        parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=1, n=8,
    )  # fmt: skip
    names = set()
    for choice in out.choices:
        (call,) = whole_calls(choice.message)
        names.add(call["name"])
        if call["name"] == "Move":
            Move.model_validate_json(call["arguments"])
        else:
            check_calls([call], {"get_time"})
    assert "Move" in names


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_plain_text_without_a_tool_call_syntax(live: LiveServer, model: str, choice: str) -> None:
    """The built-in template has no tool-call syntax: "auto" answers in plain text, as "none"."""
    kwargs = {"model": model, "messages": MESSAGES, "max_tokens": 8, "temperature": 0,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    plain = live.client().chat.completions.create(**kwargs).choices[0]
    out = live.client().chat.completions.create(**kwargs, tools=TOOLS, tool_choice=choice)
    assert out.choices[0].message.content == plain.message.content
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "length"


HERMES_CALL = (
    r'Sure\. <tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'
)


def test_auto_parses_hermes_tool_calls(live: LiveServer, model: str, hermes_template) -> None:
    """A template with `<tool_call>`: "auto" reads the calls out of the text (forced here by a
    regex, as the random model would never write one), streamed and not; "none" renders no
    tools and reads nothing."""
    kwargs = {"model": model, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 100,
              "temperature": 0, "extra_body": {"structured_outputs": {"regex": HERMES_CALL}}}  # fmt: skip
    out = live.client().chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.message.content == "Sure. " and choice.finish_reason == "tool_calls"
    calls = whole_calls(choice.message)
    assert [c["name"] for c in calls] == ["get_time"]
    check_calls(calls, {"get_time"})
    streamed = streamed_chat(live, **kwargs)[0]
    assert streamed == {"content": "Sure. ", "calls": calls, "reason": "tool_calls"}

    none = live.client().chat.completions.create(**kwargs, tool_choice="none")
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "stop"
    assert re.fullmatch(HERMES_CALL, none.choices[0].message.content)
    assert none.usage.prompt_tokens < out.usage.prompt_tokens  # the tools are not rendered


def test_tool_messages_reach_the_template(live: LiveServer, model: str, hermes_template) -> None:
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    out = live.client().chat.completions.create(
        model=model, messages=messages, tools=TOOLS, max_tokens=2, temperature=0
    )
    tokenizer = live.model.tokenizer
    rendered = tokenizer.apply_chat_template(
        [
            MESSAGES[0],
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "get_time", "arguments": {"zone": "UTC"}}}],
            },
            {"role": "tool", "content": "12:00"},
        ],
        tools=TOOLS,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>' in rendered
    ids = tokenizer(rendered, add_special_tokens=False).input_ids
    assert out.usage.prompt_tokens == len(ids)


def test_a_tool_call_goes_back_into_the_conversation(live: LiveServer, model: str) -> None:
    """The agent loop: a response's message, then the tool's answer, as the next request."""
    client = live.client()
    first = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=80
    )
    message = first.choices[0].message
    answer = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "Sunny."}
    second = client.chat.completions.create(
        model=model, messages=[*MESSAGES, message, answer], tools=TOOLS, max_tokens=3
    )
    assert second.choices[0].message.tool_calls is None  # "auto" without a tool-call syntax
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


# -------------------------------------------------------------- bad input
def tool(name: str, parameters: object) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


BAD_SCHEMA = {"type": "object", "properties": {"x": {"type": "nonsense"}}}


@pytest.mark.parametrize(
    ("path", "extra", "param", "words"),
    [
        ("completions", {"structured_outputs": {"regex": "("}}, "structured_outputs",
         "structured_outputs.regex is invalid: "),
        ("completions", {"structured_outputs": {"grammar": "root ::= nothing"}},
         "structured_outputs", "structured_outputs.grammar is invalid: "),
        ("completions", {"structured_outputs": {"json": BAD_SCHEMA}}, "structured_outputs",
         'structured_outputs.json is invalid: Unsupported type "nonsense"'),
        ("completions", {"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ("completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}},
         "structured_outputs", "got regex, choice"),
        ("completions", {"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
        ("completions", {"structured_outputs": {"regex": "a", "nope": 1}},
         "structured_outputs.nope", "unsupported parameter"),
        ("chat/completions", {"response_format": {"type": "json_schema",
          "json_schema": {"name": "x", "schema": BAD_SCHEMA}}}, "response_format",
         'response_format.json_schema.schema is invalid: Unsupported type "nonsense"'),
        ("chat/completions", {"response_format": {"type": "json_schema"}}, "response_format",
         "json_schema is required"),
        ("chat/completions", {"response_format": {"type": "xml"}}, "response_format.type",
         "response_format.type"),
        ("chat/completions", {"response_format": {"type": "json_object"},
          "structured_outputs": {"regex": "a"}}, "structured_outputs",
         "response_format and structured_outputs"),
        ("chat/completions", {"tools": [tool("f", BAD_SCHEMA)]}, "tools",
         'tools[0].function.parameters is invalid: Unsupported type "nonsense"'),
        ("chat/completions", {"tools": [tool("f", {}), tool("g", BAD_SCHEMA)],
          "tool_choice": "required"}, "tools", "tools[1].function.parameters is invalid"),
        ("chat/completions", {"tools": [{"type": "function", "function": {"parameters": {}}}]},
         "tools", "tools[0].function.name is required"),
        ("chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function",
          "function": {"name": "nope"}}}, "tool_choice", "'nope', which is not among"),
        ("chat/completions", {"tool_choice": "required"}, "tool_choice", "needs tools"),
        ("chat/completions", {"tools": TOOLS, "tool_choice": NAMED,
          "response_format": {"type": "json_object"}}, "tool_choice", "response_format"),
        ("chat/completions", {"tools": TOOLS, "parallel_tool_calls": False},
         "parallel_tool_calls", "parallel_tool_calls=false"),
        ("chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0]",
         "tool_call_id is required"),
        ("chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages[0]",
         "content is required"),
    ],
)  # fmt: skip
def test_bad_input(live: LiveServer, model: str, path: str, extra: dict, param, words) -> None:
    body = {"model": model, "max_tokens": 4, **extra}
    if path == "completions":
        body.setdefault("prompt", "x")
    else:
        body.setdefault("messages", MESSAGES)
    r = httpx.post(f"{live.url}/v1/{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_bad_grammar_through_the_client(live: LiveServer, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        live.client().chat.completions.create(
            model=model, messages=MESSAGES, extra_body={"structured_outputs": {"regex": "[a-"}}
        )
    assert "structured_outputs.regex is invalid" in info.value.body["message"]
    assert_idle(live)  # nothing was queued
