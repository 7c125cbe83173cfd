"""From a request body's bytes to engine `Request`s, on an intake worker (never the event loop).

Everything whose cost grows with the request happens here: JSON parsing and validation, the chat
template, the prompt-length bound, tokenization and the engine's own checks. A prompt the bound
proves too long is refused before it is tokenized. Every failure is an `APIError` (400 naming the
parameter, 404 for an unknown model), raised in the worker and re-raised by the handler, which
answers in the API's own error shape.

Each API parses its body (`parse`), checks the model it names (`check_model`: the served model
under any of its names, or a LoRA adapter the cores hold) and translates it into a `PromptJob` or
a `ChatJob`; from there every API takes the same path (`completion`, `chat`, given the adapter).
A completion job may hold a list of prompts: each becomes its own engine request (ids
`<id>-<i>`), each is checked against the bound before any is tokenized, and an error names the
prompt (`prompt 2: ...`).

Structured outputs (a job's constraint, or the tools of a named or "required" tool_choice) are
compiled here too (`ServedModel.check_grammar`, cached), and an error names the parameter the
constraint came from (`tools[1].function.parameters is invalid: ...`).

Output lengths: the server-wide cap (`max_tokens` among the sampling defaults, from
`--override-generation-config '{"max_new_tokens": N}'`) is the default of a request that sets
none and bounds one that sets more, as vLLM's; a job with `clamp_max_tokens` then gets at most
what its prompt leaves of the context.

A worker thread still shares the GIL, and pydantic holds it for a whole validation, whose cost
grows with the number of JSON values (a 15 MB body of tiny chat messages takes seconds). So a bulk
body is first counted in a helper process (`json_count.py`) and refused if it is not JSON or holds
more values than any request that fits the model could; only then does pydantic see it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from tandem.engine.chat_template import chat_template_problem
from tandem.lora import LoRARequest
from tandem.request import Request, SamplingParams
from tandem.server.core.wire import LoraCard
from tandem.server.frontend.adapters import Adapters
from tandem.server.frontend.errors import APIError, bad_request, validation_error
from tandem.server.frontend.json_count import JSONCounter
from tandem.server.frontend.served_model import ServedModel
from tandem.server.frontend.token_bound import PromptBound
from tandem.server.generation.fields import report_ignored
from tandem.server.generation.request import ChatJob, Constraint, Job, Message, Prompt, PromptJob
from tandem.server.generation.tools import ToolPlan, plan_tools

BodyType = TypeVar("BodyType", bound=BaseModel)

# apply_chat_template's own arguments: a request's template kwargs may not set them.
RESERVED_TEMPLATE_KWARGS = {
    "conversation", "tools", "documents", "chat_template", "tokenize", "add_generation_prompt",
    "continue_final_message", "return_dict", "return_tensors", "padding", "truncation",
}  # fmt: skip

# Values a request may hold besides its token-id prompts of up to max_model_len ids each and a
# logit_bias of up to one entry per vocabulary id (messages, content parts, tools, stop strings,
# ...: OpenAI itself allows at most 2048 messages).
OTHER_VALUES = 16384


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
        adapters: Adapters | None = None,
    ):
        """`adapters`: the LoRA adapters a request's model may name (None: none)."""
        self.model = model
        self.adapters = adapters
        self.counter = counter
        self.model_name = model_name
        self.accepted_names = set(accepted_names)
        self.bound = bound
        # The most sequences (prompts x n) one request may ask for: the server's capacity.
        self.max_seqs = max_seqs

    # ------------------------------------------------------------ bodies
    def value_limit(self, body_type: type[BaseModel]) -> tuple[int, str]:
        """The most JSON values a body that fits can hold, and why: a body that takes a list of
        prompts (`many_prompts`) up to `max_seqs` token-id prompts, any other one prompt's
        worth; either, a logit_bias entry per vocabulary id."""
        many = getattr(body_type, "many_prompts", False)
        prompts = (self.max_seqs or 1) if many else 1
        what = f"{prompts} token-id prompts" if prompts > 1 else "a token-id prompt"
        vocab = self.model.vocab_size
        limit = prompts * self.model.max_model_len + vocab + OTHER_VALUES
        return (
            limit,
            f"{what} of max_model_len ids, {vocab} logit_bias entries, {OTHER_VALUES} more",
        )

    def parse(self, body_type: type[BodyType], raw: bytes, bulk: bool, endpoint: str) -> BodyType:
        """pydantic's parse (a bulk body is counted out of process first); fields the server
        does not know are accepted and their names logged once per `endpoint`."""
        count = self.counter.count(raw) if bulk and self.counter is not None else None
        if count is not None and count.error is not None:
            raise bad_request(f"request body is not valid JSON: {count.error}")
        max_values, why = self.value_limit(body_type)
        if count is not None and count.values > max_values:
            raise bad_request(
                f"the request body holds {count.values} JSON values; this server accepts at "
                f"most {max_values} ({why})"
            )
        try:
            body = body_type.model_validate_json(raw)
        except ValidationError as exc:
            raise validation_error(list(exc.errors())) from None
        report_ignored(endpoint, body)
        return body

    def check_model(self, name: str, param: str = "model") -> LoraCard | None:
        """The LoRA adapter `name` names (None: the served model); 404 if neither. In an intake
        worker: a name this front end has not heard of is asked of the cores, off the loop."""
        if name in self.accepted_names:
            return None
        card = self.adapters.resolve(name) if self.adapters is not None else None
        if card is None:
            raise self._unknown_model(name, param)
        return card

    async def check_model_async(self, name: str, param: str = "model") -> LoraCard | None:
        """`check_model`, on the event loop."""
        if name in self.accepted_names:
            return None
        card = await self.adapters.aresolve(name) if self.adapters is not None else None
        if card is None:
            raise self._unknown_model(name, param)
        return card

    def served_name(self, adapter: LoraCard | None) -> str:
        """The model an answer names: the adapter's name, or the served model's."""
        return adapter.name if adapter is not None else self.model_name

    def _unknown_model(self, name: str, param: str) -> APIError:
        lora = self.adapters is not None and self.adapters.enabled
        also = " and the LoRA adapters GET /v1/models lists" if lora else ""
        return APIError(
            404,
            f"the model {name!r} does not exist; this server serves {self.model_name!r}{also}",
            param=param,
            code="model_not_found",
        )

    # -------------------------------------------------------------- jobs
    def completion(
        self, job: PromptJob, request_id: str, adapter: LoraCard | None = None
    ) -> list[Request]:
        """One engine request per prompt (ids `<request_id>-<i>` when there are several), under
        the LoRA `adapter` if one is given."""
        params = self.sampling_params(job)
        prompts = job.prompts
        self._check_seqs(len(prompts), params.n, job.param("prompt"))
        where = [f"prompt {i}: " if len(prompts) > 1 else "" for i in range(len(prompts))]
        for prompt, at in zip(prompts, where, strict=True):  # all, before tokenizing any
            if isinstance(prompt, str):
                self._check_bound(prompt, True, job.param("prompt"), at)
        ids = (
            [request_id]
            if len(prompts) == 1
            else [f"{request_id}-{i}" for i in range(len(prompts))]
        )
        requests = []
        for prompt, engine_id, at in zip(prompts, ids, where, strict=True):
            try:
                token_ids = self.model.intake.tokenize(prompt)
            except ValueError as exc:
                raise bad_request(at + str(exc), param=job.param("prompt")) from None
            request = self._make(job, token_ids, params, engine_id, at, adapter)
            # A raw prompt's text is the model's own, tags and all (as vLLM's completions):
            # only a conversation is read for thinking. (The core still bounds the thinking.)
            request.reasoning = None
            requests.append(request)
        return requests

    def chat(
        self, job: ChatJob, request_id: str, adapter: LoraCard | None = None
    ) -> tuple[Request, ToolPlan | None]:
        """The engine request of a conversation (under the LoRA `adapter` if one is given), and
        the plan its output is read by for tool calls (None: plain text)."""
        plan = self.tool_plan(job)
        constraint = job.constraint
        if plan is not None:
            constraint = tool_constraint(plan, constraint)
        params = self.sampling_params(dataclasses.replace(job, constraint=constraint))
        self._check_seqs(1, params.n, job.param("prompt"))
        token_ids = self.chat_tokens(job, plan)
        request = self._make(job, token_ids, params, request_id, adapter=adapter)
        return request, (plan if plan is not None and plan.parses else None)

    def tool_plan(self, job: ChatJob) -> ToolPlan | None:
        template = getattr(self.model.tokenizer, "chat_template", None)
        return plan_tools(job.tools, job.tool_choice, job.parallel_tool_calls, template)

    def chat_tokens(self, job: ChatJob, plan: ToolPlan | None) -> list[int]:
        """The conversation's prompt through the chat template (with the tools `plan` lets the
        model call), as token ids: what `chat` generates from, and what a token count counts."""
        text = render_chat(self.model, job.messages, plan.template_tools if plan else None, job)
        # The template writes any BOS itself, so the text is tokenized without special tokens.
        self._check_bound(text, False, job.param("prompt"))
        if plan is not None:
            self._check_tool_schemas(plan)
        return self.model.tokenizer(text, add_special_tokens=False).input_ids

    def sampling_params(self, job: Job) -> SamplingParams:
        """The job's values over the model's sampling defaults, under the server's cap."""
        defaults = self.model.sampling_defaults
        given = {k: v for k, v in job.sampling.items() if v is not None}
        if job.thinking_budget is not None and self.model.reasoning is not None:
            given.setdefault("thinking_token_budget", job.thinking_budget)
        cap = defaults.get("max_tokens")
        if cap is not None and given.get("max_tokens", cap) > cap:
            given["max_tokens"] = int(cap)
        constraint = job.constraint
        if constraint is not None:
            given["structured_outputs"] = constraint.spec
        try:
            return SamplingParams(**(defaults | given))
        except ValueError as exc:  # SamplingParams' messages start with the field's name
            message = str(exc)
            match = re.match(r"(\w+) must", message)
            param = match.group(1) if match else None
            if param is not None and job.param(param) != param:
                message = job.param(param) + message.removeprefix(param)
                param = job.param(param)
            raise bad_request(message, param=param) from None

    # ------------------------------------------------------------ checks
    def _check_tool_schemas(self, plan: ToolPlan) -> None:
        """Every tool's parameters must be a schema the grammar takes, whichever tool the model
        then calls (checked without the vocabulary, so dozens of tools cost milliseconds)."""
        for i, function in enumerate(plan.functions):
            try:
                self.model.grammars.check_json_schema(function.parameters)
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
        if at_least >= self.model.max_model_len:
            raise self._too_long(f"at least {at_least}", param, where, self.bound.describe())

    def _too_long(self, tokens: str, param: str, where: str = "", how: str = "") -> APIError:
        """A prompt that leaves no room to generate: both lengths named, OpenAI's code for it,
        and the wording Anthropic's API uses (clients look for "prompt is too long")."""
        limit = self.model.max_model_len
        counted = f" ({how})" if how else ""
        return APIError(
            400,
            f"{where}prompt is too long: {tokens} tokens{counted} > {limit - 1} maximum "
            f"(max_model_len {limit} less one token to generate)",
            param=param,
            code="context_length_exceeded",
        )

    def _make(
        self,
        job: Job,
        token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        where: str = "",
        adapter: LoraCard | None = None,
    ) -> Request:
        room = self.model.max_model_len - len(token_ids)
        if room < 1:
            raise self._too_long(str(len(token_ids)), job.param("prompt"), where)
        if job.clamp_max_tokens and params.max_tokens is not None and params.max_tokens > room:
            params = dataclasses.replace(
                params, max_tokens=room, min_tokens=min(params.min_tokens, room)
            )
        try:
            request = self.model.make_request(token_ids, params, request_id)
            if adapter is not None:  # the core looks it up again by name
                request.lora = LoRARequest(adapter.name, adapter.int_id, adapter.path)
            return request
        except ValueError as exc:  # the engine's validation: the prompt, its length, logit_bias
            message = str(exc)
            constraint = job.constraint
            if message.startswith("logit_bias"):  # a token id outside the vocabulary
                raise bad_request(message, param="logit_bias") from None
            if constraint is not None and message.startswith("structured"):  # its grammar
                raise constraint_error(message, constraint.param, constraint.where) from None
            if "plus max_tokens" in message:
                name = job.param("max_tokens")
                raise bad_request(where + message.replace("max_tokens", name), name) from None
            raise bad_request(where + message, param=job.param("prompt")) from None


def render_chat(
    model: ServedModel,
    messages: list[Message],
    tools: list[dict[str, Any]] | None = None,
    job: Job | None = None,
) -> str:
    """The tokenizer's chat template applied to `messages` (and `tools`, when any may be
    called), as text."""
    tokenizer = model.tokenizer
    param = job.param("prompt") if job is not None else "messages"
    problem = chat_template_problem(tokenizer)
    if problem is not None:
        instead = "token ids" if tokenizer is None else "a plain prompt"
        raise bad_request(
            f"{problem}, so a conversation cannot become a prompt; use /v1/completions with "
            f"{instead}",
            param=param,
        )
    conversation = [m.template_message() for m in messages]
    kwargs = job.template_kwargs if isinstance(job, ChatJob) else {}
    taken = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if taken:
        raise bad_request(
            f"chat_template_kwargs may not set {', '.join(taken)}: the server sets it",
            param="chat_template_kwargs",
        )
    try:
        return tokenizer.apply_chat_template(
            conversation, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
        )
    except Exception as exc:  # jinja's TemplateError, raise_exception() in templates
        raise bad_request(f"the chat template refused these messages: {exc}", param=param) from None


def completion_prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[Prompt]:
    """One prompt, or a list of them (strings or token-id lists), as OpenAI accepts."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]
