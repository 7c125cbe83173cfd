"""The `tandem bench serve` flags, with vLLM's `vllm bench serve` names (the load generator's
older names kept as aliases): apart from the client so that building the command line imports
no HTTP client and no engine."""

from __future__ import annotations

import argparse

from tandem.bench.agent import AGENT_OUTPUT_LEN, AGENT_SIZES, AGENT_TASKS

API_NAMES = ("completions", "chat", "messages", "responses", "ollama")
DATASETS = ("random", "agent")
METRICS = ("ttft", "tpot", "itl", "e2el")
RANDOM_OUTPUT_LEN = 128


def add_serve_bench_args(parser: argparse.ArgumentParser) -> None:
    s = parser.add_argument_group("server")
    s.add_argument("--base-url", "--url", dest="base_url", default=None,
                   help="the server's root URL, e.g. http://127.0.0.1:8000 (default: "
                   "http://--host:--port)")  # fmt: skip
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--model", default=None, help="the model to ask for; default: the first "
                   "of the server's /v1/models")  # fmt: skip
    s.add_argument("--api", "--endpoint-type", dest="api", choices=API_NAMES, default=None,
                   help="the endpoint: /v1/completions (the default), /v1/chat/completions, "
                   "/v1/messages (Anthropic), /v1/responses or /api/chat (Ollama); the chat APIs "
                   "send the prompt as a user turn")  # fmt: skip
    s.add_argument("--chat", dest="api", action="store_const", const="chat",
                   help="the same as --api chat")  # fmt: skip
    s.add_argument("--timeout", type=float, default=600.0, help="per-request read timeout, s")

    w = parser.add_argument_group("load")
    w.add_argument("--dataset-name", choices=DATASETS, default="random",
                   help="random: --num-prompts prompts of --prompt-words random common words; "
                   "agent: coding-agent sessions through chat completions (the agent flags), "
                   "each turn the whole conversation so far, its answer the next turn's "
                   "assistant message")  # fmt: skip
    w.add_argument("--num-prompts", "--num-requests", dest="num_prompts", type=int, default=256)
    w.add_argument("--max-concurrency", "--concurrency", dest="max_concurrency", type=int,
                   default=64, help="most requests in flight")  # fmt: skip
    w.add_argument("--request-rate", "--rate", dest="request_rate", type=float,
                   default=float("inf"),
                   help="mean arrivals/s; inf (the default): all at once")  # fmt: skip
    w.add_argument("--burstiness", type=float, default=1.0,
                   help="the gaps between arrivals are gamma-distributed with this shape and "
                   "mean 1/--request-rate: 1 is a Poisson process, below 1 burstier, above 1 "
                   "more even (vLLM's)")  # fmt: skip
    w.add_argument(
        "--prompt-words",
        type=int,
        default=32,
        help="words per random prompt (words, not tokens: no tokenizer is needed)",
    )
    w.add_argument("--token-prompts", action="store_true",
                   help="completions prompts of --prompt-words random token ids (below 1000), "
                   "for a model served without a tokenizer: it streams no text, so TTFT and "
                   "ITL are unknown and the tokens are counted from the usage chunk")  # fmt: skip
    w.add_argument("--random-output-len", "--max-tokens", dest="output_len", type=int,
                   default=None, metavar="N",
                   help=f"max_tokens of each request (default {RANDOM_OUTPUT_LEN}; agent: each "
                   f"answer's length, default {AGENT_OUTPUT_LEN})")  # fmt: skip
    w.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for exactly --random-output-len tokens (vLLM's ignore_eos; "
                   "only the OpenAI endpoints take it); --no-ignore-eos: stop at EOS")  # fmt: skip
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--seed", type=int, default=0,
                   help="the prompts and the arrival times (the same seed, the same prompts "
                   "through every API and at every rate)")  # fmt: skip

    m = parser.add_argument_group("metrics and results")
    m.add_argument("--percentile-metrics", default="ttft,itl,e2el", metavar="METRIC,...",
                   help=f"the metrics to report percentiles of, from {','.join(METRICS)}: time "
                   "to first token, time per output token after the first, inter-token latency "
                   "(the gaps between streamed chunks), end-to-end latency")  # fmt: skip
    m.add_argument("--metric-percentiles", default="50,90,99", metavar="P,...",
                   help="the percentiles, comma-separated")  # fmt: skip
    m.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="service-level objectives in ms, e.g. ttft:500 e2el:8000: a request "
                   "is good if it meets every one (itl: every gap of the request); reports "
                   "good requests per second")  # fmt: skip
    m.add_argument("--save-result", action="store_true", help="write the result as JSON")
    m.add_argument("--save-detailed", action="store_true",
                   help="with --save-result: every request's figures too")  # fmt: skip
    m.add_argument("--result-dir", default=None, help="where --save-result writes (default: .)")
    m.add_argument("--result-filename", default=None,
                   help="default: tandem-API-RATEqps-concurrencyN-MODEL-TIME.json")  # fmt: skip
    m.add_argument("--json", action="store_true", help="print the result as JSON")
    m.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="draw TTFT and ITL distributions and output tokens/s over time (PNG)",
    )

    c = parser.add_argument_group("comparisons")
    c.add_argument("--compare", default=None, metavar="API,API,...",
                   help="run the load through each API in turn, --repeats rounds (each round "
                   "starting with the next), and compare their median output tokens/s (the "
                   "first is the reference) with the server's device idle fraction")  # fmt: skip
    c.add_argument("--repeats", type=int, default=3, help="rounds of --compare / --dashboard-ab")
    c.add_argument("--dashboard-ab", action="store_true",
                   help="run each load with the server's /dashboard closed and open in a "
                   "headless Chromium, alternately, and compare: what a page watching the "
                   "engines costs the server")  # fmt: skip
    c.add_argument(
        "--chromium", default="/usr/bin/chromium", help="the browser --dashboard-ab runs"
    )

    a = parser.add_argument_group("agent dataset (tandem bench --workload agent's shape)")
    a.add_argument("--sessions", type=int, default=AGENT_SIZES["sessions"],
                   help="sessions at once, each a stream of turns")  # fmt: skip
    a.add_argument("--turns", type=int, default=AGENT_SIZES["turns"])
    a.add_argument("--head-len", type=int, default=AGENT_SIZES["head_len"],
                   help="tokens of the head every session shares (tool definitions)")  # fmt: skip
    a.add_argument("--tool-result-len", type=int, default=AGENT_SIZES["tool_result_len"],
                   help="tokens each turn's tool result adds")  # fmt: skip
    a.add_argument("--session-stagger", type=float, default=0.0, metavar="SECONDS",
                   help="session s starts s * SECONDS after the first")  # fmt: skip
    a.add_argument("--agent-task", choices=AGENT_TASKS, default="explain",
                   help="explain, or edit: each file read is to be repeated back with a line "
                   "changed (as tandem bench --agent-task)")  # fmt: skip
    a.add_argument("--tokenizer", default=None,
                   help="the tokenizer that sizes the agent texts (a model folder, GGUF or "
                   "packaged name); default: the served model's path from /v1/models, where it "
                   "is on this machine, else --model")  # fmt: skip
