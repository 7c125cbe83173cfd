"""One streamed request through any of a server's APIs, timed at the client.

Every request streams, so the time to first token and the gaps between content chunks are what
a user of the API sees. Each API's messages are read into one `Event` shape (new text, token
counts, the end, an error), so the load, the agent replay and the reports never look at a wire
format. The client is aiohttp, as vLLM's serving benchmark uses, for its cost: about 0.6x
httpx's CPU time for the same run, time the client would otherwise take from a server on the
same cores.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp


@dataclass
class RequestResult:
    """One request as the client saw it (times from `time.perf_counter`)."""

    ok: bool = False
    error: str | None = None  # "HTTP 400", "stream error: ...", an exception's name
    detail: str = ""  # the start of an error response's body
    start: float = 0.0
    end: float = 0.0
    ttft: float | None = None  # seconds to the first chunk with text
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with text
    completion_tokens: int = 0  # as the server counted them (its usage figures)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens the server says it served from a cache
    pieces: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def e2el(self) -> float:
        return self.end - self.start

    @property
    def itls(self) -> list[float]:
        times = self.chunk_times
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT)."""
        if self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.completion_tokens - 1)


@dataclass(frozen=True)
class Event:
    """What one streamed message says."""

    text: str = ""
    tokens: int | None = None  # the output's token count, where the message gives it
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    done: bool = False
    error: str | None = None


def openai_event(chunk: dict, chat: bool) -> Event:
    if "error" in chunk:
        error = chunk["error"]
        return Event(
            error=f"stream error: {error.get('code') if isinstance(error, dict) else error}"
        )
    choices = chunk.get("choices") or []
    if chat:
        text = "".join((c.get("delta") or {}).get("content") or "" for c in choices)
    else:
        text = "".join(c.get("text") or "" for c in choices)
    usage = chunk.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    timings = chunk.get("timings") or {}  # llama-server's: cache_n prompt tokens reused
    if "cache_n" in timings:
        cached = timings["cache_n"]
    return Event(text, usage.get("completion_tokens"), usage.get("prompt_tokens"), cached)


def messages_event(chunk: dict) -> Event:
    kind = chunk["type"]
    if kind == "content_block_delta":
        return Event(chunk["delta"].get("text", ""))
    if kind == "message_start":
        usage = chunk["message"].get("usage") or {}
        return Event(prompt_tokens=usage.get("input_tokens"))
    if kind == "message_delta":
        return Event(tokens=chunk["usage"]["output_tokens"])
    if kind == "error":
        return Event(error=f"stream error: {chunk['error']['type']}")
    return Event(done=kind == "message_stop")


def responses_event(chunk: dict) -> Event:
    kind = chunk["type"]
    if kind == "response.output_text.delta":
        return Event(chunk["delta"])
    if kind in ("response.completed", "response.incomplete"):
        usage = chunk["response"]["usage"]
        cached = (usage.get("input_tokens_details") or {}).get("cached_tokens")
        return Event(
            tokens=usage["output_tokens"],
            prompt_tokens=usage.get("input_tokens"),
            cached_tokens=cached,
            done=True,
        )
    if kind == "response.failed":
        return Event(error="stream error: response.failed")
    return Event()


def ollama_event(chunk: dict) -> Event:
    if "error" in chunk:
        return Event(error="stream error")
    if chunk.get("done"):
        return Event(
            tokens=chunk["eval_count"], prompt_tokens=chunk.get("prompt_eval_count"), done=True
        )
    return Event(chunk["message"]["content"])


def sse_reader(decode: Callable[[dict], Event]) -> Callable[[bytes], Event | None]:
    def read(raw: bytes) -> Event | None:
        if not raw.startswith(b"data: "):
            return None
        data = raw[6:].strip()
        return Event(done=True) if data == b"[DONE]" else decode(json.loads(data))

    return read


def ndjson_reader(decode: Callable[[dict], Event]) -> Callable[[bytes], Event | None]:
    return lambda raw: decode(json.loads(raw)) if raw.strip() else None


@dataclass(frozen=True)
class API:
    path: str
    read: Callable[[bytes], Event | None]  # one line of the stream; None: it says nothing


APIS: dict[str, API] = {
    "completions": API("/v1/completions", sse_reader(lambda c: openai_event(c, False))),
    "chat": API("/v1/chat/completions", sse_reader(lambda c: openai_event(c, True))),
    "messages": API("/v1/messages", sse_reader(messages_event)),
    "responses": API("/v1/responses", sse_reader(responses_event)),
    "ollama": API("/api/chat", ndjson_reader(ollama_event)),
}


@dataclass(frozen=True)
class Sampling:
    """What every request of a load asks for."""

    max_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = True  # vLLM's extension: only the OpenAI endpoints take it


def request_body(api: str, model: str, prompt: str | list[int], sampling: Sampling) -> dict:
    """The same request in each API's words (the chat APIs: the prompt as one user turn)."""
    return messages_body(api, model, [{"role": "user", "content": prompt}], prompt, sampling)


def messages_body(
    api: str, model: str, messages: list[dict], prompt: str | list[int] | None, sampling: Sampling
) -> dict:
    """A request of `messages` (the chat APIs) or of `prompt` (completions, responses)."""
    if api == "messages":
        body = {"messages": messages, "max_tokens": sampling.max_tokens}
    elif api == "responses":
        body = {"input": prompt, "max_output_tokens": sampling.max_tokens, "store": False}
    elif api == "ollama":
        options = {"num_predict": sampling.max_tokens, "temperature": sampling.temperature}
        return {"model": model, "messages": messages, "options": options, "stream": True}
    else:
        body = {"max_tokens": sampling.max_tokens, "stream_options": {"include_usage": True}}
        body |= {"messages": messages} if api == "chat" else {"prompt": prompt}
        if sampling.ignore_eos:
            body["ignore_eos"] = True
    return {"model": model, "temperature": sampling.temperature, "stream": True, **body}


def open_session(concurrency: int, timeout_s: float) -> aiohttp.ClientSession:
    """The load's HTTP client. A fresh connection per request: llama-server closes kept-alive
    connections, and aiohttp reusing one the server has just closed fails the request (a fifth
    of them at 32 streams); a local connection costs the server well under a millisecond."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency, force_close=True),
        timeout=aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=timeout_s),
    )


async def stream_request(
    client: aiohttp.ClientSession, url: str, api: API, body: dict
) -> RequestResult:
    """Sends one request to `url` (the server's root) and reads its stream to the end."""
    result = RequestResult(start=time.perf_counter())
    try:
        async with client.post(url + api.path, json=body) as response:
            if response.status != 200:
                result.detail = (await response.read())[:200].decode(errors="replace")
                result.error = f"HTTP {response.status}"
                return result
            async for raw in response.content:
                event = api.read(raw)
                if event is not None and read_event(event, result):
                    break
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        result.error = type(exc).__name__
    finally:
        result.end = time.perf_counter()
    return result


def read_event(event: Event, result: RequestResult) -> bool:
    """Adds what `event` says to `result`; True at the end of the stream."""
    if event.error is not None:
        result.error = event.error
    if event.tokens is not None:
        result.completion_tokens = event.tokens
    if event.prompt_tokens is not None:
        result.prompt_tokens = event.prompt_tokens
    if event.cached_tokens is not None:
        result.cached_tokens = event.cached_tokens
    if event.text:
        now = time.perf_counter()
        if result.ttft is None:
            result.ttft = now - result.start
        result.chunk_times.append(now)
        result.pieces.append(event.text)
    if event.done:
        result.ok = result.error is None
    return event.done


@dataclass(frozen=True)
class ServedModel:
    name: str
    root: str | None  # where the server loaded it from (Tandem's and vLLM's cards say)


async def served_model(client: aiohttp.ClientSession, url: str) -> ServedModel:
    """The first model of the server's /v1/models."""
    async with client.get(url + "/v1/models") as response:
        response.raise_for_status()
        card = (await response.json())["data"][0]
    return ServedModel(card["id"], card.get("root"))


async def metrics_text(client: aiohttp.ClientSession, url: str) -> str | None:
    """The server's /metrics; None where it has none or does not answer."""
    try:
        async with client.get(url + "/metrics") as response:
            return await response.text() if response.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


def side_session() -> aiohttp.ClientSession:
    """A client apart from the load's, so that reading /metrics never waits behind its
    connections."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10.0))
