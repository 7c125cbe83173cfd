"""The int8 KV cache (`kv_cache_dtype="int8"`) through the fused CPU kernels.

`tandem/ops/kv_quant.py` is the contract and the portable reference: the kernels write its codes
and scales bit for bit, and read them (in place for decodes, verifications and short chunks;
dequantized into float rows for longer chunks) within float rounding of the portable path. An
engine's greedy tokens follow the int8 reference, a function of the tokens alone (attention reads
K/V as cached, a chunk's own included), whatever the schedule: chunked or not, with or without a
cached prefix, preempted, sync or async, drafted and verified, on one rank or two. As in
test_equivalence.py, the reference is followed where its top two logits are closer than
INT8_LOGITS_ATOL (below). The attention kernels' own checks over an int8 cache (decodes,
verifications, chunks, long contexts) are test_kernels.py's, run for both kinds of cache.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import torch

from tandem.execution import fast_path
from tandem.models.default_model import build_checkpoint
from tandem.models.loader import load_model
from tandem.ops import cpu_elementwise, cpu_kernels, kv_quant
from tandem.ops.attention_metadata import AttentionMetadata, PrefillSegment

from conftest import follow_near_ties, random_prompts
from helpers import assert_idle_and_balanced, greedy, make_llm, run_both_loops

INT8 = torch.int8
# The fused path's logits stay within this of the portable path's over an int8 cache. Why more
# than FAST_PATH_LOGITS_ATOL: a K or V value that the two paths compute a rounding apart can fall
# on either side of a code's rounding boundary, and one code step moved these models' logits by
# up to 6e-4 (measured; without such a flip they agree within 5e-6).
INT8_LOGITS_ATOL = 2e-3
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}


@pytest.fixture(scope="module", autouse=True)
def kernels() -> cpu_kernels.KernelBuild:
    build = cpu_kernels.load()
    assert build.available, build.error
    return build


# ------------------------------------------------------------------------------ the kernels
@pytest.mark.parametrize("tokens", [1, 7, 1500])  # 1500: rows shared out to the threads
@pytest.mark.parametrize("dim", [8, 48, 64])  # one block shorter than 32; 32 + 16; two of 32
def test_store_kv_writes_kv_quants_codes_and_scales_bit_for_bit(tokens, dim) -> None:
    g = torch.Generator().manual_seed(tokens + dim)
    blocks, block_size, heads = 200, 16, 3
    qkv = torch.randn(tokens, (4 + 2 * heads) * dim, generator=g)  # k and v: strided views
    qkv *= torch.rand(tokens, 1, generator=g) * 10
    k = qkv[:, 4 * dim : (4 + heads) * dim].view(-1, heads, dim)
    v = qkv[:, (4 + heads) * dim :].view(-1, heads, dim)
    k[0, 0] = 0.0  # a zero row: scale 0, codes 0
    # Codes that fall halfway between two integers: rounded half to even, as torch.round.
    k[-1, -1] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 3.5, 126.5] * (dim // 8))
    k[-1, 0] = torch.tensor([1e-30, -1e-31, 2e-31, 0.0, 3e-30, -1e-30, 5e-31, 0.0] * (dim // 8))
    slots = torch.randperm(blocks * block_size, generator=g)[: 2 * tokens : 2]  # a strided view
    shape = (blocks, block_size, heads, kv_quant.row_width(dim, INT8))
    k_cache, v_cache = (torch.randint(-127, 128, shape, dtype=INT8, generator=g) for _ in "kv")
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k_ref.view(-1, *shape[2:]).index_copy_(0, slots, kv_quant.quantize(k, INT8))
    v_ref.view(-1, *shape[2:]).index_copy_(0, slots, kv_quant.quantize(v, INT8))
    cpu_elementwise.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    with pytest.raises(RuntimeError, match="rows must hold"):  # a float row width is refused
        narrow = k_cache[..., :dim].contiguous()
        cpu_elementwise.write_kv(k, v, narrow, narrow.clone(), slots)


# ------------------------------------------------------------------- the one-call forward
@pytest.fixture(scope="module")
def llama32(tmp_path_factory) -> Path:
    """A Llama whose heads (32 values, groups of 2) take the vector kernels."""
    return build_checkpoint(tmp_path_factory.mktemp("llama32"), head_dim=32, seed=1)


@pytest.fixture(scope="module")
def windowed_mistral(tmp_path_factory) -> Path:
    """Every layer one window of 24 keys: the one-call forward, windows cutting contexts."""
    return build_checkpoint(
        tmp_path_factory.mktemp("mistral-window"), "MistralForCausalLM", head_dim=32,
        extra_config={"sliding_window": 24},
    )  # fmt: skip


def int8_caches(model, num_blocks: int, block_size: int) -> list[torch.Tensor]:
    spec = model.local_spec
    width = kv_quant.row_width(spec.head_dim, INT8)
    shape = (2, num_blocks, block_size, spec.num_kv_heads, width)
    return [torch.zeros(shape, dtype=INT8) for _ in range(spec.num_layers)]


def forward_steps(model, ids: list[int], steps: list[tuple[int, int, bool]], block_size: int = 4):
    """Logits of each step over fresh int8 caches: (first, last, as_decode) positions per step,
    each a chunk after the positions before it (or a run of single-token decodes)."""
    n = len(ids)
    tables = torch.arange(-(-n // block_size)).view(1, -1)
    caches = int8_caches(model, tables.shape[1], block_size)
    tokens, positions = torch.tensor(ids), torch.arange(n)
    out = []
    with torch.inference_mode():
        for first, last, as_decode in steps:
            for a, b in [(i, i + 1) for i in range(first, last)] if as_decode else [(first, last)]:
                segments = [] if as_decode else [PrefillSegment(0, b - a, b, 0)]
                meta = AttentionMetadata(
                    positions[a:b], tables, torch.tensor([b]), int(as_decode), tables.shape[1],
                    segments, block_size,
                )  # fmt: skip
                out.append(model.compute_logits(model(tokens[a:b], positions[a:b], caches, meta)))
    return torch.cat(out)


@functools.cache
def loaded(path: Path, ops: str):
    """The model on the portable path ("eager"), the one-call forward ("fused"), or the same
    kernels op by op ("op-by-op"), whose longer chunks take the portable attention."""
    model = load_model(path, torch.float32, torch.device("cpu")).model
    plan = fast_path.prepare(model, torch.device("cpu"), torch.float32, ops == "eager")
    assert plan.ops.startswith("portable" if ops == "eager" else "fused-cpu"), plan.ops
    if ops == "op-by-op":
        model._fused_weights, model.ops = None, cpu_elementwise
    return model


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory) -> dict[str | None, Path]:
    """One-layer models without and with a window of 24 (every K and V from the embeddings),
    two heads of 64 over one kv head: two blocks of scales a row."""
    root = tmp_path_factory.mktemp("one-layer")
    return {
        window: build_checkpoint(
            root / f"window-{window}",
            "MistralForCausalLM",
            head_dim=64,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_hidden_layers=1,
            extra_config={"sliding_window": window},
        )  # fmt: skip
        for window in (None, 24)
    }


@pytest.mark.parametrize("window", [None, 24])
def test_the_fused_forward_reads_int8_caches_as_the_portable_attention(one_layer, window):
    """A fresh prompt of 150 tokens (its own K/V read as cached), 140 more after it (the context
    gathered dequantized), a short chunk read in place, and decodes: the one-call forward gives
    the logits of the same kernels op by op, whose chunks take the portable attention, within
    float rounding. One layer: both hold the same codes (its K/V come from the same GEMM),
    where a second layer's could round to a neighbouring code (INT8_LOGITS_ATOL). The portable
    forward (other GEMMs) is within INT8_LOGITS_ATOL."""
    path = one_layer[window]
    fused = loaded(path, "fused")
    assert fused._fused_weights is not None  # the one-call forward
    ids = random_prompts(random.Random(6), 1, 1024, 300, 300)[0]
    steps = [(0, 150, False), (150, 290, False), (290, 295, False), (295, 300, True)]
    assert not PrefillSegment(0, 140, 290, 0).attends_as_decodes
    logits = forward_steps(fused, ids, steps)
    op_by_op = forward_steps(loaded(path, "op-by-op"), ids, steps)
    torch.testing.assert_close(logits, op_by_op, rtol=0, atol=1e-5)
    eager = forward_steps(loaded(path, "eager"), ids, steps)
    assert (logits - eager).abs().max() < INT8_LOGITS_ATOL


def test_a_short_chunk_after_an_int8_prefix_gives_its_decodes_logits(llama32) -> None:
    """A chunk that attends as decodes gives, bit for bit, the logits of decoding its tokens."""
    model = loaded(llama32, "fused")
    ids = random_prompts(random.Random(7), 1, 1024, 40, 40)[0]
    chunk = forward_steps(model, ids, [(0, 28, False), (28, 40, False)])[28:]
    decodes = forward_steps(model, ids, [(0, 28, False), (28, 40, True)])[28:]
    assert torch.equal(chunk, decodes)


# ------------------------------------------------------------------------- the engine
def int8_reference(path: Path, prompt: list[int], token_ids: list[int], n: int) -> list[int]:
    """The int8 reference's greedy tokens to compare `token_ids` with (`follow_near_ties`): each
    next token from one portable prefill of everything before it over an int8 cache."""
    model = loaded(path, "eager")

    def logits_after(prefix: list[int]) -> torch.Tensor:
        ids = prompt + prefix
        return forward_steps(model, ids, [(0, len(ids), False)], block_size=16)[-1]

    def continuation(prefix: list[int], count: int) -> list[int]:
        tokens = list(prefix)
        for _ in range(count):
            tokens.append(int(logits_after(tokens).argmax()))
        return tokens[len(prefix) :]

    return follow_near_ties(token_ids, n, continuation, logits_after, INT8_LOGITS_ATOL)


def check_against_reference(path, prompts, outputs, n: int) -> None:
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        assert out.token_ids == int8_reference(path, prompt, out.token_ids, n), i


# (engine options, what the schedule must have had)
SCHEDULES = {
    "plain": ({}, None),
    "chunked": ({"max_num_batched_tokens": 24, "block_size": 4}, None),
    "preempted": ({"block_size": 8, "num_kv_blocks": 24, "max_num_batched_tokens": 64}, "preempt"),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_int8_greedy_tokens_follow_the_reference_in_both_loops(llama32, schedule) -> None:
    """Fused kernels, int8 cache: each loop's tokens are the reference's (up to near ties), and
    async equals sync, under chunked prefill and preemption by recompute."""
    options, must = SCHEDULES[schedule]
    prompts = random_prompts(random.Random(8), 6, 1024, 5, 90)
    runs = run_both_loops(llama32, prompts, greedy(16), kv_cache_dtype="int8", **options)
    (sync, llm), (asyn, _) = runs[False], runs[True]
    assert llm.engine.execution.ops == "fused-cpu"
    assert [o.token_ids for o in sync] == [o.token_ids for o in asyn]
    check_against_reference(llama32, prompts, sync, 16)
    if must == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0


def test_int8_tokens_do_not_depend_on_a_cached_prefix(llama32) -> None:
    """Prompts that share prefixes: with prefix caching (hits) and without, the same tokens, the
    eager engine's too (up to near ties: the reference)."""
    rng = random.Random(9)
    shared = random_prompts(rng, 2, 1024, 40, 70)
    prompts = [shared[i % 2] + tail for i, tail in enumerate(random_prompts(rng, 6, 1024, 1, 20))]
    outputs = {}
    for caching, eager in ((True, False), (False, False), (True, True)):
        llm = make_llm(
            llama32, kv_cache_dtype="int8", enable_prefix_caching=caching, enforce_eager=eager,
            block_size=8, max_num_seqs=2,
        )  # fmt: skip
        outputs[caching, eager] = llm.generate(prompts, greedy(12))
        assert (llm.engine.stats().prefix_cache.hits > 0) == caching
        assert_idle_and_balanced(llm.engine)
        llm.close()
    tokens = {key: [o.token_ids for o in outs] for key, outs in outputs.items()}
    assert tokens[True, False] == tokens[False, False]
    check_against_reference(llama32, prompts, outputs[True, False], 12)
    check_against_reference(llama32, prompts, outputs[True, True], 12)


@pytest.mark.parametrize("model_name", ["cycling_llama", "llama32"])  # generic loop, vector kernel
def test_int8_verification_of_ngram_drafts_changes_no_token(request, model_name) -> None:
    """Drafted and verified over an int8 cache: the tokens of decoding without drafts, in both
    loops, with chunked prompts and preemption."""
    path = request.getfixturevalue(model_name)
    span = random_prompts(random.Random(10), 1, 1024, 9, 9)[0]
    prompts = [
        span * 3 + [17],
        [40, 41, 42] * 5,
        *random_prompts(random.Random(11), 2, 1024, 23, 40),
    ]
    options = dict(kv_cache_dtype="int8", block_size=4, num_kv_blocks=24, max_num_batched_tokens=16)
    for async_scheduling in (False, True):
        plain = make_llm(path, async_scheduling=async_scheduling, **options)
        reference = [o.token_ids for o in plain.generate(prompts, greedy(30))]
        plain.close()
        llm = make_llm(path, speculative_config=NGRAM, async_scheduling=async_scheduling, **options)
        assert [o.token_ids for o in llm.generate(prompts, greedy(30))] == reference
        assert llm.engine.stats().speculative.accepted_tokens
        assert llm.engine.scheduler.num_preemptions > 0
        assert_idle_and_balanced(llm.engine)
        llm.close()


@pytest.mark.parametrize("model_name", ["windowed_mistral", "sliding_qwen3"])
def test_int8_sliding_windows_follow_the_reference(request, model_name) -> None:
    """One window in every layer (the one-call forward) and windows beside full layers (the
    kernels op by op): chunked prompts longer than the windows."""
    path = request.getfixturevalue(model_name)
    prompts = random_prompts(random.Random(12), 4, 1024, 20, 90)
    runs = run_both_loops(
        path, prompts, greedy(16), kv_cache_dtype="int8", block_size=4, max_num_batched_tokens=32
    )
    (sync, llm), (asyn, _) = runs[False], runs[True]
    assert llm.engine.execution.ops.startswith("fused-cpu")
    assert [o.token_ids for o in sync] == [o.token_ids for o in asyn]
    check_against_reference(path, prompts, sync, 16)


def test_int8_on_two_ranks_follows_the_reference(tiny_llama) -> None:
    """Each rank quantizes its own kv heads' rows: two ranks give one rank's tokens (head size
    16: the generic loop)."""
    prompts = random_prompts(random.Random(13), 4, 1024, 3, 60)
    llm = make_llm(
        tiny_llama, kv_cache_dtype="int8", num_kv_blocks=128, max_model_len=512,
        tensor_parallel_size=2, cpu_threads=1,
    )  # fmt: skip
    try:
        outputs = {}
        for mode in (False, True):
            llm.engine.configure(async_scheduling=mode)
            outputs[mode] = llm.generate(prompts, greedy(12))
            assert_idle_and_balanced(llm.engine)
        assert [o.token_ids for o in outputs[False]] == [o.token_ids for o in outputs[True]]
        check_against_reference(tiny_llama, prompts, outputs[True], 12)
    finally:
        llm.close()
