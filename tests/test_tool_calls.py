"""Tool calls without a model: tools and tool_choice -> plan and constraint, generated text ->
OpenAI's tool_calls, and a stream that says exactly what the whole response says, however the
text is cut into pieces."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tandem.server.frontend.errors import APIError
from tandem.server.generation.tools import (
    NO_PARAMETERS,
    ArrayParser,
    NamedParser,
    TaggedParser,
    assemble,
    plan_tools,
    required_schema,
    tool_finish_reason,
)
from tandem.server.openai.formats import ChatFormat

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Now."}},
]
HERMES = "{% for m in messages %}{{ m.content }}{% endfor %}<tool_call>"


def run(parser, pieces: list[str], finish_reason: str = "stop") -> tuple[str, list, str | None]:
    """(content, tool_calls, finish_reason) of text fed in `pieces`."""
    entries = parser.opening()
    content = ""
    for piece in pieces:
        parsed = parser.feed(piece)
        content += parsed.content
        entries += parsed.calls
    end = parser.finish(finish_reason)
    calls = assemble(entries + end.calls)
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
    return content + end.content, calls, tool_finish_reason(finish_reason, parser.called)


def same_in_every_split(make_parser, text: str, finish_reason: str = "stop"):
    """The whole text at once, one character at a time and split in two anywhere: the same."""
    whole = run(make_parser(), [text], finish_reason)
    assert run(make_parser(), list(text), finish_reason)[0] == whole[0]
    for cut in range(len(text) + 1):
        got = run(make_parser(), [text[:cut], text[cut:]], finish_reason)
        assert (got[0], strip_ids(got[1]), got[2]) == (whole[0], strip_ids(whole[1]), whole[2])
    return whole


def strip_ids(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


# ------------------------------------------------------------- requests
def test_plan_defaults_and_choices() -> None:
    assert plan_tools(None, None, None, HERMES) is None
    assert plan_tools([], "none", None, HERMES) is None
    assert plan_tools(TOOLS, "none", None, HERMES) is None
    auto = plan_tools(TOOLS, None, None, HERMES)
    assert auto.choice == "auto" and auto.syntax and auto.parses and auto.constraint() is None
    assert auto.template_tools == TOOLS
    plain = plan_tools(TOOLS, "auto", None, "{{ messages }}")
    assert not plain.syntax and not plain.parses
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None, None)
    assert named.choice == "named" and named.name == "get_time"
    assert json.loads(named.constraint().json) == NO_PARAMETERS  # no parameters: `{}`
    required = plan_tools(TOOLS, "required", False, None)
    assert json.loads(required.constraint().json) == required_schema(required.functions, True)


def test_required_schema_is_an_array_of_calls() -> None:
    plan = plan_tools(TOOLS, "required", None, None)
    schema = required_schema(plan.functions)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}], schema)
    jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, schema)
    bad = [
        [],
        [{"name": "get_time", "parameters": {"x": 1}}],
        [{"name": "nope", "parameters": {}}],
        [{"name": "get_weather", "parameters": {}}],
    ]
    for instance in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(instance, schema)
    single = required_schema(plan.functions, single=True)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, single)


def test_required_schema_keeps_each_tools_references() -> None:
    """pydantic writes nested models as `$defs` referenced from the tool's root, which is no
    longer the root once the tool sits inside the array's schema."""
    point = {
        "type": "object",
        "properties": {"at": {"$ref": "#/$defs/Point"}},
        "required": ["at"],
        "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}},
                            "required": ["x"]}},
    }  # fmt: skip
    tools = [TOOLS[1], {"type": "function", "function": {"name": "go", "parameters": point}}]
    schema = required_schema(plan_tools(tools, "required", None, None).functions)
    assert point["properties"]["at"] == {"$ref": "#/$defs/Point"}  # the tool's own: unchanged
    jsonschema.validate([{"name": "go", "parameters": {"at": {"x": 1}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "go", "parameters": {"at": {"x": "1"}}}], schema)


@pytest.mark.parametrize(
    ("tools", "choice", "parallel", "param", "words"),
    [
        (["x"], None, None, "tools", "tools[0] must be an object"),
        ([{"type": "function"}], None, None, "tools", "tools[0].function is required"),
        ([{"type": "code_interpreter"}], None, None, "tools", '"type": "function"'),
        ([{"type": "function", "function": {}}], None, None, "tools", "function.name"),
        ([{"type": "function", "function": {"name": ""}}], None, None, "tools", "name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            None,
            None,
            "tools",
            "tools[0].function.parameters",
        ),
        ([TOOLS[0], TOOLS[0]], None, None, "tools", "tools[1].function.name"),
        (TOOLS, "sometimes", None, "tool_choice", "sometimes"),
        (None, "required", None, "tool_choice", "needs tools"),
        (TOOLS, {"type": "function", "function": {"name": "x"}}, None, "tool_choice", "'x'"),
        (TOOLS, {"type": "function"}, None, "tool_choice", "tool_choice must be"),
        (TOOLS, "auto", False, "parallel_tool_calls", "parallel_tool_calls"),
    ],
)
def test_bad_tools_name_the_problem(tools, choice, parallel, param, words) -> None:
    with pytest.raises(APIError) as info:
        plan_tools(tools, choice, parallel, HERMES)
    assert info.value.status == 400 and info.value.param == param
    assert words in info.value.message


def test_unknown_tool_fields_are_ignored_and_logged_once(caplog) -> None:
    """A field the server does not know, in a tool or its function, changes nothing and is
    logged the first time it is seen."""
    odd = [{"type": "function", "cache_control": {}, "function": {"name": "f", "oops_x": 1}}]
    with caplog.at_level("INFO", logger="tandem.server"):
        for _ in range(2):
            plan = plan_tools(odd, None, None, HERMES)
            assert [f.name for f in plan.functions] == ["f"]
    logged = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert len([m for m in logged if "'tools.function.oops_x'" in m]) == 1, logged
    assert len([m for m in logged if "'tools.cache_control'" in m]) == 1, logged


# ---------------------------------------------------------------- named
def test_named_function_streams_its_arguments() -> None:
    content, calls, reason = run(NamedParser("get_weather"), ['{"city"', ': "Oslo"', "}"])
    assert content == "" and reason == "tool_calls"
    assert strip_ids(calls) == [("get_weather", '{"city": "Oslo"}')]
    # Cut by max_tokens: the partial arguments, finish_reason "length" (OpenAI's shape).
    _, calls, reason = run(NamedParser("get_weather"), ['{"ci'], "length")
    assert strip_ids(calls) == [("get_weather", '{"ci')] and reason == "length"


# ------------------------------------------------------------- required
def test_required_array_of_calls() -> None:
    text = (
        '[{"name": "get_weather", "parameters": {"city": "a]}\\"{"}}, '
        '{"name": "get_time", "parameters": {}}]'
    )
    content, calls, reason = same_in_every_split(ArrayParser, text)
    assert content == "" and reason == "tool_calls"
    assert strip_ids(calls) == [
        ("get_weather", json.dumps({"city": 'a]}"{'})),
        ("get_time", "{}"),
    ]
    assert [c["id"] for c in calls] != [calls[0]["id"]] * 2


def test_required_cut_by_max_tokens() -> None:
    done = '[{"name": "get_time", "parameters": {}}, '
    cut = done + '{"name": "get_weather", "parameters": {"city": "Os'
    _, calls, reason = same_in_every_split(ArrayParser, cut, "length")
    assert reason == "length"
    assert strip_ids(calls) == [("get_time", "{}"), ("get_weather", '{"city": "Os')]
    # Cut before the name is whole: that element is text, the calls before it stay calls.
    content, calls, _ = same_in_every_split(ArrayParser, done + '{"name": "get_w', "length")
    assert strip_ids(calls) == [("get_time", "{}")] and content == '{"name": "get_w'
    assert run(ArrayParser(), ["[ "], "length")[:2] == ("", [])


def test_required_text_that_is_not_calls_is_content() -> None:
    """An unconstrained model's text: content from where it leaves the array's shape."""
    assert run(ArrayParser(), ["Hello [world]"]) == ("Hello [world]", [], "stop")
    content, calls, reason = same_in_every_split(
        ArrayParser, '[{"name": "get_time", "parameters": {}}] and more'
    )
    assert content == "] and more" and strip_ids(calls) == [("get_time", "{}")]
    assert reason == "tool_calls"
    content, calls, reason = run(ArrayParser(), ['[{"name": 3, "parameters": {}}]'])
    assert content == '[{"name": 3, "parameters": {}}]' and calls == [] and reason == "stop"


# ----------------------------------------------------------------- auto
def test_tagged_calls_among_text() -> None:
    text = (
        "Let me look.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> Done <tool'
    )
    content, calls, reason = same_in_every_split(TaggedParser, text)
    assert content == "Let me look.\n\n Done <tool"
    assert strip_ids(calls) == [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
    assert reason == "tool_calls"


def test_tagged_text_is_held_back_only_where_a_tag_may_begin() -> None:
    parser = TaggedParser()
    assert parser.feed("Hi <").content == "Hi "
    assert parser.feed("tool").content == ""
    assert parser.feed("bar> x").content == "<toolbar> x"
    assert parser.feed("<tool_call>{").content == ""
    assert parser.finish("length").content == "<tool_call>{"  # never closed: text


def test_tagged_blocks_that_are_not_calls_stay_text() -> None:
    text = "<tool_call>not json</tool_call><tool_call>[1]</tool_call>"
    assert same_in_every_split(TaggedParser, text) == (text, [], "stop")


def test_tagged_blank_content_is_none() -> None:
    text = '\n\n<tool_call>{"name": "get_time", "parameters": {}}</tool_call>\n'
    content, calls, reason = same_in_every_split(TaggedParser, text)
    assert content == "" and strip_ids(calls) == [("get_time", "{}")]
    content, _, _ = same_in_every_split(TaggedParser, "  \n")
    assert content == ""


# ------------------------------------------------------------- responses
@pytest.mark.parametrize(
    ("choice", "text", "reason"),
    [
        ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Rome"}', "stop"),
        ("required", '[{"name": "get_time", "parameters": {}}]', "stop"),
        ("required", '[{"name": "get_time", "para', "length"),
        ("auto", 'Hm. <tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "stop"),
        ("auto", "Just text.", "stop"),
    ],
)
def test_stream_says_what_the_whole_response_says(choice, text: str, reason: str) -> None:
    plan = plan_tools(TOOLS, choice, None, HERMES)
    whole = ChatFormat("id", "m", tools=plan).full([text], [reason], {})["choices"][0]
    fmt = ChatFormat("id", "m", tools=plan)
    chunks = fmt.opening_chunks()
    for piece in (text[i : i + 3] for i in range(0, len(text), 3)):
        chunks.append(fmt.delta_chunk(piece))
    chunks.append(fmt.closing_chunk(reason))
    deltas = [c["choices"][0]["delta"] for c in chunks if c is not None]
    content = "".join(d.get("content") or "" for d in deltas)
    streamed = assemble([entry for d in deltas for entry in d.get("tool_calls", [])])
    message = whole["message"]
    assert content == (message["content"] or "")
    assert strip_ids(streamed) == strip_ids(message.get("tool_calls", []))
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]
    if message.get("tool_calls"):
        assert whole["finish_reason"] == ("length" if reason == "length" else "tool_calls")
        assert (message["content"] is None) == (choice != "auto")
    else:
        assert message["content"] == text and whole["finish_reason"] == reason
