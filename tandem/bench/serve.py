"""`tandem bench serve`: load against a running server over HTTP, as `vllm bench serve` does.

Requests arrive at `--request-rate` per second (gamma-distributed gaps of shape `--burstiness`:
1 is a Poisson process; inf sends them all at once) and at most `--max-concurrency` are in
flight. Every request streams, so TTFT and ITL are measured where a user sees them. `--api`
picks the endpoint; the same seed sends the same prompts through each API and at every rate,
so runs differ by what is measured, not by what is asked.

For other benchmarks (`tandem bench compare`): `run_load` sends prompts and returns every
request's `RequestResult`; `serve_agent.run_sessions` replays agent sessions.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.bench.agent import AGENT_OUTPUT_LEN
from tandem.bench.serve_args import RANDOM_OUTPUT_LEN
from tandem.bench.serve_client import (
    APIS,
    RequestResult,
    Sampling,
    open_session,
    request_body,
    served_model,
    stream_request,
)
from tandem.bench.serve_idle import Reading, steady_idle, watch_idle_gauge
from tandem.bench.serve_metrics import (
    MetricsSpec,
    parse_metrics_spec,
    summarize,
)

_COMMON_WORDS = (
    "the a of and to in is was he for it with as his on be at by had not are but from or have "
    "an they which one you were her all she there would their we him been has when who will more "
    "no if out so said what up its about into than them can only other new some could time these "
    "two may then do first any my now such like our over man me even most made after also did many"
)
WORDS = _COMMON_WORDS.split()


@dataclass(frozen=True)
class LoadConfig:
    """How a load is sent (the prompts apart)."""

    api: str = "completions"  # a key of serve_client.APIS
    sampling: Sampling = Sampling()
    max_concurrency: int = 64
    request_rate: float = math.inf  # mean arrivals/s
    burstiness: float = 1.0  # the gamma shape of the gaps between arrivals
    seed: int = 0  # the arrival times
    timeout_s: float = 600.0  # per-request read timeout
    model: str | None = None  # default: the first of /v1/models
    watch_idle: bool = True  # read Tandem's device idle gauge every second meanwhile


@dataclass
class LoadRun:
    """What one load got back."""

    model: str
    results: list[RequestResult]
    duration_s: float
    max_concurrency: int
    readings: list[Reading] = field(default_factory=list)

    def steady_idle(self) -> list[float]:
        """The idle gauge's samples while every stream was busy (see serve_idle)."""
        return steady_idle(self.results, self.readings, self.max_concurrency)

    def summary(self, spec: MetricsSpec | None = None) -> dict:
        """vLLM's figures (serve_metrics.summarize), and the server's idle fraction where its
        gauge was read in the steady state."""
        summary = summarize(self.results, self.duration_s, spec or MetricsSpec())
        idle = self.steady_idle()
        if idle:
            summary |= {"server_idle_median": statistics.median(idle), "server_idle_max": max(idle)}
        return summary


def make_prompt(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def random_prompts(
    seed: int | str, count: int, words: int, token_ids: bool = False
) -> list[str | list[int]]:
    """`count` prompts of `words` random common words (token_ids: random ids below 1000, valid
    in any model's vocabulary); the same seed, the same prompts."""
    rng = random.Random(seed)
    if token_ids:
        return [[rng.randrange(3, 1000) for _ in range(words)] for _ in range(count)]
    return [make_prompt(rng, words) for _ in range(count)]


def arrival_times(count: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request arrives: gaps drawn from a gamma
    distribution of shape `burstiness` and mean 1/rate (vLLM's), all at 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(f"arrivals-{seed}")
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times


async def run_load(url: str, prompts: Sequence[str | list[int]], config: LoadConfig) -> LoadRun:
    """Sends one request per prompt to the server at `url` (its root, e.g.
    http://127.0.0.1:8000) as `config` says, and returns every request's result, in the order
    of `prompts`."""
    api = APIS[config.api]
    url = url.rstrip("/")
    arrivals = arrival_times(len(prompts), config.request_rate, config.burstiness, config.seed)
    async with open_session(config.max_concurrency, config.timeout_s) as client:
        model = config.model or (await served_model(client, url)).name
        bodies = [request_body(config.api, model, p, config.sampling) for p in prompts]
        gate = asyncio.Semaphore(config.max_concurrency)

        async def send(body: dict, at: float) -> RequestResult:
            delay = at - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            async with gate:
                return await stream_request(client, url, api, body)

        readings: list[Reading] = []
        watcher = (
            asyncio.create_task(watch_idle_gauge(url, readings)) if config.watch_idle else None
        )
        start = time.perf_counter()
        results = await asyncio.gather(*(send(b, t) for b, t in zip(bodies, arrivals, strict=True)))
        duration = time.perf_counter() - start
        if watcher is not None:
            watcher.cancel()
    return LoadRun(model, list(results), duration, config.max_concurrency, readings)


def base_url(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def check_args(args: argparse.Namespace) -> MetricsSpec:
    """Every flag checked before a request is sent; a bad one raises ValueError naming it.
    Fills in the defaults that depend on the dataset."""
    agent = args.dataset_name == "agent"
    for flag in ("num_prompts", "max_concurrency", "prompt_words", "repeats"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.output_len is not None and args.output_len < 1:
        raise ValueError(f"--random-output-len must be >= 1, got {args.output_len}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    if not (args.burstiness > 0 and math.isfinite(args.burstiness)):
        raise ValueError(f"--burstiness must be a number > 0, got {args.burstiness}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    if args.compare is not None:
        names = args.compare.split(",")
        unknown = [n for n in names if n not in APIS]
        if unknown:
            raise ValueError(f"--compare: unknown API {unknown[0]!r} (known: {', '.join(APIS)})")
    rounds = args.compare is not None or args.dashboard_ab
    if rounds and args.plot:
        raise ValueError("--plot draws one run: not with --compare or --dashboard-ab")
    if agent:
        if args.api not in (None, "chat") or rounds or args.token_prompts:
            raise ValueError(
                "--dataset-name agent replays sessions through chat completions: "
                "no other --api, --compare, --dashboard-ab or --token-prompts"
            )
        if math.isfinite(args.request_rate):
            raise ValueError(
                "--dataset-name agent sends a session's next turn when its answer is complete: "
                "no --request-rate (--session-stagger spaces the sessions' starts)"
            )
        args.api = "chat"
    args.api = args.api or "completions"
    if args.token_prompts and (args.api != "completions" or args.compare):
        raise ValueError("--token-prompts sends completions prompts: use --api completions")
    return parse_metrics_spec(args.percentile_metrics, args.metric_percentiles, args.goodput)


def load_config(args: argparse.Namespace, api: str | None = None) -> LoadConfig:
    sampling = Sampling(args.output_len or RANDOM_OUTPUT_LEN, args.temperature, args.ignore_eos)
    return LoadConfig(
        api=api or args.api,
        sampling=sampling,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        seed=args.seed,
        timeout_s=args.timeout,
        model=args.model,
    )


def args_prompts(args: argparse.Namespace) -> list[str | list[int]]:
    return random_prompts(args.seed, args.num_prompts, args.prompt_words, args.token_prompts)


def result_metadata(args: argparse.Namespace, url: str, model: str) -> dict:
    """What was run, under vLLM's result keys where it has them."""
    rate = args.request_rate
    meta = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "backend": "tandem",
        "api": args.api,
        "base_url": url,
        "model_id": model,
        "dataset_name": args.dataset_name,
        "request_rate": rate if math.isfinite(rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "temperature": args.temperature,
        "ignore_eos": args.ignore_eos,
    }
    if args.dataset_name == "agent":
        return meta | {
            "max_concurrency": args.sessions,  # a stream per session
            "sessions": args.sessions,
            "turns": args.turns,
            "head_len": args.head_len,
            "tool_result_len": args.tool_result_len,
            "output_len": args.output_len or AGENT_OUTPUT_LEN,
            "agent_task": args.agent_task,
        }
    return meta | {
        "num_prompts": args.num_prompts,
        "prompt_words": args.prompt_words,
        "output_len": args.output_len or RANDOM_OUTPUT_LEN,
    }
