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
row from device tensors, bounding its loop on the device. Long contexts are split across
`num_splits` programs (flash-decoding); a small second kernel merges their partial results. The
split count depends on the batch shape and the GPU only, never on the context lengths.

Prefill (`prefill_attention`) runs one launch per chunk from the host ints of its
`PrefillSegment`: the chunk's keys, already written into the cache (`rotary_and_cache`), and its cached
prefix are read through the block table, causally (and within the sliding window).

tests/test_triton_attention.py runs these kernels on CPU tensors in Triton's interpreter
(`TRITON_INTERPRET=1`, set before triton is imported) against the portable path, and compiles
them for sm_90 with Triton's compiler; benchmarks/triton_attention_check.py runs them on a GPU.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from tandem.ops.triton_launch import (
    let_next_kernel_launch,
    pdl_options,
    wait_for_previous_kernel,
)

if TYPE_CHECKING:
    from tandem.ops.attention_metadata import AttentionMetadata, PrefillSegment

LOG2E = 1.4426950408889634
MAX_SPLITS = 16
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
    PRECISION: tl.constexpr,
    BF16_AS_FP32: tl.constexpr,
):
    """Online softmax over key tiles [tile_lo, tile_hi); returns the updated (acc, m, l)."""
    for t in range(tile_lo, tile_hi):
        k_pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
        in_ctx = k_pos < kv_len
        block = tl.load(table_row_ptr + k_pos // BLOCK_SIZE, mask=in_ctx, other=0).to(tl.int64)
        within = (k_pos % BLOCK_SIZE).to(tl.int64)
        load_mask = in_ctx[:, None] & mask_d[None, :]
        k = tl.load(
            k_ptr + (block * stride_kb + within * stride_kt)[:, None] + offs_d[None, :],
            mask=load_mask,
            other=0.0,
        )
        v = tl.load(
            v_ptr + (block * stride_vb + within * stride_vt)[:, None] + offs_d[None, :],
            mask=load_mask,
            other=0.0,
        )
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
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_acc_ptr,  # [R, H, NUM_SPLITS, HEAD_DIM] fp32 (NUM_SPLITS > 1 only)
    part_m_ptr,  # [R, H, NUM_SPLITS]
    part_l_ptr,
    block_tables_ptr,
    context_lens_ptr,
    qk_scale,
    num_heads,
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
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    BF16_AS_FP32: tl.constexpr,
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
    q = tl.load(
        q_ptr + req * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )

    # Key tiles this split visits: its share of those overlapping [window start, ctx).
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(ctx - WINDOW, 0)
    tile_lo = lo // BLOCK_N
    tile_hi = tl.cdiv(ctx, BLOCK_N)
    per_split = tl.cdiv(tile_hi - tile_lo, NUM_SPLITS)
    first = tile_lo + split * per_split
    last = tl.minimum(first + per_split, tile_hi)

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
        ctx,
        first,
        last,
        qk_scale,
        offs_d,
        mask_d,
        WINDOW,
        BLOCK_SIZE,
        BLOCK_N,
        PRECISION,
        BF16_AS_FP32,
    )

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + req * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask_g[:, None] & mask_d[None, :],
        )
    else:
        part = (req * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(part_m_ptr + part, m_i, mask=mask_g)
        tl.store(part_l_ptr + part, l_i, mask=mask_g)
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
            acc,
            mask=mask_g[:, None] & mask_d[None, :],
        )
    let_next_kernel_launch(PDL)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    out_ptr,
    num_heads,
    stride_ot,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[req, head] from the splits' partial (acc, max, sum): rescale each to the common max."""
    wait_for_previous_kernel(PDL)
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    part = (req * num_heads + head) * NUM_SPLITS + offs_s
    m = tl.load(part_m_ptr + part, mask=mask_s, other=_M_FLOOR)
    l_s = tl.load(part_l_ptr + part, mask=mask_s, other=0.0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    w = tl.exp2(m - tl.max(m, 0))
    den = tl.sum(l_s * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(den > 0, den, 1.0)
    tl.store(
        out_ptr + req * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_d,
    )
    let_next_kernel_launch(PDL)


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
        PRECISION,
        BF16_AS_FP32,
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
    if q.shape[-1] != k_cache.shape[-1] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of {tuple(k_cache.shape)}")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError("q and the caches must share a dtype")
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


def _precision(dtype: torch.dtype) -> str:
    """fp32 dots in IEEE arithmetic (TF32 would cost the fp32 path its accuracy)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per (request, KV head) so the grid fills about two waves of the GPU's SMs.

    Depends on the batch shape and the device only, so a captured graph keeps a choice that
    suits every context length it will replay with.
    """
    if device.type != "cuda":
        return 1
    programs = max(num_seqs * num_kv_heads, 1)
    return max(1, min(MAX_SPLITS, (2 * _sm_count(device.index or 0)) // programs))


def decode_attention(
    q: torch.Tensor,  # [R, H, D], one query per request
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [>= R, W] int
    context_lens: torch.Tensor,  # [>= R] int; 0 for padding rows
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """Each request's query attends to its first context_lens[r] cached keys, read in place."""
    _check(q, k_cache, v_cache)
    r, num_heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    if r == 0:
        return out
    splits = num_splits or default_num_splits(r, kv_heads, q.device)
    if splits > 1:
        part_acc = torch.empty(r, num_heads, splits, dim, dtype=torch.float32, device=q.device)
        part_m = torch.empty(r, num_heads, splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused
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
        block_tables,
        context_lens,
        scale * LOG2E,
        num_heads,
        *_strides(q, k_cache, v_cache, out, block_tables),
        GROUP=group,
        WINDOW=sliding_window or 0,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        BLOCK_G=max(16, triton.next_power_of_2(group)),  # 16: the smallest M of an MMA tile
        BLOCK_D=block_d,
        HEAD_DIM=dim,
        NUM_SPLITS=splits,
        PRECISION=_precision(q.dtype),
        BF16_AS_FP32=_INTERPRETED and q.dtype == torch.bfloat16,
        **_LAUNCH,
        **pdl_options(q.device),
    )
    if splits > 1:
        _merge_splits_kernel[(r, num_heads)](
            part_acc,
            part_m,
            part_l,
            out,
            num_heads,
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_D=block_d,
            HEAD_DIM=dim,
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
) -> torch.Tensor:
    """The packed batch's attention (K/V already written): decodes in one launch, then chunks."""
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
        )
    for seg in meta.prefills:
        prefill_attention(
            q, k_cache, v_cache, meta.block_tables, seg, meta.block_size, scale, sliding_window,
            out=out,
        )  # fmt: skip
    return out
