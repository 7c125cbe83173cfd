"""The `tandem bench` flags: the parser's part, apart from the benchmark itself so that
building the command line imports no engine."""

from __future__ import annotations

import argparse

from tandem.bench.agent import (
    AGENT_OUTPUT_LEN,
    AGENT_PRESET,
    AGENT_SIZES,
    AGENT_TASKS,
    PROMPT_MODES,
)
from tandem.bench.lora import LORA_PRESET, add_lora_args
from tandem.bench.random_gguf import BLOCK_TYPES
from tandem.bench.workloads import (
    BATCH_SIZES,
    BATCHES_PRESET,
    BLOG_CUDA_MODEL,
    BLOG_NUM_REQUESTS,
    BLOG_OUTPUT_LEN,
    BLOG_PRESET,
    BLOG_PROMPT_LEN,
    CHAT_OUTPUT_LEN,
    CHAT_PRESET,
    COPY_INSTRUCTION,
    COPY_JSON_PRESET,
    COPY_OUTPUT_LEN,
    COPY_PRESET,
    DEFAULT_SIZES,
    JSON_FRACTIONS,
    JSON_PRESET,
    JSON_SCHEMA,
    PROFILE_STEPS,
)


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--workload",
                   choices=("random", "shared-prefix", BLOG_PRESET, CHAT_PRESET, COPY_PRESET,
                            COPY_JSON_PRESET, JSON_PRESET, AGENT_PRESET, BATCHES_PRESET,
                            LORA_PRESET),
                   default="random",
                   help="random: unrelated prompts; shared-prefix: each prompt starts with one of "
                   "--num-prefixes system prompts, run with prefix caching off and on; "
                   f"{BLOG_PRESET}: the experiment of transformers' blog on asynchronous batching, "
                   f"{BLOG_NUM_REQUESTS} requests at once with short prompts "
                   f"(mean {BLOG_PROMPT_LEN} tokens) each generating exactly --output-len tokens: "
                   f"on CUDA {BLOG_OUTPUT_LEN['cuda']} tokens on the shipped config "
                   f"{BLOG_CUDA_MODEL} with dummy weights (unless --model is given), on a CPU "
                   f"{BLOG_OUTPUT_LEN['cpu']} tokens on the default model (about a minute on 2 "
                   f"cores); the size flags still override; {CHAT_PRESET}: real chat questions "
                   "through the model's chat template (it needs a tokenizer with one), each "
                   "answer ending at the model's EOS or at --output-len, whichever comes first; "
                   "the report counts the speculative tokens the async loop discarded; "
                   f"{COPY_PRESET}: '{COPY_INSTRUCTION.strip()}' and a shipped passage (through "
                   "the chat template where the model has one), each answer ending at EOS or at "
                   "--output-len; a model without a tokenizer gets random prompts whose second "
                   "half repeats the first; "
                   f"{COPY_JSON_PRESET}: the same passages to be repeated as the JSON object "
                   '{"text": ...}, every answer under that schema; '
                   f"{JSON_PRESET}: the random workload run once per --json-fractions share of "
                   f"requests under the JSON schema {JSON_SCHEMA.name} (the others ignore EOS); "
                   f"{AGENT_PRESET}: coding-agent sessions (see the agent flags): a long shared "
                   "head of tool definitions, then turns that each add the previous answer and a "
                   "tool result, the next turn submitted when the previous answer is complete; "
                   f"{BATCHES_PRESET}: for each of --batch-sizes, B prompts of exactly "
                   "--prompt-len tokens at once, each generating exactly --output-len (EOS "
                   "ignored, greedy), in a fresh process per batch: prefill time, decode "
                   "tokens/s, peak RSS and its ratio to the model file, beside llama.cpp's "
                   "llama-batched-bench on the same GGUF (--llama-cpp); Tandem runs the engine's "
                   "loop (async; --no-async for sync), --modes is not used")  # fmt: skip
    g.add_argument("--num-requests", type=int, default=None,
                   help=f"default {DEFAULT_SIZES['num_requests']} ({BLOG_PRESET}: "
                   f"{BLOG_NUM_REQUESTS}); all arrive at once unless --arrivals poisson, and "
                   "--max-num-seqs caps how many run at once (the batch size)")  # fmt: skip
    g.add_argument("--prompt-len", type=int, default=None,
                   help="mean prompt length (tokens; shared-prefix: after the system prompt); "
                   f"default {DEFAULT_SIZES['prompt_len']} ({BLOG_PRESET}: {BLOG_PROMPT_LEN})")  # fmt: skip
    g.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: system prompts")
    g.add_argument("--prefix-len", type=int, default=512,
                   help="shared-prefix: tokens per system prompt")  # fmt: skip
    g.add_argument("--output-len", type=int, default=None,
                   help=f"mean output length (tokens); default {DEFAULT_SIZES['output_len']} "
                   f"({BLOG_PRESET}: exact, {BLOG_OUTPUT_LEN['cuda']} on CUDA, "
                   f"{BLOG_OUTPUT_LEN['cpu']} on a CPU; {CHAT_PRESET}: a cap, default "
                   f"{CHAT_OUTPUT_LEN}; {COPY_PRESET} and {COPY_JSON_PRESET}: a cap, default "
                   f"{COPY_OUTPUT_LEN}; {AGENT_PRESET}: each answer, exact, default "
                   f"{AGENT_OUTPUT_LEN})")  # fmt: skip
    g.add_argument("--json-fractions", default=JSON_FRACTIONS,
                   help=f"{JSON_PRESET}: percentages of requests under the schema, one run each "
                   f"(spread evenly: 25 is every 4th request); default {JSON_FRACTIONS}")  # fmt: skip
    g.add_argument("--thinking-budget", type=int, default=None, metavar="N",
                   help=f"{JSON_PRESET}: the constrained requests are a reasoning model's: their "
                   "prompt opens the thinking block and they think N tokens (the budget ends it) "
                   "before the schema's answer; needs a model with a reasoning parser, e.g. "
                   "--model default-thinking (the default model's reasoning twin)")  # fmt: skip
    g.add_argument("--len-spread", type=float, default=0.5,
                   help="lengths are uniform in mean * [1 - spread, 1 + spread]")  # fmt: skip
    g.add_argument("--arrivals", choices=("offline", "poisson"), default="offline",
                   help="offline: all at once; poisson: at --rate requests/s")  # fmt: skip
    g.add_argument("--rate", type=float, default=8.0, help="Poisson arrival rate (requests/s)")
    g.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy; else seeded sampling"
    )
    g.add_argument("--workload-seed", type=int, default=0)
    g.add_argument("--modes", default="sync,async", help="which loops to run, in order")
    g.add_argument("--repeats", type=int, default=1,
                   help="run the modes this many times, interleaved; report each mode's median run")  # fmt: skip
    g.add_argument("--trace", help="write a Chrome/Perfetto trace (JSON) of both runs")
    g.add_argument("--plot", help="write a PNG timeline of both runs")
    g.add_argument("--profile", action="store_true",
                   help="report the bytes a decode step must read (weights + KV) and the share "
                   "of the device's bandwidth the decode steps reached; on CUDA also time the "
                   f"device's kernels (torch.profiler) over {PROFILE_STEPS} steps in the middle "
                   "of each run: their busy time over wall time, kernels per step, and the "
                   "kernels the device idles before")  # fmt: skip
    g.add_argument("--kernel-trace", metavar="DIR",
                   help="with --profile on CUDA: write each run's profiled window (kernels, "
                   "copies and memsets on every stream) to DIR as a gzipped Chrome trace")  # fmt: skip
    add_lora_args(parser)
    b = parser.add_argument_group(f"{BATCHES_PRESET} workload")
    b.add_argument("--batch-sizes", default=BATCH_SIZES, metavar="B,B,...",
                   help=f"requests at once, one measurement each; default {BATCH_SIZES}")  # fmt: skip
    b.add_argument("--llama-cpp", default="auto", metavar="auto|none|DIR",
                   help="llama.cpp's binaries to run llama-batched-bench from (a GGUF model "
                   "only): auto, those that benchmarks/setup_llama_server.sh builds into "
                   "~/.cache/tandem/llama.cpp/bin, if there; none, Tandem alone; DIR, that "
                   "folder's. Threads: --cpu-threads, else every usable core")  # fmt: skip
    r = parser.add_argument_group("random GGUF")
    r.add_argument("--random-gguf", choices=BLOCK_TYPES, default=None, metavar="TYPE",
                   help=f"run a random-weight GGUF of --model's shape ({', '.join(BLOCK_TYPES)}: "
                   "every weight in these blocks; norms and routers F32), --model being a folder "
                   "with config.json or a shipped config's name (qwen3-30b-a3b, llama-3.2-1b, "
                   "llama-3.1-8b): written once, without float weights, under "
                   "~/.cache/tandem/models (TANDEM_CACHE_DIR), then reused. Its vocabulary is "
                   "SmolLM2's (49152 tokens, from the smollm2-135m-instruct package), which "
                   "llama.cpp and Tandem both read")  # fmt: skip
    r.add_argument("--num-layers", type=int, default=None, metavar="N",
                   help="with --random-gguf: N layers in place of the config's (e.g. 12 for a "
                   "Qwen3-30B-A3B shape that does not fit 24 GiB in float32)")  # fmt: skip
    a = parser.add_argument_group(f"{AGENT_PRESET} workload")
    a.add_argument("--sessions", type=int, default=AGENT_SIZES["sessions"],
                   help="sessions at once")  # fmt: skip
    a.add_argument("--turns", type=int, default=AGENT_SIZES["turns"], help="turns per session")
    a.add_argument("--head-len", type=int, default=AGENT_SIZES["head_len"],
                   help="tokens of the head every session starts with (a system prompt of JSON "
                   "tool definitions; random ids without a tokenizer), shortened where a whole "
                   "session would not fit the context")  # fmt: skip
    a.add_argument("--tool-result-len", type=int, default=AGENT_SIZES["tool_result_len"],
                   help="tokens each turn adds as a tool result (a user message)")  # fmt: skip
    a.add_argument("--session-stagger", type=float, default=0.0, metavar="SECONDS",
                   help="session s starts s * SECONDS after the first (0: all at once)")  # fmt: skip
    a.add_argument("--agent-task", choices=AGENT_TASKS, default="explain",
                   help="explain: each session asks a question about the files it reads; edit: "
                   "each file it reads is to be repeated back with one line changed (answers "
                   "that re-emit tool results, as an agent rewriting a file; set --output-len "
                   "near --tool-result-len)")  # fmt: skip
    a.add_argument("--agent-prompts", choices=PROMPT_MODES, default="exact",
                   help="how a turn's prompt follows the previous one: exact, the previous "
                   "prompt and answer ids as they were, then the chat template's text after the "
                   "answer; rendered, the whole conversation rendered and tokenized again, as a "
                   "server does with messages")  # fmt: skip
