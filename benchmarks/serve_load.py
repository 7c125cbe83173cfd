"""Load test for a running server: Poisson arrivals, bounded concurrency, through any of its APIs.

Requests arrive as a Poisson process (`--rate` per second; `inf` sends them all at once) and at
most `--concurrency` are in flight. Every request streams, so time to first token (TTFT) and
inter-token latency (ITL, the gap between consecutive content chunks) are measured at the client.
`--api` picks the endpoint: OpenAI's completions or chat completions, Anthropic's Messages, the
Responses API or Ollama's chat; the same seed sends the same prompts through each.

    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --num-requests 256 \\
        --concurrency 64 --rate 32 --max-tokens 128

`--compare chat,messages,responses,ollama --repeats 8` runs the same load through each API in
turn, round after round (each round starting with the next API), and prints each one's median
output tokens/s and its ratio to the first's, with the server's device idle fraction: what
translating an API costs the host. `--dashboard-ab` runs the load with the server's /dashboard
closed and open in a headless Chromium (`--chromium`), alternately: what a page watching the
engines costs it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import aiohttp
import httpx
import numpy as np

_COMMON_WORDS = (
    "the a of and to in is was he for it with as his on be at by had not are but from or have "
    "an they which one you were her all she there would their we him been has when who will more "
    "no if out so said what up its about into than them can only other new some could time these "
    "two may then do first any my now such like our over man me even most made after also did many"
)
WORDS = _COMMON_WORDS.split()
IDLE_GAUGE = "tandem_device_idle_fraction"
GAUGE_WINDOW_S = 1.0  # the idle gauge summarises the latest ~1 s window with work


@dataclass
class Result:
    ok: bool = False
    error: str | None = None
    start: float = 0.0
    end: float = 0.0
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0


def make_prompt(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def session(url: str, concurrency: int, timeout_s: float) -> aiohttp.ClientSession:
    """The load's HTTP client: aiohttp, as vLLM's serving benchmark uses, for its cost: about
    0.6x httpx's CPU time for the same run, time the client would otherwise take from a server on
    the same cores. A fresh connection per request: llama-server closes kept-alive connections,
    and aiohttp reusing one the server has just closed fails the request (a fifth of them at 32
    streams); a local connection costs the server well under a millisecond."""
    return aiohttp.ClientSession(
        base_url=url,
        connector=aiohttp.TCPConnector(limit=concurrency, force_close=True),
        timeout=aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=timeout_s),
    )


@dataclass(frozen=True)
class Event:
    """What one streamed message says: new text, the output's token count, the end, an error."""

    text: str = ""
    tokens: int | None = None
    done: bool = False
    error: str | None = None


def openai_event(chunk: dict, chat: bool) -> Event:
    if "error" in chunk:
        return Event(error=f"stream error: {chunk['error'].get('code')}")
    tokens = chunk["usage"]["completion_tokens"] if chunk.get("usage") else None
    choices = chunk.get("choices", [])
    pick = (lambda c: c["delta"].get("content")) if chat else (lambda c: c.get("text"))
    return Event("".join(pick(c) or "" for c in choices), tokens)


def messages_event(chunk: dict) -> Event:
    kind = chunk["type"]
    if kind == "content_block_delta":
        return Event(chunk["delta"].get("text", ""))
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
        return Event(tokens=chunk["response"]["usage"]["output_tokens"], done=True)
    if kind == "response.failed":
        return Event(error="stream error: response.failed")
    return Event()


def ollama_event(chunk: dict) -> Event:
    if "error" in chunk:
        return Event(error="stream error")
    if chunk.get("done"):
        return Event(tokens=chunk["eval_count"], done=True)
    return Event(chunk["message"]["content"])


@dataclass(frozen=True)
class API:
    path: str
    read: object  # bytes of one line -> Event, or None for a line that carries none


def sse_reader(decode):
    def read(raw: bytes) -> Event | None:
        if not raw.startswith(b"data: "):
            return None
        data = raw[6:].strip()
        return Event(done=True) if data == b"[DONE]" else decode(json.loads(data))

    return read


APIS = {
    "completions": API("/v1/completions", sse_reader(lambda c: openai_event(c, False))),
    "chat": API("/v1/chat/completions", sse_reader(lambda c: openai_event(c, True))),
    "messages": API("/v1/messages", sse_reader(messages_event)),
    "responses": API("/v1/responses", sse_reader(responses_event)),
    "ollama": API("/api/chat", lambda raw: ollama_event(json.loads(raw)) if raw.strip() else None),
}


def request_body(api: str, model: str, prompt: str | list[int], args: argparse.Namespace) -> dict:
    """The same request in each API's words."""
    user = [{"role": "user", "content": prompt}]
    if api == "messages":
        body = {"messages": user, "max_tokens": args.max_tokens}
    elif api == "responses":
        body = {"input": prompt, "max_output_tokens": args.max_tokens, "store": False}
    elif api == "ollama":
        options = {"num_predict": args.max_tokens, "temperature": args.temperature}
        return {"model": model, "messages": user, "options": options, "stream": True}
    else:
        body = {"max_tokens": args.max_tokens, "stream_options": {"include_usage": True}}
        body |= {"messages": user} if api == "chat" else {"prompt": prompt}
        if args.ignore_eos:  # vLLM's extension; the other APIs have none (leave EOS on)
            body["ignore_eos"] = True
    return {"model": model, "temperature": args.temperature, "stream": True, **body}


async def one_request(client: aiohttp.ClientSession, body: dict, api: API) -> Result:
    result = Result(start=time.perf_counter())
    try:
        async with client.post(api.path, json=body) as response:
            if response.status != 200:
                await response.read()
                result.error = f"HTTP {response.status}"
                return result
            async for raw in response.content:
                event = api.read(raw)
                if event is None:
                    continue
                if event.error is not None:
                    result.error = event.error
                if event.tokens is not None:
                    result.completion_tokens = event.tokens
                if event.text:
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - result.start
                    result.chunk_times.append(now)
                if event.done:
                    result.ok = result.error is None
                    break
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        result.error = type(exc).__name__
    finally:
        result.end = time.perf_counter()
    return result


async def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    async with session(args.url, args.concurrency, args.timeout) as client:
        model = args.model or await first_model(client)
        api = APIS[args.api]
        gate = asyncio.Semaphore(args.concurrency)

        def body() -> dict:
            if args.token_prompts:  # ids below 1000: valid in any model's vocabulary
                prompt = [rng.randrange(3, 1000) for _ in range(args.prompt_words)]
            else:
                prompt = make_prompt(rng, args.prompt_words)
            return request_body(args.api, model, prompt, args)

        async def gated(request: dict) -> Result:
            async with gate:
                return await one_request(client, request, api)

        readings: list[tuple[float, list[float]]] = []
        watcher = asyncio.create_task(watch_idle_gauge(args.url, readings))
        tasks = []
        start = time.perf_counter()
        for _ in range(args.num_requests):
            tasks.append(asyncio.create_task(gated(body())))
            if args.rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
        watcher.cancel()
    idle = steady_idle(results, readings, args.concurrency)
    server = {"idle_median": statistics.median(idle), "idle_max": max(idle)} if idle else {}
    return summarize(results, wall, model, server)


async def first_model(client: aiohttp.ClientSession) -> str:
    async with client.get("/v1/models") as response:
        return (await response.json())["data"][0]["id"]


def idle_samples(metrics_text: str) -> list[float]:
    """Every sample of the idle gauge, whatever its labels (one per engine, later)."""
    values = []
    for line in metrics_text.splitlines():
        if line.startswith("#"):
            continue
        if line.startswith(IDLE_GAUGE + "{"):
            value_part = line.rpartition("}")[2]
        elif line.startswith(IDLE_GAUGE + " "):
            value_part = line[len(IDLE_GAUGE) :]
        else:
            continue
        values.append(float(value_part.split()[0]))
    return values


async def watch_idle_gauge(url: str, readings: list[tuple[float, list[float]]]) -> None:
    """Reads /metrics every second until cancelled, on a client of its own so it never waits
    behind the load's connections."""
    async with httpx.AsyncClient(base_url=url, timeout=5.0) as client:
        while True:
            try:
                response = await client.get("/metrics")
                readings.append((time.perf_counter(), idle_samples(response.text)))
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1.0)


def steady_idle(
    results: list[Result], readings: list[tuple[float, list[float]]], streams: int
) -> list[float]:
    """The gauge samples read while every stream was busy decoding: from when the first wave's
    last first token arrived (plus the gauge's window, so no reading covers the ramp-up) until
    the queue emptied (the last request started)."""
    first_wave = sorted(results, key=lambda r: r.start)[:streams]
    if not results or any(r.ttft is None for r in first_wave):
        return []
    steady_from = max(r.start + r.ttft for r in first_wave) + GAUGE_WINDOW_S
    steady_until = max(r.start for r in results)
    return [v for t, values in readings if steady_from <= t <= steady_until for v in values]


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


def summarize(results: list[Result], wall: float, model: str, server: dict) -> dict:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "incomplete"] = errors.get(r.error or "incomplete", 0) + 1
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    tokens = sum(r.completion_tokens for r in ok)
    return {
        "model": model,
        "requests": len(results),
        "completed": len(ok),
        "errors": sum(errors.values()),
        "error_kinds": errors,
        "wall_s": wall,
        "request_throughput_per_s": len(ok) / wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p99_ms": pct(ttft, 99),
        "itl_p50_ms": pct(itl, 50),
        "itl_p99_ms": pct(itl, 99),
        **{f"server_{k}": v for k, v in server.items()},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64, help="most requests in flight")
    p.add_argument(
        "--rate", type=float, default=float("inf"), help="mean arrivals/s (Poisson); inf: at once"
    )
    p.add_argument("--prompt-words", type=int, default=32, help="words per random prompt")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--no-ignore-eos", dest="ignore_eos", action="store_false", help="let requests stop at EOS"
    )
    p.add_argument("--api", choices=list(APIS), default="completions",
                   help="the endpoint: /v1/completions, /v1/chat/completions, /v1/messages,\n"
                   "/v1/responses or /api/chat (the chat APIs send the prompt as a user turn)")  # fmt: skip
    p.add_argument("--chat", dest="api", action="store_const", const="chat",
                   help="the same as --api chat")  # fmt: skip
    p.add_argument("--compare", default=None, metavar="API,API,...",
                   help="run the load through each API in turn, --repeats times, and compare\n"
                   "their median output tokens/s (the first is the reference)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3, help="rounds of --compare")
    p.add_argument("--dashboard-ab", action="store_true",
                   help="run each load with the server's /dashboard closed and open in a\n"
                   "headless Chromium, --repeats rounds, and compare")  # fmt: skip
    p.add_argument(
        "--chromium", default="/usr/bin/chromium", help="the browser --dashboard-ab runs"
    )
    p.add_argument(
        "--token-prompts",
        action="store_true",
        help="completions prompts of --prompt-words random token ids, for a model served\n"
        "without a tokenizer: it streams no text, so TTFT and ITL read nan and the\n"
        "tokens are counted from the usage chunk",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per-request read timeout, s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    return p.parse_args(argv)


# Headless Chromium as the probe that tested the pages runs it: no background connections.
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
PAGE_OPEN = "+dashboard"


@contextlib.contextmanager
def dashboard_browser(url: str, chromium: str) -> Iterator[Callable[[bool], None]]:
    """The callable opens `url`/dashboard in a headless Chromium of its own (True), or closes it:
    the page polls and draws as it would on a screen until the browser is stopped."""
    browser: list[subprocess.Popen] = []
    profile = tempfile.TemporaryDirectory(prefix="tandem-dashboard-")

    def show(open_: bool) -> None:
        while browser:
            process = browser.pop()
            process.terminate()
            process.wait(10)
        if open_:
            flags = [*CHROMIUM_FLAGS, "--headless", f"--user-data-dir={profile.name}"]
            browser.append(subprocess.Popen([chromium, *flags, f"{url}/dashboard"],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
            time.sleep(3.0)  # started, the page loaded and polling, before the load begins

    try:
        yield show
    finally:
        show(False)
        profile.cleanup()


def compare(args: argparse.Namespace) -> int:
    """The same load through each API, interleaved round by round: medians and ratios. With
    --dashboard-ab, each API's load runs once with /dashboard closed and once with it open in a
    headless Chromium (the page's cost to the server: its polls, and the browser's CPU)."""
    apis = args.compare.split(",") if args.compare else [args.api]
    unknown = [n for n in apis if n not in APIS]
    if unknown:
        print(f"--compare: unknown API {unknown[0]!r} (known: {', '.join(APIS)})", file=sys.stderr)
        return 2
    pages = (False, True) if args.dashboard_ab else (False,)
    names = [api + (PAGE_OPEN if page else "") for api in apis for page in pages]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with contextlib.ExitStack() as stack:
        show = None
        if args.dashboard_ab:
            show = stack.enter_context(dashboard_browser(args.url, args.chromium))
        for round_ in range(args.repeats):
            turn = round_ % len(
                names
            )  # each variant goes first in some round: no order favours one
            for name in names[turn:] + names[:turn]:
                api = name.removesuffix(PAGE_OPEN)
                if show is not None:
                    show(name.endswith(PAGE_OPEN))
                summary = asyncio.run(run(argparse.Namespace(**{**vars(args), "api": api})))
                runs[name].append(summary)
                print(f"round {round_ + 1} {name:<21} {summary['output_tokens_per_s']:8.1f} tok/s, "
                      f"{summary['errors']} errors", file=sys.stderr)  # fmt: skip
    reference = float(np.median([s["output_tokens_per_s"] for s in runs[names[0]]]))
    print(f"{'api':<21} {'tok/s (median)':>15} {'ratio':>7} {'TTFT p50 ms':>12} "
          f"{'device idle':>12} {'errors':>7}")  # fmt: skip
    # device idle: the median over rounds of each run's median window while all streams ran
    failed = 0
    for name in names:
        rates = [s["output_tokens_per_s"] for s in runs[name]]
        median = float(np.median(rates))
        ttft = float(np.median([s["ttft_p50_ms"] for s in runs[name]]))
        idle = [s.get("server_idle_median") for s in runs[name]]
        idle_text = f"{np.median(idle):.3f}" if None not in idle else "n/a"
        errors = sum(s["errors"] for s in runs[name])
        failed += errors
        print(f"{name:<21} {median:15.1f} {median / reference:6.3f}x {ttft:12.1f} "
              f"{idle_text:>12} {errors:7d}")  # fmt: skip
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.token_prompts and args.api != "completions":
        print("--token-prompts sends completions prompts: use --api completions", file=sys.stderr)
        return 2
    if args.compare or args.dashboard_ab:
        return compare(args)
    summary = asyncio.run(run(args))
    if args.json:
        print(json.dumps(summary, indent=2))
        return 1 if summary["errors"] else 0
    s = summary
    kinds = f" {s['error_kinds']}" if s["error_kinds"] else ""
    print(f"model {s['model']}: {s['completed']}/{s['requests']} requests in {s['wall_s']:.2f} s")
    print(f"  errors {s['errors']}{kinds}")
    print(f"  request throughput {s['request_throughput_per_s']:.2f} req/s")
    print(f"  output tokens/s    {s['output_tokens_per_s']:.1f} ({s['output_tokens']} tokens)")
    print(f"  TTFT p50 {s['ttft_p50_ms']:.1f} ms, p99 {s['ttft_p99_ms']:.1f} ms")
    print(f"  ITL  p50 {s['itl_p50_ms']:.2f} ms, p99 {s['itl_p99_ms']:.2f} ms")
    if "server_idle_median" in s:
        print(f"  device idle while every stream was busy: median {s['server_idle_median']:.3f}, "
              f"max {s['server_idle_max']:.3f} (Tandem's /metrics, read every second)")  # fmt: skip
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
