"""Which servers the served comparison starts, and how: the flags' defaults, then one command
per server asked for that can run here (and a line for each one that cannot).

  tandem        python -m tandem serve --model DIR --port P [--tandem-args]: its defaults (the
                engine core picks its compute threads at start-up; the front end is unpinned)
  tandem-sync   the same with --no-async
  tandem-offline
                no server: each cell's requests through `LLM.generate` in a fresh process
                (offline_same_load: the async loop, max_num_seqs = streams, --context as
                max_model_len), the figure the served throughput is held to; output tok/s only
  tandem-q8_0   the same on the Q8_0 GGUF, its blocks kept, with --int8-activations (llama.cpp's
                numerics: the pairing for llama-q8_0); tandem-int8kv: --kv-cache-dtype int8
  llama-f32     llama-server -m F32.gguf -np MAX_STREAMS -c MAX_STREAMS*CONTEXT -t THREADS
                -tb THREADS [--llama-args]; llama-q8_0: the same on the Q8_0 GGUF
  llama         (agent) llama-server on --gguf, its prompt cache on, as by default;
                llama-q8kv: the same with a q8_0 KV cache and flash attention
  vllm          vLLM's OpenAI server on --vllm-model or --model, --max-model-len CONTEXT
                --max-num-seqs MAX_STREAMS [--vllm-args] (agent: --enable-prefix-caching)
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

import tandem
from tandem.bench import peers_llama, peers_vllm, real_model
from tandem.bench.agent import AGENT_OUTPUT_LEN, AGENT_SIZES
from tandem.bench.compare_args import AGENT_SHAPE_FLAGS, MODE_FLAGS, MODES
from tandem.bench.launch import Server
from tandem.bench.machine import core_count

LLAMA_Q8_KV = ["--cache-type-k", "q8_0", "--cache-type-v", "q8_0", "-fa", "on"]
LOAD_SERVERS = ["tandem", "tandem-sync", "tandem-offline", "llama-f32", "vllm"]
AGENT_SERVERS = ["tandem", "llama", "llama-q8kv", "vllm"]
DEFAULTS = {
    "repeats": 3, "modes": list(MODES), "concurrency": [1, 8, 32], "num_requests": 0,
    "prompt_words": 32, "no_pause": False, "start_timeout": 600.0, "request_timeout": 600.0,
    "tandem_args": "", "llama_args": "", "vllm_args": "", "session_stagger": 0.0,
    "agent_task": "explain", **AGENT_SIZES,
}  # fmt: skip


def resolve_served_args(args: argparse.Namespace) -> None:
    """Fills in the served defaults (the agent workload's where they differ) and the files'
    paths; builds the default model folder on first use."""
    args.workload = args.workload or "load"
    agent = args.workload == "agent"
    # A flag the workload has no use for is refused, not ignored (MODE_FLAGS names it).
    unused = ("concurrency", "modes") if agent else AGENT_SHAPE_FLAGS
    given = next((d for d in unused if getattr(args, d) is not None), None)
    if given is not None:
        other = "load" if agent else "agent"
        raise ValueError(f"{MODE_FLAGS[given][1]} is a flag of --workload {other}")
    for dest, value in DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)
    args.pause = not args.no_pause
    args.threads = args.threads or core_count()
    args.output_len = args.output_len or (AGENT_OUTPUT_LEN if agent else 64)
    args.servers = args.servers or (AGENT_SERVERS if agent else LOAD_SERVERS)
    if min(args.repeats, args.threads, args.output_len, args.prompt_words) < 1:
        raise ValueError("--repeats, --threads, --max-tokens and --prompt-words must be >= 1")
    if args.num_requests < 0:
        raise ValueError("--num-requests must be >= 0 (0: 4 x streams)")
    args.model = served_model(args.model)
    if agent:
        args.concurrency = [args.sessions]  # a slot per session
        if args.vllm_model is None and args.model.name == real_model.GGUF_NAME:
            args.vllm_model = real_model.ensure_model()
    args.gguf_f32 = Path(args.gguf_f32 or f"{args.model}-f32.gguf")
    args.gguf_q8_0 = Path(args.gguf_q8_0 or f"{args.model}-q8_0.gguf")
    # The same file as Tandem's where --model is one.
    args.gguf = Path(args.gguf or (args.model if args.model.suffix == ".gguf" else args.gguf_f32))
    if args.context is None:
        from tandem.bench.serve_agent import agent_shape

        args.context = agent_shape(args).context() if agent else 1024
    args.llama_server = peers_llama.llama_server_path(args.llama_server)
    args.tandem_path = Path(args.tandem_path or Path(tandem.__file__).resolve().parents[1])
    args.json = Path(args.json) if args.json else None
    args.plot = Path(args.plot) if args.plot else None


def served_model(option: str | None) -> Path:
    """--model: a path; "default", Tandem's built-in model; a packaged model's short name; by
    default real_model's folder, built on first use."""
    if option is None:
        return real_model.ensure_model(real_model.DEFAULT_OUTPUT)
    path = Path(option).expanduser()
    if path.exists():
        return path
    from tandem.models.catalog import resolve_model

    return resolve_model(None if option == "default" else option)


def tandem_env(args: argparse.Namespace) -> dict[str, str]:
    """The tree whose package runs: --tandem-path ahead of any PYTHONPATH already set."""
    paths = [str(args.tandem_path), os.environ.get("PYTHONPATH")]
    return {"PYTHONPATH": os.pathsep.join(filter(None, paths))}


TANDEM_VARIANTS = {  # name: (label, extra `tandem serve` flags)
    "tandem": ("tandem", []),
    "tandem-sync": ("tandem --no-async", ["--no-async"]),  # what the async loop must beat
    "tandem-q8_0": ("tandem Q8_0 int8 act.", ["--int8-activations"]),
    "tandem-int8kv": ("tandem int8 KV", ["--kv-cache-dtype", "int8"]),
}


def plan_servers(args: argparse.Namespace) -> tuple[list[Server], list[str]]:
    """The servers asked for that can run here, and a line for each one skipped."""
    max_streams = max(args.concurrency)
    servers, skipped = [], []
    for name in args.servers:
        if name in TANDEM_VARIANTS:
            label, extra = TANDEM_VARIANTS[name]
            model = args.gguf_q8_0 if name == "tandem-q8_0" else args.model
            if not Path(model).exists():
                skipped.append(f"{name}: skipped: no {model} (run setup_llama_server.sh)")
                continue
            command = [sys.executable, "-m", "tandem", "serve", "--model", str(model),
                       "--host", "127.0.0.1", "--port", "{port}",
                       *shlex.split(args.tandem_args), *extra]  # fmt: skip
            servers.append(Server(name, label, command, tandem_env(args), reads_idle_gauge=True))
        elif name == "tandem-offline":
            command = [sys.executable, "-m", "tandem.bench.offline_same_load",
                       "--model", str(args.model), "--max-tokens", str(args.output_len),
                       "--prompt-words", str(args.prompt_words),
                       "--max-model-len", str(args.context), "--one", "async"]  # fmt: skip
            servers.append(Server(name, "tandem offline", command, tandem_env(args), offline=True))
        elif name.startswith("llama"):
            gguf = {"llama-f32": args.gguf_f32, "llama-q8_0": args.gguf_q8_0}.get(name, args.gguf)
            missing = next((f for f in (args.llama_server, gguf) if not f.is_file()), None)
            if missing is not None:
                skipped.append(f"{name}: skipped: no {missing} (run setup_llama_server.sh)")
                continue
            command = peers_llama.serve_command(args.llama_server, gguf, max_streams,
                                                args.context, args.threads)  # fmt: skip
            command += shlex.split(args.llama_args)
            label = "llama-server " + ("F32" if name == "llama-f32" else "Q8_0")
            if name in ("llama", "llama-q8kv"):
                label = "llama-server" + (" q8_0 KV" if name == "llama-q8kv" else "")
                command += LLAMA_Q8_KV if name == "llama-q8kv" else []
            servers.append(Server(name, label, command))
        elif name == "vllm":
            python = peers_vllm.find_vllm_python(args.vllm_python)
            if python is None:
                skipped.append("vllm: skipped: vLLM is not installed (no python that imports it)")
                continue
            command, env = peers_vllm.serve_command(
                python, str(args.vllm_model or args.model), args.context, max_streams,
                prefix_caching=args.workload == "agent", extra=shlex.split(args.vllm_args),
            )  # fmt: skip
            servers.append(Server(name, "vLLM", command, env))
    return servers, skipped
