"""Prometheus metrics of one app, in a registry of its own (two apps in a process never clash).

Engine gauges are read at scrape time (plain integer reads, safe from any thread); counters and
latency histograms are updated on the event loop as outputs reach the server, so TTFT and
inter-token latency are what the HTTP side sees, queueing and thread hand-off included.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily

from tandem.engine import Engine

CONTENT_TYPE = CONTENT_TYPE_LATEST

_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ServerMetrics:
    def __init__(
        self,
        engine: Engine,
        in_flight: Callable[[], int],
        device_idle_fraction: Callable[[], float],
    ):
        self.registry = CollectorRegistry()
        reg = self.registry

        for name, doc, read in (
            ("tandem_requests_running", "Requests running.", lambda: engine.stats().num_running),
            ("tandem_requests_waiting", "Requests queued.", lambda: engine.stats().num_waiting),
            (
                "tandem_requests_in_flight",
                "Sequences (prompts x n) accepted, not yet finished.",
                in_flight,
            ),
            (
                "tandem_kv_blocks_used",
                "KV-cache blocks in use.",
                lambda: engine.stats().kv_blocks_used,
            ),
            (
                "tandem_kv_blocks_cached",
                "Free KV-cache blocks still holding a cached prefix (reusable until evicted).",
                lambda: engine.stats().kv_blocks_cached,
            ),
            (
                "tandem_prefix_cache_hit_rate",
                "Prompt tokens served from the prefix cache over prompt tokens admitted, since start.",
                lambda: engine.stats().prefix_cache.hit_rate,
            ),
            (
                "tandem_kv_blocks_total",
                "KV-cache blocks in all.",
                lambda: engine.stats().kv_blocks_total,
            ),
            (
                "tandem_device_idle_fraction",
                "Device idle time over the engine's busy time (first to last step) in the latest "
                "~1 s window with work: the host overhead the async loop is meant to hide.",
                device_idle_fraction,
            ),
        ):
            Gauge(name, doc, registry=reg).set_function(read)

        reg.register(_EngineCounters(engine))
        self.finished = Counter(
            "tandem_requests_finished",
            "Finished sequences (one per sample of each prompt).",
            ["finish_reason"],
            registry=reg,
        )
        self.rejected = Counter(
            "tandem_requests_rejected",
            "Requests refused with 503 (full or shutting down).",
            registry=reg,
        )
        self.prompt_tokens = Counter(
            "tandem_prompt_tokens", "Prompt tokens of accepted requests.", registry=reg
        )
        self.generation_tokens = Counter(
            "tandem_generation_tokens", "Tokens generated.", registry=reg
        )
        self.ttft = Histogram(
            "tandem_time_to_first_token_seconds",
            "From the server accepting a request to its first token reaching the event loop.",
            buckets=_TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "tandem_inter_token_latency_seconds",
            "Between consecutive tokens of a request reaching the event loop.",
            buckets=_ITL_BUCKETS,
            registry=reg,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCounters:
    """The engine's own counters, read at scrape time (plain integers the loop thread bumps)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def describe(self) -> list:
        return []  # collected only at scrape time: no read while the collector is registered

    def collect(self):
        s = self.engine.stats()
        stats = s.prefix_cache
        for name, doc, value in (
            ("tandem_preemptions", "Requests preempted (their KV dropped, recomputed later).",
             s.num_preemptions),
            ("tandem_prefix_cache_queries", "Tokens of admitted requests looked up in the "
             "prefix cache (prompt, plus outputs when recomputing).", stats.query_tokens),
            ("tandem_prefix_cache_hits", "Tokens served from the prefix cache: prefill saved.",
             stats.hit_tokens),
            ("tandem_prefix_cache_hit_requests", "Admissions that reused at least one cached "
             "KV block.", stats.hits),
        ):  # fmt: skip
            yield CounterMetricFamily(name, doc, value=value)
