"""Soak test: a bounded run of mixed, partly hostile traffic against a server it starts itself.

Starts `tandem serve` on 127.0.0.1 (loopback only, a free port, an API key from the environment,
a small waiting queue and body limit so that every refusal path is taken), then for `--duration`
seconds `--clients` clients each loop over a random mix of: streaming and non-streaming
completions and chats, streams dropped mid-way, non-streaming requests whose client times out,
malformed requests, multi-megabyte prompts (refused by the prompt bound), bodies of many tiny
JSON values, bodies over the size limit, wrong API keys, and bursts that overfill the queue. At the end it waits for the server to
go idle and prints what was sent and answered, the statuses, KV blocks in use (must be 0), and
the server's resident memory and thread count after warm-up, at the middle and at the end (must
not grow). It exits 1 if a check fails or a status was unexpected.

    python benchmarks/soak.py --duration 600            # 10 minutes
    python benchmarks/soak.py --duration 120 --clients 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

WORDS = [
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "he",
    "for",
    "it",
    "with",
    "as",
    "his",
    "on",
    "be",
    "at",
    "by",
    "had",
    "not",
    "are",
    "but",
    "from",
    "or",
    "have",
    "an",
    "they",
    "which",
    "one",
    "you",
    "were",
    "her",
    "all",
    "she",
    "there",
    "would",
    "their",
    "we",
    "him",
    "been",
    "has",
    "when",
    "who",
    "will",
    "more",
    "no",
]

# action -> weight in the mix
ACTIONS = {
    "stream": 30,
    "complete": 25,
    "disconnect": 8,
    "timeout": 5,
    "bad": 10,
    "huge": 3,
    "many_values": 2,
    "oversize": 2,
    "unauthorized": 5,
    "burst": 2,
}
EXPECTED = {
    "stream": {200, 503},  # 503: the queue was full at that moment (a burst in progress)
    "complete": {200, 503},
    "disconnect": {200, 503},
    "timeout": {200, 503},  # only if it finished before the client's timeout
    # A full server refuses before it reads the body, so any request may get 503 in a burst.
    "bad": {400, 404, 503},
    "huge": {400, 503},
    "many_values": {400, 503},
    "oversize": {413},
    "unauthorized": {401},
    "burst": {200, 503},
}


@dataclass
class Tally:
    sent: int = 0
    answered: int = 0
    statuses: Counter = field(default_factory=Counter)
    by_action: Counter = field(default_factory=Counter)
    disconnected: int = 0  # streams the client dropped on purpose
    timed_out: int = 0  # non-streaming requests whose client gave up on purpose
    unexpected: list[str] = field(default_factory=list)

    def answer(self, action: str, status: int, detail: str = "") -> None:
        self.answered += 1
        self.statuses[status] += 1
        if status not in EXPECTED[action]:
            self.unexpected.append(f"{action}: HTTP {status} {detail[:200]}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_stats(pid: int) -> tuple[float, int]:
    """Resident memory (MiB) and threads of the server: its process and every descendant (the
    engine core, the JSON counting helper, multiprocessing's resource tracker), from /proc."""
    rss, threads = 0.0, 0
    for process in [pid, *descendants(pid)]:
        try:
            status = Path(f"/proc/{process}/status").read_text()
        except OSError:
            continue  # it has just exited
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        rss += int(fields["VmRSS"].split()[0]) / 1024
        threads += int(fields["Threads"])
    return rss, threads


def descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        kids = children(frontier.pop())
        found += kids
        frontier += kids
    return found


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def metrics(url: str, key: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            name = name.replace('{engine="0"}', "")  # one engine core: its figures, unlabelled
            values[name] = float(value)
    return values


class Soak:
    def __init__(self, args: argparse.Namespace, url: str, key: str, model: str):
        self.args = args
        self.url = url
        self.key = key
        self.model = model
        self.tally = Tally()
        self.auth = {"Authorization": f"Bearer {key}"}
        self.huge_prompt = "lorem ipsum dolor " * (2 * 1024 * 1024 // 18)  # ~2 MB, > context
        self.oversize_body = (
            b'{"model": "m", "prompt": "' + b"x" * (args.max_request_bytes + 1) + b'"}'
        )

    def body(self, rng: random.Random, stream: bool) -> tuple[str, dict]:
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 64)))
        common = {"model": self.model, "stream": stream, "temperature": rng.choice([0.0, 0.8])}
        common["max_tokens"] = rng.randint(1, self.args.max_tokens)
        if rng.random() < 0.5:
            return "/v1/completions", {**common, "prompt": words}
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": words}]}

    async def client(self, index: int, deadline: float) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        actions, weights = list(ACTIONS), list(ACTIONS.values())
        async with httpx.AsyncClient(base_url=self.url, timeout=120, headers=self.auth) as http:
            while time.monotonic() < deadline:
                action = rng.choices(actions, weights)[0]
                self.tally.by_action[action] += 1
                try:
                    await getattr(self, action)(http, rng)
                except httpx.TransportError as exc:  # the server must never drop a connection
                    self.tally.unexpected.append(f"{action}: {type(exc).__name__}: {exc}")

    async def _stream(self, http: httpx.AsyncClient, rng: random.Random, drop: bool) -> None:
        action = "disconnect" if drop else "stream"
        path, body = self.body(rng, stream=True)
        if drop:
            body["max_tokens"] = self.args.max_tokens  # long enough to be cut
        self.tally.sent += 1
        async with http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                self.tally.answer(action, r.status_code, (await r.aread()).decode())
                return
            events = 0
            last = ""
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events += 1
                    last = line
                    if drop and events == 2:
                        self.tally.disconnected += 1
                        self.tally.answer(action, 200)
                        return  # leaving the block closes the connection mid-stream
            self.tally.answer(action, 200)
            if last != "data: [DONE]":
                self.tally.unexpected.append(f"{action}: stream ended without [DONE]")

    async def stream(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        await self._stream(http, rng, drop=False)

    async def disconnect(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        await self._stream(http, rng, drop=True)

    async def _post(self, http: httpx.AsyncClient, action: str, path: str, **kwargs) -> None:
        self.tally.sent += 1
        r = await http.post(path, **kwargs)
        self.tally.answer(action, r.status_code, r.text)
        if r.status_code >= 400 and set(r.json().get("error", {})) != {
            "message", "type", "param", "code"}:  # fmt: skip
            self.tally.unexpected.append(f"{action}: error not in OpenAI's shape: {r.text[:200]}")

    async def complete(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        path, body = self.body(rng, stream=False)
        await self._post(http, "complete", path, json=body)

    async def timeout(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        path, body = self.body(rng, stream=False)
        body.update(max_tokens=self.args.max_tokens, ignore_eos=True)
        try:
            await self._post(http, "timeout", path, json=body, timeout=rng.uniform(0.02, 0.2))
        except httpx.TimeoutException:
            self.tally.timed_out += 1

    async def bad(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        m = self.model
        content = rng.choice(
            [
                b"{not json",
                json.dumps({"model": m, "prompt": "x", "temperature": -1}).encode(),
                json.dumps({"model": m, "prompt": "x", "made_up": 1}).encode(),
                json.dumps({"model": m, "prompt": "x", "max_tokens": 10**6}).encode(),
                json.dumps({"model": m, "prompt": [5, 10**9]}).encode(),
                json.dumps({"model": "no-such-model", "prompt": "x"}).encode(),
                json.dumps({"model": m, "messages": []}).encode(),
            ]
        )
        path = "/v1/chat/completions" if b"messages" in content else "/v1/completions"
        await self._post(http, "bad", path, content=content)

    async def huge(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        body = {"model": self.model, "prompt": self.huge_prompt, "max_tokens": 4}
        await self._post(http, "huge", "/v1/completions", json=body)

    async def many_values(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        """20,000 tiny chat messages: counted in the server's helper process, refused."""
        body = {"model": self.model, "messages": [{"role": "user", "content": "x"}] * 20_000}
        await self._post(http, "many_values", "/v1/chat/completions", json=body)

    async def oversize(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        await self._post(http, "oversize", "/v1/completions", content=self.oversize_body)

    async def unauthorized(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        path, body = self.body(rng, stream=rng.random() < 0.5)
        headers = rng.choice([{"Authorization": "Bearer wrong"}, {"Authorization": ""}])
        await self._post(http, "unauthorized", path, json=body, headers=headers)

    async def burst(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        """More requests at once than running + waiting slots: some must get 503."""
        n = self.args.max_num_seqs + self.args.max_waiting + 8
        calls = []
        for _ in range(n):
            path, body = self.body(rng, stream=False)
            calls.append(self._post(http, "burst", path, json={**body, "max_tokens": 4}))
        await asyncio.gather(*calls)


async def run_load(
    soak: Soak, pid: int, args: argparse.Namespace
) -> list[tuple[float, float, int]]:
    """Run the clients until the deadline; sample the server's memory every few seconds."""
    start = time.monotonic()
    deadline = start + args.duration
    samples: list[tuple[float, float, int]] = []

    async def sample() -> None:
        while time.monotonic() < deadline:
            samples.append((time.monotonic() - start, *server_stats(pid)))
            await asyncio.sleep(args.sample_every)

    sampler = asyncio.ensure_future(sample())
    await asyncio.gather(*(soak.client(i, deadline) for i in range(args.clients)))
    await sampler
    samples.append((time.monotonic() - start, *server_stats(pid)))
    return samples


def at(samples: list[tuple[float, float, int]], t: float) -> tuple[float, float, int]:
    return min(samples, key=lambda s: abs(s[0] - t))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--clients", type=int, default=8, help="concurrent client loops")
    p.add_argument("--model", default=None, help="checkpoint folder (default: built-in model)")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens a request asks for")
    p.add_argument("--max-num-seqs", type=int, default=8, help="server: requests running at once")
    p.add_argument("--max-waiting", type=int, default=8, help="server: queued requests")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20, help="server: body limit")
    p.add_argument("--num-kv-blocks", type=int, default=2048,
                   help="server: KV blocks; the prefix cache's index grows until every free "
                   "block is cached, so a cache this size is full within the warm-up and the "
                   "memory check sees leaks, not the cache filling (2048 x 16 tokens)")  # fmt: skip
    p.add_argument("--warmup", type=float, default=0.2, help="fraction of --duration (default 0.2)")
    p.add_argument("--rss-tolerance-mib", type=float, default=16.0,
                   help="growth of resident memory after warm-up still called flat")  # fmt: skip
    p.add_argument("--sample-every", type=float, default=2.0, help="seconds between samples")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    port, key = free_port(), secrets.token_hex(16)
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "tandem", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--max-num-seqs", str(args.max_num_seqs), "--max-waiting", str(args.max_waiting),
               "--max-request-bytes", str(args.max_request_bytes), "--protect-metrics",
               "--max-model-len", "1024", "--num-kv-blocks", str(args.num_kv_blocks)]  # fmt: skip
    if args.model:
        command += ["--model", args.model]
    env = {**os.environ, "TANDEM_API_KEY": key, "HF_HUB_OFFLINE": "1"}
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"tandem-soak-{port}.log", "w")  # noqa: SIM115
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    # Stopped from outside (SIGTERM), the soak still stops its server: the finally block runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    failures: list[str] = []
    helpers: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                print(f"the server exited with {server.returncode}; log: {log.name}")
                return 1
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                print("the server did not start")
                return 1
            time.sleep(0.2)
        auth = {"Authorization": f"Bearer {key}"}
        model = httpx.get(f"{url}/v1/models", headers=auth).json()["data"][0]["id"]
        soak = Soak(args, url, key, model)
        print(f"soak: {args.duration:.0f} s, {args.clients} clients, server pid {server.pid} on "
              f"{url}, model {model!r}; log {log.name}", flush=True)  # fmt: skip
        began = time.monotonic()
        samples = asyncio.run(run_load(soak, server.pid, args))
        load_s = time.monotonic() - began

        # Idle: every request answered or aborted, every KV block back.
        idle_deadline = time.monotonic() + 30
        while True:
            m = metrics(url, key)
            idle = m["tandem_requests_in_flight"] == 0 and m["tandem_kv_blocks_used"] == 0
            if idle or time.monotonic() > idle_deadline:
                break
            time.sleep(0.2)
        rss_idle, threads_idle = server_stats(server.pid)
        t = soak.tally

        print(f"\nload: {load_s:.0f} s")
        print(f"requests sent: {t.sent}")
        print(f"answered: {t.answered} (" + ", ".join(
            f"{status}: {n}" for status, n in sorted(t.statuses.items())) + ")")  # fmt: skip
        print(f"left on purpose by the client: {t.disconnected} mid-stream disconnects, "
              f"{t.timed_out} client timeouts")  # fmt: skip
        print("actions: " + ", ".join(f"{a} {n}" for a, n in sorted(t.by_action.items())))
        if t.sent != t.answered + t.timed_out:
            failures.append(f"{t.sent - t.answered - t.timed_out} requests got no answer")
        if t.unexpected:
            failures.append(f"{len(t.unexpected)} unexpected outcomes")
            for line in t.unexpected[:10]:
                print("  unexpected:", line)
        finished = {k: v for k, v in m.items() if k.startswith("tandem_requests_finished_total")}
        print("server: " + ", ".join(f"{k.split('=')[-1][1:-2]} {v:.0f}"
                                     for k, v in sorted(finished.items())) + " finished; "
              f"{m['tandem_requests_rejected_total']:.0f} refused with 503")  # fmt: skip
        blocks = m["tandem_kv_blocks_used"]
        print(f"KV blocks cached when idle: {m['tandem_kv_blocks_cached']:.0f}")
        print(f"KV blocks in use when idle: {blocks:.0f} of {m['tandem_kv_blocks_total']:.0f}; "
              f"requests in flight: {m['tandem_requests_in_flight']:.0f}")  # fmt: skip
        if blocks != 0 or m["tandem_requests_in_flight"] != 0:
            failures.append("the server did not return to idle")

        warm = args.warmup * load_s
        start, middle, end = at(samples, warm), at(samples, (warm + load_s) / 2), samples[-1]
        rss = [s[1] for s in samples if s[0] >= warm]
        print(f"server RSS MiB: start {start[1]:.1f} (after {warm:.0f} s warm-up), middle "
              f"{middle[1]:.1f}, end {end[1]:.1f}, idle {rss_idle:.1f}; after warm-up min "
              f"{min(rss):.1f}, max {max(rss):.1f}")  # fmt: skip
        series = [at(samples, load_s * i / 10)[1] for i in range(11)]
        print("server RSS MiB every tenth of the run: " + " ".join(f"{r:.1f}" for r in series))
        print(f"server threads: start {start[2]}, middle {middle[2]}, end {end[2]}, "
              f"idle {threads_idle}")  # fmt: skip
        growth = end[1] - start[1]
        if growth > args.rss_tolerance_mib:
            failures.append(f"resident memory grew {growth:.1f} MiB after warm-up")
        if threads_idle > start[2]:
            failures.append(f"threads grew from {start[2]} to {threads_idle}")
        helpers = descendants(server.pid)
        print(f"server child processes when idle: {len(helpers)} (the engine core, the JSON "
              "counting helper, multiprocessing's resource tracker)")  # fmt: skip
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                code = server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                code = server.wait()
            print(f"server exit status after SIGTERM: {code}")
            if code != 0:
                failures.append(f"the server exited with {code}")
            left = [pid for pid in helpers if Path(f"/proc/{pid}").exists()]
            if left:
                failures.append(f"child processes left behind: {left}")
        log.close()
    for failure in failures:
        print("FAIL:", failure)
    print("PASS" if not failures else "FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
