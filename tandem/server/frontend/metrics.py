"""Prometheus metrics of one front end, in a registry of its own (two apps never clash).

The engine's figures (per engine core, labelled `engine`) come from the state every step
message carries, read at scrape time. Counters and latency histograms are updated on the event
loop as outputs arrive, so TTFT and inter-token latency are what the HTTP side sees. With
several front ends (`$PROMETHEUS_MULTIPROC_DIR` set before start-up), those live in shared files
and any front end's /metrics sums them over all.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from tandem.server.core.client import CoreClient

CONTENT_TYPE = CONTENT_TYPE_LATEST
MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"

_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

_ENGINE_GAUGES = (
    ("tandem_requests_running", "Requests running.", "num_running"),
    ("tandem_requests_waiting", "Requests queued.", "num_waiting"),
    ("tandem_kv_blocks_used", "KV-cache blocks in use.", "kv_blocks_used"),
    ("tandem_kv_blocks_cached",
     "Free KV-cache blocks still holding a cached prefix (reusable until evicted).",
     "kv_blocks_cached"),
    ("tandem_prefix_cache_hit_rate",
     "Prompt tokens served from the prefix cache over prompt tokens admitted, since start.",
     "prefix_hit_rate"),
    ("tandem_kv_blocks_total", "KV-cache blocks in all.", "kv_blocks_total"),
    ("tandem_device_idle_fraction",
     "Device idle time over the engine's busy time (first to last step) in the latest ~1 s "
     "window with work: the host overhead the async loop is meant to hide.",
     "device_idle_fraction"),
    ("tandem_spec_decode_acceptance_rate",
     "Speculative decoding: draft tokens accepted over draft tokens verified, since start.",
     "spec_acceptance_rate"),
    ("tandem_spec_decode_mean_accepted_length",
     "Speculative decoding: tokens a request gains per step that verifies drafts (its accepted "
     "drafts plus one of its own), since start; 0 before any.",
     "spec_mean_accepted_length"),
)  # fmt: skip
_ENGINE_COUNTERS = (
    ("tandem_preemptions", "Requests preempted (their KV dropped, recomputed later).",
     "num_preemptions"),
    ("tandem_prefix_cache_queries", "Tokens of admitted requests looked up in the prefix cache "
     "(prompt, plus outputs when recomputing).", "prefix_query_tokens"),
    ("tandem_prefix_cache_hits", "Tokens served from the prefix cache: prefill saved.",
     "prefix_hit_tokens"),
    ("tandem_prefix_cache_hit_requests", "Admissions that reused at least one cached KV block.",
     "prefix_hit_requests"),
    # vLLM's names (its spec_decode counters), so its dashboards read them.
    ("vllm:spec_decode_num_drafts", "Speculative decoding: (request, step) pairs that verified "
     "drafts.", "spec_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.",
     "spec_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.",
     "spec_accepted_tokens"),
)  # fmt: skip


class ServerMetrics:
    def __init__(self, client: CoreClient):
        self.multiprocess = bool(os.environ.get(MULTIPROCESS_ENV))
        self.registry = CollectorRegistry()
        reg = self.registry
        self._engines = _EngineFigures(client)
        reg.register(self._engines)
        self.in_flight = Gauge(
            "tandem_requests_in_flight",
            "Sequences (prompts x n) accepted, not yet finished.",
            registry=reg,
            multiprocess_mode="livesum",
        )
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
        if not self.multiprocess:
            return generate_latest(self.registry)
        registry = CollectorRegistry()  # every front end's counters, summed from their files
        MultiProcessCollector(registry)
        registry.register(self._engines)
        return generate_latest(registry)


class _EngineFigures:
    """Every core's gauges and counters from its latest step message, read at scrape time."""

    def __init__(self, client: CoreClient):
        self.client = client

    def describe(self) -> list:
        return []  # collected only at scrape time: no read while the collector is registered

    def collect(self):
        stats = [(str(i), s) for i, s in enumerate(self.client.stats) if s is not None]
        for kind, figures in ((GaugeMetricFamily, _ENGINE_GAUGES),
                              (CounterMetricFamily, _ENGINE_COUNTERS)):  # fmt: skip
            for name, doc, field in figures:
                # Speculative decoding's figures also name the drafting method.
                by_method = field.startswith("spec_")
                family = kind(name, doc, labels=["engine", "method"] if by_method else ["engine"])
                for engine, s in stats:
                    labels = [engine, s.spec_method] if by_method else [engine]
                    family.add_metric(labels, getattr(s, field))
                yield family
