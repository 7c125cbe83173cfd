"""From a request body's bytes to an engine `Request`, on an intake worker (never the event loop).

Everything whose cost grows with the request happens here: JSON parsing and validation, the chat
template, the prompt-length bound, tokenization and the engine's own checks. A prompt the bound
proves too long is refused before it is tokenized. Every failure is an `APIError` (400 naming the
parameter, 404 for an unknown model), raised in the worker and re-raised by the handler.

A completion body may hold a list of prompts: each becomes its own engine request (ids
`<id>-<i>`), each is checked against the bound before any is tokenized, and an error names the
prompt (`prompt 2: ...`). Every engine request carries the body's `n`.

Structured outputs (`structured_outputs`, chat's `response_format`, or the tools of a named or
"required" tool_choice) are compiled here too (`ServedModel.check_grammar`, cached), and an error
names the parameter the constraint came from (`tools[1].function.parameters is invalid: ...`).

A worker thread still shares the GIL, and pydantic holds it for a whole validation, whose cost
grows with the number of JSON values (a 15 MB body of tiny chat messages takes seconds). So a bulk
body is first counted in a helper process (`json_count.py`) and refused if it is not JSON or holds
more values than any request that fits the model could; only then does pydantic see it.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from tandem.engine.chat_template import chat_template_problem
from tandem.request import Request, SamplingParams, StructuredOutputsParams
from tandem.server.errors import APIError, bad_request, validation_error
from tandem.server.json_count import JSONCounter
from tandem.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from tandem.server.served_model import ServedModel
from tandem.server.token_bound import PromptBound
from tandem.server.tool_calls import ToolPlan, plan_tools

Prompt = str | list[int]
Body = TypeVar("Body", bound=BaseModel)

# Values a request may hold besides its token-id prompts of up to max_model_len ids each and a
# logit_bias of up to one entry per vocabulary id (messages, content parts, stop strings, ...:
# OpenAI itself allows at most 2048 messages).
OTHER_VALUES = 16384


@dataclass(frozen=True)
class Prepared:
    """An HTTP request ready for the engine: one engine request per prompt, each with `n`
    samples, and the body it came from."""

    body: CompletionRequest | ChatCompletionRequest
    request_id: str  # the response's id
    requests: list[Request]
    tools: ToolPlan | None = None  # set when the output is read for tool calls

    @property
    def n(self) -> int:
        return self.requests[0].params.n

    @property
    def logprobs(self) -> int | None:
        """Alternatives per generated token to return; None: no logprobs."""
        return self.requests[0].params.logprobs

    @property
    def num_seqs(self) -> int:
        """Sequences it asks the engine for: prompts x n."""
        return len(self.requests) * self.n

    @property
    def seqs_param(self) -> str:
        """The parameter to name when it asks for too many sequences."""
        if self.n > 1:
            return "n"
        return "messages" if isinstance(self.body, ChatCompletionRequest) else "prompt"


@dataclass(frozen=True)
class Constraint:
    """A request's structured_outputs, and how to name where it came from in an error."""

    spec: StructuredOutputsParams
    param: str
    where: str | None = None  # in messages, in place of "structured_outputs.<kind>"


def constraint_error(message: str, param: str, where: str | None) -> APIError:
    if where is not None:
        message = re.sub(r"^structured_outputs\.\w+", where, message, count=1)
    return bad_request(message, param=param)


def made_constraint(spec_of, param: str, where: str | None = None) -> Constraint | None:
    """`spec_of()`'s StructuredOutputsParams (or None) as a Constraint; its ValueError as a 400."""
    try:
        spec = spec_of()
    except ValueError as exc:
        raise constraint_error(str(exc), param, where) from None
    return None if spec is None else Constraint(spec, param, where)


def body_constraint(body: CompletionRequest | ChatCompletionRequest) -> Constraint | None:
    """vLLM's structured_outputs, or OpenAI's response_format (chat): one at most."""
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type == "text":
        fmt = None
    if body.structured_outputs is not None:
        if fmt is not None:
            raise bad_request(
                "response_format and structured_outputs cannot both constrain the output: "
                "set one of them",
                param="structured_outputs",
            )
        return made_constraint(body.structured_outputs.params, "structured_outputs")
    if fmt is None:
        return None
    where = "response_format.json_schema.schema" if fmt.type == "json_schema" else None
    return made_constraint(fmt.params, "response_format", where)


def tool_constraint(plan: ToolPlan, other: Constraint | None) -> Constraint | None:
    """A named or "required" tool_choice constrains the output itself, so it takes no other."""
    if plan.choice == "auto":
        return other
    if other is not None:
        choice = "a named function" if plan.choice == "named" else '"required"'
        raise bad_request(
            f"tool_choice {choice} constrains the output to tool calls: it cannot be combined "
            f"with {other.param}",
            param="tool_choice",
        )
    where = "tools"
    if plan.choice == "named":
        index = next(i for i, f in enumerate(plan.functions) if f.name == plan.name)
        where = f"tools[{index}].function.parameters"
    return made_constraint(plan.constraint, "tools", where)


class Preparer:
    def __init__(
        self,
        model: ServedModel,
        model_name: str,
        accepted_names: list[str],
        bound: PromptBound | None,
        counter: JSONCounter | None = None,
        max_seqs: int | None = None,
    ):
        self.model = model
        self.counter = counter
        self.model_name = model_name
        self.accepted_names = set(accepted_names)
        self.bound = bound
        # The most sequences (prompts x n) one request may ask for: the server's capacity.
        self.max_seqs = max_seqs

    def value_limit(self, model: type[BaseModel]) -> tuple[int, str]:
        """The most JSON values a body that fits can hold, and why: a completion may hold up
        to `max_seqs` token-id prompts, a chat one prompt's worth; either, a logit_bias entry
        per vocabulary id."""
        prompts = (self.max_seqs or 1) if model is CompletionRequest else 1
        what = f"{prompts} token-id prompts" if prompts > 1 else "a token-id prompt"
        vocab = self.model.vocab_size
        limit = prompts * self.model.max_model_len + vocab + OTHER_VALUES
        return (
            limit,
            f"{what} of max_model_len ids, {vocab} logit_bias entries, {OTHER_VALUES} more",
        )

    def completion(self, raw: bytes, bulk: bool = False) -> Prepared:
        body = self._parse(CompletionRequest, raw, bulk)
        self._check_body(body)
        constraint = body_constraint(body)
        params = sampling_params(body, self.model.sampling_defaults, constraint)
        prompts = completion_prompts(body.prompt)
        self._check_seqs(len(prompts), params.n, "prompt")
        where = [f"prompt {i}: " if len(prompts) > 1 else "" for i in range(len(prompts))]
        for prompt, at in zip(prompts, where, strict=True):  # all, before tokenizing any
            if isinstance(prompt, str):
                self._check_bound(prompt, add_special_tokens=True, param="prompt", where=at)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        ids = (
            [request_id]
            if len(prompts) == 1
            else [f"{request_id}-{i}" for i in range(len(prompts))]
        )
        requests = [
            self._make(prompt, params, engine_id, "prompt", at, constraint)
            for prompt, engine_id, at in zip(prompts, ids, where, strict=True)
        ]
        return Prepared(body, request_id, requests)

    def chat(self, raw: bytes, bulk: bool = False) -> Prepared:
        body = self._parse(ChatCompletionRequest, raw, bulk)
        self._check_body(body)
        template = getattr(self.model.tokenizer, "chat_template", None)
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, template)
        constraint = body_constraint(body)
        if plan is not None:
            constraint = tool_constraint(plan, constraint)
        params = sampling_params(body, self.model.sampling_defaults, constraint)
        self._check_seqs(1, params.n, "messages")
        text = render_chat(self.model, body.messages, plan.template_tools if plan else None)
        # The template writes any BOS itself, so the text is tokenized without special tokens.
        self._check_bound(text, add_special_tokens=False, param="messages")
        if plan is not None:
            self._check_tool_schemas(plan)
        token_ids = self.model.tokenizer(text, add_special_tokens=False).input_ids
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        request = self._make(token_ids, params, request_id, "messages", constraint=constraint)
        tools = plan if plan is not None and plan.parses else None
        return Prepared(body, request_id, [request], tools)

    def _parse(self, model: type[Body], raw: bytes, bulk: bool) -> Body:
        """pydantic's strict parse; a bulk body is counted out of process first."""
        count = self.counter.count(raw) if bulk and self.counter is not None else None
        if count is not None and count.error is not None:
            raise bad_request(f"request body is not valid JSON: {count.error}")
        max_values, why = self.value_limit(model)
        if count is not None and count.values > max_values:
            raise bad_request(
                f"the request body holds {count.values} JSON values; this server accepts at "
                f"most {max_values} ({why})"
            )
        try:
            return model.model_validate_json(raw)
        except ValidationError as exc:
            raise validation_error(list(exc.errors())) from None

    def _check_body(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        if body.model not in self.accepted_names:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        if body.stream_options is not None and not body.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )

    def _check_tool_schemas(self, plan: ToolPlan) -> None:
        """Every tool's parameters must compile, whichever tool the model then calls."""
        for i, function in enumerate(plan.functions):
            try:
                self.model.check_grammar(StructuredOutputsParams(json=function.parameters))
            except ValueError as exc:
                raise constraint_error(
                    str(exc), "tools", f"tools[{i}].function.parameters"
                ) from None

    def _check_seqs(self, num_prompts: int, n: int, prompt_param: str) -> None:
        """Refuse, before tokenizing, a request for more sequences than the server holds."""
        num_seqs = num_prompts * n
        if self.max_seqs is not None and num_seqs > self.max_seqs:
            raise bad_request(
                f"this request asks for {num_seqs} sequences (prompts x n); the server holds at "
                f"most {self.max_seqs} at once",
                param="n" if n > 1 else prompt_param,
            )

    def _check_bound(
        self, text: str, add_special_tokens: bool, param: str, where: str = ""
    ) -> None:
        """Refuse, without tokenizing, a text certain to leave no room to generate."""
        if self.bound is None:
            return
        at_least = self.bound.min_tokens(text, add_special_tokens)
        limit = self.model.max_model_len
        if at_least >= limit:
            raise bad_request(
                f"{where}prompt has at least {at_least} tokens ({self.bound.describe()}), which "
                f"leaves no room to generate within max_model_len {limit}",
                param=param,
            )

    def _make(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str,
        param: str,
        where: str = "",
        constraint: Constraint | None = None,
    ) -> Request:
        try:
            return self.model.make_request(prompt, params, request_id)
        except ValueError as exc:  # the engine's validation: the prompt, its length, logit_bias
            message = str(exc)
            if message.startswith("logit_bias"):  # a token id outside the vocabulary
                raise bad_request(message, param="logit_bias") from None
            if constraint is not None and message.startswith("structured"):  # its grammar
                raise constraint_error(message, constraint.param, constraint.where) from None
            raise bad_request(
                where + message, param="max_tokens" if "plus max_tokens" in message else param
            ) from None


def completion_prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[Prompt]:
    """One prompt, or a list of them (strings or token-id lists), as OpenAI accepts."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]


def render_chat(
    model: ServedModel, messages: list[ChatMessage], tools: list[dict] | None = None
) -> str:
    """The tokenizer's chat template applied to `messages` (and `tools`, when any may be
    called), as text."""
    tokenizer = model.tokenizer
    problem = chat_template_problem(tokenizer)
    if problem is not None:
        instead = "token ids" if tokenizer is None else "a plain prompt"
        raise bad_request(
            f"{problem}, so /v1/chat/completions cannot build a prompt; use /v1/completions "
            f"with {instead}",
            param="messages",
        )
    conversation = [m.as_template_message() for m in messages]
    try:
        return tokenizer.apply_chat_template(
            conversation, tools=tools, tokenize=False, add_generation_prompt=True
        )
    except Exception as exc:  # jinja's TemplateError, raise_exception() in templates
        raise bad_request(
            f"the chat template refused these messages: {exc}", param="messages"
        ) from None


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    defaults: dict[str, float],
    constraint: Constraint | None = None,
) -> SamplingParams:
    try:
        return body.sampling_params(defaults, constraint.spec if constraint else None)
    except ValueError as exc:  # SamplingParams' messages start with the field's name
        message = str(exc)
        match = re.match(r"(\w+) must", message)
        param = match.group(1) if match else None
        if param == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
            param = "max_completion_tokens"
            message = param + message.removeprefix("max_tokens")
        raise bad_request(message, param=param) from None
