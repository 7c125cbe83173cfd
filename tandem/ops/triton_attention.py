"""Paged attention for CUDA, in Triton: decodes and prefill chunks read the paged KV cache in place.

`ops/attention.py` sends CUDA tensors here when triton imports; its portable path stays the
reference. Both kernels walk a request's keys in tiles of `BLOCK_N` positions, whatever the cache's
block size: each key's slot is looked up in the request's block-table row, so no context is ever
copied out of the cache. One program handles one KV head and the query heads of its GQA group
together (rows of one `tl.dot`), so the group shares every K/V load. Softmax is online, in fp32,
in base 2 (the scale is folded with log2(e)); the running maximum starts at a finite floor
instead of -inf, so a row that has seen only masked keys stays finite, and a row with no key at
all (a padding row of a decode batch, context length 0) comes out as zeros.

Decode (`decode_attention`) is built for CUDA graphs: its grid is (requests, KV heads, splits),
fixed for a padded batch, and each program reads its request's context length and block-table
row from device tensors, bounding its loop on the device. A request's keys are split across
programs (flash-decoding) by a rule the kernel applies to its context length: as many splits as
fill the GPU for the batch's shape (`default_num_splits`), or, for a long context, one per
`split_tokens` keys (`SPLIT_TOKENS`, up to `LONG_SPLITS`) if that is more, so that a batch that
already fills the GPU still reads a long context with more loads in flight. Programs beyond a
request's count return at once. The split that finishes last (an atomic count per request
and KV head, back to zero after) merges the partial results, so no second kernel runs. Given a
plain step's own keys and values (`NewKeys`), it rotates q and those keys itself, caches them
(the first split) and attends to each row's own key from registers (the last split), so the
step needs no rotary kernel before it.

Prefill (`prefill_attention`) runs one launch per chunk from the host ints of its
`PrefillSegment`: the chunk's keys, already written into the cache (`rotary_and_cache`), and its cached
prefix are read through the block table, causally (and within the sliding window).

An fp8 KV cache (`kv_quant`: uint8 rows of head_dim e4m3 codes, then the row's float32 scale) is
a constexpr switch (`FP8`) of both kernels. A tile's codes are loaded, converted in registers,
multiplied by their row's scale in fp32 and rounded to the model's dtype (`kv_quant.dequantize`),
so the dots are those of a bf16/fp16 cache, and a chunk reads its own keys as cached, like the
portable path. Rows are head_dim + 4 bytes, so only 4-byte aligned: the kernels say so
(`tl.multiple_of`), without which Triton loads the codes a byte at a time and does not prefetch
them. The fused decode writes the step's key and value as codes and a scale too (the bits of
`rotary_and_cache`'s), and attends to them as read back.

tests/test_triton_attention.py runs these kernels on CPU tensors in Triton's interpreter
(`TRITON_INTERPRET=1`, set before triton is imported) against the portable path, and compiles
them for sm_90 with Triton's compiler; benchmarks/triton_attention_check.py runs them on a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from tandem.ops.triton_launch import (
    let_next_kernel_launch,
    pdl_options,
    wait_for_previous_kernel,
)
from tandem.ops.triton_rounding import (
    check_cache,
    kv_fp8_codes,
    kv_fp8_scale,
    kv_fp8_values,
    rotated,
    rounded,
)

if TYPE_CHECKING:
    from tandem.ops.attention_metadata import AttentionMetadata, PrefillSegment

LOG2E = 1.4426950408889634
MAX_SPLITS = 16
# A long context gets a split per this many keys (when that is more than the splits that fill
# the GPU), up to LONG_SPLITS: at 32 requests of the 8B shape one split read 4096 and 8192 keys
# a request in 1.27x and 1.34x the time of two (docs/performance.md, H200).
SPLIT_TOKENS = 2048
LONG_SPLITS = 4
# Below every real score, and finite: exp2(floor - floor) is 1, never nan.
_M_FLOOR = tl.constexpr(-1.0e30)
# Explicit, so a Triton release that changes the defaults changes nothing here.
_LAUNCH = {"num_warps": 4, "enable_fp_fusion": True}


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, BF16_AS_FP32: tl.constexpr):
    """a @ b accumulated in fp32. BF16_AS_FP32 (the interpreter only, whose dot multiplies bf16's
    raw bits) takes the bf16 operands' exact values in fp32, as the tensor cores do."""
    if BF16_AS_FP32:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=PRECISION)
    return c


@triton.jit
def _attend_tiles(
    acc,
    m_i,
    l_i,
    q,  # [M, BLOCK_D] queries, in the cache dtype
    q_pos,  # [M] position of each row's query; keys at k <= q_pos (and > q_pos - WINDOW) count
    table_row_ptr,  # this request's block-table row
    k_ptr,  # cache base plus the KV head's offset
    v_ptr,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    kv_len,  # keys at positions >= kv_len are never loaded
    tile_lo,
    tile_hi,
    qk_scale,
    offs_d,
    mask_d,
    WINDOW: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
    BF16_AS_FP32: tl.constexpr,
    FP8: tl.constexpr,
):
    """Online softmax over key tiles [tile_lo, tile_hi); returns the updated (acc, m, l)."""
    for t in range(tile_lo, tile_hi):
        k_pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
        in_ctx = k_pos < kv_len
        block = tl.load(table_row_ptr + k_pos // BLOCK_SIZE, mask=in_ctx, other=0).to(tl.int64)
        within = (k_pos % BLOCK_SIZE).to(tl.int64)
        k_rows = k_ptr + block * stride_kb + within * stride_kt
        v_rows = v_ptr + block * stride_vb + within * stride_vt
        if FP8:  # rows of head_dim (in 4s) + 4 bytes: 4 codes a load, prefetched (see above)
            k_rows, v_rows = tl.multiple_of(k_rows, 4), tl.multiple_of(v_rows, 4)
        k = _cache_rows(k_rows, offs_d, in_ctx, mask_d, q.dtype, HEAD_DIM, FP8)
        v = _cache_rows(v_rows, offs_d, in_ctx, mask_d, q.dtype, HEAD_DIM, FP8)
        s = _dot(q, tl.trans(k), PRECISION, BF16_AS_FP32) * qk_scale
        keep = (k_pos[None, :] <= q_pos[:, None]) & in_ctx[None, :]
        if WINDOW > 0:
            keep = keep & (k_pos[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, BF16_AS_FP32)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _cache_rows(rows_ptr, offs_d, in_ctx, mask_d, DTYPE: tl.constexpr, HEAD_DIM: tl.constexpr,
                FP8: tl.constexpr):  # fmt: skip
    """Cache rows (`rows_ptr`: each one's start) as values of DTYPE, the model's: as stored, or
    (FP8) e4m3 codes times the row's float32 scale, read from its 4 bytes after the codes."""
    mask = in_ctx[:, None] & mask_d[None, :]
    if FP8:
        codes = tl.load(rows_ptr[:, None] + offs_d[None, :], mask=mask, other=0)
        scale_ptr = (rows_ptr + HEAD_DIM).to(tl.pointer_type(tl.float32))
        scale = tl.load(scale_ptr, mask=in_ctx, other=0.0)
        rows = kv_fp8_values(codes.to(tl.float8e4nv, bitcast=True), scale[:, None], DTYPE)
    else:
        rows = tl.load(rows_ptr[:, None] + offs_d[None, :], mask=mask, other=0.0)
    return rows


@triton.jit
def _fp8_row(x):
    """One row [1, D] as an fp8 cache holds it: e4m3 codes and a float32 scale."""
    xf = x.to(tl.float32)
    scale = kv_fp8_scale(tl.max(tl.abs(xf)))
    return kv_fp8_codes(xf, scale), scale


@triton.jit
def _read_back(x):
    """One row [1, D] in its dtype as an fp8 cache gives it back."""
    codes, scale = _fp8_row(x)
    return kv_fp8_values(codes, scale, x.dtype)


@triton.jit
def _store_row(at, offs_d, x, HEAD_DIM: tl.constexpr, FP8: tl.constexpr):
    """One row [1, D] into the cache at `at`: as it is, or (FP8) its codes, then its scale."""
    if FP8:
        codes, scale = _fp8_row(x)
        tl.store(at + offs_d[None, :], codes.to(tl.uint8, bitcast=True))
        tl.store((at + HEAD_DIM).to(tl.pointer_type(tl.float32)), scale)
    else:
        tl.store(at + offs_d[None, :], x)


@triton.jit
def _rotated_heads(x1, x2, c1, c2, s1, s2, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """[ROWS, BLOCK_D] rotated heads from their [ROWS, BLOCK_D // 2] halves, whole again."""
    out1, out2 = rotated(x1, x2, c1, c2, s1, s2)
    return tl.reshape(tl.permute(tl.join(out1, out2), (0, 2, 1)), (ROWS, BLOCK_D))


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_acc_ptr,  # [R, H, NUM_SPLITS, HEAD_DIM] fp32 (NUM_SPLITS > 1 only)
    part_m_ptr,  # [R, H, NUM_SPLITS]
    part_l_ptr,
    counters_ptr,  # [>= R * Hkv] int32, zero: splits of each (request, KV head) done
    block_tables_ptr,
    context_lens_ptr,
    qk_scale,
    num_heads,
    num_kv_heads,
    fill_splits,  # splits of any context (up to its tiles)
    split_tiles,  # or one per this many key tiles, if more
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    new_k_ptr,  # ROTATE: the step's keys [R, Hkv, D] and values, before rotation and caching
    new_v_ptr,
    stride_nkt,
    stride_nkh,
    stride_nvt,
    stride_nvh,
    positions_ptr,  # ROTATE: each row's position, the rotary tables' row
    cos_ptr,
    sin_ptr,
    stride_table,
    slots_ptr,  # ROTATE: each row's cache slot (block * block_size + offset)
    GROUP: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,  # the grid's splits, the most any request uses
    BLOCK_S: tl.constexpr,
    PRECISION: tl.constexpr,
    BF16_AS_FP32: tl.constexpr,
    ROTATE: tl.constexpr,
    FP8: tl.constexpr,  # the caches hold e4m3 codes and a scale per row (uint8)
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + req).to(tl.int32)

    offs_g = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + offs_g
    mask_g = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q_rows = q_ptr + req * stride_qt + heads[:, None] * stride_qh
    # Keys read from the cache: [0, kv_len); with ROTATE the step's own, the last, from registers.
    kv_len = ctx - 1 if ROTATE else ctx

    # Key tiles this split visits: its share of those overlapping [window start, kv_len), among
    # this request's `splits`, each of which has at least one tile (or split 0 alone, none).
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(ctx - WINDOW, 0)
    tile_lo = lo // BLOCK_N
    tile_hi = tl.cdiv(kv_len, BLOCK_N)
    tiles = tl.maximum(tile_hi - tile_lo, 0)
    splits = tl.maximum(tl.minimum(fill_splits, tiles), tiles // split_tiles)
    splits = tl.maximum(tl.minimum(splits, NUM_SPLITS), 1)
    per_split = tl.maximum(tl.cdiv(tiles, splits), 1)
    splits = tl.maximum(tl.cdiv(tiles, per_split), 1)
    first = tile_lo + split * per_split
    last = tl.minimum(first + per_split, tile_hi)

    if split >= splits:  # a program this request does not use: nothing to read or write
        return

    if ROTATE:  # q and the step's key rotated here; that key and value cached by split 0
        half = tl.arange(0, BLOCK_D // 2)[None, :]
        row = tl.load(positions_ptr + req).to(tl.int64) * stride_table + half
        dtype = q_ptr.dtype.element_ty
        c1 = rounded(tl.load(cos_ptr + row), dtype)
        c2 = rounded(tl.load(cos_ptr + row + BLOCK_D // 2), dtype)
        s1 = rounded(tl.load(sin_ptr + row), dtype)
        s2 = rounded(tl.load(sin_ptr + row + BLOCK_D // 2), dtype)
        q1 = tl.load(q_rows + half, mask=mask_g[:, None], other=0.0)
        q2 = tl.load(q_rows + BLOCK_D // 2 + half, mask=mask_g[:, None], other=0.0)
        q = _rotated_heads(q1, q2, c1, c2, s1, s2, BLOCK_G, BLOCK_D)
        key = new_k_ptr + req * stride_nkt + kv_head * stride_nkh
        k_new = _rotated_heads(
            tl.load(key + half), tl.load(key + BLOCK_D // 2 + half), c1, c2, s1, s2, 1, BLOCK_D
        )
        v_new = tl.load(new_v_ptr + req * stride_nvt + kv_head * stride_nvh + offs_d[None, :])
        if split == 0:
            slot = tl.load(slots_ptr + req).to(tl.int64)
            block, within = slot // BLOCK_SIZE, slot % BLOCK_SIZE
            k_at = k_cache_ptr + block * stride_kb + within * stride_kt + kv_head * stride_kh
            v_at = v_cache_ptr + block * stride_vb + within * stride_vt + kv_head * stride_vh
            _store_row(k_at, offs_d, k_new, HEAD_DIM, FP8)
            _store_row(v_at, offs_d, v_new, HEAD_DIM, FP8)
        if FP8:  # the step's own key and value attended as read back, as every other one
            k_new, v_new = _read_back(k_new), _read_back(v_new)
    else:
        q = tl.load(q_rows + offs_d[None, :], mask=mask_g[:, None] & mask_d[None, :], other=0.0)

    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], _M_FLOOR, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    q_pos = tl.full([BLOCK_G], 0, dtype=tl.int32) + (ctx - 1)
    acc, m_i, l_i = _attend_tiles(
        acc,
        m_i,
        l_i,
        q,
        q_pos,
        block_tables_ptr + req.to(tl.int64) * stride_bt,
        k_cache_ptr + kv_head * stride_kh,
        v_cache_ptr + kv_head * stride_vh,
        stride_kb,
        stride_kt,
        stride_vb,
        stride_vt,
        kv_len,
        first,
        last,
        qk_scale,
        offs_d,
        mask_d,
        WINDOW,
        BLOCK_SIZE,
        BLOCK_N,
        HEAD_DIM,
        PRECISION,
        BF16_AS_FP32,
        FP8,
    )
    if ROTATE:  # noqa: SIM102 - a constexpr: without it the body (k_new, v_new) is not compiled
        if split == splits - 1:  # the step's own key, the last of the context
            s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * qk_scale
            m_new = tl.maximum(m_i, s_new)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s_new - m_new)
            l_i = l_i * alpha + p
            weight = p.to(v_new.dtype).to(tl.float32)  # as the tiles' p.to(v.dtype) @ v
            acc = acc * alpha[:, None] + weight[:, None] * v_new.to(tl.float32)
            m_i = m_new

    out_rows = out_ptr + req * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    mask_out = mask_g[:, None] & mask_d[None, :]
    if NUM_SPLITS == 1:
        _store_out(out_rows, acc, l_i, mask_out)
    else:
        if splits == 1:
            _store_out(out_rows, acc, l_i, mask_out)
        else:
            parts = (req * num_heads + heads) * NUM_SPLITS  # [BLOCK_G] each head's first split
            tl.store(part_m_ptr + parts + split, m_i, mask=mask_g)
            tl.store(part_l_ptr + parts + split, l_i, mask=mask_g)
            tl.store(
                part_acc_ptr + (parts + split)[:, None] * HEAD_DIM + offs_d[None, :],
                acc,
                mask=mask_out,
            )
            # Every thread's stores before the count (release); the last split sees all (acquire).
            tl.debug_barrier()
            counter = counters_ptr + req * num_kv_heads + kv_head
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if done == splits - 1:
                _merge_splits(
                    part_acc_ptr, part_m_ptr, part_l_ptr, parts, splits, out_rows, mask_g,
                    mask_out, offs_d, BLOCK_G, BLOCK_S, BLOCK_D, HEAD_DIM,
                )  # fmt: skip
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # for the next launch
    let_next_kernel_launch(PDL)


@triton.jit
def _merge_splits(
    part_acc_ptr, part_m_ptr, part_l_ptr, parts, splits, out_rows, mask_g, mask_out, offs_d,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """The heads' outputs from their `splits` partial (acc, max, sum), in split order, each
    rescaled to the common max. The loads bypass L1 (`.cg`), which other SMs' writes miss."""
    offs_s = tl.arange(0, BLOCK_S)
    mask = mask_g[:, None] & (offs_s[None, :] < splits)
    at = parts[:, None] + offs_s[None, :]
    top = tl.max(tl.load(part_m_ptr + at, mask=mask, other=_M_FLOOR, cache_modifier=".cg"), 1)
    den = tl.zeros([BLOCK_G], dtype=tl.float32)
    num = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for s in range(0, splits):
        m = tl.load(part_m_ptr + parts + s, mask=mask_g, other=_M_FLOOR, cache_modifier=".cg")
        w = tl.exp2(m - top)
        den += w * tl.load(part_l_ptr + parts + s, mask=mask_g, other=0.0, cache_modifier=".cg")
        acc = tl.load(
            part_acc_ptr + (parts + s)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=mask_out,
            other=0.0,
            cache_modifier=".cg",
        )
        num += w[:, None] * acc
    _store_out(out_rows, num, den, mask_out)


@triton.jit
def _store_out(out_rows, acc, l_sum, mask):
    """The heads' outputs: the accumulator over the softmax's sum (zeros where nothing summed)."""
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(out_rows, out.to(out_rows.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["token_start", "num_tokens", "ctx", "row"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    qk_scale,
    token_start,  # the chunk's first row in q / out
    num_tokens,
    ctx,  # KV length after the chunk: its queries sit at ctx - num_tokens .. ctx - 1
    row,  # the request's row in block_tables
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    GROUP: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
    BF16_AS_FP32: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Rows are (token, head of the group) pairs, token-major: the group shares each K/V tile.
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    valid = tok < num_tokens
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q_rows = (token_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=valid[:, None] & mask_d[None, :],
        other=0.0,
    )
    start = ctx - num_tokens  # position of the chunk's first query
    q_pos = tl.where(valid, start + tok, -1)

    # Keys up to the tile's last query; with a window, from its first query's window start.
    first_tok = (tile * BLOCK_M) // GROUP
    last_tok = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // GROUP, num_tokens - 1)
    hi = start + last_tok + 1
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(start + first_tok - WINDOW + 1, 0)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _M_FLOOR, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_tiles(
        acc,
        m_i,
        l_i,
        q,
        q_pos,
        block_tables_ptr + row.to(tl.int64) * stride_bt,
        k_cache_ptr + kv_head * stride_kh,
        v_cache_ptr + kv_head * stride_vh,
        stride_kb,
        stride_kt,
        stride_vb,
        stride_vt,
        hi,
        lo // BLOCK_N,
        tl.cdiv(hi, BLOCK_N),
        qk_scale,
        offs_d,
        mask_d,
        WINDOW,
        BLOCK_SIZE,
        BLOCK_N,
        HEAD_DIM,
        PRECISION,
        BF16_AS_FP32,
        FP8,
    )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=valid[:, None] & mask_d[None, :],
    )
    let_next_kernel_launch(PDL)


# ---------------------------------------------------------------------------- host side
_INTERPRETED = not isinstance(_decode_kernel, triton.runtime.JITFunction)  # TRITON_INTERPRET=1


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, kv_heads, dim]")
    check_cache(k_cache, q.shape[-1])
    if v_cache.dtype != k_cache.dtype or k_cache.dtype not in (q.dtype, torch.uint8):
        raise ValueError("the caches must share q's dtype, or both be fp8 (uint8)")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of {tuple(k_cache.shape)}")
    for t in (q, k_cache, v_cache):
        if t.stride(-1) != 1:
            raise ValueError("the head dimension must be contiguous")


def _strides(q, k_cache, v_cache, out, block_tables) -> tuple[int, ...]:
    """The strides both kernels take, in their order: q (token, head), each cache (block, slot,
    head), out (token, head), block table (row)."""
    return (
        *q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3], *out.stride()[:2],
        block_tables.stride(0),
    )  # fmt: skip


@dataclass
class NewKeys:
    """A decode step's own keys and values (not yet rotated nor cached) and what rotating and
    caching them takes: one row per request."""

    k: torch.Tensor  # [R, Hkv, D]
    v: torch.Tensor
    positions: torch.Tensor  # [R]
    cos: torch.Tensor  # [max_positions, D] fp32
    sin: torch.Tensor
    slots: torch.Tensor  # [R]


def fuses_new_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the decode kernel can rotate and cache the step's keys itself: bf16 or fp16 (an
    fp32 rotation needs its products unfused, which the attention does not compile with) and a
    power-of-two head size (the halves of a head are its two tiles)."""
    dim = q.shape[-1]
    return (
        q.dtype in (torch.bfloat16, torch.float16)
        and dim == triton.next_power_of_2(dim)
        and all(t.stride(-1) == 1 for t in (q, k, v))
    )


def _new_key_args(new: NewKeys | None, q: torch.Tensor) -> tuple:
    """The decode kernel's arguments for `new` (placeholders without it)."""
    if new is None:
        return (q, q, 0, 0, 0, 0, q, q, q, 0, q)
    return (
        new.k, new.v, new.k.stride(0), new.k.stride(1), new.v.stride(0), new.v.stride(1),
        new.positions, new.cos, new.sin, new.cos.stride(0), new.slots,
    )  # fmt: skip


def _precision(dtype: torch.dtype) -> str:
    """fp32 dots in IEEE arithmetic (TF32 would cost the fp32 path its accuracy)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per (request, KV head) so the grid fills about two waves of the GPU's SMs: the
    splits any context gets (up to its key tiles); long ones get more (`grid_splits`).

    Depends on the batch shape and the device only, so a captured graph keeps a choice that
    suits every context length it will replay with.
    """
    if device.type != "cuda":
        return 1
    programs = max(num_seqs * num_kv_heads, 1)
    return max(1, min(MAX_SPLITS, (2 * _sm_count(device.index or 0)) // programs))


def grid_splits(fill: int, max_context: int, split_tokens: int) -> int:
    """The grid's splits: `fill`, or as many as the longest context a block-table row holds
    gets at a split per `split_tokens` keys (at most LONG_SPLITS), whichever is more."""
    long = min(LONG_SPLITS, max_context // split_tokens) if split_tokens else 1
    return max(fill, long, 1)


# Per device, zeros: the split counts of each (request, KV head). The decode kernel leaves them
# at zero, so one tensor serves every launch; outgrown ones stay alive for the graphs that
# captured their address.
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def _split_counters(device: torch.device, needed: int) -> torch.Tensor:
    held = _COUNTERS.setdefault(device, [])
    if not held or held[-1].numel() < needed:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "decode attention's split counters must exist before a CUDA graph is captured: "
                "run the step once eagerly first"
            )
        held.append(torch.zeros(max(needed, 1 << 14), dtype=torch.int32, device=device))
    return held[-1]


def _partials(
    r: int, heads: int, splits: int, dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each split's (acc, max, sum) per request and head, fp32, for the last split to merge."""
    acc = torch.empty(r, heads, splits, dim, dtype=torch.float32, device=device)
    m = torch.empty(r, heads, splits, dtype=torch.float32, device=device)
    return acc, m, torch.empty_like(m)


def decode_attention(
    q: torch.Tensor,  # [R, H, D], one query per request
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], or fp8: uint8 rows of D + 4
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [>= R, W] int
    context_lens: torch.Tensor,  # [>= R] int; 0 for padding rows
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    split_tokens: int = SPLIT_TOKENS,
    block_n: int = 64,
    new_keys: NewKeys | None = None,
) -> torch.Tensor:
    """Each request's query attends to its first context_lens[r] cached keys, read in place.
    With `new_keys` (`fuses_new_keys`) q is not yet rotated: the kernel rotates it and the
    step's keys, caches the step's keys and values, and attends to the cached ones before
    them and to its own from registers (one launch instead of a rotary kernel and this).
    `num_splits`: the splits of every context (default: those that fill the GPU);
    `split_tokens`: a long context's keys per further split (0: none)."""
    _check(q, k_cache, v_cache)
    r, num_heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    if split_tokens and split_tokens < block_n:
        raise ValueError(f"split_tokens {split_tokens} is below a key tile of {block_n}")
    if out is None:
        out = torch.empty_like(q)
    if r == 0:
        return out
    fill = num_splits or default_num_splits(r, kv_heads, q.device)
    splits = grid_splits(fill, block_tables.shape[1] * block_size, split_tokens)
    if splits > 1:
        part_acc, part_m, part_l = _partials(r, num_heads, splits, dim, q.device)
        counters = _split_counters(q.device, r * kv_heads)
    else:
        part_acc = part_m = part_l = out  # unused
        counters = context_lens
    group = num_heads // kv_heads
    block_d = triton.next_power_of_2(dim)
    _decode_kernel[(r, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_acc,
        part_m,
        part_l,
        counters,
        block_tables,
        context_lens,
        scale * LOG2E,
        num_heads,
        kv_heads,
        fill,
        split_tokens // block_n if split_tokens else 1 << 30,
        *_strides(q, k_cache, v_cache, out, block_tables),
        *_new_key_args(new_keys, q),
        GROUP=group,
        WINDOW=sliding_window or 0,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        BLOCK_G=max(16, triton.next_power_of_2(group)),  # 16: the smallest M of an MMA tile
        BLOCK_D=block_d,
        HEAD_DIM=dim,
        NUM_SPLITS=splits,
        BLOCK_S=triton.next_power_of_2(splits),
        PRECISION=_precision(q.dtype),
        BF16_AS_FP32=_INTERPRETED and q.dtype == torch.bfloat16,
        ROTATE=new_keys is not None,
        FP8=k_cache.dtype == torch.uint8,
        **_LAUNCH,
        **pdl_options(q.device),
    )
    return out


def prefill_attention(
    q: torch.Tensor,  # [T, H, D] the packed batch's queries
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seg: PrefillSegment,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    *,
    out: torch.Tensor,  # [T, H, D]: the chunk's rows are written
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """One chunk's queries attend causally to its request's cached prefix and to themselves.

    The chunk's own K/V must already be in the cache (`rotary_and_cache` runs first)."""
    _check(q, k_cache, v_cache)
    num_heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    if seg.num_tokens == 0:
        return out
    _prefill_kernel[(triton.cdiv(seg.num_tokens * group, block_m), kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        scale * LOG2E,
        seg.token_start,
        seg.num_tokens,
        seg.context_len,
        seg.row,
        *_strides(q, k_cache, v_cache, out, block_tables),
        GROUP=group,
        WINDOW=sliding_window or 0,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(dim),
        HEAD_DIM=dim,
        PRECISION=_precision(q.dtype),
        BF16_AS_FP32=_INTERPRETED and q.dtype == torch.bfloat16,
        FP8=k_cache.dtype == torch.uint8,
        **_LAUNCH,
        **pdl_options(q.device),
    )
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    new_keys: NewKeys | None = None,
) -> torch.Tensor:
    """The packed batch's attention (K/V already written, or the decodes' in `new_keys`, to be
    rotated and written by the decode kernel): decodes in one launch, then chunks."""
    out = torch.empty_like(q)
    d = meta.num_decodes
    if d:
        decode_attention(
            q[:d],
            k_cache,
            v_cache,
            meta.block_tables,
            meta.context_lens,
            meta.block_size,
            scale,
            sliding_window,
            out=out[:d],
            new_keys=new_keys,
        )
    for seg in meta.prefills:
        prefill_attention(
            q, k_cache, v_cache, meta.block_tables, seg, meta.block_size, scale, sliding_window,
            out=out,
        )  # fmt: skip
    return out
