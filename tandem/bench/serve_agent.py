"""Agent sessions replayed through a server's chat completions API (`tandem bench serve
--dataset-name agent`, and `tandem bench compare --workload agent` on every server): `tandem
bench --workload agent`'s sessions, sent as an agent sends them.

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

import argparse
import asyncio
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.bench.agent import AGENT_OUTPUT_LEN, AgentShape, AgentTexts
from tandem.bench.serve_client import (
    APIS,
    RequestResult,
    Sampling,
    messages_body,
    metrics_text,
    open_session,
    served_model,
    side_session,
    stream_request,
)
from tandem.bench.serve_metrics import pct_ms

# /metrics counters of prompt tokens looked up in, and served from, the prefix cache: Tandem's
# names, and vLLM's.
CACHE_COUNTERS = {
    "queries": ("tandem_prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
    "hits": ("tandem_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
}


@dataclass
class Turn:
    """One turn of one session: its request's result (the text is the next turn's assistant
    message)."""

    session: int
    turn: int  # 0-based
    result: RequestResult

    @property
    def ok(self) -> bool:
        return self.result.ok

    @property
    def error(self) -> str | None:
        return self.result.error and f"{self.result.error} {self.result.detail}".strip()


@dataclass
class AgentCell:
    """One run of the sessions on one server."""

    turns: list[Turn]
    wall_s: float
    cache: dict[str, float] = field(default_factory=dict)  # /metrics counters' growth
    model: str = ""
    output_len: int = AGENT_OUTPUT_LEN

    @property
    def ok(self) -> list[Turn]:
        return [t for t in self.turns if t.ok]

    @property
    def results(self) -> list[RequestResult]:
        return [t.result for t in self.turns]

    def ttft_ms(self, later: bool, q: float) -> float:
        """TTFT percentile of first turns (later=False) or of the turns after them."""
        return pct_ms(
            [t.result.ttft for t in self.ok if (t.turn > 0) == later and t.result.ttft is not None],
            q,
        )

    @property
    def output_tokens_per_s(self) -> float:
        return sum(t.result.completion_tokens for t in self.ok) / self.wall_s

    def cached_share(self) -> float:
        """Prompt tokens served from a cache over prompt tokens: from /metrics, else from the
        requests' own figures; NaN where the server gives neither."""
        if self.cache.get("queries"):
            return self.cache["hits"] / self.cache["queries"]
        known = [t.result for t in self.ok if t.result.cached_tokens is not None]
        prompt = sum(r.prompt_tokens or 0 for r in known)
        if not prompt:
            return math.nan
        return sum(r.cached_tokens or 0 for r in known) / prompt

    def agent_summary(self) -> dict:
        """The agent's own figures, beside the load's (serve_metrics.summarize)."""
        return {
            "first_ttft_p50_ms": self.ttft_ms(False, 50),
            "later_ttft_p50_ms": self.ttft_ms(True, 50),
            "later_ttft_p90_ms": self.ttft_ms(True, 90),
            "cached_share": self.cached_share(),
            "short_turns": sum(t.result.completion_tokens != self.output_len for t in self.ok),
        }


async def cache_counters(url: str) -> dict[str, float]:
    """The /metrics prefix-cache counters (empty where the server has none)."""
    async with side_session() as client:
        text = await metrics_text(client, url)
    found: dict[str, float] = {}
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        base = name.partition("{")[0]
        for key, names in CACHE_COUNTERS.items():
            if base in names:
                found[key] = found.get(key, 0.0) + float(value.split()[0])
    return found


async def run_sessions(
    url: str, texts: AgentTexts, shape: AgentShape, timeout_s: float, model: str | None = None
) -> AgentCell:
    """Every session's turns against the server at `url` (its root), closed loop: a session's
    next turn is sent when its previous answer is complete."""
    url = url.rstrip("/")
    chat = APIS["chat"]
    sampling = Sampling(shape.output_len, temperature=0.0, ignore_eos=True)
    results = {
        (s, k): texts.turn_message(s, k)
        for s in range(shape.sessions)
        for k in range(1, shape.turns)
    }
    before = await cache_counters(url)
    async with open_session(shape.sessions, timeout_s) as client:
        name = model or (await served_model(client, url)).name

        async def one_session(s: int) -> list[Turn]:
            await asyncio.sleep(shape.start_time(s))
            messages, turns = texts.first_messages(s), []
            for k in range(shape.turns):
                body = messages_body("chat", name, messages, None, sampling)
                turn = Turn(s, k, await stream_request(client, url, chat, body))
                turns.append(turn)
                if not turn.ok or k + 1 == shape.turns:
                    break
                messages = messages + [
                    {"role": "assistant", "content": turn.result.text},
                    {"role": "user", "content": results[s, k + 1]},
                ]
            return turns

        start = time.perf_counter()
        sessions = await asyncio.gather(*(one_session(s) for s in range(shape.sessions)))
        wall = time.perf_counter() - start
    after = await cache_counters(url)
    growth = {k: after[k] - before.get(k, 0.0) for k in after}
    turns = [t for turns in sessions for t in turns]
    return AgentCell(turns, wall, growth, name, shape.output_len)


def agent_shape(args: argparse.Namespace) -> AgentShape:
    return AgentShape(
        args.sessions,
        args.turns,
        args.head_len,
        args.tool_result_len,
        args.output_len or AGENT_OUTPUT_LEN,
        args.session_stagger,
        args.agent_task,
    )


def agent_tokenizer(tokenizer: str | None, served_root: str | None, model: str | None) -> Any:
    """The tokenizer that sizes the texts: --tokenizer, else the served model's own files where
    they are on this machine, else --model (a path or a packaged model's name)."""
    from tandem.models.catalog import resolve_model
    from tandem.models.loader import find_tokenizer

    name = tokenizer
    if name is None and served_root is not None and Path(served_root).exists():
        name = served_root
    name = name or model
    if name is None:
        raise ValueError(
            "--dataset-name agent sizes its texts in the model's tokens, and the "
            "served model's files are not on this machine: give --tokenizer PATH"
        )
    path = resolve_model(name)
    if not path.exists():
        raise ValueError(f"--tokenizer: no model at {path}")
    tokenizer = find_tokenizer(path)
    if tokenizer is None:
        raise ValueError(f"--tokenizer: {path} has no tokenizer files")
    return tokenizer


async def run_agent_bench(url: str, args: argparse.Namespace) -> AgentCell:
    """`tandem bench serve --dataset-name agent`: the sessions once, their texts seeded by
    --seed."""
    shape = agent_shape(args)
    async with open_session(1, args.timeout) as client:
        served = await served_model(client, url)
    tokenizer = await asyncio.to_thread(agent_tokenizer, args.tokenizer, served.root, args.model)
    texts = AgentTexts(tokenizer, shape.head_len, shape.tool_result_len, args.seed, shape.task)
    return await run_sessions(url, texts, shape, args.timeout, args.model or served.name)


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
        "short_turns": sum(
            t.result.completion_tokens != shape.output_len for c in cells for t in c.ok
        ),
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
    left.bar(
        x + 0.2, later, 0.4, yerr=whisker, capsize=3, label="later turns, p50 (to p90)", color="C1"
    )
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
