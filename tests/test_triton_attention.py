"""The CUDA attention kernels (Triton) against the portable path, on the CPU.

Under Triton's interpreter (`TRITON_INTERPRET=1`) the kernels' own logic runs on CPU tensors and
is compared with `ops/attention.py`; shapes are tiny, since the interpreter runs every program of
the grid in Python. Separately, Triton's real compiler builds the kernels down to sm_90 (H200)
binaries without a GPU (tests/triton_sm90_compile.py), which the interpreter alone would not prove.
Caches hold the model's dtype or fp8 (`kv_quant`: uint8 rows of e4m3 codes and a float32 scale),
read by the portable path as the same values.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction  # conftest chose the interpreter

from tandem.ops import attention, kv_quant
from tandem.ops import triton_attention as ta
from tandem.ops.attention import (
    AttentionMetadata,
    PrefillSegment,
    _decode_attention,
    write_kv,
)

_ROOT = Path(__file__).resolve().parents[1]
assert isinstance(ta._decode_kernel, InterpretedFunction)


FP8 = torch.uint8  # an fp8 KV cache's storage (`kv_quant`): e4m3 codes and a scale per row


def _cache(num_blocks, block_size, kv_heads, dim, dtype, g):
    """A cache full of nan: a kernel that loads any slot past a context would return nan (fp8:
    every byte 0xff, so every scale is nan)."""
    shape = (num_blocks, block_size, kv_heads, kv_quant.row_width(dim, dtype))
    fill = 0xFF if dtype == FP8 else float("nan")
    return torch.full(shape, fill, dtype=dtype), torch.full(shape, fill, dtype=dtype)


def _fill(k_cache, v_cache, table_row, length, g) -> None:
    """Write random K/V into the first `length` positions of one request (quantized by write_kv
    into an fp8 cache)."""
    bs, kv_heads, width = k_cache.shape[1:]
    quantized = kv_quant.is_quantized(k_cache)
    dim = width - kv_quant.SCALE_BYTES if quantized else width
    slots = torch.arange(length)
    flat = table_row[slots // bs] * bs + slots % bs
    dtype = torch.float32 if quantized else k_cache.dtype
    k = torch.randn(length, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(length, kv_heads, dim, generator=g).to(dtype)
    write_kv(k, v, k_cache, v_cache, flat)


def _tables(lens, block_size, num_blocks, g, extra_columns=1):
    """Distinct random blocks per request; unused columns hold garbage block ids."""
    width = max(-(-n // block_size) for n in lens) + extra_columns
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.randint(10**6, 10**7, (len(lens), width))  # never a valid block id
    used = 0
    for i, n in enumerate(lens):
        need = -(-n // block_size)
        tables[i, :need] = perm[used : used + need]
        used += need
    return tables


def _clean(cache: torch.Tensor) -> torch.Tensor:
    """The reference gathers whole blocks and masks afterwards: it needs finite padding (an fp8
    cache's unwritten rows, of nan scales, become zeros)."""
    if cache.dtype == FP8:
        rows = cache.clone().view(-1, cache.shape[-1])
        scales = rows[:, -kv_quant.SCALE_BYTES :].contiguous().view(torch.float32).view(-1)
        rows[scales.isnan()] = 0
        return rows.view(cache.shape)
    return torch.nan_to_num(cache.float(), nan=0.0)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


DECODE_CASES = [
    # head_dim, heads, kv_heads, block_size, lens, window, splits, block_n
    (32, 4, 4, 16, [1, 17, 40], None, 1, 16),
    (64, 4, 2, 32, [33, 5, 64, 70], None, 1, 16),
    (48, 8, 2, 16, [23, 47, 2], None, 3, 16),  # head_dim padded to 64 by masking
    (32, 8, 2, 16, [50, 38, 16, 1, 66], 7, 1, 16),  # 38: the window starts at key 31
    (64, 8, 2, 32, [70, 9], 20, 4, 16),  # window and splits: some splits have no tile
    (32, 4, 1, 16, [100], None, 2, 64),  # one request, GQA group of 4, the GPU tile size
]


ROTATING_CASES = [
    # dtype, head_dim, heads, kv_heads, block_size, lens (after the step), window, splits, block_n
    (torch.bfloat16, 32, 4, 2, 16, [1, 17, 40], None, 1, 16),
    (torch.float16, 64, 8, 2, 16, [50, 38, 16, 2, 66], 7, 1, 16),  # a window
    (torch.bfloat16, 32, 4, 1, 16, [70, 9, 33], 20, 4, 16),  # splits, some without a tile
    (torch.float16, 128, 2, 1, 32, [65, 3], None, 2, 64),  # the GPU tile size
]


@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype-cache", "fp8-cache"])
@pytest.mark.parametrize("dtype,dim,heads,kv_heads,bs,lens,window,splits,block_n", ROTATING_CASES)
def test_decode_rotating_its_own_keys_matches_rotary_then_decode(
    dtype, dim, heads, kv_heads, bs, lens, window, splits, block_n, fp8
) -> None:
    """A plain decode step's kernel given the step's keys (`NewKeys`): it caches the same
    rotated keys and values, bit for bit, as the rotary kernel (fp8: the same codes and
    scales), and attends as the decode kernel does after it (the step's own key summed last,
    as read back from the cache: within a few ulps), and as the portable path does."""
    from tandem.ops import triton_elementwise as te

    g = torch.Generator().manual_seed(sum(lens) + dim)
    num_blocks = 40
    k_cache, v_cache = _cache(num_blocks, bs, kv_heads, dim, FP8 if fp8 else dtype, g)
    tables = _tables(lens, bs, num_blocks, g)
    for i, n in enumerate(lens):
        _fill(k_cache, v_cache, tables[i], n - 1, g)  # the keys before the step's own
    r = len(lens)
    qkv = torch.randn(r, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(r, heads, dim), k.view(r, kv_heads, dim), v.view(r, kv_heads, dim)
    positions = torch.tensor(lens) - 1
    slots = tables[torch.arange(r), positions // bs] * bs + positions % bs
    angles = torch.arange(128.0)[:, None] * torch.rand(dim // 2, generator=g)[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    context = torch.tensor(lens)
    assert ta.fuses_new_keys(q, k, v)
    options = dict(num_splits=splits, block_n=block_n)
    caches = k_cache.clone(), v_cache.clone()
    q_rot, _ = te.rotary_and_cache(q.clone(), k.clone(), v, positions, cos, sin, *caches, slots)
    ref = ta.decode_attention(q_rot, *caches, tables, context, bs, 0.3, window, **options)
    fused_caches = k_cache.clone(), v_cache.clone()
    new = ta.NewKeys(k, v, positions, cos, sin, slots)
    got = ta.decode_attention(
        q, *fused_caches, tables, context, bs, 0.3, window, new_keys=new, **options
    )
    for mine, theirs in zip(fused_caches, caches, strict=True):
        assert _same_bytes(mine, theirs)
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(got.float(), ref.float(), rtol=4 * ulp, atol=4 * ulp)
    meta = AttentionMetadata(
        slots, tables.clamp(max=num_blocks - 1), context, r, tables.shape[1], [], bs,
    )  # fmt: skip
    portable = _decode_attention(q_rot.float(), *map(_clean, caches), meta, 0.3, window)
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(got.float(), portable, rtol=tol, atol=tol)


def test_only_bf16_fp16_and_whole_tiles_of_heads_fuse() -> None:
    q, k = torch.zeros(2, 4, 64, dtype=torch.bfloat16), torch.zeros(2, 2, 64, dtype=torch.bfloat16)
    assert ta.fuses_new_keys(q, k, k)
    assert not ta.fuses_new_keys(q.float(), k.float(), k.float())  # fp32: products unfused
    assert not ta.fuses_new_keys(q[..., :48], k[..., :48], k[..., :48])  # 48: halves of 24


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8], ids=["fp32-cache", "fp8-cache"])
@pytest.mark.parametrize("dim,heads,kv_heads,bs,lens,window,splits,block_n", DECODE_CASES)
def test_decode_matches_portable_attention(
    dim, heads, kv_heads, bs, lens, window, splits, block_n, cache_dtype
) -> None:
    """fp32 queries over an fp32 cache, or an fp8 one read as the portable path reads it (code
    times scale in fp32): the same numbers but for the order of sums."""
    g = torch.Generator().manual_seed(sum(lens) + dim)
    num_blocks = 24
    k_cache, v_cache = _cache(num_blocks, bs, kv_heads, dim, cache_dtype, g)
    tables = _tables(lens, bs, num_blocks, g)
    for i, n in enumerate(lens):
        _fill(k_cache, v_cache, tables[i], n, g)
    # A padded batch: two rows of context 0 whose table rows are garbage.
    r = len(lens)
    padded_tables = torch.cat([tables, torch.randint(10**6, 10**7, (2, tables.shape[1]))])
    context = torch.tensor([*lens, 0, 0])
    q = torch.randn(r + 2, heads, dim + 8, generator=g)[:, :, :dim]  # strided, as from a fused qkv
    out = ta.decode_attention(
        q, k_cache, v_cache, padded_tables, context, bs, 0.3, window,
        num_splits=splits, block_n=block_n,
    )  # fmt: skip
    meta = AttentionMetadata(
        torch.zeros(0), tables.clamp(max=num_blocks - 1), context[:r], r,
        max(-(-n // bs) for n in lens), [], bs,
    )  # fmt: skip
    ref = _decode_attention(q[:r], _clean(k_cache), _clean(v_cache), meta, 0.3, window)
    torch.testing.assert_close(out[:r], ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[r:], torch.zeros_like(out[r:]))  # padding rows: zeros, not nan


def _packed_batch(dim, heads, kv_heads, bs, decode_lens, chunks, dtype, g, cache_dtype=None):
    """A mixed step as the runner makes one: decodes first, then prefill chunks.

    chunks: (cached prefix, chunk tokens) per prefill. Returns q, k, v, caches (of `dtype`, or
    `cache_dtype`) and metadata, the caches holding every request's context before this step
    (nan elsewhere)."""
    lens = [n - 1 for n in decode_lens] + [prefix for prefix, _ in chunks]
    ends = list(decode_lens) + [prefix + n for prefix, n in chunks]
    num_blocks = sum(-(-n // bs) for n in ends) + 3
    k_cache, v_cache = _cache(num_blocks, bs, kv_heads, dim, cache_dtype or dtype, g)
    tables = _tables(ends, bs, num_blocks, g)
    for i, n in enumerate(lens):
        _fill(k_cache, v_cache, tables[i], n, g)
    slots, prefills = [], []
    token = len(decode_lens)
    for i, (start, end) in enumerate(zip(lens, ends, strict=True)):
        pos = torch.arange(start, end)
        slots.append(tables[i, pos // bs] * bs + pos % bs)
        if i >= len(decode_lens):
            prefills.append(PrefillSegment(token, end - start, end, i))
            token += end - start
    t = token
    q = torch.randn(t, heads, dim, generator=g).to(dtype)
    k = torch.randn(t, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(t, kv_heads, dim, generator=g).to(dtype)
    meta = AttentionMetadata(
        torch.cat(slots), tables, torch.tensor(ends), len(decode_lens),
        max((-(-n // bs) for n in decode_lens), default=0), prefills, bs,
    )  # fmt: skip
    return q, k, v, k_cache, v_cache, meta


def _portable(q, k, v, k_cache, v_cache, meta, scale, window):
    """The portable path on fp32 copies (nan-free), the reference for every dtype."""
    kc, vc = _clean(k_cache), _clean(v_cache)
    clamped = AttentionMetadata(
        meta.slot_mapping, meta.block_tables.clamp(max=kc.shape[0] - 1), meta.context_lens,
        meta.num_decodes, meta.decode_max_blocks, meta.prefills, meta.block_size,
    )  # fmt: skip
    write_kv(k.float(), v.float(), kc, vc, meta.slot_mapping)
    return attention.portable_attention(
        q.float(), k.float(), v.float(), kc, vc, clamped, scale, window
    )


PREFILL_CASES = [
    # head_dim, heads, kv_heads, block_size, decode lens, (prefix, chunk) per prefill, window
    (32, 4, 4, 16, [], [(0, 20)], None),  # a first chunk: no cached prefix
    (32, 4, 2, 16, [], [(37, 12)], None),  # a later chunk: 37 cached tokens, crossing blocks
    (64, 8, 2, 32, [5, 40], [(0, 9), (30, 35)], None),  # mixed step, GQA 4, two chunks
    (48, 4, 2, 16, [3], [(20, 25), (0, 17)], 7),  # sliding window, head_dim padded
]


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32-cache", "fp8-cache"])
@pytest.mark.parametrize("dim,heads,kv_heads,bs,decode_lens,chunks,window", PREFILL_CASES)
def test_packed_batch_matches_portable_attention(
    dim, heads, kv_heads, bs, decode_lens, chunks, window, fp8
) -> None:
    """What the CUDA dispatch runs: write_kv, then decodes and chunks read the cache in place
    (a chunk its own keys too: over an fp8 cache, as the portable path reads them back)."""
    g = torch.Generator().manual_seed(dim + len(chunks) + (window or 0))
    q, k, v, k_cache, v_cache, meta = _packed_batch(
        dim, heads, kv_heads, bs, decode_lens, chunks, torch.float32, g, FP8 if fp8 else None
    )
    ref = _portable(q, k, v, k_cache, v_cache, meta, 0.25, window)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = ta.paged_attention(q, k_cache, v_cache, meta, 0.25, window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32-cache", "fp8-cache"])
@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16)])
def test_prefill_tiles_smaller_than_the_chunk(block_m, block_n, fp8) -> None:
    """Several query tiles (a tile ends inside a GQA group's rows) and key tiles per chunk."""
    g = torch.Generator().manual_seed(block_m)
    q, k, v, k_cache, v_cache, meta = _packed_batch(
        32, 6, 2, 16, [], [(21, 19)], torch.float32, g, FP8 if fp8 else None
    )  # group of 3: 57 rows, tiles of 16 split groups
    ref = _portable(q, k, v, k_cache, v_cache, meta, 0.25, 11)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.full_like(q, float("nan"))
    (seg,) = meta.prefills
    ta.prefill_attention(
        q, k_cache, v_cache, meta.block_tables, seg, 16, 0.25, 11,
        out=out, block_m=block_m, block_n=block_n,
    )  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype-cache", "fp8-cache"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_tolerance(dtype, fp8) -> None:
    """bf16/fp16 inputs: fp32 softmax and accumulation, probabilities rounded for the PV dot
    (an fp8 cache's values rounded to the model's dtype, as the portable path reads them)."""
    g = torch.Generator().manual_seed(7)
    q, k, v, k_cache, v_cache, meta = _packed_batch(
        64, 8, 2, 16, [30, 70], [(18, 14)], dtype, g, FP8 if fp8 else None
    )
    ref = _portable(q, k, v, k_cache, v_cache, meta, 0.125, None)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = ta.paged_attention(q, k_cache, v_cache, meta, 0.125, None)
    assert out.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    split = ta.decode_attention(
        q[:2], k_cache, v_cache, meta.block_tables, meta.context_lens, 16, 0.125, num_splits=3,
        block_n=16,
    )  # fmt: skip
    torch.testing.assert_close(split.float(), ref[:2], rtol=tol, atol=tol)


def test_decode_of_a_long_random_batch() -> None:
    """Random lengths and tables; the split count that fills an H200 for this batch shape."""
    rng = random.Random(3)
    g = torch.Generator().manual_seed(3)
    lens = [rng.randint(1, 150) for _ in range(4)]
    bs, num_blocks = 16, 64
    k_cache, v_cache = _cache(num_blocks, bs, 2, 32, torch.float32, g)
    tables = _tables(lens, bs, num_blocks, g)
    for i, n in enumerate(lens):
        _fill(k_cache, v_cache, tables[i], n, g)
    q = torch.randn(len(lens), 4, 32, generator=g)
    context = torch.tensor(lens)
    meta = AttentionMetadata(
        torch.zeros(0), tables.clamp(max=num_blocks - 1), context, len(lens),
        tables.shape[1], [], bs,
    )  # fmt: skip
    ref = _decode_attention(q, _clean(k_cache), _clean(v_cache), meta, 0.2, None)
    splits = ta.MAX_SPLITS  # 4 requests x 2 KV heads on 132 SMs
    out = ta.decode_attention(
        q, k_cache, v_cache, tables, context, bs, 0.2, num_splits=splits, block_n=16
    )
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def _spying_partials(monkeypatch) -> list[torch.Tensor]:
    """The decode kernel's partial maxima, nan until a split writes its own."""
    seen, allocate = [], ta._partials

    def partials(r, heads, splits, dim, device):
        acc, m, l_sum = (t.fill_(float("nan")) for t in allocate(r, heads, splits, dim, device))
        seen.append(m)
        return acc, m, l_sum

    monkeypatch.setattr(ta, "_partials", partials)
    return seen


LONG_CASES = [
    # lens (after the step), window, fill splits, split_tokens, new keys (rotated by the kernel),
    # splits each request's partials come from (none for one split: it writes out itself);
    # tiles of 16 keys
    ([300, 40, 1], None, 1, 64, False, [4, 0, 0]),  # 19 tiles: 4 splits of 5; 3 and 1 tiles: 1
    ([300, 40, 2], None, 1, 64, True, [4, 0, 0]),  # the same with the step's own key
    ([300, 130], 100, 1, 64, True, [0, 2]),  # the window keeps 7 and 8 tiles
    ([300, 130], None, 2, 128, False, [2, 2]),  # 19 tiles: 2 of 10 (LONG cut to the grid's 2)
    ([260, 70], None, 3, 0, False, [3, 3]),  # the fill alone: 17 tiles in 6s, 5 in 2s
    ([70, 20], None, 4, 0, False, [3, 2]),  # 5 tiles in 2s: 3 splits, not 4 with one empty
]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("lens,window,fill,split_tokens,rotate,partials", LONG_CASES)
def test_long_contexts_split_more_and_merge_in_their_last_split(
    monkeypatch, lens, window, fill, split_tokens, rotate, partials, fp8
) -> None:
    """A long context gets a split per `split_tokens` keys beyond the fill (up to LONG_SPLITS),
    a short one only the fill's, each split with a tile; the last split to finish merges them
    (their count back at zero after), and every request equals the portable path."""
    from tandem.ops import triton_elementwise as te

    seen = _spying_partials(monkeypatch)
    dtype, dim, heads, kv_heads, bs, block_n = torch.bfloat16, 32, 4, 2, 16, 16
    g = torch.Generator().manual_seed(sum(lens) + fill)
    num_blocks = sum(-(-n // bs) for n in lens) + 2
    k_cache, v_cache = _cache(num_blocks, bs, kv_heads, dim, FP8 if fp8 else dtype, g)
    tables = _tables(lens, bs, num_blocks, g)
    for i, n in enumerate(lens):
        _fill(k_cache, v_cache, tables[i], n - 1, g)  # the keys before the step's own
    r = len(lens)
    q, k, v = (torch.randn(r, h, dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
    positions = torch.tensor(lens) - 1
    slots = tables[torch.arange(r), positions // bs] * bs + positions % bs
    angles = torch.arange(512.0)[:, None] * torch.rand(dim // 2, generator=g)[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    context = torch.tensor(lens)
    ref_caches = k_cache.clone(), v_cache.clone()
    q_rot, _ = te.rotary_and_cache(q.clone(), k.clone(), v, positions, cos, sin, *ref_caches, slots)
    meta = AttentionMetadata(
        slots, tables.clamp(max=num_blocks - 1), context, r, tables.shape[1], [], bs,
    )  # fmt: skip
    clean = (_clean(c) for c in ref_caches)
    ref = _decode_attention(q_rot.float(), *clean, meta, 0.2, window)
    options = dict(num_splits=fill, split_tokens=split_tokens, block_n=block_n)
    if rotate:
        new = ta.NewKeys(k, v, positions, cos, sin, slots)
        out = ta.decode_attention(
            q, k_cache, v_cache, tables, context, bs, 0.2, window, new_keys=new, **options
        )
    else:
        out = ta.decode_attention(q_rot, *ref_caches, tables, context, bs, 0.2, window, **options)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    (m,) = seen
    assert [int((~m[row, 0].isnan()).sum()) for row in range(r)] == partials
    assert not ta._split_counters(q.device, 1).any()


def test_splits_for_the_longest_context_the_tables_hold() -> None:
    assert ta.grid_splits(1, 1024, ta.SPLIT_TOKENS) == 1
    assert ta.grid_splits(1, 4096, ta.SPLIT_TOKENS) == 2
    assert ta.grid_splits(1, 131072, ta.SPLIT_TOKENS) == ta.LONG_SPLITS
    assert ta.grid_splits(16, 131072, ta.SPLIT_TOKENS) == 16  # the fill, when it is more
    assert ta.grid_splits(3, 131072, 0) == 3  # long contexts not split further


def test_cpu_attention_never_looks_for_triton(monkeypatch) -> None:
    """CPU tensors keep the portable path; triton is looked up for CUDA tensors only."""

    def fail():
        raise AssertionError("CPU attention consulted the Triton kernels")

    monkeypatch.setattr(attention, "triton_kernels", fail)
    g = torch.Generator().manual_seed(0)
    q, k, v, k_cache, v_cache, meta = _packed_batch(32, 4, 2, 16, [9], [(0, 5)], torch.float32, g)
    out = attention.paged_attention(q, k, v, _clean(k_cache), _clean(v_cache), meta, 0.3, None)
    assert torch.isfinite(out).all()


def test_triton_kernels_lookup_and_off_switch(monkeypatch) -> None:
    attention.triton_kernels.cache_clear()
    try:
        kernels = attention.triton_kernels()
        assert kernels is not None and kernels.__name__ == "tandem.ops.triton_attention"
        attention.triton_kernels.cache_clear()
        monkeypatch.setenv("TANDEM_TRITON_ATTENTION", "0")
        assert attention.triton_kernels() is None
    finally:
        attention.triton_kernels.cache_clear()


def test_caches_the_kernels_refuse() -> None:
    """An fp8 cache needs its rows (so their scales) 4-byte aligned, head_dim in 4s, and rows of
    head_dim + 4 bytes; int8 is the CPU's cache; any other must share q's dtype."""
    q = torch.zeros(2, 4, 36)
    fp8 = torch.zeros(4, 16, 2, 40, dtype=FP8)
    ta._check(q, fp8, fp8)
    ta._check(q.bfloat16(), fp8, fp8)
    refused = [
        (q[..., :18], torch.zeros(4, 16, 2, 22, dtype=FP8), "in 4s"),
        (q, torch.zeros(4, 16, 2, 40, dtype=torch.int8), "CPU"),
        (q, fp8[..., :36], "do not hold"),
        (q, torch.zeros(4 * 16 * 2 * 40 + 2, dtype=FP8)[2:].view(fp8.shape), "aligned"),
        (q.bfloat16(), torch.zeros(4, 16, 2, 36), "dtype"),
    ]
    for query, cache, message in refused:
        with pytest.raises(ValueError, match=message):
            ta._check(query, cache, cache)


def test_default_split_count_ignores_context_lengths() -> None:
    cpu = torch.device("cpu")
    assert ta.default_num_splits(32, 8, cpu) == 1


# ------------------------------------------------------------ real compilation for sm_90
H200_SHARED_MEMORY = 232448  # bytes per block (227 KiB)


CASE_NAMES = ("llama8b-bf16", "llama1b-bf16", "group7-window-fp16", "fp32-dim48")
FP8_KV_CASES = ("llama8b-bf16-fp8kv", "group7-window-fp16-fp8kv", "fp32-dim48-fp8kv")


def test_kernels_compile_for_sm90() -> None:
    """Triton's real compiler (not the interpreter) builds every kernel for an H200: bf16 and
    fp16 dots on tensor cores, fp32 through IEEE dots, shared memory within the SM's limit, and
    the fused norms, rotary, SiLU and FP8 row rounding of ops/triton_elementwise.py in every
    case's dtype, and the few-rows GEMM of ops/triton_gemm.py in bf16 and fp16 on tensor cores;
    the decode kernel also as it rotates and caches a plain step's keys (bf16, fp16), the GEMM
    over FP8 weights' e4m3 codes and the gate/up GEMM ending in SiLU; all but the SiLU with
    programmatic dependent launch. Over fp8 KV caches, the kernels that touch the cache: the
    attention reading e4m3 codes (converted in registers, the dots still on tensor cores) and
    the rotary and rotating decode writing them. LoRA's shrink and expand (ops/triton_lora.py)
    in every case's dtype."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, str(_ROOT / "tests" / "triton_sm90_compile.py")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    records = [json.loads(line) for line in result.stdout.splitlines()]
    kernels = {(r["case"], r["kernel"]) for r in records}
    elementwise = {"_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel",
                   "_quantize_rows_fp8_kernel", "_lora_shrink_kernel",
                   "_lora_expand_kernel"}  # fmt: skip
    gemm = {(case, "_few_rows_gemm_kernel") for case in CASE_NAMES if case[:4] != "fp32"}
    assert gemm <= kernels
    # the GEMM over e4m3 codes (FP8 weights) at every bf16/fp16 case, on tensor cores
    scaled = [r for r in records if r["scaled"]]
    assert {(r["case"], r["kernel"]) for r in scaled} == gemm
    assert all(r["mma"] and r["e4m3"] for r in scaled)
    # and the gate/up GEMM that ends in SiLU(gate) * up
    assert {(r["case"], r["kernel"]) for r in records if r["gated"]} == gemm
    assert kernels - gemm - {(r["case"], name) for r in records for name in elementwise} == {
        ("llama8b-bf16", "_decode_kernel"),
        ("llama8b-bf16", "_prefill_kernel"),
        ("llama1b-bf16", "_decode_kernel"),
        ("llama1b-bf16", "_prefill_kernel"),
        ("group7-window-fp16", "_decode_kernel"),
        ("group7-window-fp16", "_prefill_kernel"),
        ("fp32-dim48", "_decode_kernel"),
        ("llama8b-bf16-fp8kv", "_decode_kernel"),
        ("llama8b-bf16-fp8kv", "_prefill_kernel"),
        ("group7-window-fp16-fp8kv", "_decode_kernel"),
        ("group7-window-fp16-fp8kv", "_prefill_kernel"),
        ("fp32-dim48-fp8kv", "_decode_kernel"),
    }
    assert {(case, name) for case in CASE_NAMES for name in elementwise} <= kernels
    fp8_kv = {(r["case"], r["kernel"]) for r in records if r["fp8_kv"]}  # only the cache's
    assert {case for case, _ in fp8_kv} == set(FP8_KV_CASES)
    assert {name for _, name in fp8_kv} == {"_decode_kernel", "_prefill_kernel", "_rotary_kernel"}
    rotating = {r["case"] for r in records if r["rotates"]}  # plain decode steps' kernel
    assert rotating == {"llama8b-bf16", "llama1b-bf16", "group7-window-fp16", *FP8_KV_CASES[:2]}
    # split decodes merge in their last split: every thread's partials stored (bar.sync), then
    # one thread's acquire-release count, the partials read back from L2
    merging = {(r["case"], r["rotates"]) for r in records if r["counts_splits"]}
    assert merging == {
        (case, rotates)
        for case in ("llama8b-bf16", "llama8b-bf16-fp8kv")
        for rotates in (False, True)
    } | {("fp32-dim48", False), ("fp32-dim48-fp8kv", False)}
    for r in records:
        assert r["cubin_bytes"] > 0 and r["shared"] <= H200_SHARED_MEMORY, r
        if r["kernel"] in ("_rms_norm_kernel", "_rotary_kernel", "_quantize_rows_fp8_kernel"):
            assert not r["fma"], r  # PyTorch's two roundings, not a contracted a*b + c
        assert r["e4m3"] == (
            r["kernel"] == "_quantize_rows_fp8_kernel" or r["scaled"] or r["fp8_kv"]
        ), r
        if r["fp8_kv"]:  # codes read by the attention, written by the rotary and rotating decode
            assert r["from_e4m3"] == (r["kernel"] != "_rotary_kernel"), r
            assert r["to_e4m3"] == (r["kernel"] == "_rotary_kernel" or r["rotates"]), r
            assert not r["byte_loads"], r  # 4 codes a load at least: rows are 4-byte aligned
        # launched dependent: waits for the kernel before it, lets the next launch at its end
        dependent = r["kernel"] != "_silu_and_mul_kernel"
        assert r["pdl"] == r["lets_next_launch"] == dependent, r
        if r["kernel"] in ("_decode_kernel", "_prefill_kernel", "_few_rows_gemm_kernel") and (
            r["case"][:4] != "fp32"
        ):
            assert r["mma"], r  # the dots run on tensor cores
