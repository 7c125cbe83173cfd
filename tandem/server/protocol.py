"""Request bodies of the OpenAI API subset we serve, validated strictly.

Unknown fields are refused (extra="forbid") and wrong types are not coerced (strict=True), so a
client never gets an answer to a question it did not ask. OpenAI parameters that Tandem does not
implement are declared only so that their neutral value (what the official client sends when the
user sets it to the default) is accepted; any other value is refused, naming the parameter.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from tandem.request import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams

MAX_N = 128


def _only(*neutral: Any) -> AfterValidator:
    """Accept an unsupported parameter only at a value that changes nothing."""

    def check(value: Any) -> Any:
        if value not in neutral and not (isinstance(value, (list, dict)) and not value):
            shown = " or ".join(json.dumps(v) for v in neutral)
            raise ValueError(f"not supported by this server (only {shown} is accepted)")
        return value

    return AfterValidator(check)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` (the official client sends it in extra_body): exactly one
    constraint, checked by `StructuredOutputsParams`."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None

    def params(self) -> StructuredOutputsParams:
        """Raises ValueError naming the field (from StructuredOutputsParams)."""
        values = self.model_dump(exclude_none=True)
        values["json"] = values.pop("json_", None)
        return StructuredOutputsParams(**values)


class _GenerationRequest(_Strict):
    """Fields shared by both endpoints: sampling, streaming, and refused OpenAI features."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # Extensions with vLLM's names.
    # Bounded: values of 2**63 and up overflow the engine's float64 -> int64 sampling table.
    top_k: Annotated[int | None, Field(le=2**31 - 1)] = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    # Samples per prompt, sharing its KV blocks; OpenAI's bound.
    n: Annotated[int | None, Field(ge=1, le=MAX_N)] = None
    structured_outputs: StructuredOutputs | None = None
    user: str | None = None  # an opaque end-user id; it changes nothing about generation

    def default_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(
        self,
        defaults: dict[str, float] | None = None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The body's values over the model's sampling `defaults`, with the output constrained
        by `structured_outputs` (the caller resolves it from the body). Raises ValueError (from
        SamplingParams) naming the parameter that is out of range."""
        values: dict[str, Any] = {
            "max_tokens": self.default_max_tokens(),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "n": self.n,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logit_bias": _token_keys(self.logit_bias),
            "logprobs": self.num_logprobs(),
            "structured_outputs": structured_outputs,
        }
        given = {k: v for k, v in values.items() if v is not None}
        return SamplingParams(**((defaults or {}) | given))

    def num_logprobs(self) -> int | None:
        """Top alternatives per generated token, or None for no logprobs."""
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _token_keys(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias has token ids as JSON object keys, so strings: back to ints."""
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise ValueError(f"logit_bias must have token ids as keys, got {key!r}") from None
    return out


Logprobs = Annotated[int | None, Field(ge=0, le=MAX_LOGPROBS)]


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions. A prompt (a string or a list of token ids) or a list of prompts."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: Annotated[bool, _only(False)] = False
    best_of: Annotated[int | None, _only(1, None)] = None
    logprobs: Logprobs = None  # the sampled token's and this many alternatives' (OpenAI: <= 5)
    suffix: Annotated[str | None, _only(None, "")] = None

    def num_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as the model wrote it


class MessageToolCall(_Strict):
    """A tool call of an earlier assistant turn, as a response gave it."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only beside an assistant's tool_calls
    tool_calls: list[MessageToolCall] | None = None  # assistant only
    tool_call_id: str | None = None  # tool only: the call this message answers

    @model_validator(mode="after")
    def _fields_of_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls is only allowed in assistant messages")
        if (self.tool_call_id is None) != (self.role != "tool"):
            raise ValueError("tool_call_id is required in tool messages, and only there")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required unless an assistant message has tool_calls")
        return self

    def as_template_message(self) -> dict[str, Any]:
        """Chat templates take tool-call arguments as objects (Hugging Face's convention), so
        JSON text is parsed back; text that is not JSON stays as it was."""
        content = self.content
        if content is None:
            content = ""
        elif not isinstance(content, str):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _json_or_text(call.function.arguments),
                    },
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


class JSONSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(_Strict):
    """OpenAI's response_format: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema", and only there')
        if self.json_schema is not None and self.json_schema.schema_ is None:
            raise ValueError("json_schema.schema is required")
        return self

    def params(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is not None:
            return StructuredOutputsParams(json=self.json_schema.schema_)
        return None


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions. The prompt is the tokenizer's chat template applied to messages."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: Logprobs = None
    response_format: ResponseFormat | None = None
    # Checked by tool_calls.plan_tools, which names the tool at fault.
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: one call at most (named or "required")

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs must be used with logprobs set to true")
            return None
        return self.top_logprobs or 0

    def default_max_tokens(self) -> int | None:
        """max_completion_tokens supersedes max_tokens; neither means up to the context limit."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens
