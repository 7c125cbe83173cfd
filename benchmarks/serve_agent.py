"""The agent-session workload through a server's chat completions API (`serve_compare.py
--workload agent`): `tandem bench --workload agent`'s sessions, replayed as an agent sends them.

Each session is a conversation: a long system message of tool definitions (the head every
session shares), then turns, each one request of the whole conversation so far, streamed,
greedy, `max_tokens` the answer's length with `ignore_eos` (Tandem, vLLM and llama-server take
it). The text the server streamed back is the assistant message of the next turn, followed by
the next tool result: what each server really produced, as a client keeps it. A session's next
turn is sent when its previous answer is complete; the sessions run at once.

Prompt tokens served from a cache, where the server says: llama-server's `timings.cache_n` per
request, vLLM's `usage.prompt_tokens_details.cached_tokens`, and for Tandem (and vLLM) the
prefix-cache counters of /metrics read before and after the run.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import serve_load

from tandem.bench.agent import AgentShape, AgentTexts

CHAT_PATH = "/v1/chat/completions"
# /metrics counters of prompt tokens looked up in, and served from, the prefix cache: Tandem's
# names, and vLLM's.
CACHE_COUNTERS = {
    "queries": ("tandem_prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
    "hits": ("tandem_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
}


@dataclass
class Turn:
    session: int
    turn: int  # 0-based
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens the server says it served from a cache
    text: str = ""


@dataclass
class AgentCell:
    """One repeat of the sessions on one server."""

    turns: list[Turn]
    wall_s: float
    cache: dict[str, float] = field(default_factory=dict)  # /metrics counters' growth

    @property
    def ok(self) -> list[Turn]:
        return [t for t in self.turns if t.ok]

    def ttft_ms(self, later: bool, q: float) -> float:
        """TTFT percentile of first turns (later=False) or of the turns after them."""
        return serve_load.pct(
            [t.ttft_s for t in self.ok if (t.turn > 0) == later and t.ttft_s is not None], q
        )

    @property
    def output_tokens_per_s(self) -> float:
        return sum(t.completion_tokens for t in self.ok) / self.wall_s

    def cached_share(self) -> float:
        """Prompt tokens served from a cache over prompt tokens: from /metrics, else from the
        requests' own figures; NaN where the server gives neither."""
        if self.cache.get("queries"):
            return self.cache["hits"] / self.cache["queries"]
        known = [t for t in self.ok if t.cached_tokens is not None and t.prompt_tokens]
        if not known:
            return math.nan
        return sum(t.cached_tokens for t in known) / sum(t.prompt_tokens for t in known)


def body(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict:
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def one_turn(client: aiohttp.ClientSession, request: dict, turn: Turn) -> Turn:
    """Streams one turn: its text, TTFT, token counts and what the server says it cached."""
    start = time.perf_counter()
    try:
        async with client.post(CHAT_PATH, json=request) as response:
            if response.status != 200:
                turn.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return turn
            async for raw in response.content:
                if not raw.startswith(b"data: "):
                    continue
                data = raw[6:].strip()
                if data == b"[DONE]":
                    turn.ok = turn.error is None
                    break
                read_chunk(json.loads(data), turn, start)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        turn.error = type(exc).__name__
    return turn


def read_chunk(chunk: dict, turn: Turn, start: float) -> None:
    if "error" in chunk:
        turn.error = f"stream error: {chunk['error']}"
        return
    for choice in chunk.get("choices", []):
        text = (choice.get("delta") or {}).get("content") or ""
        if text and turn.ttft_s is None:
            turn.ttft_s = time.perf_counter() - start
        turn.text += text
    usage = chunk.get("usage") or {}
    if usage:
        turn.completion_tokens = usage.get("completion_tokens", 0)
        turn.prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            turn.cached_tokens = details["cached_tokens"]
    timings = chunk.get("timings")  # llama-server's: cache_n reused, prompt_n computed
    if timings and "cache_n" in timings:
        turn.cached_tokens = timings["cache_n"]


async def cache_counters(url: str) -> dict[str, float]:
    """The /metrics prefix-cache counters (empty where the server has none)."""
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10.0) as client:
            text = (await client.get("/metrics")).text
    except httpx.HTTPError:
        return {}
    found: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        base = name.partition("{")[0]
        for key, names in CACHE_COUNTERS.items():
            if base in names:
                found[key] = found.get(key, 0.0) + float(value.split()[0])
    return found


async def run_sessions(
    url: str, texts: AgentTexts, shape: AgentShape, timeout_s: float
) -> AgentCell:
    """Every session's turns against the server at `url`, closed loop."""
    results = {
        (s, k): texts.turn_message(s, k)
        for s in range(shape.sessions)
        for k in range(1, shape.turns)
    }
    before = await cache_counters(url)
    async with serve_load.session(url, shape.sessions, timeout_s) as client:
        model = await serve_load.first_model(client)

        async def one_session(s: int) -> list[Turn]:
            await asyncio.sleep(shape.start_time(s))
            messages, turns = texts.first_messages(s), []
            for k in range(shape.turns):
                turn = await one_turn(client, body(model, messages, shape.output_len), Turn(s, k))
                turns.append(turn)
                if not turn.ok or k + 1 == shape.turns:
                    break
                messages = messages + [
                    {"role": "assistant", "content": turn.text},
                    {"role": "user", "content": results[s, k + 1]},
                ]
            return turns

        start = time.perf_counter()
        sessions = await asyncio.gather(*(one_session(s) for s in range(shape.sessions)))
        wall = time.perf_counter() - start
    after = await cache_counters(url)
    growth = {k: after[k] - before.get(k, 0.0) for k in after}
    return AgentCell([t for turns in sessions for t in turns], wall, growth)


def median(values: list[float]) -> float:
    clean = [v for v in values if v == v]
    return statistics.median(clean) if clean else math.nan


def summarize(label: str, cells: list[AgentCell], shape: AgentShape) -> dict:
    """Medians over the repeats of one server."""
    expected = shape.sessions * shape.turns
    return {
        "label": label,
        "first_ttft_p50_ms": median([c.ttft_ms(False, 50) for c in cells]),
        "later_ttft_p50_ms": median([c.ttft_ms(True, 50) for c in cells]),
        "later_ttft_p90_ms": median([c.ttft_ms(True, 90) for c in cells]),
        "wall_s": median([c.wall_s for c in cells]),
        "output_tokens_per_s": median([c.output_tokens_per_s for c in cells]),
        "cached_share": median([c.cached_share() for c in cells]),
        "failed_turns": sum(expected - len(c.ok) for c in cells),
        "short_turns": sum(t.completion_tokens != shape.output_len for c in cells for t in c.ok),
        "repeats": len(cells),
        "wall_s_by_repeat": [c.wall_s for c in cells],
        "later_ttft_p50_ms_by_repeat": [c.ttft_ms(True, 50) for c in cells],
    }


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| server | first-turn TTFT p50 (ms) | later TTFT p50 (ms) | later TTFT p90 (ms) "
        "| wall (s) | output tok/s | prompt tokens cached |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        share = row["cached_share"]
        cached = f"{share:.1%}" if math.isfinite(share) else "–"
        lines.append(
            f"| {row['label']} | {row['first_ttft_p50_ms']:.0f} | {row['later_ttft_p50_ms']:.0f} "
            f"| {row['later_ttft_p90_ms']:.0f} | {row['wall_s']:.2f} "
            f"| {row['output_tokens_per_s']:.1f} | {cached} |"
        )
    return "\n".join(lines)


def draw(rows: list[dict], path: Path, title: str) -> None:
    """TTFT of first and later turns (p50, whisker to p90 for later turns) and wall time, one
    bar per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = [row["label"] for row in rows]
    x = np.arange(len(labels))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    first = [row["first_ttft_p50_ms"] for row in rows]
    later = np.array([row["later_ttft_p50_ms"] for row in rows])
    p90 = np.array([row["later_ttft_p90_ms"] for row in rows])
    left.bar(x - 0.2, first, 0.4, label="first turns, p50", color="C0")
    whisker = [np.zeros_like(later), np.clip(p90 - later, 0, None)]
    left.bar(x + 0.2, later, 0.4, yerr=whisker, capsize=3, label="later turns, p50 (to p90)",
             color="C1")  # fmt: skip
    left.set_yscale("log")
    left.set_title("time to first token (ms, lower is better)")
    left.legend(fontsize=8)
    bars = right.bar(x, [row["wall_s"] for row in rows], 0.6, color=[f"C{i + 2}" for i in x])
    right.bar_label(bars, fmt="%.1f", fontsize=8)
    right.set_title("wall time of all sessions (s, lower is better)")
    for ax in (left, right):
        ax.set_xticks(x, labels, rotation=15, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
