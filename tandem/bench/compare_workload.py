"""What every engine of the offline comparison gets alike: the model (a preset built once, or a
folder), the seeded prompts, and the limits and cache sizes.

The same token-id prompts go to every engine, greedy, EOS ignored so each request generates
exactly `output_len` tokens; the chat workload instead renders real questions through the
model's chat template once (the same ids for every engine) and honours EOS.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.bench.workloads import CHAT_OUTPUT_LEN, chat_prompt_ids
from tandem.models.catalog import cache_root

TANDEM_BLOCK_SIZE = 16  # Tandem's default KV block size (tokens per block)
VLLM_CPU_BLOCK_SIZE = 128  # vLLM's CPU backend allocates its cache in blocks of 128 tokens
GiB = 1024**3

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


@dataclass
class Workload:
    """Prompts as token id lists; every request generates exactly `output_len` tokens, or (a
    chat workload: `eos_ids` set) at most that many, ending early on one of `eos_ids`."""

    spec: WorkloadSpec
    prompts: list[list[int]]
    output_len: int
    warm_prompts: list[list[int]]  # other prompts, same length range: the untimed warm-up call
    warm_output_len: int = 8
    eos_ids: list[int] | None = None  # None: EOS ignored

    @property
    def name(self) -> str:
        return self.spec.name

    def lengths_ok(self, outputs: list[list[int]]) -> bool:
        """Each request generated output_len tokens, or fewer ending on an EOS (chat)."""
        eos = set(self.eos_ids or ())
        return all(len(o) == self.output_len or (o and o[-1] in eos) for o in outputs)

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
class Limits:
    """The scheduling limits and cache sizes every engine gets."""

    max_num_seqs: int
    max_batch_tokens: int
    max_model_len: int
    tandem_kv_blocks: int
    vllm_kv_bytes: int
    llama_slots: int  # llama-server -np: one slot per request of the largest workload
    llama_slot_len: int  # tokens per slot (-c is slots times this)


def bench_models_dir() -> Path:
    return Path(os.environ.get("TANDEM_BENCH_MODELS") or cache_root() / "bench-models")


def resolve_bench_model(name: str) -> Path:
    """A preset name, 'default' or a folder; presets are built once, atomically, into the cache."""
    if name == "default":
        from tandem.models.default_model import default_model_path

        return default_model_path()
    if name not in MODEL_PRESETS:
        path = Path(name).expanduser()
        if not (path / "config.json").exists():
            raise ValueError(f"--model {name!r}: not a preset ({', '.join(MODEL_PRESETS)}, "
                             "default) nor a folder with a config.json")  # fmt: skip
        return path
    cache = bench_models_dir()
    path = cache / f"{name}-{PRESET_VERSION}"
    if (path / "config.json").exists():
        return path
    from tandem.models.default_model import build_checkpoint

    print(f"building the {name} benchmark checkpoint into {path} (once)", file=sys.stderr)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        build_checkpoint(Path(tmp) / name, "LlamaForCausalLM", **MODEL_PRESETS[name])
        os.replace(Path(tmp) / name, path)  # a half-built folder is never taken for a model
    return path


def load_model_facts(name: str, path: Path) -> Model:
    """The shapes the limits are sized from, and the ids a random prompt may use (no special
    token: no stray BOS or EOS inside a prompt)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(path).get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    try:
        special = set(AutoTokenizer.from_pretrained(path).all_special_ids)
    except (OSError, ValueError):  # no tokenizer shipped: only the config's ids are known
        special = set()
    ids = (config.bos_token_id, config.eos_token_id, config.pad_token_id)
    special |= {i for i in ids if isinstance(i, int)}
    params = 0
    for f in path.glob("*.safetensors"):
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


def make_workload(args: argparse.Namespace, spec: WorkloadSpec, model: Model, max_len: int):
    """Seeded random prompts of non-special ids, clipped to the length limit (str seeds are
    stable across runs and Python versions)."""
    if spec.chat:
        return make_chat_workload(args, spec, model, max_len)
    num = args.num_requests or spec.num_requests
    out = args.output_len or spec.output_len
    lo, hi = args.prompt_range or (spec.min_prompt, spec.max_prompt)
    hi = min(hi, max_len - out)
    lo = min(lo, hi)
    if hi < 1:
        raise ValueError(f"{spec.name}: {out} new tokens do not fit in max_model_len {max_len}")

    def prompts(n: int, seed: str) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.choice(model.allowed_ids) for _ in range(rng.randint(lo, hi))] for _ in range(n)]  # fmt: skip

    return Workload(
        spec=spec,
        prompts=prompts(num, f"{args.seed}-{spec.name}"),
        output_len=out,
        warm_prompts=prompts(min(8, num), f"{args.seed}-{spec.name}-warm-up"),
    )


def make_chat_workload(args: argparse.Namespace, spec: WorkloadSpec, model: Model, max_len: int):
    """Tandem bench's chat questions, rendered once here: every engine gets the same ids, and
    stops on the same EOS ids (Tandem's rule: config, tokenizer and generation_config.json)."""
    from transformers import AutoConfig, AutoTokenizer

    from tandem.engine.intake import eos_token_ids

    num = args.num_requests or spec.num_requests
    out = args.output_len or spec.output_len
    try:
        tokenizer = AutoTokenizer.from_pretrained(model.path)
    except (OSError, ValueError):
        tokenizer = None  # chat_prompt_ids names the problem
    prompts = chat_prompt_ids(tokenizer, num, str(model.path))
    longest = max(len(p) for p in prompts)
    if longest + out > max_len:
        raise ValueError(f"chat: prompts of up to {longest} tokens and {out} new tokens do not "
                         f"fit in max_model_len {max_len}")  # fmt: skip
    eos = sorted(eos_token_ids(AutoConfig.from_pretrained(model.path), tokenizer, model.path))
    if not eos:
        raise ValueError(f"chat: {model.path} names no EOS token, so no answer could end early")
    return Workload(spec, prompts, out, prompts[: min(8, num)], eos_ids=eos)


def make_limits(args: argparse.Namespace, model: Model, workloads: list[Workload]) -> Limits:
    """Caches that hold the largest workload at full length at once: nobody has to preempt."""
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
    longest = max(max(w.seq_lens()) for w in workloads)
    return Limits(
        max_num_seqs=args.max_num_seqs,
        max_batch_tokens=args.max_batch_tokens,
        max_model_len=min(args.max_model_len, model.max_positions),
        tandem_kv_blocks=tandem_blocks + 1,
        vllm_kv_bytes=vllm_bytes,
        llama_slots=max(len(w.prompts) for w in workloads),
        llama_slot_len=256 * math.ceil((longest + 2) / 256),
    )
