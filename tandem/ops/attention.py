"""Paged attention over packed (ragged) batches, in portable PyTorch.

The batch holds decode tokens first (one query each), then prefill chunks. Every token's K/V is
first written into the paged cache; decodes then attend to their cache in one batched call, and
each prefill chunk attends to its cached prefix plus causally within itself. The portable decode
path gathers each request's blocks into a dense copy; with the fused CPU kernels
(`csrc/cpu_kernels.cpp`) decodes read the paged cache in place instead. On CUDA, when triton
imports, `paged_attention` runs the Triton kernels of `triton_attention.py`, which read the cache
in place for decodes and prefill chunks alike (`TANDEM_TRITON_ATTENTION=0` keeps the portable ops).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from tandem.ops import kv_quant
from tandem.ops.attention_metadata import AttentionMetadata, PrefillSegment


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Scatter the step's keys and values into the paged cache ([blocks, block_size, heads, dim]),
    as codes and scales where the cache is one byte a value (`kv_quant`)."""
    if kv_quant.is_quantized(k_cache):
        k, v = kv_quant.quantize(k, k_cache.dtype), kv_quant.quantize(v, v_cache.dtype)
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v)


RotaryOp = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (q, k, ...) -> (q, k)


def rotary_then_write_kv(rotary: RotaryOp, write: Callable[..., None] = write_kv) -> RotaryOp:
    """An ops module's `rotary_and_cache` from its `rotary`: rotate q and k, then `write` the
    step's K and V into the cache (CUDA's fused kernel does both in one launch)."""

    def rotary_and_cache(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = rotary(q, k, positions, cos, sin)
        write(k, v, k_cache, v_cache, slots)
        return q, k

    return rotary_and_cache


def rotate_cache_attend(
    rotary_and_cache: RotaryOp, attention: Callable[..., torch.Tensor], fuse_decodes: bool = False
):
    """An ops module's `attend` from its `rotary_and_cache` and its `paged_attention`: rotate q
    and k, write the step's K and V into the cache, attend. `fuse_decodes` (CUDA's ops): in a
    plain decode step (`meta.distinct_decodes`) the Triton decode kernel, given the decode
    rows' own keys, rotates, caches and attends in one launch where it can
    (`triton_attention.fuses_new_keys`); a prefill's rows are rotated and cached first."""

    def attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        d, slots = meta.num_decodes, meta.slot_mapping
        kernels = triton_kernels() if fuse_decodes and d and meta.distinct_decodes else None
        if kernels is None or not kernels.fuses_new_keys(q, k, v):  # None: switched off too
            q, k = rotary_and_cache(q, k, v, positions, cos, sin, k_cache, v_cache, slots)
            return attention(q, k, v, k_cache, v_cache, meta, scale, sliding_window)
        rotary_and_cache(q[d:], k[d:], v[d:], positions[d:], cos, sin, k_cache, v_cache, slots[d:])
        new = kernels.NewKeys(k[:d], v[:d], positions[:d], cos, sin, slots[:d])
        return kernels.paged_attention(q, k_cache, v_cache, meta, scale, sliding_window, new)

    return attend


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The step's attention, once its K/V are in the cache (each ops module's
    `rotary_and_cache` writes them): on CUDA the Triton kernels, else the portable op."""
    if q.is_cuda and (kernels := triton_kernels()) is not None:
        return kernels.paged_attention(q, k_cache, v_cache, meta, scale, sliding_window)
    return portable_attention(q, k, v, k_cache, v_cache, meta, scale, sliding_window)


def portable_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """`paged_attention` in PyTorch ops on any device, once the step's K/V are in the cache (a
    cache of one byte a value is read dequantized to q's dtype)."""
    out = torch.empty_like(q)
    d = meta.num_decodes
    if d:
        out[:d] = _decode_attention(q[:d], k_cache, v_cache, meta, scale, sliding_window)
    for seg in meta.prefills:
        rows = slice(seg.token_start, seg.token_start + seg.num_tokens)
        first = 0  # the first key position any query of the chunk sees
        if seg.context_len == seg.num_tokens:  # no cached prefix: the fresh K/V, as cached
            keys = kv_quant.cached_values(k[rows], k_cache)
            values = kv_quant.cached_values(v[rows], v_cache)
        else:
            if sliding_window is not None:  # blocks before the window may be given back
                start = seg.context_len - seg.num_tokens
                first = max(0, start - sliding_window + 1) // meta.block_size * meta.block_size
            keys, values = _gather_context(k_cache, v_cache, meta, seg, first, q.dtype)
        out[rows] = _chunk_attention(q[rows], keys, values, seg, scale, sliding_window, first)
    return out


@functools.cache
def triton_kernels() -> ModuleType | None:
    """`triton_attention` if triton imports (and TANDEM_TRITON_ATTENTION is not 0), else None.

    Looked up on the first CUDA call only, so CPU runs never import triton."""
    if os.environ.get("TANDEM_TRITON_ATTENTION", "1") == "0":
        return None
    try:
        from tandem.ops import triton_attention
    except ImportError:
        return None
    return triton_attention


def _gather_context(
    k_cache, v_cache, meta: AttentionMetadata, seg: PrefillSegment, first: int, dtype: torch.dtype
):
    """The chunk's keys and values (as `dtype`) from position `first` (a block boundary) to its
    end."""
    bs = meta.block_size
    blocks = meta.block_tables[seg.row, first // bs : -(-seg.context_len // bs)]
    shape = (len(blocks) * bs, *k_cache.shape[2:])
    length = seg.context_len - first
    keys, values = k_cache[blocks].view(shape)[:length], v_cache[blocks].view(shape)[:length]
    return _read(keys, dtype), _read(values, dtype)


def _read(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows as values: themselves, or dequantized to `dtype`."""
    return kv_quant.dequantize(rows, dtype) if kv_quant.is_quantized(rows) else rows


def _chunk_attention(q, keys, values, seg: PrefillSegment, scale, sliding_window, first=0):
    """Causal attention of one chunk whose first query sits at position context_len - num_tokens;
    `keys` start at position `first`."""
    q = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    keys = keys.transpose(0, 1).unsqueeze(0)
    values = values.transpose(0, 1).unsqueeze(0)
    if seg.context_len == seg.num_tokens and sliding_window is None:
        out = F.scaled_dot_product_attention(
            q, keys, values, is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        q_pos = torch.arange(seg.context_len - seg.num_tokens, seg.context_len, device=q.device)
        k_pos = torch.arange(first, seg.context_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
    return out.squeeze(0).transpose(0, 1)


def _decode_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale, sliding_window):
    """All single-token queries at once: gather each request's blocks, mask past its length."""
    d, width = meta.num_decodes, meta.decode_max_blocks
    blocks = meta.block_tables[:d, :width]
    length = width * meta.block_size
    keys, values = _read(k_cache[blocks], q.dtype), _read(v_cache[blocks], q.dtype)
    keys = keys.view(d, length, *keys.shape[-2:]).transpose(1, 2)
    values = values.view(d, length, *values.shape[-2:]).transpose(1, 2)
    ctx = meta.context_lens[:d, None]
    k_pos = torch.arange(length, device=q.device)[None, :]
    mask = k_pos < ctx
    if sliding_window is not None:
        mask &= k_pos >= ctx - sliding_window
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
    )
    return out.squeeze(2)
