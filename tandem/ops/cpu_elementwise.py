"""The forward's non-GEMM ops through the fused CPU kernels, op by op.

Models that the one-call forward (`tandem::llama_forward`) does not cover (FP8 layers, experts
neither packed nor quantized) still run their norms, rotary embedding and SiLU through the
kernels of `csrc/cpu_kernels.cpp`, and their decode attention (and a short chunk's after a
cached context) reads the paged cache in place instead of gathering each request's blocks into a
dense copy first: that copy grows with the context, the in-place read does not copy at all. The
arithmetic is the fused forward's (sums in another order than `elementwise.py`'s, within 1e-4 of
transformers' logits). Ops the kernels do not have are the portable ones.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from tandem.ops.attention import portable_attention, rotary_then_write_kv, rotate_cache_attend
from tandem.ops.attention_metadata import AttentionMetadata


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.tandem.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x), residual + x); the residual stream is updated in place."""
    residual = residual.contiguous()
    return torch.ops.tandem.add_rms_norm(x, residual, weight, eps), residual


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place (q and k are the step's own projections)."""
    torch.ops.tandem.rotary_(q, positions, cos, sin)
    torch.ops.tandem.rotary_(k, positions, cos, sin)
    return q, k


def write_kv(*k_v_caches_slots: torch.Tensor) -> None:
    """`attention.write_kv` in one kernel: a copy per token's row, not `index_copy_`'s path."""
    torch.ops.tandem.store_kv(*k_v_caches_slots)


# rotary, then the step's K (rotated) and V written into the paged cache at the slots.
rotary_and_cache = rotary_then_write_kv(rotary, write_kv)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.tandem.silu_and_mul(x)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Once the step's K/V are in the cache: decodes read it in place (from their window's
    start), and so do chunks that attend as decodes (`PrefillSegment.attends_as_decodes`);
    other prefill chunks as the portable op."""
    d = meta.num_decodes
    in_place = [seg for seg in meta.prefills if seg.attends_as_decodes]
    chunks = [seg for seg in meta.prefills if not seg.attends_as_decodes]
    if not d and not in_place:  # a prefill step: its output as it comes
        return portable_attention(q, k, v, k_cache, v_cache, meta, scale, sliding_window)
    out = torch.empty_like(q)
    window = sliding_window or 0
    if d:
        torch.ops.tandem.paged_decode_attention(
            out[:d], q[:d].contiguous(), k_cache, v_cache, meta.block_tables[:d],
            meta.context_lens[:d], scale, window,
        )  # fmt: skip
    for seg in in_place:
        rows = slice(seg.token_start, seg.token_start + seg.num_tokens)
        tables = meta.block_tables[seg.row].expand(seg.num_tokens, -1)
        lens = torch.arange(seg.context_len - seg.num_tokens + 1, seg.context_len + 1)
        torch.ops.tandem.paged_decode_attention(
            out[rows], q[rows].contiguous(), k_cache, v_cache, tables, lens, scale, window
        )
    if chunks:
        rest = portable_attention(
            q, k, v, k_cache, v_cache, replace(meta, num_decodes=0, prefills=chunks), scale,
            sliding_window,
        )  # fmt: skip
        for seg in chunks:
            rows = slice(seg.token_start, seg.token_start + seg.num_tokens)
            out[rows] = rest[rows]
    return out


attend = rotate_cache_attend(rotary_and_cache, paged_attention)
