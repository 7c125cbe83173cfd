"""`tandem generate | chat | bench | serve`: the command line, with vLLM's engine flag names."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields

from tandem.config import KV_CACHE_DTYPES, LOAD_FORMATS, EngineConfig, SpeculativeConfig
from tandem.reasoning import PARSER_CHOICES
from tandem.request import SAMPLING_FIELDS, SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="a Hugging Face checkpoint folder, a .gguf file, or a short name: "
                   "smollm2-135m-instruct (default: the built-in tiny Llama, random weights)")  # fmt: skip
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="sampling defaults for what a request leaves unset: auto, the model's "
                   "(generation_config.json or GGUF metadata); vllm, none; or FOLDER's "
                   "generation_config.json")  # fmt: skip
    g.add_argument("--override-generation-config", type=json_object, default=None,
                   metavar="JSON",
                   help="put over those defaults, as vLLM's flag: sampling fields by name, and "
                   "max_new_tokens, a cap on every request's output (the default of one that "
                   "sets none), e.g. '{\"max_new_tokens\": 256}'")  # fmt: skip
    g.add_argument("--reasoning-parser", choices=PARSER_CHOICES, default="auto",
                   help="which block of a reasoning model's output is its thinking (vLLM's "
                   "names); auto: qwen3's where the chat template writes <think>, else none")  # fmt: skip
    g.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                   help="auto: the folder's safetensors; dummy: seeded random weights made on the "
                   "device from config.json alone (no tokenizer files: token-id prompts only)")  # fmt: skip
    g.add_argument("--quantization", "-q", default=None, choices=("none", "int8", "fp8"),
                   help="default: a GGUF's Q8_0/Q4_0/Q4_1/Q4_K layers run in their blocks (CPU, "
                   "float32); none: every weight dequantized; int8: per-channel int8 linear "
                   "layers from float weights (CPU); fp8: per-channel e4m3 decoder weights, "
                   "activations per token (CUDA 8.9+ in bfloat16; emulated on a CPU)")  # fmt: skip
    g.add_argument("--int8-activations", action="store_true",
                   help="quantized layers multiply activations rounded to int8 per block of 32, "
                   "in integers, as llama.cpp does: faster, and no longer token-exact to the "
                   "float model (CPU)")  # fmt: skip
    g.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda")
    g.add_argument("--seed", type=int, default=0, help="engine seed for requests without their own")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="auto: the model's dtype; int8 (CPU) or fp8 (CUDA): a byte a value and "
                   "a float32 scale per 32 values (int8) or per token and KV head (fp8), about "
                   "0.28x (int8 beside float32) or half (fp8 beside bfloat16) of the bytes")  # fmt: skip
    g.add_argument("--num-kv-blocks", type=int, default=None, help="fix the KV cache size exactly")
    g.add_argument("--kv-cache-memory-gib", type=float, default=1.0, help="CPU KV cache size")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                   help="CUDA: fraction of free memory for the KV cache")  # fmt: skip
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    g.add_argument("--max-num-seqs", type=int, default=128, help="most requests running at once")
    g.add_argument(
        "--max-model-len", type=int, default=None, help="context limit (prompt + output)"
    )
    g.add_argument("--cpu-threads", type=int, default=None,
                   help="CPU: torch compute threads (default: one per core)")  # fmt: skip
    g.add_argument("--no-async", dest="async_scheduling", action="store_false",
                   help="synchronous loop: the host waits for each step before preparing the next")  # fmt: skip
    g.add_argument("--enforce-eager", action="store_true",
                   help="portable PyTorch ops only: no fused kernels, no pre-packed GEMMs")  # fmt: skip
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many ranks, one process each")  # fmt: skip
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="split the layers over this many stages of --tensor-parallel-size "
                   "ranks each (tensor parallel within a node, pipeline across nodes; "
                   "TANDEM_PP_LAYER_PARTITION=a,b,... sets the layers per stage)")  # fmt: skip
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="do not share KV blocks between requests with a common prefix")  # fmt: skip
    g.add_argument("--kv-events-config", type=json_object, default=None, metavar="JSON",
                   help="publish the prefix cache's stored and removed blocks in vLLM's format, "
                   "e.g. '{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\"}' "
                   "(also topic, hwm)")  # fmt: skip
    g.add_argument("--speculative-config", type=speculative_config, default=None, metavar="JSON",
                   help="speculative decoding, as vLLM's flag: e.g. '{\"method\": \"ngram\", "
                   "\"num_speculative_tokens\": 4}' (ngram also takes prompt_lookup_max and "
                   "prompt_lookup_min), or '{\"method\": \"draft_model\", \"model\": FOLDER, "
                   "\"num_speculative_tokens\": 4}'; \"adaptive\": false keeps every draft "
                   "at full length (default: off)")  # fmt: skip


def json_object(text: str) -> dict:
    """A flag's JSON object, refused at parse time (argparse's usage line, exit 2)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def speculative_config(text: str) -> SpeculativeConfig:
    """--speculative-config's JSON, refused at parse time (argparse's usage line, exit 2)."""
    try:
        return SpeculativeConfig.of(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine flags given (fields without a flag, such as `detokenize`, or a flag left
    unset, keep their default)."""
    given = {f.name: getattr(args, f.name) for f in fields(EngineConfig)
             if getattr(args, f.name, None) is not None}  # fmt: skip
    return EngineConfig(**given)


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 64) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    model_default = "default: the model's (--generation-config), else %s"
    g.add_argument(
        "--temperature", type=float, default=None, help="0 = greedy; " + model_default % 0
    )
    g.add_argument("--top-p", type=float, default=None, help=model_default % 1)
    g.add_argument("--top-k", type=int, default=None, help=model_default % "0 (off)")
    g.add_argument("--min-p", type=float, default=None, help=model_default % 0)
    g.add_argument("--repetition-penalty", type=float, default=None, help=model_default % 1)
    g.add_argument("--thinking-token-budget", type=int, default=None, metavar="N",
                   help="reasoning models: the most thinking tokens before the end of the "
                   "block is forced; " + model_default % "no bound")  # fmt: skip
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("-n", "--n", type=int, default=1, help="samples per prompt")


def sampling_params(
    args: argparse.Namespace, model_defaults: dict[str, float | int] | None = None
) -> SamplingParams:
    """The flags given, over the model's defaults, over the command line's own: greedy."""
    given = {name: getattr(args, name) for name in SAMPLING_FIELDS}
    values = {"temperature": 0.0} | (model_defaults or {})
    values |= {name: value for name, value in given.items() if value is not None}
    return SamplingParams(
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        n=args.n,
        **values,
    )


def overridden_by(args: argparse.Namespace) -> str:
    """ "; over them: --temperature 0" for the sampling flags given, or nothing."""
    given = [
        f"--{name.replace('_', '-')} {value:g}"
        for name in SAMPLING_FIELDS
        if (value := getattr(args, name)) is not None
    ]
    return f"; over them: {' '.join(given)}" if given else ""


def cmd_generate(args: argparse.Namespace) -> int:
    from tandem.llm import LLM

    prompts = list(args.prompts)
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts or prompts == ["-"]:
        if sys.stdin.isatty():
            print("tandem generate: give prompts as arguments, --file or on stdin", file=sys.stderr)
            return 2
        prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    params = sampling_params(args)  # before loading the model: bad flags fail fast
    llm = LLM(**vars(engine_config(args)))
    defaults = llm.engine.generation_defaults
    params = sampling_params(args, defaults.values)
    print(f"tandem generate: {defaults.describe()}", file=sys.stderr)
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs, strict=True):
        for sample in out.outputs:  # one per --n
            if args.json:
                record = {"prompt": prompt, "text": sample.text, "token_ids": sample.token_ids,
                          "finish_reason": sample.finish_reason}  # fmt: skip
                if args.n > 1:
                    record["index"] = sample.index
                if sample.reasoning is not None:  # a reasoning model's thinking
                    record["reasoning"] = sample.reasoning
                print(json.dumps(record, ensure_ascii=False))
            else:
                print(f"{prompt}{sample.text}")
                print(f"[{len(sample.token_ids)} tokens, {sample.finish_reason}]", file=sys.stderr)
    llm.close()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from tandem.chat import run_chat
    from tandem.engine.engine import Engine

    sampling_params(args)  # before loading the model: bad flags fail fast
    engine = Engine(engine_config(args))
    defaults = engine.generation_defaults.for_chat()  # llama.cpp's where the model sets none
    params = sampling_params(args, defaults.values)
    print(f"tandem chat: {defaults.describe()}{overridden_by(args)}", file=sys.stderr)
    try:
        return run_chat(engine, params, args.system, args.question)
    finally:
        engine.close()


def cmd_bench(args: argparse.Namespace) -> int:
    from tandem.bench.cli import run_bench

    return run_bench(args, engine_config(args))


def cmd_bench_latency(args: argparse.Namespace) -> int:
    from tandem.bench.latency import run_latency_bench

    return run_latency_bench(args, engine_config(args))


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from tandem.bench.serve_bench import run_serve_bench

    return run_serve_bench(args)


def cmd_bench_compare(args: argparse.Namespace) -> int:
    from tandem.bench.compare import run_compare

    return run_compare(args)


def add_bench_parsers(sub: argparse._SubParsersAction) -> None:
    """`tandem bench [throughput | latency | serve | compare]`: vLLM's subcommand names; bare
    `tandem bench` is `throughput`."""
    from tandem.bench.args import add_bench_args
    from tandem.bench.compare_args import add_compare_args
    from tandem.bench.latency_args import add_latency_args
    from tandem.bench.serve_args import add_serve_bench_args

    about = ("Runs the same workload with the synchronous and the asynchronous loop in one "
             "process and prints device idle time, throughput and latency side by side. With "
             "--speculative-config, each loop runs with speculation off and on (n-gram drafts, "
             "and the draft model when the config names one).")  # fmt: skip
    bench = sub.add_parser("bench", help="measure: throughput (the default), latency, a "
                           "server under load, or Tandem beside its peers",
                           description=about + " Subcommands: throughput (this, by name), "
                           "latency, serve, compare.")  # fmt: skip
    add_bench_args(bench)
    add_engine_args(bench)
    bench.set_defaults(func=cmd_bench)
    kinds = bench.add_subparsers(dest="bench_command", metavar="SUBCOMMAND")
    throughput = kinds.add_parser("throughput", help="one workload, sync then async (the "
                                  "default)", description=about)  # fmt: skip
    add_bench_args(throughput)
    add_engine_args(throughput)
    throughput.set_defaults(func=cmd_bench)
    latency = kinds.add_parser("latency", help="one batch at a time: end-to-end latency, TTFT "
                               "and ITL, sync and async",
                               description="Sends one batch of --batch-size requests, waits for "
                               "them to finish, and repeats: percentiles of the end-to-end "
                               "latency, time to first token and inter-token latency, for each "
                               "loop.")  # fmt: skip
    add_latency_args(latency)
    add_engine_args(latency)
    latency.set_defaults(func=cmd_bench_latency)
    serve = kinds.add_parser("serve", help="load against a running OpenAI-compatible server",
                             description="Load against a running server over HTTP: arrivals, "
                             "concurrency, any of its APIs; TTFT, ITL and end-to-end "
                             "percentiles, goodput.")  # fmt: skip
    add_serve_bench_args(serve)
    serve.set_defaults(func=cmd_bench_serve)
    compare = kinds.add_parser("compare", help="the same workload through Tandem and the "
                               "installed peers",
                               description="The same seeded workload through Tandem and each "
                               "peer engine installed (transformers, vLLM's CPU build, "
                               "llama.cpp), offline or served; one table.")  # fmt: skip
    add_compare_args(compare)
    compare.set_defaults(func=cmd_bench_compare)


def node_topology(args: argparse.Namespace, env: dict[str, str]) -> None:
    """Fill the node flags not given: from torchrun's environment when it is there (one
    `tandem serve` per node: --nproc-per-node 1; the same command on every node, so a node
    other than 0 placed by the launcher is headless), else one machine."""
    launched = "RANK" in env and "WORLD_SIZE" in env
    placed = launched and args.node_rank is None
    if launched and int(env.get("LOCAL_WORLD_SIZE", "1")) != 1:
        raise ValueError(
            "run one `tandem serve` per node under a launcher (torchrun --nproc-per-node 1): "
            "it starts that node's tensor-parallel ranks itself"
        )
    defaults = {"nnodes": 1, "node_rank": 0, "master_addr": "127.0.0.1", "master_port": 29500}
    if launched:
        defaults = {"nnodes": int(env["WORLD_SIZE"]), "node_rank": int(env["RANK"]),
                    "master_addr": env.get("MASTER_ADDR", "127.0.0.1"),
                    "master_port": int(env.get("MASTER_PORT", 29500))}  # fmt: skip
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if placed and args.node_rank > 0:
        args.headless = True
    if args.headless != (args.node_rank > 0):
        raise ValueError(
            "--headless runs nodes 1..N-1 (their ranks only); node 0 runs the engine and the API"
            if args.headless
            else f"node {args.node_rank} runs with --headless: node 0 runs the engine and the API"
        )


def cmd_serve(args: argparse.Namespace) -> int:
    from tandem.server.core.lora import parse_lora_module
    from tandem.server.serve import EngineFailure, serve

    node_topology(args, dict(os.environ))
    if args.headless:
        return run_headless(args)
    lora_modules = []
    for text in args.lora_modules or []:
        try:
            lora_modules.append(parse_lora_module(text))
        except ValueError as exc:
            raise ValueError(f"--lora-modules {exc}") from None
    try:
        serve(
            engine_config(args),
            host=args.host,
            port=args.port,
            max_waiting=args.max_waiting,
            grace_period=args.grace_period,
            api_key=args.api_key,
            protect_metrics=args.protect_metrics,
            max_request_bytes=args.max_request_bytes,
            api_server_count=args.api_server_count,
            data_parallel_size=args.data_parallel_size,
            engine_timeout_s=args.engine_timeout,
            trace=args.trace,
            served_model_name=args.served_model_name,
            lora_modules=lora_modules,
            allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        )
    except EngineFailure as exc:  # the traceback is already in the log
        print(f"tandem serve: {exc}", file=sys.stderr)
        return 1
    return 0


def run_headless(args: argparse.Namespace) -> int:
    """This machine's ranks of node 0's engine: no API; the exit code says how it ended."""
    import logging

    from tandem.execution.node import run_headless_node
    from tandem.execution.rendezvous import RendezvousError
    from tandem.models.catalog import checkpoint_path, resolve_model

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    config = engine_config(args)
    try:
        return run_headless_node(config, str(checkpoint_path(resolve_model(config.model))))
    except RendezvousError as exc:
        print(f"tandem serve: {exc}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Tandem: LLM inference whose host prepares step N+1 while the device "
        "computes step N (asynchronous continuous batching over a paged KV cache).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate text for prompts",
                         description="Generate text for prompts given as arguments, --file or stdin.")  # fmt: skip
    gen.add_argument("prompts", nargs="*", help="prompts ('-' or none: read stdin)")
    gen.add_argument("--file", help="a file with one prompt per line")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_sampling_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser(
        "chat",
        help="chat with the model in the terminal",
        description="Chat with the model: its chat template applied to the whole conversation, "
        "replies streamed as they are generated. /reset clears the conversation, /exit or "
        "Ctrl-D quits, Ctrl-C stops a reply. With a question: answer it and exit; with stdin "
        "not a terminal: one user message per line.",
    )
    chat.add_argument("question", nargs="?", default=None, help="answer this one and exit")
    chat.add_argument("--system", default=None, metavar="TEXT", help="system message")
    add_sampling_args(chat, max_tokens=512)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    add_bench_parsers(sub)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                           description="Serve the model over an OpenAI-compatible HTTP API.")  # fmt: skip
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the names clients may use for the model (the first is reported; "
                       "default: a short name as given, else the folder's or file's name)")  # fmt: skip
    serve.add_argument("--max-waiting", type=int, default=256,
                       help="queued requests beyond which new ones get 503")  # fmt: skip
    serve.add_argument("--grace-period", type=float, default=10.0,
                       help="seconds to finish in-flight requests on shutdown")  # fmt: skip
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on every /v1 request "
                       "(default: $TANDEM_API_KEY; unset: no key needed)")  # fmt: skip
    serve.add_argument("--protect-metrics", action="store_true",
                       help="require the API key for /metrics too (/health is always open)")  # fmt: skip
    serve.add_argument("--max-request-bytes", type=int, default=None, metavar="N",
                       help="larger request bodies get 413 without being read "
                       "(default: 16 MiB)")  # fmt: skip
    serve.add_argument("--api-server-count", type=int, default=1, metavar="N",
                       help="front-end processes (HTTP, tokenizing, detokenizing) sharing the "
                       "port in front of the engine cores (default: 1)")  # fmt: skip
    serve.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                       help="engine replicas, one core process each; on the CPU each computes "
                       "on its own 1/N of the cores (default: 1)")  # fmt: skip
    serve.add_argument("--engine-timeout", type=float, default=60.0, metavar="S",
                       help="an engine core with requests in flight that sends nothing for S "
                       "seconds is taken as hung: requests end with an error, the server "
                       "exits 1 (default: 60)")  # fmt: skip
    serve.add_argument("--trace", default=None, metavar="PATH",
                       help="on exit, write a Chrome/Perfetto trace of every engine step (host "
                       "phases, the core's socket work, the device) to PATH")  # fmt: skip
    lora = serve.add_argument_group("LoRA adapters (vLLM's flags)")
    lora.add_argument("--enable-lora", action="store_true",
                      help="requests may name a LoRA adapter as their model")  # fmt: skip
    lora.add_argument("--max-loras", type=int, default=1, metavar="N",
                      help="adapters a step can run at once (device slots; more may be loaded: "
                      "the least recently used slot is reused) (default: 1)")  # fmt: skip
    lora.add_argument("--max-lora-rank", type=int, default=16, metavar="R",
                      help="the highest adapter rank accepted (default: 16)")  # fmt: skip
    lora.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                      help="adapters loaded at start: NAME=PATH (a PEFT folder), or JSON "
                      "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; a bad one "
                      "stops the server starting")  # fmt: skip
    lora.add_argument("--allow-runtime-lora-updating", action="store_true",
                      help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also: "
                      "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True or "
                      "TANDEM_ALLOW_RUNTIME_LORA_UPDATING=1); for development")  # fmt: skip
    nodes = serve.add_argument_group(
        "several machines (vLLM's flags; under torchrun, read from RANK, WORLD_SIZE, "
        "MASTER_ADDR and MASTER_PORT when not given)"
    )
    nodes.add_argument("--nnodes", type=int, default=None, metavar="N",
                       help="machines the ranks span (default: 1)")  # fmt: skip
    nodes.add_argument("--node-rank", type=int, default=None, metavar="K",
                       help="this machine's place: 0 runs the engine and the API (default: 0)")  # fmt: skip
    nodes.add_argument("--master-addr", default=None, metavar="ADDR",
                       help="node 0's address, where the nodes meet (default: 127.0.0.1)")  # fmt: skip
    nodes.add_argument("--master-port", type=int, default=None, metavar="PORT",
                       help="node 0's rendezvous port; it listens at PORT + 1 too (default: "
                       "29500)")  # fmt: skip
    nodes.add_argument("--headless", action="store_true",
                       help="nodes 1..N-1: run this machine's ranks only, no API")  # fmt: skip
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # bad flags or input: one clear line, no traceback
        print(f"tandem {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
