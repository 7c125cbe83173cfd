"""The forward's non-GEMM ops as fused Triton kernels, for CUDA steps (graphs and eager).

Why: an eager Llama layer in portable PyTorch launches about 43 kernels, 30 of them for two
RMSNorms and the rotary embedding. On an H200 at batch 32 an 8B model's decode step is 1391
kernels, and even replayed from a CUDA graph the device idles about half a microsecond between
two of them: 8% of the step. Fused, a layer is about 11 kernels (the rotary embedding and the
step's K/V store into the cache are one).

Each kernel keeps `ops/elementwise.py`'s arithmetic: every intermediate that PyTorch rounds to the
model's dtype is rounded here too, products and sums are not contracted into FMAs
(`enable_fp_fusion=False`), exp and division are CUDA's accurate ones (libdevice, `div_rn`)
and rsqrt its hardware approximation, as PyTorch's `rsqrtf`; only the RMSNorm's sum of squares
adds in another order. The CPU suite runs them under Triton's interpreter against the portable ops
(where exp is numpy's, and a cast to bf16 truncates instead of rounding).

Into an fp8 KV cache (`kv_quant`) the rotary kernel writes each row's e4m3 codes and scale with
the bits of `kv_quant.quantize` (float32 division, ties to even), by the rules it shares with
the attention kernels (`triton_rounding.kv_fp8_*`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.ops.attention import paged_attention, rotate_cache_attend
from tandem.ops.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE
from tandem.ops.triton_launch import (
    INTERPRETED,
    let_next_kernel_launch,
    pdl_options,
    wait_for_previous_kernel,
)
from tandem.ops.triton_rounding import (
    check_cache,
    kv_fp8_codes,
    kv_fp8_scale,
    rotated,
    round_to_e4m3,
    rounded,
    silu_times,
)

_EXACT = {"enable_fp_fusion": False}  # a*b + c stays two roundings, as in PyTorch


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,  # read (HAS_RESIDUAL) and overwritten with residual + x
    weight_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    n_cols,
    inv_n,  # 1 / n_cols, rounded once on the host as torch's mean takes it
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # residual + x, in the dtype
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean = tl.sum(xf * xf, axis=0) * inv_n
    normed = (xf * tl.rsqrt(mean + eps)).to(x.dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)
    let_next_kernel_launch(PDL)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`elementwise.rms_norm` over the last dimension (any leading shape)."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty_like(rows)
    _launch_norm(rows, None, weight, out, eps)
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`elementwise.add_rms_norm` in one kernel. The residual stream is updated in place
    (residual += x), which the layers allow: each step's stream is its own buffer."""
    out = torch.empty_like(x)
    _launch_norm(x, residual, weight, out, eps)
    return out, residual


def _launch_norm(x, residual, weight, out, eps) -> None:
    n_rows, n_cols = x.shape
    if n_rows == 0:
        return
    has_residual = residual is not None
    _rms_norm_kernel[(n_rows,)](
        x, residual if has_residual else x, weight, out, x.stride(0),
        residual.stride(0) if has_residual else 0, out.stride(0), n_cols, 1.0 / n_cols, eps,
        HAS_RESIDUAL=has_residual, BLOCK=triton.next_power_of_2(n_cols), **_EXACT,
        **pdl_options(x.device),
    )  # fmt: skip


@triton.jit
def _rotate_heads(
    x_ptr, stride_t, stride_h, token, n_heads, c1, c2, s1, s2, offs_d, mask_d,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """x*cos + rotate_half(x)*sin for every head of one token, in place. Returns the two halves,
    the heads' offsets and the mask, for a copy into the cache."""
    heads = tl.arange(0, BLOCK_H)
    mask = (heads < n_heads)[:, None] & mask_d[None, :]
    first = x_ptr + token * stride_t + heads[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    out1, out2 = rotated(x1, x2, c1[None, :], c2[None, :], s1[None, :], s2[None, :])
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF, out2, mask=mask)
    return out1, out2, heads, mask


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, cos_ptr, sin_ptr, slots_ptr, k_cache_ptr, v_cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_table,
    stride_slot, stride_cache_h, n_q_heads, n_k_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
    WRITE_CACHE: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    dtype = q_ptr.dtype.element_ty
    row = pos * stride_table + offs_d
    # cos[positions].to(q.dtype): the table is fp32, the products are taken in the model's dtype.
    c1 = rounded(tl.load(cos_ptr + row, mask=mask_d, other=0.0), dtype)
    c2 = rounded(tl.load(cos_ptr + row + HALF, mask=mask_d, other=0.0), dtype)
    s1 = rounded(tl.load(sin_ptr + row, mask=mask_d, other=0.0), dtype)
    s2 = rounded(tl.load(sin_ptr + row + HALF, mask=mask_d, other=0.0), dtype)
    _rotate_heads(q_ptr, stride_qt, stride_qh, token, n_q_heads, c1, c2, s1, s2, offs_d, mask_d,
                  HALF, BLOCK_QH)  # fmt: skip
    k1, k2, heads, mask = _rotate_heads(
        k_ptr, stride_kt, stride_kh, token, n_k_heads, c1, c2, s1, s2, offs_d, mask_d, HALF,
        BLOCK_KH,
    )  # fmt: skip
    if WRITE_CACHE:  # the step's rotated K and its V into the paged cache, at the token's slot
        slot = tl.load(slots_ptr + token).to(tl.int64)
        rows = slot * stride_slot + heads * stride_cache_h
        v_first = v_ptr + token * stride_vt + heads[:, None] * stride_vh + offs_d[None, :]
        v1, v2 = tl.load(v_first, mask=mask), tl.load(v_first + HALF, mask=mask)
        _cache_halves(k_cache_ptr + rows, k1, k2, offs_d, mask, heads < n_k_heads, HALF, FP8)
        _cache_halves(v_cache_ptr + rows, v1, v2, offs_d, mask, heads < n_k_heads, HALF, FP8)
    let_next_kernel_launch(PDL)


@triton.jit
def _cache_halves(rows_ptr, x1, x2, offs_d, mask, mask_rows, HALF: tl.constexpr, FP8: tl.constexpr):
    """Cache rows (`rows_ptr`: each row's start) from their halves: as they are, or (FP8) as
    e4m3 codes with the row's float32 scale in its 4 bytes after them (`kv_quant.quantize`)."""
    at = rows_ptr[:, None] + offs_d[None, :]
    if FP8:
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        scale = kv_fp8_scale(tl.maximum(tl.max(tl.abs(a), 1), tl.max(tl.abs(b), 1)))
        tl.store(at, kv_fp8_codes(a, scale[:, None]).to(tl.uint8, bitcast=True), mask=mask)
        tl.store(at + HALF, kv_fp8_codes(b, scale[:, None]).to(tl.uint8, bitcast=True), mask=mask)
        tl.store((rows_ptr + 2 * HALF).to(tl.pointer_type(tl.float32)), scale, mask=mask_rows)
    else:
        tl.store(at, x1, mask=mask)
        tl.store(at + HALF, x2, mask=mask)


def rotary(
    q: torch.Tensor,  # [T, H, D], head dimension contiguous
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,
    cos: torch.Tensor,  # [max_positions, D] fp32
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`elementwise.rotary` in one kernel for q and k, in place (they are views of the step's
    fresh qkv projection)."""
    _launch_rotary(q, k, None, positions, cos, sin, None, None, None)
    return q, k


def rotary_and_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [blocks, block_size, Hkv, D], or fp8: uint8 rows of D + 4
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [T]: block * block_size + offset
) -> tuple[torch.Tensor, torch.Tensor]:
    """`elementwise.rotary_and_cache` in one kernel: q and k rotated in place, the rotated k and
    v stored at their slots. Three kernels (rotary, two index copies) in one."""
    _launch_rotary(q, k, v, positions, cos, sin, k_cache, v_cache, slots)
    return q, k


# A plain decode step's rows rotated, cached and attended by the decode kernel in one launch.
attend = rotate_cache_attend(rotary_and_cache, paged_attention, fuse_decodes=True)


def _launch_rotary(q, k, v, positions, cos, sin, k_cache, v_cache, slots) -> None:
    tokens, dim = q.shape[0], q.shape[-1]
    if tokens == 0:
        return
    write = k_cache is not None
    if write:
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
        check_cache(k_cache, dim)
    half = dim // 2
    _rotary_kernel[(tokens,)](
        q, k, v if write else k, positions, cos, sin, slots if write else positions,
        k_cache if write else k, v_cache if write else k, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0) if write else 0, v.stride(1) if write else 0, cos.stride(0),
        k_cache.stride(1) if write else 0, k_cache.stride(2) if write else 0, q.shape[1],
        k.shape[1], HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_QH=triton.next_power_of_2(q.shape[1]), BLOCK_KH=triton.next_power_of_2(k.shape[1]),
        WRITE_CACHE=write, FP8=write and k_cache.dtype == torch.uint8, **_EXACT,
        **pdl_options(q.device),
    )  # fmt: skip


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, silu_times(gate, up, LIBDEVICE), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`elementwise.silu_and_mul` ([T, 2I] -> [T, I]) in one kernel, launched in stream order:
    launched dependent on the gate/up GEMM before it, the device idled three times longer
    between the two (H200, docs/performance.md)."""
    tokens, width = x.shape
    out = torch.empty((tokens, width // 2), dtype=x.dtype, device=x.device)
    if tokens:
        block = min(1024, triton.next_power_of_2(width // 2))
        grid = (tokens, triton.cdiv(width // 2, block))
        _silu_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), width // 2, BLOCK=block,
                                   LIBDEVICE=not INTERPRETED, **_EXACT)  # fmt: skip
    return out


@triton.jit
def _quantize_rows_fp8_kernel(
    x_ptr, codes_ptr, scales_ptr, stride_x, stride_c, n_cols, fp8_max, min_scale,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=0), fp8_max), min_scale)
    codes = round_to_e4m3(tl.clamp(tl.div_rn(x, scale), -fp8_max, fp8_max))
    tl.store(codes_ptr + row * stride_c + cols, codes.to(codes_ptr.dtype.element_ty), mask=mask)
    tl.store(scales_ptr + row, scale)
    let_next_kernel_launch(PDL)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8.quantize_rows` in one kernel: e4m3 codes [R, C] and float32 scales [R, 1], the same
    bits."""
    rows, cols = x.shape
    codes = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_fp8_kernel[(rows,)](
            x, codes, scales, x.stride(0), codes.stride(0), cols, FP8_MAX, MIN_SCALE,
            BLOCK=triton.next_power_of_2(cols), **_EXACT, **pdl_options(x.device),
        )  # fmt: skip
    return codes, scales
