"""A request in Tandem's own form, whichever API it came through: what each API's translation
produces and `prepare.Preparer` turns into engine requests.

A `ChatJob` is a conversation (messages, tools) and a `PromptJob` raw prompts; both carry the
sampling values the request set (with `SamplingParams`' names), the output's constraint, and how
the API names its parameters, so that an error about `max_tokens` names `max_output_tokens` to a
Responses client and `options.num_predict` to an Ollama one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tandem.request import StructuredOutputsParams

Prompt = str | list[int]


@dataclass(frozen=True)
class ToolCall:
    """A tool call of an earlier assistant turn."""

    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


@dataclass(frozen=True)
class Message:
    role: str  # as the chat template sees it: system, developer, user, assistant or tool
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # assistant only
    tool_call_id: str | None = None  # tool only: the call this message answers

    def template_message(self) -> dict[str, Any]:
        """Hugging Face's message shape. Templates take tool-call arguments as objects, so JSON
        text is parsed back; text that is not JSON stays as it was."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": _json_or_text(call.arguments)},
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return text


def as_turns(messages: list[Message]) -> list[Message]:
    """The conversation as chat templates take it, for APIs whose conversations are looser.

    System messages lead; one later in the conversation (Claude Code sends reminders as
    system messages after the user's) becomes a user turn, since most templates take a system
    prompt only at the start. Consecutive messages of one role are one turn, their texts
    joined by a blank line (the Messages API's documented rule; many templates refuse two user
    turns in a row). Tool results and assistant turns with tool calls stay apart: each is its
    own message to the template.
    """
    leading = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
    messages = messages[:leading] + [
        Message("user", m.content) if m.role == "system" else m for m in messages[leading:]
    ]
    merged: list[Message] = []
    for message in messages:
        last = merged[-1] if merged else None
        plain = not (message.tool_calls or message.tool_call_id is not None)
        if (
            last is not None
            and plain
            and last.role == message.role
            and not (last.tool_calls or last.tool_call_id is not None)
        ):
            text = "\n\n".join(t for t in (last.content, message.content) if t)
            merged[-1] = Message(last.role, text)
        else:
            merged.append(message)
    return merged


@dataclass(frozen=True)
class Constraint:
    """A request's structured output, and how to name where it came from in an error."""

    spec: StructuredOutputsParams
    param: str
    where: str | None = None  # in messages, in place of "structured_outputs.<kind>"


@dataclass
class Job:
    """What every request has, prompt or conversation."""

    sampling: dict[str, Any]  # SamplingParams' fields the request set (None: unset)
    constraint: Constraint | None = None
    # A max_tokens beyond what the context leaves is lowered to fit (the answer then ends with
    # "length"), as llama.cpp does; otherwise it is refused, as OpenAI does.
    clamp_max_tokens: bool = False
    # The API's name for an engine parameter, where they differ ("max_tokens" ->
    # "max_output_tokens"); "prompt" names the prompt or conversation.
    param_names: dict[str, str] = field(default_factory=dict)
    # The budget an API's own thinking setting means (Anthropic's budget_tokens, an effort):
    # a hint, applied where the model has a reasoning parser and ignored elsewhere (unlike
    # `thinking_token_budget` among the sampling values, which a model without one refuses).
    thinking_budget: int | None = None

    def param(self, name: str) -> str:
        return self.param_names.get(name, name)


@dataclass
class PromptJob(Job):
    prompts: list[Prompt] = field(default_factory=list)


@dataclass
class ChatJob(Job):
    messages: list[Message] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None  # OpenAI chat's shape: {"type": "function", ...}
    tool_choice: str | dict[str, Any] | None = None  # OpenAI chat's values
    parallel_tool_calls: bool | None = None
    # The chat template's own variables (vLLM's chat_template_kwargs): `enable_thinking` false
    # turns a Qwen3-style template's thinking off.
    template_kwargs: dict[str, Any] = field(default_factory=dict)


# What a thinking setting of the APIs that have one turns into: "off" closes the block in the
# template where it takes `enable_thinking`, and gives a budget of 0 (the end is forced at once)
# where it does not; a number is a budget of thinking tokens; None leaves the model to decide.
THINKING_OFF = {"enable_thinking": False}
EFFORT_BUDGETS: dict[str, int | None] = {"low": 1024, "medium": 8192, "high": None, "xhigh": None}


def thinking_settings(setting: str | int | None) -> tuple[int | None, dict[str, Any]]:
    """(thinking_token_budget, template kwargs) for "off", an effort ("low", "medium",
    "high"), a number of tokens, or None."""
    if setting is None:
        return None, {}
    if setting == "off":
        return 0, dict(THINKING_OFF)
    if isinstance(setting, int):
        return setting, {}
    return EFFORT_BUDGETS[setting], {}
