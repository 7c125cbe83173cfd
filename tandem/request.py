"""Requests, their sampling parameters and the outputs streamed back to callers."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tandem.lora import LoRARequest
from tandem.metrics import SpeculativeStats
from tandem.reasoning import ReasoningTracker

MAX_LOGPROBS = 20  # top alternatives per token, as vLLM's default max_logprobs
# The longest schema, regex, grammar or choice list a request may carry (characters): compiling
# grows with it, and a request is no place for a megabyte of grammar.
MAX_GRAMMAR_CHARS = 64 * 1024
GRAMMAR_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's fields): exactly one of a JSON schema, any JSON object,
    a regular expression, a choice among strings, an EBNF (or Lark) grammar, or an xgrammar
    structural tag (JSON text). Invalid values raise ValueError naming the field."""

    json: str | dict | None = None  # a JSON schema (dict or its text); kept as canonical text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in GRAMMAR_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(GRAMMAR_KINDS)}; got {', '.join(given) or 'none'}"
            )
        if isinstance(self.json, dict):
            self.json = json.dumps(self.json, separators=(",", ":"))  # properties keep their order
        for name in ("json", "regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a boolean")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            if any(not isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must hold strings only")
        if len(self.key[1]) > MAX_GRAMMAR_CHARS:
            raise ValueError(
                f"structured_outputs.{self.kind} is {len(self.key[1])} characters long; "
                f"at most {MAX_GRAMMAR_CHARS} are accepted"
            )

    @property
    def kind(self) -> str:
        return next(k for k in GRAMMAR_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): equal for requests that compile to the same grammar."""
        kind = self.kind
        if kind == "choice":
            return kind, json.dumps(self.choice)
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)


# The sampling fields a checkpoint's defaults may set (generation_config.json's names too).
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "thinking_token_budget"
)  # fmt: skip


@dataclass
class SamplingParams:
    """How to sample one request; named and defaulted as in vLLM. Invalid values raise ValueError."""

    max_tokens: int | None = 16  # None: up to the context limit
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1  # samples of the prompt; they share its KV blocks
    # Penalties: presence and frequency as in OpenAI (generated tokens only), repetition as in
    # transformers (prompt and generated tokens; > 1 discourages repeats).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens exist
    # Log-probabilities of the model's raw logits (before penalties and temperature): the sampled
    # token's plus this many top alternatives per generated (or, for prompt_logprobs, prompt) token.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Constrained decoding: every output token keeps the text a prefix of the grammar's language.
    # With a reasoning model, the answer after the thinking is constrained, never the thinking.
    structured_outputs: StructuredOutputsParams | None = None
    # Reasoning models: the most thinking tokens before the end of the block is forced (None:
    # no bound; 0: the block closes at once). Only with the engine's reasoning parser.
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(
                f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}"
            )
        self.top_k = max(self.top_k, 0)
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        self._check_penalties()
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict")
        budget = self.thinking_token_budget
        if budget is not None and (not _is_int(budget) or budget < 0):
            raise ValueError(
                f"thinking_token_budget must be None or a non-negative integer, got {budget!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(
                    f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}"
                )

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError("logit_bias must be a dict of token id -> bias")
        self.logit_bias = dict(self.logit_bias or {})
        for token, bias in self.logit_bias.items():
            if not _is_int(token) or token < 0:
                raise ValueError(
                    f"logit_bias must have token ids (integers >= 0) as keys, got {token!r}"
                )
            if not _is_number(bias) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias must have biases in [-100, 100], got {bias!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class Logprob:
    """One token's log-probability under the model's raw distribution, as vLLM reports it."""

    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


TokenLogprobs = dict[int, Logprob]  # token id -> Logprob: the sampled (or prompt) token first


@dataclass
class LogitsProcessing:
    """A request's logits processing beyond temperature and truncation, resolved by the engine
    against the model (token ids checked, stop ids for min_tokens gathered). None on a request
    that needs none, so the common path skips all of it."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    bias_values: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    min_tokens: int = 0
    min_tokens_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    uses_penalties: bool = field(init=False)

    def __post_init__(self) -> None:
        self.uses_penalties = self.presence != 0 or self.frequency != 0 or self.repetition != 1

    @property
    def used(self) -> bool:
        return self.uses_penalties or len(self.bias_ids) > 0 or len(self.min_tokens_ids) > 0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # compared by identity: the queues remove a request, not an equal one
class Request:
    """One request's host-side state; with n > 1, one sample of it (`index`).

    Token bookkeeping in the asynchronous loop: `output_token_ids` holds retired tokens only;
    `num_inflight` counts tokens that launched steps will sample but that the host has not read
    yet. `num_computed_tokens` counts tokens whose KV a launched step writes. With drafts in
    flight both are upper bounds (every draft accepted), exact again once their steps retire.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the effective sampling seed: the user's, or one derived from the engine's seed
    sampling_row: tuple[float, int, float, float, int]  # temperature, top_k, top_p, min_p, seed key
    max_tokens: int  # resolved against the context limit
    arrival_time: float
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_inflight: int = 0
    num_computed_tokens: int = 0
    # Speculative decoding: drafts in flight (their acceptance is not known yet, so num_inflight
    # and num_computed_tokens are upper bounds by this much), its accepted drafts and tries
    # (decaying counts), and steps since it last drafted (`scheduling/draft_policy.py`).
    num_speculative: int = 0
    draft_hits: float = 0.0
    draft_tries: float = 0.0
    steps_without_drafts: int = 0
    # Its own speculative decoding (RequestOutput.speculative reports it).
    speculation: SpeculativeStats = field(default_factory=SpeculativeStats)
    probe_backoff: int = 0  # its probes come PROBE_INTERVAL << this steps apart
    sampled_in_row: bool = False  # a step since admission sampled it: the device has its length
    # KV blocks per group of layers (`scheduling/kv_groups.py`; one group unless layers differ
    # in window), by block of positions; DROPPED where a window has passed a block.
    block_ids: list[list[int]] = field(default_factory=list)
    slot: int | None = None  # row of the device token table
    # With a LoRA adapter: its request, its loaded weights' key and, while running, its slot.
    lora: LoRARequest | None = None
    lora_key: str | None = None
    lora_slot: int = -1
    last_step: int = -1  # id of the last launched step that involves this request
    num_preemptions: int = 0
    finish_reason: str | None = None
    error: str | None = None  # why the engine ended it, when that was not the request's doing
    aborted: bool = False
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    index: int = 0  # which of the request's n samples this is
    # Prefix cache: chained hashes of the full blocks of known tokens (computed lazily), and how
    # many leading blocks of block_ids are in the cache (hits at admission, then registered).
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int | None = None  # prompt tokens its first admission found cached
    processing: LogitsProcessing | None = None
    # With structured outputs: the compiled grammar (shared by a request's samples), then each
    # sample's own matcher, advanced by retired tokens only (`engine/grammar.py`).
    compiled_grammar: Any = None
    grammar: Any = None
    # With a reasoning parser: the sample's phase over its retired tokens (`tandem/reasoning.py`).
    reasoning: ReasoningTracker | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per output token, when asked for
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # one per prompt token; [0] None

    @property
    def key(self) -> tuple[str, int]:
        """Unique among live requests: the owner of its KV blocks and token-table row."""
        return (self.request_id, self.index)

    @property
    def needs_extras(self) -> bool:
        """Does a step with this request need anything beyond plain sampling?"""
        asks_logprobs = self.logprobs is not None or self.prompt_logprobs is not None
        return self.processing is not None or asks_logprobs

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and some are not retired yet (so must be computed)."""
        done = self.prompt_logprobs
        return done is not None and len(done) < len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens known or in flight: the sequence length once every launched step retires."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight

    @property
    def num_scheduled_outputs(self) -> int:
        return len(self.output_token_ids) + self.num_inflight

    @property
    def can_sample_more(self) -> bool:
        """Lengths are certain, so the scheduler never over-schedules past max_tokens."""
        return self.num_scheduled_outputs < self.max_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def known_token_ids(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end), all retired (prompt, then outputs)."""
        prompt = self.prompt_token_ids
        n = len(prompt)
        if end <= n:
            return prompt[start:end]
        return prompt[start:n] + self.output_token_ids[max(0, start - n) : end - n]

    def token_id_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return (
            self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]
        )


@dataclass
class CompletionOutput:
    """One finished sample of a request (vLLM's name and fields)."""

    index: int
    text: str  # the answer (with a reasoning parser, what follows the thinking)
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None  # one per token_ids entry, when asked for
    reasoning: str | None = None  # the thinking, without its tags (None: no reasoning parser)


@dataclass
class RequestOutput:
    """What a caller sees of a request: cumulative text and ids plus what is new since last time.

    While the request runs, `token_ids` is its live list (copying it every step would cost
    O(n^2)); copy it to keep a snapshot. A finished output owns its list.

    With n > 1 the engine streams each sample separately: `index` says which one, and `finished`
    refers to that sample. `LLM.generate` returns one output per prompt whose `outputs` holds
    every sample in index order; its own text, token_ids and finish_reason are sample 0's, so
    n = 1 code reads it as before.
    """

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop", "length" or "abort"
    error: str | None = None
    index: int = 0
    outputs: list[CompletionOutput] = field(default_factory=list)  # filled by LLM.generate
    # With SamplingParams.logprobs: one dict per token of `token_ids` (live, like it), the sampled
    # token first, then the top alternatives by rank. With prompt_logprobs: one per prompt token,
    # None for the first (nothing predicts it), complete from the first output on.
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # With a reasoning parser: the thinking so far and its new part, without the tags (`text`
    # is then the answer alone; `token_ids` hold every token, tags included).
    reasoning: str | None = None
    delta_reasoning: str = ""
    # Prompt tokens the prefix cache served at the request's admission (vLLM's name); 0 before.
    num_cached_tokens: int = 0
    # Speculative decoding, once the sample has verified drafts: its draft tokens verified,
    # accepted, the steps that verified them, and the figures made of them.
    speculative: SpeculativeStats | None = None
