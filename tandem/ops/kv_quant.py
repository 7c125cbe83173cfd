"""A KV cache of one byte per value: `kv_cache_dtype` "int8" (CPU) and "fp8" (e4m3, CUDA).

Each (token, kv head) row of K or V is stored as `head_dim` one-byte codes followed by its own
float32 scale in the row's last 4 bytes, so a layer's cache stays one tensor
[2, blocks, block_size, kv_heads, head_dim + 4] that every block-level mechanism (prefix
sharing, preemption, tensor-parallel heads, sliding-window groups) handles as before. The
tensor's dtype says how the codes read: int8 (torch.int8) codes are integers in [-127, 127]
with scale max|x| / 127; fp8 codes (torch.uint8, the bits of float8_e4m3fn) with scale
max|x| / 448. A value reads back as code * scale, in float32.

The rule that keeps outputs a function of the tokens alone: attention always reads K/V as the
cache holds them, a prefill chunk's own keys included, so a chunk's result does not depend on
whether its context was computed in this step, an earlier chunk, or another request (prefix
cache). The kernels (`csrc/cpu_kernels.cpp`, `triton_attention.py`) compute the same codes and
scales bit for bit (float32 division, round half to even) and read them in registers.
"""

from __future__ import annotations

import torch

from tandem.ops.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE

SCALE_BYTES = 4  # a float32 scale after each row's codes
INT8_MAX = 127.0
QUANTIZED = (torch.int8, torch.uint8)  # storage dtypes of the int8 and fp8 caches


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of the cache's last dimension: a head's values, plus the scale's bytes."""
    return head_dim + SCALE_BYTES if dtype in QUANTIZED else head_dim


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in QUANTIZED


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows [..., D] (any float dtype) as cache rows [..., D + 4] of `dtype` (int8 or uint8)."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    if dtype == torch.int8:
        scale = amax / INT8_MAX
        safe = torch.where(scale > 0, scale, 1.0)
        codes = torch.where(scale > 0, x / safe, 0.0).round().clamp(-INT8_MAX, INT8_MAX)
        codes = codes.to(torch.int8)
    else:
        scale = torch.clamp(amax / FP8_MAX, min=MIN_SCALE)
        codes = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)
    return torch.cat([codes, scale.view(dtype)], dim=-1)


def dequantize(rows: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Cache rows [..., D + 4] back as values [..., D]: code * scale in float32, then `out_dtype`."""
    codes, scale_bytes = rows[..., :-SCALE_BYTES], rows[..., -SCALE_BYTES:]
    scale = scale_bytes.contiguous().view(torch.float32)
    if rows.dtype == torch.int8:
        values = codes.float()
    else:
        values = codes.contiguous().view(FP8_DTYPE).float()
    return (values * scale).to(out_dtype)


def cached_values(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x as attention reads it back from `cache`: itself, or its codes dequantized."""
    if not is_quantized(cache):
        return x
    return dequantize(quantize(x, cache.dtype), x.dtype)
