"""The forward's non-GEMM ops as fused Triton kernels, for CUDA steps (graphs and eager).

Why: an eager Llama layer in portable PyTorch launches about 43 kernels, 30 of them for two
RMSNorms and the rotary embedding. On an H200 at batch 32 an 8B model's decode step is 1391
kernels, and even replayed from a CUDA graph the device idles about half a microsecond between
two of them: 8% of the step. Fused, a layer is about 13 kernels.

Each kernel keeps `ops/elementwise.py`'s arithmetic: every intermediate that PyTorch rounds to the
model's dtype is rounded here too, products and sums are not contracted into FMAs
(`enable_fp_fusion=False`), exp and division are CUDA's accurate ones (libdevice, `div_rn`)
and rsqrt its hardware approximation, as PyTorch's `rsqrtf`; only the RMSNorm's sum of squares
adds in another order. The CPU suite runs them under Triton's interpreter against the portable ops
(where exp is numpy's, and a cast to bf16 truncates instead of rounding).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from tandem.ops.attention import paged_attention  # noqa: F401 - the Triton kernels on CUDA

_EXACT = {"enable_fp_fusion": False}  # a*b + c stays two roundings, as in PyTorch
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


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
):
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
    )  # fmt: skip


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """x rounded to the model's dtype, kept in fp32: where PyTorch stores an intermediate."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rotate_heads(
    x_ptr, stride_t, stride_h, token, n_heads, c1, c2, s1, s2, offs_d, mask_d,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """x*cos + rotate_half(x)*sin for every head of one token, in place."""
    heads = tl.arange(0, BLOCK_H)
    mask = (heads < n_heads)[:, None] & mask_d[None, :]
    first = x_ptr + token * stride_t + heads[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    out1 = _round(a * c1[None, :], dtype) + _round(-b * s1[None, :], dtype)
    out2 = _round(b * c2[None, :], dtype) + _round(a * s2[None, :], dtype)
    tl.store(first, out1.to(dtype), mask=mask)
    tl.store(first + HALF, out2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_table, n_q_heads, n_k_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    dtype = q_ptr.dtype.element_ty
    row = pos * stride_table + offs_d
    # cos[positions].to(q.dtype): the table is fp32, the products are taken in the model's dtype.
    c1 = _round(tl.load(cos_ptr + row, mask=mask_d, other=0.0), dtype)
    c2 = _round(tl.load(cos_ptr + row + HALF, mask=mask_d, other=0.0), dtype)
    s1 = _round(tl.load(sin_ptr + row, mask=mask_d, other=0.0), dtype)
    s2 = _round(tl.load(sin_ptr + row + HALF, mask=mask_d, other=0.0), dtype)
    _rotate_heads(q_ptr, stride_qt, stride_qh, token, n_q_heads, c1, c2, s1, s2, offs_d, mask_d,
                  HALF, BLOCK_QH)  # fmt: skip
    _rotate_heads(k_ptr, stride_kt, stride_kh, token, n_k_heads, c1, c2, s1, s2, offs_d, mask_d,
                  HALF, BLOCK_KH)  # fmt: skip


def rotary(
    q: torch.Tensor,  # [T, H, D], head dimension contiguous
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,
    cos: torch.Tensor,  # [max_positions, D] fp32
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`elementwise.rotary` in one kernel for q and k, in place (they are views of the step's
    fresh qkv projection)."""
    tokens, dim = q.shape[0], q.shape[-1]
    if tokens == 0:
        return q, k
    half = dim // 2
    _rotary_kernel[(tokens,)](
        q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), q.shape[1], k.shape[1], HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_QH=triton.next_power_of_2(q.shape[1]), BLOCK_KH=triton.next_power_of_2(k.shape[1]),
        **_EXACT,
    )  # fmt: skip
    return q, k


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # CUDA's accurate expf, as PyTorch's silu (tl.exp is ex2.approx); the interpreter has none.
    e = libdevice.exp(-g) if LIBDEVICE else tl.exp(-g)
    silu = _round(tl.div_rn(g, 1.0 + e), gate.dtype)  # F.silu, in the dtype
    tl.store(out_ptr + row * stride_o + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`elementwise.silu_and_mul` ([T, 2I] -> [T, I]) in one kernel."""
    tokens, width = x.shape
    out = torch.empty((tokens, width // 2), dtype=x.dtype, device=x.device)
    if tokens:
        block = min(1024, triton.next_power_of_2(width // 2))
        grid = (tokens, triton.cdiv(width // 2, block))
        _silu_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), width // 2, BLOCK=block,
                                   LIBDEVICE=not _INTERPRETED, **_EXACT)  # fmt: skip
    return out
