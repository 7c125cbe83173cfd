"""Benchmark workloads: the sizes of each preset, and the prompts, lengths and arrival times they
make. Most are random token ids (nothing is tokenized, so any model with a vocabulary runs them);
`chat` is real user questions through the model's chat template, ending at the model's own EOS;
`copy` asks the model to repeat a shipped passage (the case speculative decoding's drafts are
right most often), `copy-json` the same as a JSON object under a schema (drafts under a
grammar); `json` is the random workload with a share of its requests under a shipped JSON
schema; `batches` is B random prompts at once of exactly --prompt-len tokens, each generating
exactly --output-len, for each batch size B."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tandem.bench.agent import AGENT_OUTPUT_LEN, AGENT_PRESET
from tandem.bench.lora import LORA_PRESET, lora_config
from tandem.config import EngineConfig
from tandem.engine.chat_template import chat_template_problem, render_chat_ids
from tandem.lora import LoRARequest
from tandem.request import StructuredOutputsParams

# The experiment of transformers' blog on asynchronous batching (an 8B model on an H200, batch 32,
# 8K generated tokens): every request at once, short prompts, each generating exactly
# --output-len tokens.
BLOG_PRESET = "llama8b-32x8k"
BLOG_NUM_REQUESTS = 32
BLOG_PROMPT_LEN = 32
BLOG_OUTPUT_LEN = {"cuda": 8192, "cpu": 1536}  # CPU: the default model, about a minute on 2 cores
BLOG_CUDA_MODEL = "llama-3.1-8b"  # a config shipped in models/, with load_format="dummy"
DEFAULT_SIZES = {"num_requests": 64, "prompt_len": 128, "output_len": 128}
# Real chat questions, each rendered by the model's chat template; --output-len caps the answer,
# which ends at the model's own end-of-turn token: requests finish at different steps.
CHAT_PRESET = "chat"
CHAT_OUTPUT_LEN = 256
CHAT_PROMPTS = Path(__file__).with_name("data") / "chat_prompts.txt"  # package data
# "Repeat the following text exactly" and a shipped passage, through the chat template where the
# model has one: the answer repeats the prompt, so an n-gram draft from the prompt is often
# right. --output-len caps the answer (about a passage and a preamble), EOS ends it.
COPY_PRESET = "copy"
COPY_OUTPUT_LEN = 128
COPY_INSTRUCTION = "Repeat the following text exactly:\n"
COPY_PASSAGES = Path(__file__).with_name("data") / "copy_passages.txt"  # package data
# The copy workload answered as JSON: a structured extraction that quotes its input, every
# request under the schema of one string field.
COPY_JSON_PRESET = "copy-json"
COPY_JSON_INSTRUCTION = 'Repeat the following text exactly, as the JSON object {"text": ...}:\n'
COPY_JSON_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string"}},
    "required": ["text"],
    "additionalProperties": False,
}
# The random workload run once per share of requests (percent) under a JSON schema: a product
# record of bounded strings, integers, an enum and an array (package data).
JSON_PRESET = "json"
JSON_FRACTIONS = "0,25,100"
JSON_SCHEMA = Path(__file__).with_name("data") / "product_schema.json"
# B requests at once, every prompt and output of the same length, for each B of --batch-sizes:
# what llama.cpp's llama-batched-bench runs (batches.py), beside it.
BATCHES_PRESET = "batches"
BATCH_SIZES = "1,32"
MODELS_DIR = Path(__file__).with_name("models")  # package data: config.json files only
PROFILE_STEPS = 64  # steps per profiled window: a few tens of thousands of kernels on an 8B


def resolve_workload(args: argparse.Namespace, config: EngineConfig, device: str) -> EngineConfig:
    """Fill in the sizes left unset; the blog's preset on CUDA (`device`) also picks the
    8B-shaped dummy model (unless --model was given). Returns the engine config to use."""
    if args.workload == BLOG_PRESET:
        sizes = {
            "num_requests": BLOG_NUM_REQUESTS,
            "prompt_len": BLOG_PROMPT_LEN,
            "output_len": BLOG_OUTPUT_LEN["cuda" if device == "cuda" else "cpu"],
        }
        if device == "cuda" and config.model is None:
            config = replace(config, model=str(shipped_model(BLOG_CUDA_MODEL)), load_format="dummy")
    elif args.workload == CHAT_PRESET:
        sizes = {**DEFAULT_SIZES, "output_len": CHAT_OUTPUT_LEN}  # prompt_len: unused
    elif args.workload in (COPY_PRESET, COPY_JSON_PRESET):  # prompt_len: tokenizer-less only
        sizes = {**DEFAULT_SIZES, "output_len": COPY_OUTPUT_LEN}
    elif args.workload == AGENT_PRESET:  # sizes of its own (args.py's agent flags)
        sizes = {**DEFAULT_SIZES, "output_len": AGENT_OUTPUT_LEN}
    elif args.workload == LORA_PRESET:  # 32 requests, as a batch of one step each
        sizes = {**DEFAULT_SIZES, "num_requests": 32}
        config = lora_config(args, config)
    else:
        sizes = DEFAULT_SIZES
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return config


def shipped_model(name: str) -> Path:
    """A config-only model folder shipped with the package (`tandem/bench/models/`)."""
    path = MODELS_DIR / name
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{path / 'config.json'} is missing (it ships with the tandem package); give "
            "--model <a folder with config.json> --load-format dummy"
        )
    return path


def profile_window(workload: Workload) -> tuple[int, int]:
    """Steps [first, stop) of a run to profile: PROFILE_STEPS around its middle (decode steps
    dominate a run: about as many as the longest output)."""
    steps = max(workload.output_lens, default=1)
    width = max(1, min(PROFILE_STEPS, steps // 2))
    first = max(1, steps // 2 - width // 2)
    return first, first + width


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]  # max_tokens: exact when EOS is ignored, a cap otherwise
    arrival_times: list[float]  # seconds after start
    ignore_eos: bool = True  # False: a request may end early, on the model's EOS
    # Per request (empty: none): the grammar its output must match. A constrained request
    # honours EOS (its grammar ends it) whatever `ignore_eos` says.
    structured: list[StructuredOutputsParams | None] = field(default_factory=list)
    # Per request (empty: none): its thinking budget, a reasoning model's request.
    thinking: list[int | None] = field(default_factory=list)
    # Per request (empty: none): the LoRA adapter it runs under (`lora.py`).
    loras: list[LoRARequest | None] = field(default_factory=list)

    def lora(self, i: int) -> LoRARequest | None:
        return self.loras[i] if self.loras else None

    def constraint(self, i: int) -> StructuredOutputsParams | None:
        return self.structured[i] if self.structured else None

    def thinking_budget(self, i: int) -> int | None:
        return self.thinking[i] if self.thinking else None

    @property
    def ends_early(self) -> bool:
        """Whether a request may finish before its max_tokens."""
        return not self.ignore_eos or any(s is not None for s in self.structured)

    def warmup(self, n: int = 4, max_tokens: int = 4) -> Workload:
        """The first `n` requests, `max_tokens` each or their own output if shorter (an engine
        sized to the workload holds no more), all at once (constraints and adapters kept; more
        requests where that takes every adapter into a slot before the run)."""
        k = min(max(n, len(set(self.loras) - {None}) + 1), len(self.prompts))
        lens = [min(max_tokens, length) for length in self.output_lens[:k]]
        return Workload(
            self.prompts[:k], lens, [0.0] * k, True, self.structured[:k], self.thinking[:k],
            self.loras[:k],
        )  # fmt: skip


def make_workload(args: argparse.Namespace, vocab_size: int, max_model_len: int) -> Workload:
    rng = random.Random(args.workload_seed)

    def length(mean: int) -> int:
        lo, hi = (
            max(1, round(mean * (1 - args.len_spread))),
            max(1, round(mean * (1 + args.len_spread))),
        )
        return rng.randint(lo, hi)

    shared = args.workload == "shared-prefix"
    if shared and (args.num_prefixes < 1 or args.prefix_len < 1):
        raise ValueError("--num-prefixes and --prefix-len must be >= 1")
    prefixes = [
        [rng.randrange(3, vocab_size) for _ in range(args.prefix_len if shared else 0)]
        for _ in range(args.num_prefixes if shared else 1)
    ]
    prompts, outputs, arrivals, t = [], [], [], 0.0
    exact_outputs = args.workload == BLOG_PRESET  # as the blog's experiment: every request alike
    for i in range(args.num_requests):
        prefix = prefixes[i % len(prefixes)]
        n_out = args.output_len if exact_outputs else length(args.output_len)
        n_out = min(n_out, max_model_len - 1)
        n_in = min(len(prefix) + length(args.prompt_len), max_model_len - n_out)
        suffix = [rng.randrange(3, vocab_size) for _ in range(max(0, n_in - len(prefix)))]
        prompts.append((prefix + suffix)[:n_in])
        outputs.append(n_out)
        if args.arrivals == "poisson":
            t += rng.expovariate(args.rate)
        arrivals.append(t)
    return Workload(prompts, outputs, arrivals)


def parse_batch_sizes(text: str) -> list[int]:
    """--batch-sizes: distinct positive batch sizes, in the order given."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise ValueError(f"--batch-sizes takes distinct sizes >= 1, e.g. 1,32; got {text!r}")
    return sizes


def make_batch_workload(
    batch: int, prompt_len: int, output_len: int, vocab_size: int, seed: int = 0
) -> Workload:
    """`batch` random prompts of exactly `prompt_len` tokens, all at once, each generating
    exactly `output_len` tokens."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(prompt_len)] for _ in range(batch)]
    return Workload(prompts, [output_len] * batch, [0.0] * batch)


def chat_questions() -> list[str]:
    """The shipped user questions, one per line."""
    lines = CHAT_PROMPTS.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip()]


def chat_prompt_ids(
    tokenizer: Any, num_requests: int, where: str = "this model"
) -> list[list[int]]:
    """`num_requests` rendered questions, cycling through the shipped ones. `where` names the
    model in the error raised when it cannot render a chat."""
    problem = chat_template_problem(tokenizer)
    if problem is not None:
        raise ValueError(
            f"the chat workload renders questions with the model's chat template ({where}): "
            f"{problem}"
        )
    questions = chat_questions()[:num_requests]
    rendered = [render_chat_ids(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    return [rendered[i % len(rendered)] for i in range(num_requests)]


def make_chat_workload(
    args: argparse.Namespace, tokenizer: Any, max_model_len: int, where: str = "this model"
) -> Workload:
    """The chat workload: --num-requests rendered questions, answers capped at --output-len
    tokens (less where the context is shorter), EOS honoured."""
    if args.num_requests < 1 or args.output_len < 1:
        raise ValueError("--num-requests and --output-len must be >= 1")
    prompts = chat_prompt_ids(tokenizer, args.num_requests, where)
    longest = max(len(p) for p in prompts)
    if longest >= max_model_len:
        raise ValueError(
            f"a chat prompt has {longest} tokens: no room in max_model_len {max_model_len}"
        )
    return _answers(args, prompts, max_model_len)


def _answers(args: argparse.Namespace, prompts: list[list[int]], max_model_len: int) -> Workload:
    """`prompts` whose answers end at EOS or --output-len (less where the context is shorter),
    arriving as --arrivals says."""
    rng = random.Random(args.workload_seed)
    arrivals, t = [], 0.0
    for _ in prompts:
        if args.arrivals == "poisson":
            t += rng.expovariate(args.rate)
        arrivals.append(t)
    caps = [min(args.output_len, max_model_len - len(p)) for p in prompts]
    return Workload(prompts, caps, arrivals, ignore_eos=False)


def copy_passages() -> list[str]:
    """The shipped passages, separated by blank lines."""
    text = COPY_PASSAGES.read_text(encoding="utf-8")
    return [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]


def copy_prompt_ids(
    tokenizer: Any, num_requests: int, instruction: str = COPY_INSTRUCTION
) -> list[list[int]]:
    """`num_requests` copy requests, cycling through the passages: through the chat template
    when the tokenizer has one, else the plain text tokenized as the engine would."""
    texts = [instruction + passage for passage in copy_passages()[:num_requests]]
    if chat_template_problem(tokenizer) is None:
        rendered = [render_chat_ids(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    else:
        rendered = [tokenizer(t).input_ids for t in texts]
    return [rendered[i % len(rendered)] for i in range(num_requests)]


def repeated_span_ids(
    args: argparse.Namespace, vocab_size: int, max_model_len: int
) -> list[list[int]]:
    """A tokenizer-less model's copy prompts: random ids of about --prompt-len tokens, the
    second half a repeat of the first (an n-gram lookup finds its continuation in the prompt)."""
    rng = random.Random(args.workload_seed)
    spread = args.len_spread
    lo = max(2, round(args.prompt_len * (1 - spread)))
    hi = max(lo, round(args.prompt_len * (1 + spread)))
    prompts = []
    for _ in range(args.num_requests):
        n_in = min(rng.randint(lo, hi), max_model_len - 1)
        span = [rng.randrange(3, vocab_size) for _ in range((n_in + 1) // 2)]
        prompts.append((span + span)[:n_in])
    return prompts


def make_copy_workload(
    args: argparse.Namespace,
    tokenizer: Any,
    vocab_size: int,
    max_model_len: int,
    where: str = "this model",
) -> Workload:
    """The copy workload: --num-requests prompts asking for a passage back (a model without a
    tokenizer: prompts that repeat a span), answers ending at EOS or --output-len; copy-json:
    each answer under `COPY_JSON_SCHEMA`."""
    as_json = args.workload == COPY_JSON_PRESET
    if args.num_requests < 1 or args.output_len < 1:
        raise ValueError("--num-requests and --output-len must be >= 1")
    if tokenizer is None:
        if args.prompt_len < 2:
            raise ValueError("--prompt-len must be >= 2 (a span and its repeat)")
        prompts = repeated_span_ids(args, vocab_size, max_model_len)
    else:
        instruction = COPY_JSON_INSTRUCTION if as_json else COPY_INSTRUCTION
        prompts = copy_prompt_ids(tokenizer, args.num_requests, instruction)
    longest = max(len(p) for p in prompts)
    if longest >= max_model_len:
        raise ValueError(
            f"a copy prompt has {longest} tokens: no room in max_model_len {max_model_len} "
            f"({where})"
        )
    workload = _answers(args, prompts, max_model_len)
    if as_json:
        spec = StructuredOutputsParams(json=COPY_JSON_SCHEMA)
        workload = replace(workload, structured=[spec] * len(prompts))
    return workload


def json_schema_spec() -> StructuredOutputsParams:
    """The shipped schema as a request's structured output."""
    return StructuredOutputsParams(json=json.loads(JSON_SCHEMA.read_text(encoding="utf-8")))


def parse_json_fractions(text: str) -> list[int]:
    """--json-fractions: distinct percentages of constrained requests, in the order given."""
    try:
        fractions = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        fractions = []
    if not fractions or any(not 0 <= f <= 100 for f in fractions):
        raise ValueError(f"--json-fractions takes percentages 0-100, e.g. 0,25,100; got {text!r}")
    if len(set(fractions)) != len(fractions):
        raise ValueError(f"--json-fractions has a percentage twice: {text!r}")
    return fractions


def constrain(
    workload: Workload,
    percent: int,
    spec: StructuredOutputsParams,
    thinking: tuple[int, int] | None = None,
) -> Workload:
    """The workload with `percent`% of its requests, spread evenly (25: every 4th, from the
    first), under `spec`; the others keep ignoring EOS and run to their length. `thinking`
    (start tag, budget): the constrained requests are a reasoning model's, their prompt opening
    the thinking block and their budget ending it before the answer (their output length grows
    by the budget and the end tag)."""
    chosen = [(i * percent) % 100 < percent for i in range(len(workload.prompts))]
    structured = [spec if c else None for c in chosen]
    if thinking is None:
        return replace(workload, structured=structured)
    start, budget = thinking
    return replace(
        workload,
        structured=structured,
        prompts=[p + [start] if c else p for p, c in zip(workload.prompts, chosen, strict=True)],
        output_lens=[
            n + budget + 1 if c else n for n, c in zip(workload.output_lens, chosen, strict=True)
        ],
        thinking=[budget if c else None for c in chosen],
    )
