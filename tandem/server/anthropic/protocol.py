"""Request bodies of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) and
their translation into Tandem's own form.

The conversation: `system` (a string or text blocks) first; each message's text blocks joined as
written; an assistant's `tool_use` blocks become its tool calls (the input as JSON text), and a
user's `tool_result` blocks become tool messages, which the chat template renders in the
model's own tool role; consecutive turns of one role are one turn, as the API documents.
`thinking` blocks of earlier turns are dropped (the model never sees its old reasoning); image
and document blocks are refused by name, since the served models read text only. Block types
the server does not know are skipped and logged once, like unknown fields.

Tools: custom tools (`input_schema`) become functions; Anthropic's server tools (web search,
code execution, ...) cannot run here and are ignored, each named in a Warning header.
`tool_choice` maps `auto`, `any` (OpenAI's "required"), `tool` (a named function) and `none`;
`disable_parallel_tool_use` limits `any` and `tool` to one call (under `auto` the model's own
syntax decides, as nothing constrains it).

`thinking`, for a reasoning model: `enabled` with `budget_tokens` bounds the thinking, `disabled`
turns it off (`generation/request.thinking_settings`), `adaptive` leaves it to the model.
"""

from __future__ import annotations

import json
import re
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

ENDPOINT = "/v1/messages"
BILLING_PREFIX = "x-anthropic-billing-header:"
BILLING_LINE = re.compile(r"^x-anthropic-billing-header:[^\n]*\n?")
UNSUPPORTED_BLOCKS = {"image", "document", "container_upload"}
IGNORED_BLOCKS = {"thinking", "redacted_thinking"}


class ContentBlock(Body):
    """Any content block: which fields matter depends on `type`."""

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: Any = None  # tool_use: the call's arguments, an object
    tool_use_id: str | None = None  # tool_result
    content: str | list[ContentBlock] | None = None  # tool_result
    is_error: bool | None = None  # tool_result


class InputMessage(Body):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(Body):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom", or a server tool's versioned type


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Body):
    """`effort` is the model's own choice of how long to think: nothing to set here."""

    effort: str | None = None
    format: OutputFormat | None = None


class ThinkingConfig(Body):
    """`enabled` with `budget_tokens`: the thinking budget; `disabled`: no thinking;
    `adaptive`: the model decides (no budget)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0)

    def setting(self) -> str | int | None:
        if self.type == "disabled":
            return "off"
        return self.budget_tokens if self.type == "enabled" else None


class CountTokensRequest(Body):
    """POST /v1/messages/count_tokens: what `input_tokens` a message would report."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[ContentBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    def job(
        self, sampling: dict[str, Any] | None = None, constraint: Constraint | None = None
    ) -> tuple[ChatJob, list[str]]:
        """The conversation as a job, and the tools it ignored (server tools)."""
        tools, ignored = _tools(self.tools or [])
        choice, parallel = _tool_choice(self.tool_choice)
        if not tools and choice == "auto":  # every tool was a server tool: nothing to call
            choice = None
        budget, template_kwargs = thinking_settings(
            self.thinking.setting() if self.thinking else None
        )
        job = ChatJob(
            sampling or {},
            constraint,
            thinking_budget=budget,
            clamp_max_tokens=True,
            param_names={"prompt": "messages", "stop": "stop_sequences"},
            messages=as_turns(_system(self.system) + _conversation(self.messages)),
            tools=tools or None,
            tool_choice=choice,
            parallel_tool_calls=parallel,
            template_kwargs=template_kwargs,
        )
        return job, ignored


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, le=2**31 - 1)
    output_config: OutputConfig | None = None  # `format`: structured outputs, a JSON schema

    def constraint(self) -> Constraint | None:
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is None:
            return None
        spec = partial(StructuredOutputsParams, json=fmt.schema_)
        return made_constraint(spec, "output_config", "output_config.format.schema")

    def sampling(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_sequences,
        }


def _system(system: str | list[ContentBlock] | None) -> list[Message]:
    """The system prompt, without Claude Code's billing line: it is metadata for Anthropic's
    own service, and its per-request hash would change the prompt's first tokens on every
    turn, so the prefix cache could never reuse a conversation."""
    if system is None:
        return []
    if isinstance(system, str):
        text = BILLING_LINE.sub("", system)
        return [Message("system", text)] if text else []
    texts = [_text_of(block, f"system[{i}]") for i, block in enumerate(system)]
    texts = [t for t in texts if t and not t.startswith(BILLING_PREFIX)]
    return [Message("system", "\n\n".join(texts))] if texts else []


def _conversation(messages: list[InputMessage]) -> list[Message]:
    out: list[Message] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}].content"
        blocks = message.content
        if isinstance(blocks, str):
            out.append(Message(message.role, blocks))
        elif message.role == "assistant":
            out.append(_assistant(blocks, where))
        else:
            out += _user(message.role, blocks, where)
    return out


def _assistant(blocks: list[ContentBlock], where: str) -> Message:
    texts: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        if block.type == "tool_use":
            if not block.id or not block.name:
                raise bad_request(f"{at}: a tool_use block needs an id and a name", at)
            calls.append(ToolCall(block.id, block.name, json.dumps(block.input or {})))
        elif _readable(block, at):
            texts.append(_text_of(block, at))
    return Message("assistant", "".join(texts), tuple(calls))


def _user(role: str, blocks: list[ContentBlock], where: str) -> list[Message]:
    """Text blocks as one message; each tool result as a tool message, in place."""
    out: list[Message] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        if block.type == "tool_result":
            if texts:
                out.append(Message(role, "".join(texts)))
                texts = []
            if not block.tool_use_id:
                raise bad_request(f"{at}: a tool_result block needs its tool_use_id", at)
            out.append(Message("tool", _result_text(block, at), tool_call_id=block.tool_use_id))
        elif _readable(block, at):
            texts.append(_text_of(block, at))
    if texts or not out:
        out.append(Message(role, "".join(texts)))
    return out


def _result_text(block: ContentBlock, where: str) -> str:
    content = block.content
    if content is None or isinstance(content, str):
        return content or ""
    parts = [(b, f"{where}.content[{k}]") for k, b in enumerate(content)]
    return "".join(_text_of(b, at) for b, at in parts if _readable(b, at))


def _readable(block: ContentBlock, where: str) -> bool:
    """Whether a block is text to keep; refuses what the model cannot read, skips the rest."""
    if block.type == "text":
        return True
    if block.type in UNSUPPORTED_BLOCKS:
        raise bad_request(
            f"{where}: {block.type} content blocks are not supported: the served model reads "
            "text only",
            where,
        )
    if block.type not in IGNORED_BLOCKS:
        log_ignored(ENDPOINT, [f"content blocks of type {block.type!r}"])
    return False


def _text_of(block: ContentBlock, where: str) -> str:
    if block.type != "text" or block.text is None:
        raise bad_request(f"{where}: expected a text block with its text", where)
    return block.text


def _tools(tools: list[Tool]) -> tuple[list[dict[str, Any]], list[str]]:
    """Custom tools in OpenAI chat's shape, and a note for each server tool left out."""
    functions: list[dict[str, Any]] = []
    ignored: list[str] = []
    for i, tool in enumerate(tools):
        if tool.type not in (None, "custom"):
            ignored.append(f"tools[{i}] ({tool.type}) is a server tool this server cannot run")
            continue
        if tool.input_schema is None:
            raise bad_request(f"tools[{i}].input_schema is required", "tools")
        function = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        functions.append({"type": "function", "function": function})
    return functions, ignored


def _tool_choice(choice: ToolChoice | None) -> tuple[str | dict[str, Any] | None, bool | None]:
    """OpenAI chat's tool_choice, and parallel_tool_calls."""
    if choice is None:
        return None, None
    single = True if choice.disable_parallel_tool_use and choice.type in ("any", "tool") else None
    if choice.type == "tool":
        if not choice.name:
            raise bad_request('tool_choice of type "tool" needs the tool\'s name', "tool_choice")
        return {"type": "function", "function": {"name": choice.name}}, (False if single else None)
    mapped = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return mapped, (False if single else None)
