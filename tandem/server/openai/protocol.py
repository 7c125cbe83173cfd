"""Request bodies of /v1/completions and /v1/chat/completions, and their translation into
Tandem's own form (`PromptJob`, `ChatJob`).

Wrong types are not coerced (strict=True). Unknown fields are accepted and logged once
(`generation/fields.py`); OpenAI parameters that Tandem does not implement are declared only so
that their neutral value (what the official client sends when the user sets it to the default)
is accepted; any other value is refused, naming the parameter. A structured-output spec is the
exception: a constraint of a kind the server does not know would silently go unenforced, so its
unknown keys are refused.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tandem.request import MAX_LOGPROBS, StructuredOutputsParams
from tandem.server.frontend.errors import bad_request
from tandem.server.frontend.served_model import ServedModel
from tandem.server.generation.fields import Body, only
from tandem.server.generation.prepare import completion_prompts, made_constraint
from tandem.server.generation.request import (
    ChatJob,
    Constraint,
    Message,
    PromptJob,
    ToolCall,
)

MAX_N = 128


class StreamOptions(Body):
    include_usage: bool = False


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (the official client sends it in extra_body): exactly one
    constraint, checked by `StructuredOutputsParams`."""

    model_config = ConfigDict(extra="forbid", strict=True)

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


class JSONSchemaFormat(Body):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(Body):
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


class _GenerationRequest(Body):
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
    response_format: ResponseFormat | None = None  # chat's; vLLM takes it on completions too
    thinking_token_budget: Annotated[int | None, Field(ge=0)] = None  # vLLM's: reasoning models
    user: str | None = None  # an opaque end-user id; it changes nothing about generation

    def default_max_tokens(self) -> int | None:
        return self.max_tokens

    def check(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )

    def sampling(self) -> dict[str, Any]:
        """The sampling values the body sets (None: unset), with `SamplingParams`' names."""
        return {
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
            "thinking_token_budget": self.thinking_token_budget,
        }

    def constraint(self) -> Constraint | None:
        """vLLM's structured_outputs, or OpenAI's response_format: one at most."""
        fmt = self.response_format
        if fmt is not None and fmt.type == "text":
            fmt = None
        if self.structured_outputs is not None:
            if fmt is not None:
                raise bad_request(
                    "response_format and structured_outputs cannot both constrain the output: "
                    "set one of them",
                    param="structured_outputs",
                )
            return made_constraint(self.structured_outputs.params, "structured_outputs")
        if fmt is None:
            return None
        where = "response_format.json_schema.schema" if fmt.type == "json_schema" else None
        return made_constraint(fmt.params, "response_format", where)

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
            raise bad_request(
                f"logit_bias must have token ids as keys, got {key!r}", "logit_bias"
            ) from None
    return out


Logprobs = Annotated[int | None, Field(ge=0, le=MAX_LOGPROBS)]


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions. A prompt (a string or a list of token ids) or a list of prompts."""

    many_prompts: ClassVar[bool] = True
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: Annotated[bool, only(False)] = False
    best_of: Annotated[int | None, only(1, None)] = None
    logprobs: Logprobs = None  # the sampled token's and this many alternatives' (OpenAI: <= 5)
    suffix: Annotated[str | None, only(None, "")] = None
    # vLLM's extra: logprobs name each token "token_id:<id>", not by its text.
    return_tokens_as_token_ids: bool = False

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def job(self) -> PromptJob:
        return PromptJob(
            self.sampling(), self.constraint(), prompts=completion_prompts(self.prompt)
        )


class TextPart(Body):
    type: Literal["text"]
    text: str


class CalledFunction(Body):
    name: str
    arguments: str  # JSON text, as the model wrote it


class MessageToolCall(Body):
    """A tool call of an earlier assistant turn, as a response gave it."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(Body):
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

    def message(self) -> Message:
        content = self.content
        if content is None:
            content = ""
        elif not isinstance(content, str):
            content = "".join(part.text for part in content)
        calls = tuple(
            ToolCall(call.id, call.function.name, call.function.arguments)
            for call in self.tool_calls or ()
        )
        return Message(self.role, content, calls, self.tool_call_id)


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions. The prompt is the tokenizer's chat template applied to messages."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: Logprobs = None
    # Checked by tool_calls.plan_tools, which names the tool at fault.
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: one call at most (named or "required")
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: {"enable_thinking": false}

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise bad_request(
                    "top_logprobs must be used with logprobs set to true", "top_logprobs"
                )
            return None
        return self.top_logprobs or 0

    def default_max_tokens(self) -> int | None:
        """max_completion_tokens supersedes max_tokens; neither means up to the context limit."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def job(self) -> ChatJob:
        names = {"prompt": "messages"}
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        return ChatJob(
            self.sampling(),
            self.constraint(),
            param_names=names,
            messages=[m.message() for m in self.messages],
            tools=self.tools,
            tool_choice=self.tool_choice,
            parallel_tool_calls=self.parallel_tool_calls,
            template_kwargs=self.chat_template_kwargs or {},
        )


class TokenizeRequest(Body):
    """vLLM's POST /tokenize: a `prompt`, or `messages` rendered by the chat template."""

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: Annotated[bool, only(True)] = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self

    def chat_job(self) -> ChatJob:
        return ChatJob(
            {},
            messages=[m.message() for m in self.messages or []],
            template_kwargs=self.chat_template_kwargs or {},
        )

    def token_ids(self, model: ServedModel) -> list[int]:
        if isinstance(self.prompt, list):
            try:
                return model.intake.tokenize(self.prompt)
            except ValueError as exc:
                raise bad_request(str(exc), param="prompt") from None
        if model.tokenizer is None:
            raise bad_request("this model has no tokenizer: give token ids", param="prompt")
        special = self.add_special_tokens is not False
        return model.tokenizer(self.prompt, add_special_tokens=special).input_ids


class DetokenizeRequest(Body):
    """vLLM's POST /detokenize."""

    model: str | None = None
    tokens: list[int]

    def text(self, model: ServedModel) -> str:
        if model.tokenizer is None:
            raise bad_request("this model has no tokenizer", param="tokens")
        try:
            ids = model.intake.tokenize(self.tokens) if self.tokens else []
        except ValueError as exc:
            raise bad_request(str(exc), param="tokens") from None
        return model.tokenizer.decode(ids)


class LoadLoRAAdapterRequest(Body):
    """vLLM's POST /v1/load_lora_adapter: a PEFT folder, under the name requests will use."""

    lora_name: str
    lora_path: str

    @model_validator(mode="after")
    def _both_given(self) -> LoadLoRAAdapterRequest:
        if not self.lora_name or not self.lora_path:
            raise ValueError("both lora_name and lora_path must be non-empty")
        return self


class UnloadLoRAAdapterRequest(Body):
    """vLLM's POST /v1/unload_lora_adapter: by name (or by the core's `lora_int_id`)."""

    lora_name: str | None = None
    lora_int_id: int | None = None

    @model_validator(mode="after")
    def _one_given(self) -> UnloadLoRAAdapterRequest:
        if not self.lora_name and self.lora_int_id is None:
            raise ValueError("give lora_name (or lora_int_id)")
        return self
