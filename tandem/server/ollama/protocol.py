"""Request bodies of Ollama's API (/api/chat, /api/generate, /api/show) and their translation
into Tandem's own form.

`options` map to sampling by Ollama's names (`num_predict` is max_tokens: -1 or -2 mean up to
the context, and a value past it is clamped; `repeat_penalty` is the repetition penalty);
options that tune Ollama's own runtime (`num_ctx`, `num_gpu`, `num_thread`, ...) change nothing
here and are logged once, as unknown fields are. `format` is `"json"` (any JSON object) or a
JSON schema. /api/generate renders `system` and `prompt` through the chat template as Ollama
does, or sends the prompt as it is with `raw`.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from tandem.request import StructuredOutputsParams
from tandem.server.frontend.errors import bad_request
from tandem.server.generation.fields import Body, log_ignored, only
from tandem.server.generation.prepare import made_constraint
from tandem.server.generation.request import (
    ChatJob,
    Constraint,
    Job,
    Message,
    PromptJob,
    ToolCall,
    thinking_settings,
)

# Ollama's option -> SamplingParams' field.
SAMPLING_OPTIONS = {
    "num_predict": "max_tokens",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
PARAM_NAMES = {field: f"options.{option}" for option, field in SAMPLING_OPTIONS.items()}
UNLIMITED = (-1, -2)  # num_predict: no limit, or fill the context


class _Request(Body):
    model: str
    stream: bool = True  # Ollama streams unless told not to
    format: Literal["json"] | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | float | None = None  # the model stays loaded while the server runs
    # A reasoning model: false turns the thinking off, "low" / "medium" / "high" bound it.
    think: bool | Literal["low", "medium", "high"] | None = None

    def thinking(self) -> tuple[int | None, dict[str, Any]]:
        setting = (
            "off" if self.think is False else None if self.think in (None, True) else self.think
        )
        return thinking_settings(setting)

    def sampling(self) -> dict[str, Any]:
        options = dict(self.options or {})
        values = {field: options.pop(option, None) for option, field in SAMPLING_OPTIONS.items()}
        if values["max_tokens"] in UNLIMITED:
            values["max_tokens"] = None
        log_ignored(self.endpoint, [f"options.{name}" for name in options])
        return values

    def constraint(self) -> Constraint | None:
        if self.format is None:
            return None
        if self.format == "json":
            spec = partial(StructuredOutputsParams, json_object=True)
        else:
            spec = partial(StructuredOutputsParams, json=self.format)
        return made_constraint(spec, "format", "format")

    def job_fields(self) -> dict[str, Any]:
        return {
            "sampling": self.sampling(),
            "thinking_budget": self.thinking()[0],
            "constraint": self.constraint(),
            "clamp_max_tokens": True,
            "param_names": {**PARAM_NAMES, "prompt": self.prompt_param},
        }

    endpoint: ClassVar[str] = "/api"
    prompt_param: ClassVar[str] = "prompt"


class ToolCallFunction(Body):
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)


class OllamaToolCall(Body):
    function: ToolCallFunction


class OllamaMessage(Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None
    thinking: str | None = None  # an earlier turn's reasoning: the model does not see it again

    def message(self, index: int) -> Message:
        if self.images:
            raise bad_request(
                f"messages[{index}].images: images are not supported: the served model reads "
                "text only",
                f"messages[{index}].images",
            )
        calls = tuple(
            ToolCall(f"call_{index}_{k}", call.function.name, _arguments(call.function.arguments))
            for k, call in enumerate(self.tool_calls or ())
        )
        return Message(self.role, self.content, calls)


def _arguments(arguments: dict[str, Any] | str) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


class ChatRequest(_Request):
    """POST /api/chat."""

    endpoint: ClassVar[str] = "/api/chat"
    prompt_param: ClassVar[str] = "messages"
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None

    def job(self) -> ChatJob:
        return ChatJob(
            **self.job_fields(),
            messages=[m.message(i) for i, m in enumerate(self.messages)],
            tools=self.tools or None,
            template_kwargs=self.thinking()[1],
        )


class GenerateRequest(_Request):
    """POST /api/generate."""

    endpoint: ClassVar[str] = "/api/generate"
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    images: list[str] | None = None
    suffix: Annotated[str | None, only(None, "")] = None
    template: Annotated[str | None, only(None, "")] = None
    context: Annotated[list[int] | None, only(None)] = None

    def job(self) -> Job:
        if self.images:
            raise bad_request(
                "images are not supported: the served model reads text only", "images"
            )
        if self.raw:
            return PromptJob(**self.job_fields(), prompts=[self.prompt])
        system = [Message("system", self.system)] if self.system else []
        messages = [*system, Message("user", self.prompt)]
        return ChatJob(**self.job_fields(), messages=messages, template_kwargs=self.thinking()[1])


class ShowRequest(Body):
    model: str | None = None
    name: str | None = None  # older clients' field

    @property
    def model_name(self) -> str:
        name = self.model or self.name
        if not name:
            raise bad_request("model is required", "model")
        return name
