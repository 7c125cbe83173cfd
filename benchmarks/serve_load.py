"""Load test for a running OpenAI-compatible server: Poisson arrivals, bounded concurrency.

Requests arrive as a Poisson process (`--rate` per second; `inf` sends them all at once) and at
most `--concurrency` are in flight. Every request streams, so time to first token (TTFT) and
inter-token latency (ITL, the gap between consecutive content chunks) are measured at the client.

    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --num-requests 256 \\
        --concurrency 64 --rate 32 --max-tokens 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np

_COMMON_WORDS = (
    "the a of and to in is was he for it with as his on be at by had not are but from or have "
    "an they which one you were her all she there would their we him been has when who will more "
    "no if out so said what up its about into than them can only other new some could time these "
    "two may then do first any my now such like our over man me even most made after also did many"
)
WORDS = _COMMON_WORDS.split()


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


async def one_request(client: aiohttp.ClientSession, body: dict, path: str, chat: bool) -> Result:
    result = Result(start=time.perf_counter())
    try:
        async with client.post(path, json=body) as response:
            if response.status != 200:
                await response.read()
                result.error = f"HTTP {response.status}"
                return result
            async for raw in response.content:
                if not raw.startswith(b"data: "):
                    continue
                data = raw[6:].strip()
                if data == b"[DONE]":
                    result.ok = result.error is None
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error'].get('code')}"
                    continue
                if chunk.get("usage"):
                    result.completion_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    text = choice["delta"].get("content") if chat else choice.get("text")
                    if text:
                        now = time.perf_counter()
                        if result.ttft is None:
                            result.ttft = now - result.start
                        result.chunk_times.append(now)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        result.error = type(exc).__name__
    finally:
        result.end = time.perf_counter()
    return result


async def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    async with session(args.url, args.concurrency, args.timeout) as client:
        model = args.model or await first_model(client)
        path = "/v1/chat/completions" if args.chat else "/v1/completions"
        gate = asyncio.Semaphore(args.concurrency)

        def body() -> dict:
            if args.token_prompts:  # ids below 1000: valid in any model's vocabulary
                prompt = [rng.randrange(3, 1000) for _ in range(args.prompt_words)]
            else:
                prompt = make_prompt(rng, args.prompt_words)
            request = {
                "model": model,
                "max_tokens": args.max_tokens,
                "temperature": args.temperature,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if args.ignore_eos:
                request["ignore_eos"] = True
            if args.chat:
                request["messages"] = [{"role": "user", "content": prompt}]
            else:
                request["prompt"] = prompt
            return request

        async def gated(request: dict) -> Result:
            async with gate:
                return await one_request(client, request, path, args.chat)

        tasks = []
        start = time.perf_counter()
        for _ in range(args.num_requests):
            tasks.append(asyncio.create_task(gated(body())))
            if args.rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
        server_metrics = await scrape(client)
    return summarize(results, wall, model, server_metrics)


async def first_model(client: aiohttp.ClientSession) -> str:
    async with client.get("/v1/models") as response:
        return (await response.json())["data"][0]["id"]


async def scrape(client: aiohttp.ClientSession) -> dict[str, float]:
    """A few server-side gauges, when the server exposes Tandem's /metrics."""
    try:
        async with client.get("/metrics") as response:
            text = await response.text()
    except aiohttp.ClientError:
        return {}
    wanted = {"tandem_device_idle_fraction"}
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            values[name] = float(value)
    return values


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
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.token_prompts and args.chat:
        print("--token-prompts sends completions prompts: leave out --chat", file=sys.stderr)
        return 2
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
    if "server_tandem_device_idle_fraction" in s:
        idle = s["server_tandem_device_idle_fraction"]
        print(f"  server device idle fraction (last ~1 s window with work) {idle:.3f}")
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
