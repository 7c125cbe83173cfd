"""The messages between API-server processes and engine-core processes, and their encoding.

msgpack via msgspec: typed, validated on decode, and a few microseconds per message. Traffic is
batched both ways: a front end sends one `Inbox` per event-loop turn (every new request and
abort of that turn), and a core sends one `StepOutputs` per step to each front end with work in
it, carrying every request's new token ids. Never a message per token per request.
"""

from __future__ import annotations

import msgspec

from tandem.request import SamplingParams


class NewRequest(msgspec.Struct, array_like=True):
    """A validated, tokenized request; the core resolves its seed and lengths again."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_name: str | None = None  # the LoRA adapter it runs under, by name (None: the base model)


class Abort(msgspec.Struct, array_like=True):
    request_id: str
    index: int | None = None  # one sample (a stop string hit in the front end), or all


class Hello(msgspec.Struct, tag=True):
    """A front end's first message: the core answers `Ready` (or `CoreFailed`)."""

    frontend: int


class Inbox(msgspec.Struct, tag=True):
    adds: list[NewRequest] = []
    aborts: list[Abort] = []


class Shutdown(msgspec.Struct, tag=True):
    """Stop at once (the front ends have drained or failed): what is in flight is dropped."""


class TimelineQuery(msgspec.Struct, tag=True):
    """The steps retired after step `after` (-1: the latest `TIMELINE_S` seconds' worth), for
    the dashboard: asked about once a second while a page shows it, answered between steps."""

    after: int = -1


class LoraCard(msgspec.Struct, array_like=True):
    """A LoRA adapter a core holds: its name (a request's `model`), its PEFT folder, the core's
    own number for it, and the base model /v1/models names as its parent (None: the served one)."""

    name: str
    path: str
    int_id: int
    base_model_name: str | None = None


class LoraLoad(msgspec.Struct, tag=True):
    """Load an adapter (vLLM's /v1/load_lora_adapter): read on a thread of the core, answered
    with a `LoraAnswer` once done, the loop stepping meanwhile. `query` pairs the answer."""

    query: int
    name: str
    path: str
    base_model_name: str | None = None


class LoraUnload(msgspec.Struct, tag=True):
    """Unload an adapter by name, or by the core's number for it: requests may no longer name
    it (those under way keep it to their end)."""

    query: int
    name: str | None = None
    int_id: int | None = None


class LoraList(msgspec.Struct, tag=True):
    """Which adapters the core holds (a front end meeting a model name it does not know)."""

    query: int


FrontendMessage = Hello | Inbox | Shutdown | TimelineQuery | LoraLoad | LoraUnload | LoraList


class Ready(msgspec.Struct, tag=True):
    """What a front end needs from the core to validate requests for it."""

    engine_index: int
    pid: int
    model_path: str
    model_type: str  # transformers' name of the architecture ("llama", "gemma3_text")
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_kv_blocks: int
    max_num_seqs: int
    execution: str  # the device and threads, as the engine describes them
    reasoning_parser: str | None  # the engine's, resolved (None: no reasoning parser)
    # The model's sampling defaults for what a request leaves unset, and where they come from.
    sampling_defaults: dict[str, float | int]
    sampling_defaults_note: str
    # LoRA: whether requests may name adapters, and those loaded at start (--lora-modules).
    enable_lora: bool = False
    adapters: list[LoraCard] = []


class CoreStats(msgspec.Struct, array_like=True):
    """The engine's state after a step: a few integers, so every step message carries them."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int
    num_preemptions: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefix_hit_requests: int
    prefix_hit_rate: float
    device_idle_fraction: float  # of the latest ~1 s window with steps
    num_steps: int  # steps retired since start
    # Speculative decoding since start (zeros without it): the (request, step) pairs that
    # verified drafts, draft tokens verified and accepted, and the two figures made of them.
    spec_drafts: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_acceptance_rate: float
    spec_mean_accepted_length: float
    spec_method: str  # the drafting method in use ("" without speculation)
    generation_tokens: int = 0  # output tokens sent since start (dropped speculative ones not)


class TokenDelta(msgspec.Struct, array_like=True):
    """One sample's new tokens from one step (and how it ended, if it did)."""

    request_id: str
    index: int
    token_ids: list[int]
    num_output_tokens: int  # cumulative, as the core counts them
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    # Per new token, when asked for: (token id, logprob, rank), the sampled token first.
    logprobs: list[list[tuple[int, float, int]]] | None = None
    # On the finished delta of a sample that verified drafts: its draft tokens, accepted ones
    # and verifying steps.
    speculative: tuple[int, int, int] | None = None
    # The HTTP status an `error` stands for where it is not 500: 404 for a LoRA adapter the core
    # does not hold (unloaded through another front end).
    error_status: int | None = None


class StepOutputs(msgspec.Struct, tag=True):
    deltas: list[TokenDelta]
    stats: CoreStats


class StepSpans(msgspec.Struct, array_like=True):
    """One retired step on the core's clock (`time.perf_counter`, seconds): when the device ran
    it, the time within that it waited for a grammar bitmask, and the host's phases."""

    step_id: int
    num_tokens: int
    num_seqs: int
    device: tuple[float, float]
    device_wait: float
    skipped: bool
    host: dict[str, tuple[float, float]]


class Timeline(msgspec.Struct, tag=True):
    """The answer to a `TimelineQuery`: the steps asked for, oldest first, and the core's clock
    as it answered (a reader places the steps against its own time by it)."""

    now: float
    steps: list[StepSpans]


class CoreFailed(msgspec.Struct, tag=True):
    """The engine failed (its load or a step): the core exits after sending this."""

    message: str


class LoraAnswer(msgspec.Struct, tag=True):
    """A core's answer to a `LoraLoad`, `LoraUnload` or `LoraList`: the adapters it holds now,
    and the error, if the operation failed, with its HTTP status (400: a bad adapter, 404: no
    such adapter)."""

    query: int
    adapters: list[LoraCard]
    error: str | None = None
    status: int = 200


CoreMessage = Ready | StepOutputs | Timeline | CoreFailed | LoraAnswer

encode = msgspec.msgpack.Encoder().encode
frontend_decoder = msgspec.msgpack.Decoder(FrontendMessage)
core_decoder = msgspec.msgpack.Decoder(CoreMessage)


def failure_note(address: str) -> str:
    """Where a core that fails to start leaves its reason, next to its ipc:// socket: a front
    end that said hello too late (or not yet) still learns why, not only that it exited."""
    return address.removeprefix("ipc://") + ".failed"


def read_failure_note(address: str) -> str | None:
    try:
        with open(failure_note(address)) as f:
            return f.read() or None
    except OSError:
        return None
