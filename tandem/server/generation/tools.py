"""Tool calls on /v1/chat/completions: a request's `tools` and `tool_choice` become the output's
constraint and the chat template's tools, and the generated text becomes OpenAI's `tool_calls`.

The grammar does the work where it can, so nothing is left to the model's luck:
- a named function: the output is constrained to its `parameters` schema, so the text *is* the
  arguments (streamed as generated);
- `"required"`: the output is constrained to a JSON array of `{"name", "parameters"}` objects,
  one schema per tool (vLLM's shape); each call is streamed once its object is complete;
- `"auto"`: unconstrained; if the chat template speaks Hermes' syntax (`<tool_call>{"name": ...,
  "arguments": ...}</tool_call>`, what templates mentioning `<tool_call>` use), those blocks are
  parsed out, each streamed once closed; the text outside them is the content, held back only
  where a `<tool_call>` may be starting (as stop strings are). Other templates: plain content.

Every parser is incremental, and a whole response is the same parser fed the whole text, so a
stream and a plain response always agree. Text that is not a parsed call is content: an
`"auto"` block whose JSON does not parse, or one cut off, is returned as text. A call cut off by
max_tokens is returned as it stands (named, or `"required"` once its name is complete: partial
arguments), with finish_reason "length", as OpenAI does; complete calls finish "tool_calls".
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.request import StructuredOutputsParams
from tandem.server.frontend.errors import bad_request
from tandem.server.generation.fields import log_ignored

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# A function that declares no parameters takes none (OpenAI): its arguments are `{}`.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
# A "required" element cut off after its name: the name, and the parameters' text so far.
_PARTIAL_CALL = re.compile(
    r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")(?:\s*,\s*"parameters"\s*:\s*(.*)|.*)', re.DOTALL
)


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict[str, Any]  # a JSON schema


@dataclass
class Parsed:
    """What some text means: content and tool-call entries (in OpenAI's streamed shape), in the
    order the text gave them (APIs whose answers are a list of blocks keep that order)."""

    pieces: list[str | dict[str, Any]] = field(default_factory=list)

    @classmethod
    def of_text(cls, text: str) -> Parsed:
        return cls([text] if text else [])

    @classmethod
    def of_call(cls, entry: dict[str, Any]) -> Parsed:
        return cls([entry])

    @property
    def content(self) -> str:
        return "".join(p for p in self.pieces if isinstance(p, str))

    @property
    def calls(self) -> list[dict[str, Any]]:
        return [p for p in self.pieces if not isinstance(p, str)]

    def add_text(self, text: str) -> None:
        if text:
            self.pieces.append(text)

    def add_call(self, entry: dict[str, Any]) -> None:
        self.pieces.append(entry)

    def __add__(self, other: Parsed) -> Parsed:
        return Parsed(self.pieces + other.pieces)


class ToolCallParser(Protocol):
    called: bool  # at least one call came out

    def opening(self) -> list[dict[str, Any]]: ...
    def feed(self, text: str) -> Parsed: ...
    def finish(self, finish_reason: str | None) -> Parsed: ...


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools, resolved: what the template gets, what the output must match, and how
    the text is read back."""

    functions: list[Function]
    template_tools: list[dict[str, Any]]  # as the client sent them
    choice: str  # "auto", "required" or "named"
    name: str | None = None  # the named function
    single: bool = False  # parallel_tool_calls false: at most one call
    syntax: bool = False  # "auto": the template's <tool_call> blocks are parsed

    @property
    def parses(self) -> bool:
        """Whether the output is read for tool calls at all."""
        return self.choice != "auto" or self.syntax

    def constraint(self) -> StructuredOutputsParams | None:
        if self.choice == "named":
            return StructuredOutputsParams(json=self.function(self.name).parameters)
        if self.choice == "required":
            return StructuredOutputsParams(json=required_schema(self.functions, self.single))
        return None

    def function(self, name: str | None) -> Function:
        return next(f for f in self.functions if f.name == name)

    def parser(self) -> ToolCallParser:
        if self.choice == "named":
            assert self.name is not None
            return NamedParser(self.name)
        if self.choice == "required":
            return ArrayParser()
        return TaggedParser()


def required_schema(functions: list[Function], single: bool = False) -> dict[str, Any]:
    """A JSON array of one or more calls, each `{"name": <a tool>, "parameters": <its schema>}`.
    A tool's own references (`#/$defs/...`, as pydantic writes them) are rebased to where its
    schema now sits."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [f.name]},
                "parameters": _rebased(f.parameters, f"#/items/anyOf/{i}/properties/parameters"),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for i, f in enumerate(functions)
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if single:
        schema["maxItems"] = 1
    return schema


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with every local `$ref` ("#...") pointing below `base`."""
    if isinstance(schema, list):
        return [_rebased(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    return {
        key: base + value[1:]
        if key == "$ref" and isinstance(value, str) and value.startswith("#")
        else _rebased(value, base)
        for key, value in schema.items()
    }


def plan_tools(
    tools: list[Any] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    chat_template: Any,
) -> ToolPlan | None:
    """The request's plan, or None when no tool may be called (no tools, or tool_choice "none").
    Raises APIError (400) naming the tool or the tool_choice at fault."""
    functions = _functions(tools or [])
    choice, name = _choice(tool_choice, functions)
    if parallel_tool_calls is False and choice == "auto":
        raise bad_request(
            'parallel_tool_calls=false is only supported with tool_choice "required" or a '
            "named function",
            param="parallel_tool_calls",
        )
    if choice == "none":
        return None
    return ToolPlan(
        functions,
        list(tools or []),
        choice,
        name,
        single=parallel_tool_calls is False,
        syntax=TOOL_CALL_START in str(chat_template or ""),
    )


def _functions(tools: list[Any]) -> list[Function]:
    functions = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f'{where} must be an object with "type": "function"', "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{where}.function is required and must be an object", "tools")
        unknown = [f"tools.{name}" for name in sorted(set(tool) - {"type", "function"})]
        known = {"name", "description", "parameters", "strict"}
        log_ignored("tools", unknown + [f"tools.function.{n}" for n in sorted(set(fn) - known)])
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{where}.function.name is required (a non-empty string)", "tools")
        if any(f.name == name for f in functions):
            raise bad_request(f"{where}.function.name {name!r} names an earlier tool too", "tools")
        if not isinstance(fn.get("description", ""), str):
            raise bad_request(f"{where}.function.description must be a string", "tools")
        if not isinstance(fn.get("strict", False), bool):
            raise bad_request(f"{where}.function.strict must be a boolean", "tools")
        parameters = fn.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(f"{where}.function.parameters must be a JSON schema object", "tools")
        functions.append(Function(name, parameters or NO_PARAMETERS))
    return functions


def _choice(
    tool_choice: str | dict[str, Any] | None, functions: list[Function]
) -> tuple[str, str | None]:
    """(choice, name): OpenAI's default is "auto" with tools, "none" without."""
    if tool_choice is None:
        return ("auto" if functions else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise bad_request(
                f'tool_choice must be "none", "auto", "required" or a named function, got '
                f"{tool_choice!r}",
                "tool_choice",
            )
        if tool_choice != "none" and not functions:
            raise bad_request(f'tool_choice "{tool_choice}" needs tools', "tool_choice")
        return tool_choice, None
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str) or len(tool_choice) != 2:
        raise bad_request(
            'tool_choice must be {"type": "function", "function": {"name": ...}}', "tool_choice"
        )
    if all(f.name != name for f in functions):
        known = ", ".join(repr(f.name) for f in functions) or "none"
        raise bad_request(
            f"tool_choice names the function {name!r}, which is not among the tools ({known})",
            "tool_choice",
        )
    return "named", name


def tool_finish_reason(finish_reason: str | None, called: bool) -> str | None:
    """A choice that ended by itself after calling tools finished with "tool_calls"."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def call_entry(index: int, name: str, arguments: str) -> dict[str, Any]:
    """A tool call as the first (or only) streamed entry of its index."""
    return {
        "index": index,
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def assemble(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Streamed entries -> whole tool calls (a message's `tool_calls`), by index."""
    calls: dict[int, dict[str, Any]] = {}
    for entry in entries:
        call = calls.get(entry["index"])
        if call is None:
            calls[entry["index"]] = {
                "id": entry["id"],
                "type": "function",
                "function": dict(entry["function"]),
            }
        else:
            call["function"]["arguments"] += entry["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


class NamedParser:
    """The output is the named function's arguments: the call opens the stream, the text
    streams as its arguments."""

    def __init__(self, name: str):
        self.name = name
        self.called = True

    def opening(self) -> list[dict[str, Any]]:
        return [call_entry(0, self.name, "")]

    def feed(self, text: str) -> Parsed:
        return Parsed([{"index": 0, "function": {"arguments": text}}] if text else [])

    def finish(self, finish_reason: str | None) -> Parsed:
        return Parsed()


class ArrayParser:
    """`[{"name": ..., "parameters": {...}}, ...]`, one call out per complete element. Text that
    does not follow that shape (an unconstrained model's) is content from where it departs."""

    def __init__(self) -> None:
        self.text = ""
        self.scanned = 0  # characters of `text` looked at
        self.consumed = 0  # characters of `text` accounted for (calls, structure, content)
        self.state = "start"  # start, items, element, end, content
        self.element = 0  # where the current element starts
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.called = False
        self.num_calls = 0

    def opening(self) -> list[dict[str, Any]]:
        return []

    def feed(self, text: str) -> Parsed:
        self.text += text
        out = Parsed()
        while self.scanned < len(self.text) and self.state != "content":
            self._step(self.text[self.scanned], out)
            self.scanned += 1
        if self.state == "content":
            out.add_text(self.text[self.consumed :])
            self.consumed = self.scanned = len(self.text)
        return out

    def finish(self, finish_reason: str | None) -> Parsed:
        self.consumed = len(self.text)
        if self.state != "element":
            return Parsed()  # structure only ("[", ",", "]", blanks); content was given out
        element = self.text[self.element :]
        partial = _PARTIAL_CALL.fullmatch(element)
        name = _json_string(partial[1]) if partial is not None else None
        if name is None:
            return Parsed.of_text(element)
        self.called = True
        return Parsed.of_call(call_entry(self.num_calls, name, partial[2] or ""))

    def _step(self, char: str, out: Parsed) -> None:
        if self.state == "element":
            self._in_element(char, out)
        elif char.isspace():
            pass
        elif self.state == "start" and char == "[":
            self.state = "items"
        elif self.state == "items" and char == "{":
            self.state, self.element, self.depth = "element", self.scanned, 1
        elif self.state == "items" and char in ",]":
            if char == "]":
                self.state = "end"
        else:
            self.state = "content"

    def _in_element(self, char: str, out: Parsed) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
            return
        if char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            if self.depth == 0:
                self._element_done(out)

    def _element_done(self, out: Parsed) -> None:
        try:
            value = json.loads(self.text[self.element : self.scanned + 1])
        except ValueError:
            value = None
        name = value.get("name") if isinstance(value, dict) else None
        if not isinstance(name, str) or "parameters" not in value:
            self.state = "content"
            return
        arguments = json.dumps(value["parameters"], ensure_ascii=False)
        out.add_call(call_entry(self.num_calls, name, arguments))
        self.num_calls += 1
        self.called = True
        self.consumed = self.scanned + 1
        self.state = "items"


class TaggedParser:
    """Hermes' `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in free text.

    Content streams as it comes, except a tail that may be the start of `<tool_call>` and any
    blank text before the first visible content (a response of calls and blanks has no content,
    so the stream gives none either)."""

    def __init__(self) -> None:
        self.pending = ""  # outside a block: a possible start tag; inside: the block's text
        self.inside = False
        self.searched = 0  # inside: where to look for the end tag next
        self.blank = ""  # blank content held until visible content follows
        self.visible = False
        self.called = False
        self.num_calls = 0

    def opening(self) -> list[dict[str, Any]]:
        return []

    def feed(self, text: str) -> Parsed:
        self.pending += text
        out = Parsed()
        while True:
            if self.inside:
                end = self.pending.find(TOOL_CALL_END, self.searched)
                if end < 0:
                    self.searched = max(0, len(self.pending) - len(TOOL_CALL_END) + 1)
                    return out
                self._block(self.pending[:end], out)
                self.pending = self.pending[end + len(TOOL_CALL_END) :]
                self.inside = False
            else:
                start = self.pending.find(TOOL_CALL_START)
                if start < 0:
                    keep = _prefix_tail(self.pending, TOOL_CALL_START)
                    self._content(self.pending[: len(self.pending) - keep], out)
                    self.pending = self.pending[len(self.pending) - keep :]
                    return out
                self._content(self.pending[:start], out)
                self.pending = self.pending[start + len(TOOL_CALL_START) :]
                self.inside, self.searched = True, 0

    def finish(self, finish_reason: str | None) -> Parsed:
        """What is left is text: a tail that never became a tag, or a block never closed."""
        out = Parsed()
        self._content((TOOL_CALL_START if self.inside else "") + self.pending, out)
        self.pending, self.inside = "", False
        return out

    def _block(self, body: str, out: Parsed) -> None:
        call = _tagged_call(body)
        if call is None:  # not a call after all: the model's text, as it wrote it
            self._content(TOOL_CALL_START + body + TOOL_CALL_END, out)
            return
        out.add_call(call_entry(self.num_calls, *call))
        self.num_calls += 1
        self.called = True

    def _content(self, text: str, out: Parsed) -> None:
        if self.visible:
            out.add_text(text)
            return
        self.blank += text
        if self.blank and not self.blank.isspace():
            out.add_text(self.blank)
            self.blank, self.visible = "", True


def _tagged_call(body: str) -> tuple[str, str] | None:
    """(name, arguments) of a block's JSON; None if it is not a call."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return value["name"], arguments


def _json_string(text: str) -> str | None:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _prefix_tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
