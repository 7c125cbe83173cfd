"""Request bodies of OpenAI's Responses API (POST /v1/responses) and their translation into
Tandem's own form.

`input` is a string (one user message) or items: messages (`input_text` / `output_text` parts
joined as written; a `developer` message is a system one), `function_call` (an assistant's tool
call) and `function_call_output` (a tool message, rendered in the model's tool role);
consecutive messages of one role are one turn. `instructions` is a system message first.
`reasoning` items of earlier turns are dropped; image and file parts are refused by name (the
served models read text only); other item types (hosted tools' calls) are skipped and logged.

Tools: function tools; hosted tools (web search, file search, MCP, ...) and tool kinds the
server cannot run are ignored, each named in a Warning header. `text.format` (`json_schema`,
`json_object`) constrains the answer's text (a turn that must call a tool has none).
`include` values and `reasoning` settings change nothing
here. `parallel_tool_calls: false` limits "required" and a named function to one call (under
"auto" the model's own syntax decides).
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any, Literal

from pydantic import Field

from tandem.request import StructuredOutputsParams
from tandem.server.frontend.errors import bad_request
from tandem.server.generation.fields import Body, log_ignored
from tandem.server.generation.prepare import made_constraint
from tandem.server.generation.request import (
    ChatJob,
    Constraint,
    Message,
    ToolCall,
    as_turns,
    thinking_settings,
)

ENDPOINT = "/v1/responses"
TEXT_PARTS = {"input_text", "output_text", "text"}
UNSUPPORTED_PARTS = {"input_image", "input_file", "input_audio"}
DROPPED_ITEMS = {"reasoning"}
ROLES = {"developer": "system"}


class ContentPart(Body):
    type: str
    text: str | None = None
    refusal: str | None = None


class InputItem(Body):
    """Any input item: which fields matter depends on `type` (a message may omit it)."""

    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call
    output: str | list[ContentPart] | None = None  # function_call_output


class TextFormat(Body):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(Body):
    format: TextFormat | None = None


class Reasoning(Body):
    """`effort`, for a reasoning model: none or minimal turns the thinking off, the others are
    budgets (`generation/request.EFFORT_BUDGETS`); unset leaves it to the model."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None

    def setting(self) -> str | None:
        return "off" if self.effort in ("none", "minimal") else self.effort


class ResponsesRequest(Body):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, Any] | None = None
    user: str | None = None
    reasoning: Reasoning | None = None

    def thinking(self) -> tuple[int | None, dict[str, Any]]:
        return thinking_settings(self.reasoning.setting() if self.reasoning else None)

    def sampling(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }

    def constraint(self) -> Constraint | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return made_constraint(partial(StructuredOutputsParams, json_object=True), "text")
        if fmt.schema_ is None:
            raise bad_request('text.format of type "json_schema" needs its schema', "text")
        spec = partial(StructuredOutputsParams, json=fmt.schema_)
        return made_constraint(spec, "text", "text.format.schema")

    def messages(self) -> list[Message]:
        """The input as messages, without `instructions` (a previous response's history does
        not carry them: each request gives its own)."""
        if isinstance(self.input, str):
            return [Message("user", self.input)]
        return _items(self.input)

    def job(self, history: list[Message]) -> tuple[ChatJob, list[str]]:
        """The conversation (a stored `history`, then this input) as a job, and notes on the
        tools it ignored."""
        tools, ignored = _tools(self.tools or [])
        choice = _tool_choice(self.tool_choice, bool(tools))
        forced = choice not in (None, "auto", "none")  # the answer is a call: no text to format
        single = self.parallel_tool_calls is False and forced
        system = [Message("system", self.instructions)] if self.instructions else []
        job = ChatJob(
            self.sampling(),
            None if forced else self.constraint(),
            clamp_max_tokens=True,
            param_names={"prompt": "input", "max_tokens": "max_output_tokens"},
            thinking_budget=self.thinking()[0],
            messages=as_turns(system + history + self.messages()),
            tools=tools or None,
            tool_choice=choice,
            parallel_tool_calls=False if single else None,
            template_kwargs=self.thinking()[1],
        )
        return job, ignored


def _items(items: list[InputItem]) -> list[Message]:
    out: list[Message] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if item.type == "message":
            if item.role is None or item.content is None:
                raise bad_request(f"{where}: a message needs a role and content", where)
            out.append(Message(ROLES.get(item.role, item.role), _text(item.content, where)))
        elif item.type == "function_call":
            if not item.call_id or not item.name:
                raise bad_request(f"{where}: a function_call needs its call_id and name", where)
            call = ToolCall(item.call_id, item.name, item.arguments or "")
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and last.tool_call_id is None:
                out[-1] = Message("assistant", last.content, (*last.tool_calls, call))
            else:
                out.append(Message("assistant", "", (call,)))
        elif item.type == "function_call_output":
            if not item.call_id:
                raise bad_request(f"{where}: a function_call_output needs its call_id", where)
            output = _text(item.output or "", f"{where}.output")
            out.append(Message("tool", output, tool_call_id=item.call_id))
        elif item.type not in DROPPED_ITEMS:
            log_ignored(ENDPOINT, [f"input items of type {item.type!r}"])
    return out


def _text(content: str | list[ContentPart], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type in TEXT_PARTS and part.text is not None:
            texts.append(part.text)
        elif part.type == "refusal" and part.refusal is not None:
            texts.append(part.refusal)
        elif part.type in UNSUPPORTED_PARTS:
            raise bad_request(
                f"{where}[{j}]: {part.type} parts are not supported: the served model reads "
                "text only",
                f"{where}[{j}]",
            )
        else:
            log_ignored(ENDPOINT, [f"content parts of type {part.type!r}"])
    return "".join(texts)


def _tools(tools: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """Function tools in OpenAI chat's shape, and a note for each tool left out."""
    functions = []
    ignored = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            ignored.append(f"tools[{i}] ({kind}) is a tool this server cannot run")
            continue
        function = {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool
        }
        functions.append({"type": "function", "function": function})
    return functions, ignored


def _tool_choice(choice: str | dict[str, Any] | None, any_tools: bool) -> str | dict | None:
    """OpenAI chat's tool_choice for the Responses API's."""
    if isinstance(choice, dict):
        if choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise bad_request(
            f"tool_choice {json.dumps(choice)} is not supported: give none, auto, required or "
            '{"type": "function", "name": ...}',
            "tool_choice",
        )
    if choice == "auto" and not any_tools:  # every tool was one this server cannot run
        return None
    return choice
