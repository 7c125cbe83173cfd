"""llama.cpp's `llama-server` as a peer: in the offline comparison one HTTP /completion request
per prompt, all sent at once; `--served` starts it beside the other servers (serve_command).

The binaries are built by benchmarks/setup_llama_server.sh into the cache (tandem.bench.llama_cpp
finds them there).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import tempfile
import time
from pathlib import Path

from tandem.bench import launch
from tandem.bench.compare_engines import Engine, EngineError, Run
from tandem.bench.compare_workload import Limits, Model, Workload
from tandem.bench.llama_cpp import default_bin_dir

KV_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}  # -ctk / -ctv
START_TIMEOUT_S = 300


def llama_server_path(option: str | None = None) -> Path:
    """--llama-server, else $LLAMA_SERVER, else the setup script's."""
    chosen = option or os.environ.get("LLAMA_SERVER")
    return Path(chosen).expanduser() if chosen else default_bin_dir() / "llama-server"


def llama_binary(name: str, server: str | None = None) -> Path:
    """A llama.cpp binary (llama-perplexity, llama-tokenize, ...) beside llama-server's."""
    return llama_server_path(server).with_name(name)


def gguf_format(path: Path) -> str:
    """A GGUF's weight types, the most common first: "Q8_0", "Q4_1+Q8_0" (one Q8_0 matrix)."""
    from gguf import GGUFReader

    matrices = (t.tensor_type.name for t in GGUFReader(path).tensors if len(t.shape) > 1)
    return "+".join(name for name, _ in collections.Counter(matrices).most_common())


def serve_command(binary: Path, gguf: Path, slots: int, slot_len: int, threads: int) -> list[str]:
    """llama-server with a slot per stream, each of `slot_len` tokens (-c is the slots' total),
    and -t/-tb threads; the port is left as "{port}"."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", "{port}",
            "-np", str(slots), "-c", str(slots * slot_len), "-t", str(threads),
            "-tb", str(threads)]  # fmt: skip


class LlamaCppEngine(Engine):
    """llama-server on a GGUF, started once and paused between its own calls, as vLLM is. Each
    prompt is one /completion request, all sent at once: the prompt as token ids, greedy,
    exactly n_predict tokens with EOS ignored (chat: up to its EOS), no prompt cache, the ids
    back in `tokens` (not streamed: a stream leaves out the id of a token that ends inside a
    UTF-8 character). The timed call is the HTTP round trip of all the requests. Non-streamed
    replies carry no per-token times, so TTFT and ITL are n/a."""

    name = "llamacpp"
    latency_from = "n/a"

    def __init__(self, args: argparse.Namespace, model: Model, limits: Limits):
        self.gguf = Path(args.llamacpp_gguf)
        self.format = gguf_format(self.gguf)
        kv = KV_TYPES[args.dtype]  # the KV cache in the dtype Tandem's has
        command = serve_command(llama_server_path(args.llama_server), self.gguf,
                                limits.llama_slots, limits.llama_slot_len, args.threads)  # fmt: skip
        command += ["-b", str(limits.max_batch_tokens), "-ctk", kv, "-ctv", kv, "--cache-ram", "0"]
        self.server = launch.Server(self.name, self.label, command)
        self.settings = (
            f"{limits.llama_slots} slots of {limits.llama_slot_len} tokens, batch "
            f"{limits.max_batch_tokens}, KV cache {kv}, {args.threads} threads"
        )
        start = time.perf_counter()
        try:
            log_dir = Path(tempfile.mkdtemp(prefix="tandem-llamacpp-"))
            asyncio.run(launch.start(self.server, START_TIMEOUT_S, log_dir))
            props = json.loads(launch.get(f"{self.server.url}/props"))
            self.build = props.get("build_info", "?")
        except Exception:
            launch.stop(self.server)
            raise
        self.startup_s = time.perf_counter() - start
        launch.signal_group(self.server, signal.SIGSTOP)

    @property
    def label(self) -> str:
        return f"llamacpp ({self.format})"

    def describe(self) -> str:
        return (
            f"llama-server {self.build} on {self.gguf.name}: {self.settings}; started in "
            f"{self.startup_s:.1f} s; its log: {self.server.log_path}"
        )

    def _generate(self, prompts: list[list[int]], n: int, eos: list[int] | None) -> Run:
        import aiohttp

        body = {"n_predict": n, "temperature": 0, "ignore_eos": eos is None,
                "cache_prompt": False, "return_tokens": True}  # fmt: skip

        async def post(session: aiohttp.ClientSession, prompt: list[int]) -> dict:
            async with session.post("/completion", json={**body, "prompt": prompt}) as reply:
                if reply.status != 200:
                    text = await reply.text()
                    raise EngineError(f"/completion answered {reply.status}: {text[:300]}")
                return await reply.json()

        async def send() -> tuple[list[dict], float]:
            pool = aiohttp.TCPConnector(limit=len(prompts))
            timeout = aiohttp.ClientTimeout(total=3600)
            async with aiohttp.ClientSession(self.server.url, connector=pool,
                                             timeout=timeout) as session:  # fmt: skip
                start = time.perf_counter()
                outs = await asyncio.gather(*(post(session, p) for p in prompts))
                return outs, time.perf_counter() - start

        launch.signal_group(self.server, signal.SIGCONT)
        try:
            outs, wall = asyncio.run(send())
        finally:
            launch.signal_group(self.server, signal.SIGSTOP)
        reasons = ["length" if o["stop_type"] == "limit" else "stop" for o in outs]
        return Run([o["tokens"] for o in outs], wall, finish_reasons=reasons)

    def warm(self, work: Workload) -> None:
        self._generate(work.warm_prompts, work.warm_output_len, work.eos_ids)

    def run(self, work: Workload) -> Run:
        return self._generate(work.prompts, work.output_len, work.eos_ids)

    def close(self) -> None:
        launch.stop(self.server)


def skip_reason(args: argparse.Namespace, model: Model) -> str | None:
    if args.device != "cpu":
        return "the llama.cpp built here runs on the CPU; this run is on " + args.device
    if not args.llamacpp_gguf:
        return "no GGUF given (--llamacpp-gguf PATH)"
    if not Path(args.llamacpp_gguf).is_file():
        return f"no such file: {args.llamacpp_gguf}"
    binary = llama_server_path(args.llama_server)
    if not binary.is_file():
        return f"not installed (no {binary}; run `bash benchmarks/setup_llama_server.sh`)"
    return None


def start(args: argparse.Namespace, model: Model, limits: Limits) -> LlamaCppEngine:
    return LlamaCppEngine(args, model, limits)
