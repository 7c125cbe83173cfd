"""Small helpers shared by the engine tests."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

from tandem import LLM, Engine, RequestOutput, SamplingParams
from tandem.config import usable_cores
from tandem.ops.attention_metadata import AttentionMetadata, PrefillSegment


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


# A tiny model's cache: 64 MiB holds tens of thousands of its tokens, and each engine zeroes its
# whole cache at start (the 1 GiB default, for each of the suite's hundreds of engines, costs a
# tenth of the suite's time).
TEST_KV_CACHE_GIB = 1 / 16


def make_llm(path: Path, **options) -> LLM:
    options.setdefault("dtype", "float32")
    options.setdefault("device", "cpu")
    # The cores shared out by rank, fixed: timing the thread counts at start-up (tested on its
    # own, and by every engine the bench and the server start) would add about half a second to
    # each engine.
    ranks = options.get("tensor_parallel_size", 1)
    options.setdefault("cpu_threads", max(1, usable_cores() // max(ranks, 1)))
    if "num_kv_blocks" not in options:
        options.setdefault("kv_cache_memory_gib", TEST_KV_CACHE_GIB)
    return LLM(str(path), **options)


def assert_idle_and_balanced(engine: Engine) -> None:
    """Invariant 3: nothing in flight, every KV block, table row and request tree back, none
    owned."""
    s = engine.scheduler
    assert not engine.has_unfinished()
    assert not s.running and not s.waiting
    accounting = s.blocks.check()  # the pool's own invariants (no block listed twice, ...)
    assert accounting.used == 0 and s.blocks.num_free == s.blocks.size, s.blocks.owners()
    assert s.slots.num_free == s.slots.size, s.slots.owners()
    assert not s.blocks.owners() and not s.slots.owners()
    assert len(set(s.slots._free)) == s.slots.size  # no row listed free twice
    assert s.proposer is None or s.proposer.num_active == 0  # suffix trees of ended requests go


def run_both_loops(
    path: Path, prompts: list, params: list[SamplingParams], **options
) -> dict[bool, tuple[list[RequestOutput], LLM]]:
    """Generate with the sync (False) and the async (True) loop, each on its own engine, and
    check that each engine ends idle and balanced. Maps async_scheduling -> (outputs, llm)."""
    runs = {}
    for mode in (False, True):
        llm = make_llm(path, async_scheduling=mode, **options)
        runs[mode] = (llm.generate(prompts, params), llm)
        assert_idle_and_balanced(llm.engine)
    return runs


def prefill_then_decode_logits(
    model, prompt: list[int], block_size: int = 4, distinct_decodes: bool = False
) -> torch.Tensor:
    """Logits at every position: a prefill of all but the last token, then one decode step
    (`distinct_decodes`: marked a plain decode step, which CUDA's ops may fuse)."""
    spec = model.spec
    n = len(prompt)
    num_blocks = -(-n // block_size)
    dtype = model.embed.weight.dtype  # the cache holds the model's dtype
    caches = [
        torch.zeros(2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, dtype=dtype)
        for _ in range(spec.num_layers)
    ]
    tables = torch.arange(num_blocks).view(1, -1)
    ids = torch.tensor(prompt)
    positions = torch.arange(n)
    prefill = AttentionMetadata(
        positions[: n - 1], tables, torch.tensor([n - 1]), 0, 0,
        [PrefillSegment(0, n - 1, n - 1, 0)], block_size,
    )  # fmt: skip
    decode = AttentionMetadata(
        positions[n - 1 :], tables, torch.tensor([n]), 1, num_blocks, [], block_size,
        distinct_decodes=distinct_decodes,
    )  # fmt: skip
    with torch.inference_mode():
        first = model(ids[: n - 1], positions[: n - 1], caches, prefill)
        last = model(ids[n - 1 :], positions[n - 1 :], caches, decode)
        return model.compute_logits(torch.cat([first, last]))


def bench_table(out: str) -> dict[str, list[str]]:
    """Row name -> its cells, from `tandem bench`'s box-drawn table (one row per line)."""
    rows = {}
    for line in out.splitlines():
        if "│" in line:
            parts = [p.strip() for p in line.split("│")]
            rows[parts[1]] = parts[2:-1]
    return rows


# Real text for the real models' prompt logprobs.
REAL_TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built it."
)


def packaged_model(short_name: str, what: str) -> Path:
    """A packaged real model's file. Without its package the test skips, or fails where
    TANDEM_REQUIRE_REAL_MODEL is set (CI installs every packaged model)."""
    from tandem.models.catalog import PACKAGED_MODELS

    path = PACKAGED_MODELS[short_name].path()
    if path is None:
        message = f"{what} is not installed: {PACKAGED_MODELS[short_name].install}"
        if os.environ.get("TANDEM_REQUIRE_REAL_MODEL"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@functools.cache
def transformers_gguf(path: Path):
    """transformers' own GGUF loading of a file: tokenizer and fp32 model. transformers parses
    the file once for the tokenizer, once for the config and once for the weights (about 15 s
    each for Gemma 3's 262k-token vocabulary); gguf's reader only reads, so one parse serves
    all three."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reader_class = gguf.GGUFReader
    parsed = functools.cache(reader_class)
    gguf.GGUFReader = lambda file, *args, **kwargs: parsed(str(file), *args, **kwargs)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    finally:
        gguf.GGUFReader = reader_class
    return tokenizer, model.eval()
