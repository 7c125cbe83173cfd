"""The fast CPU path: fused kernels against the portable ops, and the model against transformers.

The fused kernels sum in another order than PyTorch, so they are held to a tolerance; the test
models' greedy tokens stay equal to transformers' where transformers' top two logits are further
apart than FAST_PATH_LOGITS_ATOL (tests/test_equivalence.py runs the fast path, the default).
`enforce_eager` keeps the portable arithmetic, transformers' own up to float32 noise.
"""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
from functools import partial

import pytest
import torch

from tandem.execution import fast_path
from tandem.models.loader import load_model
from tandem.ops import cpu_elementwise, cpu_kernels, kv_quant
from tandem.ops import elementwise as ops
from tandem.ops.attention import _decode_attention, portable_attention
from tandem.ops.attention_metadata import AttentionMetadata, PrefillSegment
from tandem.ops.huge_pages import HUGE_PAGE
from tandem.ops.linear import Linear, linear, pack_panels
from tandem.ops.quantized import pack, quantized_linear

from conftest import (
    FAST_PATH_LOGITS_ATOL,
    _load_hf_model,
    hf_greedy_reference_allowing_near_ties,
    random_prompts,
)
from helpers import greedy, make_llm, prefill_then_decode_logits


@pytest.fixture(scope="module", autouse=True)
def kernels() -> cpu_kernels.KernelBuild:
    build = cpu_kernels.load()
    assert build.available, build.error  # the CI machine has a compiler: the fast path must build
    return build


def test_elementwise_kernels_match_portable_ops() -> None:
    fused = torch.ops.tandem
    g = torch.Generator().manual_seed(0)
    x, residual = torch.randn(37, 96, generator=g), torch.randn(37, 96, generator=g)
    w = torch.randn(96, generator=g)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), ops.rms_norm(x, w, 1e-6))
    fused_res = residual.clone()
    fused_out = fused.add_rms_norm(x, fused_res, w, 1e-5)  # updates the residual in place
    ref, ref_res = ops.add_rms_norm(x, residual, w, 1e-5)
    torch.testing.assert_close(fused_out, ref)
    assert torch.equal(fused_res, ref_res)  # one addition per element: exact

    qkv = torch.randn(37, 4 * 16 + 2 * 2 * 16, generator=g)  # q and k are strided views
    q, k = qkv[:, :64].view(-1, 4, 16), qkv[:, 64:96].view(-1, 2, 16)
    positions = torch.randint(0, 50, (37,), generator=g)
    cos, sin = torch.randn(50, 16, generator=g), torch.randn(50, 16, generator=g)
    q_ref, k_ref = ops.rotary(q, k, positions, cos, sin)
    q_out, k_out = q.clone(), k.clone()
    fused.rotary_(q_out, positions, cos, sin)
    fused.rotary_(k_out, positions, cos, sin)
    torch.testing.assert_close(q_out, q_ref)
    torch.testing.assert_close(k_out, k_ref)

    gate_up = torch.cat([torch.linspace(-30, 30, 1000).view(1, -1)] * 2, dim=1)
    gate_up = torch.cat([gate_up, torch.randn(36, 2000, generator=g)])
    torch.testing.assert_close(
        fused.silu_and_mul(gate_up), ops.silu_and_mul(gate_up), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("tokens", [1, 7, 1500])  # 1500: rows shared out to the threads
def test_store_kv_writes_each_tokens_row_into_its_slot(tokens) -> None:
    g = torch.Generator().manual_seed(tokens)
    blocks, block_size, heads, dim = 200, 16, 3, 8
    qkv = torch.randn(tokens, (4 + 2 * heads) * dim, generator=g)  # k and v: strided views
    k = qkv[:, 4 * dim : (4 + heads) * dim].view(-1, heads, dim)
    v = qkv[:, (4 + heads) * dim :].view(-1, heads, dim)
    slots = torch.randperm(blocks * block_size, generator=g)[: 2 * tokens : 2]  # a strided view
    k_cache = torch.randn(blocks, block_size, heads, dim, generator=g)
    v_cache = torch.randn(blocks, block_size, heads, dim, generator=g)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k_ref.view(-1, heads, dim).index_copy_(0, slots, k)
    v_ref.view(-1, heads, dim).index_copy_(0, slots, v)
    cpu_elementwise.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)

    for bad in (-1, blocks * block_size):  # refused before anything is written
        wrong = slots.clone()
        wrong[-1] = bad
        with pytest.raises(RuntimeError, match=f"slot {bad} is outside the cache"):
            cpu_elementwise.write_kv(k * 2, v * 2, k_cache, v_cache, wrong)
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_sampling_noise_kernel_is_the_portable_hash_bit_for_bit() -> None:
    """The sampler's noise decides every sampled token: the fused kernel must not move a bit."""
    from tandem.sampler.sampling import portable_uniform_noise, seed_key, uniform_noise

    g = torch.Generator().manual_seed(1)
    for rows, vocab in ((1, 1), (3, 7), (32, 8192), (2, 151936)):
        keys = torch.randint(0, 2**32, (rows,), generator=g)
        keys[0] = seed_key(-(2**70))  # any Python seed folds into 32 bits
        index = torch.randint(0, 2**40, (rows,), generator=g)  # only the low 32 bits count
        fused = uniform_noise(keys, index, vocab)
        assert fused.dtype == torch.float32 and fused.shape == (rows, vocab)
        assert torch.equal(fused, portable_uniform_noise(keys, index, vocab))
        assert fused.min() > 0 and fused.max() < 1


def test_argmax_kernel_is_torch_argmax() -> None:
    """Greedy tokens come from this argmax: first index of the largest value, NaN the largest."""
    from tandem.sampler.sampling import argmax_rows

    g = torch.Generator().manual_seed(2)
    for rows, cols in ((1, 1), (3, 7), (5, 16), (7, 17), (32, 2048), (4, 151936), (0, 9)):
        x = torch.randn(rows, cols, generator=g)
        few_values = torch.randint(0, 3, (rows, cols), generator=g).float()  # ties everywhere
        cases = [x, torch.full((rows, cols), float("-inf")), few_values]
        if cols > 3:
            tied = x.clone()
            tied[:, 1] = tied[:, -1] = 6.0  # ties: the first index wins
            nan = tied.clone()
            nan[::2, 2] = nan[::2, -2] = float("nan")  # the first NaN wins, even over +inf
            nan[:, 0] = float("inf")
            cases += [tied, nan]
        for case in cases:
            fused = torch.ops.tandem.argmax_rows(case)
            assert fused.dtype == torch.int64 and torch.equal(fused, case.argmax(dim=-1))
    strided = torch.randn(6, 64, generator=g)[:, :40]  # a row stride wider than the row
    assert torch.equal(argmax_rows(strided), strided.argmax(dim=-1))
    assert torch.equal(argmax_rows(strided.t()), strided.t().argmax(dim=-1))  # portable path


def _reference_scores(logits, temperature, min_p, keys, index) -> torch.Tensor:
    """The reference sampler's scores, probs / exponential noise, in float64."""
    from tandem.sampler.sampling import portable_uniform_noise

    probs = (logits.double() / temperature.double()[:, None]).softmax(dim=-1)
    probs = probs.masked_fill(probs < min_p.double()[:, None] * probs.max(-1, keepdim=True)[0], 0)
    exponential = -portable_uniform_noise(keys, index, logits.shape[1]).double().log()
    return probs / exponential


def test_sampler_kernel_draws_the_reference_samplers_tokens() -> None:
    """Temperature and min_p rows pick the reference's token (ties to float precision aside);
    temperature 0 rows are greedy; nothing below min_p is ever drawn."""
    g = torch.Generator().manual_seed(3)
    differ = total = 0
    for rows, vocab, spread in ((64, 7, 1.0), (64, 2048, 3.0), (8, 151936, 4.0), (40, 33, 0.2)):
        for _ in range(4):
            logits = torch.randn(rows, vocab, generator=g) * spread
            logits[0, : vocab // 2] = float("-inf")  # masked tokens (min_tokens, logit_bias)
            temperature = torch.rand(rows, generator=g) * 1.5 + 0.05
            temperature[1::5] = 0.0
            min_p = torch.where(torch.rand(rows, generator=g) < 0.5, 0.0, 0.3)
            keys = torch.randint(0, 2**32, (rows,), generator=g)
            index = torch.randint(0, 2**20, (rows,), generator=g)
            ids = torch.ops.tandem.sample_rows(logits, temperature, min_p, keys, index)
            greedy = temperature == 0
            assert torch.equal(ids[greedy], logits[greedy].argmax(-1))
            scores = _reference_scores(logits, temperature, min_p, keys, index)[~greedy]
            picked, best = scores.gather(1, ids[~greedy, None])[:, 0], scores.max(-1)[0]
            assert (picked > 0).all()  # never a masked or min_p-dropped token
            assert torch.allclose(picked, best, rtol=1e-5, atol=0)  # the best, up to rounding
            differ += int((ids[~greedy] != scores.argmax(-1)).sum())
            total += int((~greedy).sum())
    assert differ <= total // 200, (differ, total)  # a different pick is a float-precision tie


def test_sampler_kernel_follows_the_softmax() -> None:
    """Over many seeds the draws of one row follow softmax(logits / T)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf")]]).repeat(20000, 1)
    temperature = torch.full((20000,), 0.7)
    ids = torch.ops.tandem.sample_rows(
        logits, temperature, torch.zeros(20000), torch.arange(20000), torch.zeros(20000).long()
    )
    observed = torch.bincount(ids, minlength=5).double() / 20000
    expected = (logits[0].double() / 0.7).softmax(-1)
    assert observed[4] == 0
    assert (observed - expected).abs().max() < 0.012, (observed, expected)


def _thread_ids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_submitting_a_cpu_step_frees_the_submitting_threads_openmp_team() -> None:
    """libgomp sleeps at once, instead of spinning, once its teams outnumber the cores: a team
    the host kept would slow every parallel region of the device thread (streams.py)."""
    from tandem.execution.streams import CPUStream

    stream = CPUStream()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        cpu_kernels.release_openmp_threads()  # whatever an earlier test left on this thread
        existing = _thread_ids()
        torch.randn(1 << 22).add_(1.0)  # a parallel region: this thread now keeps a team
        team = _thread_ids() - existing
        assert len(team) == 1
        stream.submit(lambda: None).wait()
        assert not team & _thread_ids()  # the team's other thread has exited
        torch.randn(1 << 22).add_(1.0)  # a later region builds a new team: nothing breaks
        assert len(_thread_ids() - existing) == 1
    finally:
        cpu_kernels.release_openmp_threads()
        torch.set_num_threads(before)
        stream.close()


@pytest.fixture(params=["vector", "generic"])
def attention_kernel(request):
    """The vector kernel (head sizes 32, 64, 128; groups of 1/2/3/4/8) and the generic loop, which
    serves every other shape: both are checked on a machine that has both."""
    before = torch.ops.tandem.set_generic_decode_attention(request.param == "generic")
    yield request.param
    torch.ops.tandem.set_generic_decode_attention(before)


@pytest.fixture(params=["whole", "spans of 8"])
def decode_span(request):
    """Contexts read whole (the default span, 1024 positions, is longer than these tests'), or
    in spans of 8 positions, each a task, merged after (longer contexts are read that way)."""
    before = torch.ops.tandem.set_decode_span_tokens(1024 if request.param == "whole" else 8)
    yield request.param
    torch.ops.tandem.set_decode_span_tokens(before)


def random_cache(kind: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random K or V rows [..., D]: as float32, or as an int8 cache of them (codes and a scale
    per block of 32 values, each block of its own magnitude, so a kernel that took one block's
    scale for another's would be far off)."""
    values = torch.randn(*shape, generator=g)
    if kind == "float32":
        return values
    size = kv_quant.INT8_BLOCK
    magnitudes = torch.rand(*shape[:-1], -(-shape[-1] // size), generator=g)
    blocks = magnitudes.repeat_interleave(size, -1)[..., : shape[-1]]
    return kv_quant.quantize(values * blocks, torch.int8)


# 48: the generic loop only; 128 with groups of 4 and 8: the V pass in slices of a head.
@pytest.mark.parametrize("head_dim", [32, 64, 128, 48])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 3), (9, 3), (16, 2)])
@pytest.mark.parametrize("num_requests", [1, 3, 40])  # few: a task per kv head; many: per request
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("cache", ["float32", "int8"])
def test_paged_decode_attention_reads_the_cache_in_place(
    head_dim, heads, kv_heads, num_requests, window, cache, attention_kernel
) -> None:
    rng = random.Random(head_dim * 100 + heads * 10 + num_requests)
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    num_blocks, block_size = 96, 4
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = (random_cache(cache, shape, g) for _ in "kv")
    lens = [rng.randint(1, 40) for _ in range(num_requests)]
    width = max(-(-n // block_size) for n in lens)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in lens])
    # Decode queries as the model makes them: a strided view of a fused projection.
    fused = torch.randn(num_requests, heads * head_dim + 8, generator=g)
    q = fused[:, : heads * head_dim].view(num_requests, heads, head_dim)
    context = torch.tensor(lens)
    meta = AttentionMetadata(torch.zeros(0), tables, context, num_requests, width, [], block_size)
    ref = _decode_attention(q, k_cache, v_cache, meta, 0.3, window)
    out = torch.empty(num_requests, heads, head_dim)
    torch.ops.tandem.paged_decode_attention(
        out, q, k_cache, v_cache, tables, context, 0.3, window or 0
    )
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache", ["float32", "int8"])
@pytest.mark.parametrize("window", [None, 7])
def test_short_chunks_after_a_cached_context_attend_as_decodes(
    window, cache, attention_kernel, decode_span
) -> None:
    """One decode and six chunks: 4 queries after 31 cached tokens, 3 after 9, 12 after 28 and
    as many as the build's bound after 20 attend in place, as decodes; a chunk one query longer
    than the bound, and a fresh prompt of 6, as the portable op (which reads a fresh prompt's
    own K/V as an int8 cache holds them). Every row is the portable op's, and an in-place
    chunk's query j is, bit for bit, the decode of its token."""
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, block_size, num_blocks = 6, 3, 64, 4, 128
    k_cache, v_cache = (
        random_cache(cache, (num_blocks, block_size, kv_heads, dim), g) for _ in "kv"
    )
    # (queries, context after them)
    bound = cpu_kernels.decode_like_tokens()
    assert bound >= 16  # 16 with 8 lanes, 128 with 16
    chunks = [(4, 35), (3, 12), (12, 40), (bound, bound + 20), (bound + 1, bound + 30), (6, 6)]
    prefills, start = [], 1  # row 0: the decode
    for row, (tokens, context) in enumerate(chunks, start=1):
        prefills.append(PrefillSegment(start, tokens, context, row))
        start += tokens
    assert [seg.attends_as_decodes for seg in prefills] == [True] * 4 + [False] * 2
    context_lens = torch.tensor([23] + [context for _, context in chunks])
    width = -(-int(context_lens.max()) // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in context_lens])
    q = torch.randn(start, heads, dim, generator=g)
    k, v = (torch.randn(start, kv_heads, dim, generator=g) for _ in range(2))
    meta = AttentionMetadata(torch.zeros(0), tables, context_lens, 1, width, prefills, block_size)
    ref = portable_attention(q, k, v, k_cache, v_cache, meta, 0.125, window)
    out = cpu_elementwise.paged_attention(q, k, v, k_cache, v_cache, meta, 0.125, window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for seg in prefills[:4]:
        for j in range(seg.num_tokens):
            row = seg.token_start + j
            alone = torch.empty(1, heads, dim)
            torch.ops.tandem.paged_decode_attention(
                alone, q[row : row + 1], k_cache, v_cache, tables[seg.row : seg.row + 1],
                torch.tensor([seg.context_len - seg.num_tokens + 1 + j]), 0.125, window or 0,
            )  # fmt: skip
            assert torch.equal(out[row], alone[0]), (seg, j)


# (decode rows of one request, context of its last, blocks it shares with the request before):
# verifications of 5, 8 and 3 rows whose contexts cross 8 and 16 (either build's group of rows),
# a decode, two requests that share their first blocks (a cached prefix) with contexts one
# apart, which may be read as one run, and one more a token further that shares none.
VERIFICATION_RUNS = [
    (5, 17, 0),
    (1, 30, 0),
    (8, 40, 0),
    (3, 9, 0),
    (1, 8, 0),
    (1, 9, 2),
    (1, 10, 0),
]


@pytest.mark.parametrize("head_dim", [64, 32, 128, 48])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2)])
# One run: its queries in two parts per kv head (two cores); some: a task per kv head; many: per
# run.
@pytest.mark.parametrize(
    "runs", [[(8, 40, 0)], VERIFICATION_RUNS, VERIFICATION_RUNS * 4], ids=["one", "some", "many"]
)
@pytest.mark.parametrize("window", [None, 12])
@pytest.mark.parametrize("cache", ["float32", "int8"])
def test_a_verifications_rows_are_each_the_decode_of_its_position(
    head_dim, heads, kv_heads, runs, window, cache, attention_kernel, decode_span
) -> None:
    """A verification's rows (its request's block table row repeated, contexts one token apart)
    are read as one run of queries; each row is still, bit for bit, the decode of its position
    alone, and the portable op's result. A window that cuts some of a run's contexts (12) makes
    their queries walk alone. Read in spans and merged, every query has the bits of its decode
    alone."""
    g = torch.Generator().manual_seed(head_dim + heads + len(runs))
    num_blocks, block_size = 160, 4
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = (random_cache(cache, shape, g) for _ in "kv")
    width = -(-max(context for _, context, _ in runs) // block_size)
    tables, lens = [], []
    for rows, context, shared in runs:
        table = torch.randperm(num_blocks, generator=g)[:width]
        if shared:
            table[:shared] = tables[-1][:shared]
        tables += [table] * rows
        lens += range(context - rows + 1, context + 1)
    tables, context = torch.stack(tables), torch.tensor(lens)
    fused = torch.randn(len(lens), heads * head_dim + 8, generator=g)
    q = fused[:, : heads * head_dim].view(len(lens), heads, head_dim)
    out = torch.empty(len(lens), heads, head_dim)
    torch.ops.tandem.paged_decode_attention(
        out, q, k_cache, v_cache, tables, context, 0.3, window or 0
    )
    meta = AttentionMetadata(torch.zeros(0), tables, context, len(lens), width, [], block_size)
    ref = _decode_attention(q, k_cache, v_cache, meta, 0.3, window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for row in range(len(lens)):
        alone = torch.empty(1, heads, head_dim)
        torch.ops.tandem.paged_decode_attention(
            alone, q[row : row + 1], k_cache, v_cache, tables[row : row + 1],
            context[row : row + 1], 0.3, window or 0,
        )  # fmt: skip
        assert torch.equal(out[row], alone[0]), row


@pytest.fixture(params=[2, 1])
def torch_threads(request):
    """2: the work spreads over torch's OpenMP team; 1: over helpers from the inter-op pool."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("num_requests", [3, 12])  # per kv head / per request, on every core
@pytest.mark.parametrize("cache", ["float32", "int8"])
def test_paged_decode_attention_on_long_contexts(
    num_requests, cache, attention_kernel, torch_threads
) -> None:
    """Contexts long enough that the kernel spreads the work over all cores, and the prefetch
    runs far ahead."""
    g = torch.Generator().manual_seed(num_requests)
    heads, kv_heads, dim, block_size, num_blocks = 8, 2, 32, 16, 1200
    k_cache, v_cache = (
        random_cache(cache, (num_blocks, block_size, kv_heads, dim), g) for _ in "kv"
    )
    context = torch.randint(1500, 3000, (num_requests,), generator=g)
    width = -(-int(context.max()) // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in context])
    q = torch.randn(num_requests, heads, dim, generator=g)
    meta = AttentionMetadata(torch.zeros(0), tables, context, num_requests, width, [], block_size)
    ref = _decode_attention(q, k_cache, v_cache, meta, 0.2, None)
    out = torch.empty_like(q)
    torch.ops.tandem.paged_decode_attention(out, q, k_cache, v_cache, tables, context, 0.2, 0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "arch", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
)
def test_fast_path_logits_stay_close_to_transformers(tiny_checkpoints, arch) -> None:
    """Fast path: within FAST_PATH_LOGITS_ATOL of transformers' logits; eager path: within float32
    noise. Either may take another argmax only where transformers' top two are that close."""
    path = tiny_checkpoints[arch]
    prompt = random_prompts(random.Random(3), 1, 1024, 60, 60)[0]
    with torch.no_grad():
        reference = _load_hf_model(str(path))(torch.tensor([prompt])).logits[0]
    diffs = {}
    for eager in (True, False):
        loaded = load_model(path, torch.float32, torch.device("cpu"))
        plan = fast_path.prepare(loaded.model, torch.device("cpu"), torch.float32, eager)
        assert plan.ops == ("portable" if eager else "fused-cpu")
        assert plan.packed_gemm == (not eager)
        logits = prefill_then_decode_logits(loaded.model, prompt)
        diffs[eager] = (logits - reference).abs().max().item()
        ids = logits.argmax(-1)
        gaps = reference.max(-1).values - reference.gather(1, ids[:, None])[:, 0]
        assert (gaps[ids != reference.argmax(-1)] < FAST_PATH_LOGITS_ATOL).all(), gaps.min()
    assert diffs[True] < 2e-5, diffs  # the portable path is transformers' arithmetic
    assert diffs[False] < FAST_PATH_LOGITS_ATOL, diffs


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Gemma3ForCausalLM"])
# 12: its queries span groups of 8 and 16 rows; None: the build's bound, at most 30 (of 40)
@pytest.mark.parametrize("tail", [4, 12, None])
def test_a_short_chunk_after_a_cached_prefix_gives_its_decodes_logits(tiny_checkpoints, arch, tail):
    """A prompt's last tokens as one chunk after its cached prefix give, bit for bit, the
    logits of decoding them one step at a time: the chunk attends as decodes, and the fast
    path sums each row alike at any number of rows."""
    tail = tail or min(cpu_kernels.decode_like_tokens(), 30)
    loaded = load_model(tiny_checkpoints[arch], torch.float32, torch.device("cpu"))
    model, spec = loaded.model, loaded.model.spec
    plan = fast_path.prepare(model, torch.device("cpu"), torch.float32, False)
    assert model.has_fused_forward, plan.ops
    prompt, block_size = random_prompts(random.Random(5), 1, 1024, 40, 40)[0], 4
    n = len(prompt)
    ids, positions = torch.tensor(prompt), torch.arange(n)
    tables = torch.arange(-(-n // block_size)).view(1, -1)
    shape = (2, tables.shape[1], block_size, spec.num_kv_heads, spec.head_dim)
    caches = [torch.zeros(shape) for _ in range(spec.num_layers)]

    def step(first: int, last: int, as_decode: bool, kv: list[torch.Tensor]) -> torch.Tensor:
        context = torch.tensor([last])
        segments = [] if as_decode else [PrefillSegment(0, last - first, last, 0)]
        meta = AttentionMetadata(positions[first:last], tables, context, int(as_decode),
                                 tables.shape[1], segments, block_size)  # fmt: skip
        return model.compute_logits(model(ids[first:last], positions[first:last], kv, meta))

    with torch.inference_mode():
        step(0, n - tail, False, caches)  # the cached prefix
        assert PrefillSegment(0, tail, n, 0).attends_as_decodes
        chunk = step(n - tail, n, False, [c.clone() for c in caches])
        decodes = torch.cat([step(i, i + 1, True, caches) for i in range(n - tail, n)])
    assert torch.equal(chunk, decodes)


@pytest.mark.parametrize("cached", [5, 70])  # the cached part shorter, and longer, than the chunk
def test_a_long_chunk_after_a_cached_prefix_matches_the_portable_path(tiny_checkpoints, cached):
    """A chunk too long to attend as decodes, after a cached prefix (the fused forward's two
    flash calls merged, `attend_after_context`), gives the portable model's logits for every
    query."""
    tail = cpu_kernels.decode_like_tokens() + 9
    n = cached + tail
    prompt = random_prompts(random.Random(6), 1, 1024, n, n)[0]
    ids, positions, block_size = torch.tensor(prompt), torch.arange(n), 4
    tables = torch.arange(-(-n // block_size)).view(1, -1)
    logits = {}
    for eager in (True, False):
        model = load_model(tiny_checkpoints["LlamaForCausalLM"], torch.float32, torch.device("cpu"))
        model = model.model
        plan = fast_path.prepare(model, torch.device("cpu"), torch.float32, eager)
        assert plan.ops == ("portable" if eager else "fused-cpu")
        spec = model.spec
        shape = (2, tables.shape[1], block_size, spec.num_kv_heads, spec.head_dim)
        caches = [torch.zeros(shape) for _ in range(spec.num_layers)]
        with torch.inference_mode():
            for first, last in [(0, cached), (cached, n)]:
                segment = PrefillSegment(0, last - first, last, 0)
                meta = AttentionMetadata(positions[first:last], tables, torch.tensor([last]), 0,
                                         tables.shape[1], [segment], block_size)  # fmt: skip
                hidden = model(ids[first:last], positions[first:last], caches, meta)
        assert not segment.attends_as_decodes
        logits[eager] = model.compute_logits(hidden)
    torch.testing.assert_close(logits[False], logits[True], rtol=0, atol=FAST_PATH_LOGITS_ATOL)


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "MistralForCausalLM"])  # Mistral's tied
def test_the_fast_path_keeps_panels_in_place_of_float_weights(tiny_checkpoints, arch) -> None:
    """Packed into panels, a linear layer holds no float weight beside them (it doubled the
    weights' memory), and `float_weight` reads the checkpoint's tensor back bit for bit; a tied
    embedding's lookups read the logits' panels, its only copy."""
    model = load_model(tiny_checkpoints[arch], torch.float32, torch.device("cpu")).model
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    before = {name: m.weight.detach().clone() for name, m in layers.items()}
    embedding = model.embed.weight.detach().clone()
    assert fast_path.prepare(model, torch.device("cpu"), torch.float32, False).packed_gemm
    tied = model.spec.tie_word_embeddings
    assert (model.embed.weight.shape == (embedding.shape[0], 0)) == tied
    assert model.embedding_table.dim() == (3 if tied else 2)
    ids = torch.tensor([0, 1, 47, 48, 49, embedding.shape[0] - 1, 5])
    assert torch.equal(model._embed(ids), embedding[ids])
    for name, m in layers.items():
        assert m.packed.dim() == 3 and m.weight.shape == (m.out_features, 0), name
        assert m.weight.untyped_storage().nbytes() == 0, name
        assert torch.equal(m.float_weight(), before[name]), name
        assert m.bias is None or m.bias.numel() == m.out_features  # Qwen2's q/k/v biases stay
    with pytest.raises(RuntimeError):  # the stand-in cannot be multiplied by mistake
        torch.nn.functional.linear(torch.randn(1, m.in_features), m.weight)
    # Every panel in one buffer, back to back in the order the forward reads them (layer by
    # layer, the tied logits last), from a huge page's start.
    panels = [m.packed for m in layers.values()] + [model.embedding_table] * tied
    assert len({p.untyped_storage().data_ptr() for p in panels}) == 1
    ends = [(p.data_ptr(), p.data_ptr() + p.numel() * 4) for p in panels]
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ends)), ends
    assert ends[0][0] % HUGE_PAGE == 0


def test_enforce_eager_keeps_the_portable_path_and_matches_transformers(tiny_llama) -> None:
    rng = random.Random(11)
    prompts = random_prompts(rng, 6, 1024, 5, 80)
    llm = make_llm(tiny_llama, enforce_eager=True)
    assert llm.engine.execution.ops == "portable" and not llm.engine.execution.packed_gemm
    for prompt, out in zip(prompts, llm.generate(prompts, greedy(12)), strict=True):
        assert out.token_ids == hf_greedy_reference_allowing_near_ties(
            tiny_llama, prompt, out.token_ids, 12
        )


@pytest.mark.parametrize(
    "arch", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
)
def test_fast_path_greedy_tokens_match_transformers(tiny_checkpoints, arch) -> None:
    """A short greedy run per architecture (test_cpu_isa.py reruns it under the AVX2 build)."""
    path = tiny_checkpoints[arch]
    prompts = random_prompts(random.Random(4), 3, 1024, 2, 200)
    llm = make_llm(path)
    assert llm.engine.execution.ops == "fused-cpu"
    for prompt, out in zip(prompts, llm.generate(prompts, greedy(12)), strict=True):
        assert out.token_ids == hf_greedy_reference_allowing_near_ties(
            path, prompt, out.token_ids, 12
        )


def test_without_a_compiler_the_engine_falls_back_to_portable_ops(tiny_llama, monkeypatch) -> None:
    failed = cpu_kernels.KernelBuild(False, 0.1, False, error="no compiler")
    monkeypatch.setattr(cpu_kernels, "load", lambda: failed)
    llm = make_llm(tiny_llama)
    assert llm.engine.execution.ops == "portable" and llm.engine.execution.packed_gemm
    assert "unavailable" in llm.engine.execution.describe()
    prompt = random_prompts(random.Random(5), 1, 1024, 30, 30)[0]
    tokens = llm.generate([prompt], greedy(8))[0].token_ids
    assert tokens == hf_greedy_reference_allowing_near_ties(tiny_llama, prompt, tokens, 8)


def test_kernel_build_is_cached_on_disk(kernels, monkeypatch) -> None:
    monkeypatch.setattr(cpu_kernels, "_loaded", None)  # forget this process's load
    again = cpu_kernels.load()
    assert again.available and again.cached and again.path == kernels.path


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 14, 32, 67, 256, 1100])
@pytest.mark.parametrize(
    "out_features,in_features", [(960, 576), (7, 37), (1, 16), (4099, 64), (50, 2100)]
)
def test_gemm_equals_a_float64_linear(rows, out_features, in_features, torch_threads) -> None:
    """The fast path's float32 GEMM over the weight's panels: row counts with and without a
    partial tile and beyond one task's block of rows (1100), output counts with a partial last
    panel, inputs in several passes (2100), a strided x, with and without bias; through
    `linear` as the model calls it too."""
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features + 3, generator=g)[:, :in_features]  # rows 3 floats apart
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    panels = pack_panels(w)
    expected = torch.nn.functional.linear(x.double(), w.double(), b.double()).float()
    got = torch.ops.tandem.gemm(x, panels, b, out_features)
    atol = 1e-4 * max(1.0, in_features / 1024)  # one float32 sum per output: error grows with in
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=atol)
    no_bias = torch.ops.tandem.gemm(x, panels, torch.empty(0), out_features)
    torch.testing.assert_close(no_bias, (x.double() @ w.double().T).float(), rtol=1e-5, atol=atol)
    assert torch.equal(linear(x, w, b, panels), got)


def test_gemms_are_the_same_bits_while_another_process_takes_a_core() -> None:
    """The GEMMs share their tasks out (csrc tasks.h): each thread walks its own share, then
    claims what is left of the others', so which thread computes a task depends on what else
    the cores run. With a busy process on them (as a server's host and front end are), every
    product at 2 threads equals the 1-thread product bit for bit: each task computed exactly
    once, for task counts that do not split evenly (5 tasks of panels and 5 of 4-bit groups on
    either instruction set) and fewer tasks than threads."""
    g = torch.Generator().manual_seed(7)
    products = []
    for out_features, in_features in [(1300, 64), (960, 576), (1, 16)]:
        panels = pack_panels(torch.randn(out_features, in_features, generator=g))
        products.append((partial(torch.ops.tandem.gemm, panels=panels, bias=torch.empty(0),
                                 outs=out_features), in_features))  # fmt: skip
    codes = torch.randint(0, 16, (1120, 576), generator=g, dtype=torch.uint8)
    scales = (torch.rand(1120, 18, generator=g) * 0.02).half()
    products.append((partial(quantized_linear, q=pack(codes, scales, scales * -8, "Q4_0")), 576))
    cases = [(f, torch.randn(rows, k, generator=g)) for f, k in products for rows in (1, 9)]
    before = torch.get_num_threads()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        torch.set_num_threads(1)
        expected = [product(x) for product, x in cases]
        torch.set_num_threads(2)
        for _ in range(30):
            for (product, x), want in zip(cases, expected, strict=True):
                assert torch.equal(product(x), want), (product, x.shape)
    finally:
        busy.kill()
        busy.wait()
        torch.set_num_threads(before)


def test_gemm_refuses_panels_that_do_not_match() -> None:
    w, x = torch.randn(50, 32), torch.randn(3, 32)
    panels = pack_panels(w)
    with pytest.raises(RuntimeError, match="panels must be float32"):
        torch.ops.tandem.gemm(x, panels, torch.empty(0), 200)  # another weight's row count
    with pytest.raises(RuntimeError, match="panels must be float32"):
        torch.ops.tandem.gemm(torch.randn(3, 31), panels, torch.empty(0), 50)
    assert torch.ops.tandem.gemm(x[:0], panels, torch.empty(0), 50).shape == (0, 50)


@pytest.mark.parametrize("out_features,in_features", [(960, 576), (4099, 37), (100, 1500)])
def test_gemm_rows_do_not_depend_on_their_step(out_features, in_features, torch_threads):
    """A row's output is the same bits whether its step has 1, 8 (the panels streamed once) or
    more rows (tiles, blocks of rows), and wherever it sits in a tile: a sequence decodes the
    same in any batch, and a prompt prefills the same in any chunks."""
    g = torch.Generator().manual_seed(out_features)
    x = torch.randn(700, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    panels = pack_panels(w)
    whole = torch.ops.tandem.gemm(x, panels, b, out_features)
    for first, count in [(0, 1), (5, 1), (8, 8), (3, 9), (1, 13), (40, 5), (2, 43), (100, 600)]:
        part = torch.ops.tandem.gemm(x[first : first + count], panels, b, out_features)
        assert torch.equal(part, whole[first : first + count]), (first, count)
