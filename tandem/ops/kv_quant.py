"""A KV cache of one byte per value: `kv_cache_dtype` "int8" (CPU) and "fp8" (e4m3, CUDA).

Each (token, kv head) row of K or V is stored as `head_dim` one-byte codes followed by float32
scales, so a layer's cache stays one tensor [2, blocks, block_size, kv_heads, row_width] that
every block-level mechanism (prefix sharing, preemption, tensor-parallel heads, sliding-window
groups) handles as before. The tensor's dtype says how the codes read:

* int8 (torch.int8): a scale per block of 32 values along the head (the last block shorter where
  head_dim is not a multiple of 32), as llama.cpp's q8_0; codes are integers in [-127, 127] with
  scale max|x| / 127 over their block. Why blocks: a scale per row let one large value coarsen
  the whole head; over SmolLM2's perplexity text a row's scale cost +0.09% on average, blocks of
  32 +0.02% (docs/experiments.md).
* fp8 (torch.uint8, the bits of float8_e4m3fn): one scale per row, max|x| / 448 (e4m3 carries
  its own exponent, so a block's scale buys it little).

A value reads back as code * scale, in float32.

The rule that keeps outputs a function of the tokens alone: attention always reads K/V as the
cache holds them, a prefill chunk's own keys included, so a chunk's result does not depend on
whether its context was computed in this step, an earlier chunk, or another request (prefix
cache). The kernels (`csrc/cpu_kernels.cpp`, `triton_attention.py`) compute the same codes and
scales bit for bit (float32 division, round half to even) and read them in registers.
"""

from __future__ import annotations

import torch

from tandem.ops.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE

SCALE_BYTES = 4  # a float32 scale
INT8_BLOCK = 32  # int8 values per scale
INT8_MAX = 127.0
QUANTIZED = (torch.int8, torch.uint8)  # storage dtypes of the int8 and fp8 caches


def num_scales(head_dim: int, dtype: torch.dtype) -> int:
    """Scales a row of `head_dim` values carries: one per int8 block, one per fp8 row."""
    return -(-head_dim // INT8_BLOCK) if dtype == torch.int8 else 1


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of the cache's last dimension: a head's values, plus its scales' bytes."""
    if dtype not in QUANTIZED:
        return head_dim
    return head_dim + SCALE_BYTES * num_scales(head_dim, dtype)


def head_dim_of(width: int, dtype: torch.dtype) -> int:
    """The head size whose rows are `width` elements wide (`row_width` inverted: an int8 row of
    n blocks is between 36 (n - 1) and 36 n wide)."""
    if dtype == torch.int8:
        return width - SCALE_BYTES * -(-width // (INT8_BLOCK + SCALE_BYTES))
    return width - SCALE_BYTES if dtype == torch.uint8 else width


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in QUANTIZED


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    """x [..., D] as [..., n, size], the last block zero-padded (zeros change no block's max)."""
    pad = -x.shape[-1] % size
    return torch.nn.functional.pad(x, (0, pad)).unflatten(-1, (-1, size))


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows [..., D] (any float dtype) as cache rows [..., row_width(D)] of `dtype` (int8 or
    uint8): the codes, then the scales."""
    x = x.float()
    dim = x.shape[-1]
    if dtype == torch.int8:
        blocks = _blocks(x, INT8_BLOCK)
        scale = blocks.abs().amax(-1, keepdim=True) / INT8_MAX
        safe = torch.where(scale > 0, scale, 1.0)
        codes = torch.where(scale > 0, blocks / safe, 0.0).round().clamp(-INT8_MAX, INT8_MAX)
        codes = codes.to(torch.int8).flatten(-2)[..., :dim]
        scale = scale.squeeze(-1)
    else:
        scale = torch.clamp(x.abs().amax(-1, keepdim=True) / FP8_MAX, min=MIN_SCALE)
        codes = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)
    return torch.cat([codes, scale.contiguous().view(dtype)], dim=-1)


def dequantize(rows: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Cache rows [..., row_width(D)] back as values [..., D]: code * scale in float32, then
    `out_dtype`."""
    dim = head_dim_of(rows.shape[-1], rows.dtype)
    codes, scale_bytes = rows[..., :dim], rows[..., dim:]
    scales = scale_bytes.contiguous().view(torch.float32)
    if rows.dtype == torch.int8:
        values = _blocks(codes.float(), INT8_BLOCK) * scales.unsqueeze(-1)
        return values.flatten(-2)[..., :dim].to(out_dtype)
    values = codes.contiguous().view(FP8_DTYPE).float()
    return (values * scales).to(out_dtype)


def cached_values(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x as attention reads it back from `cache`: itself, or its codes dequantized."""
    if not is_quantized(cache):
        return x
    return dequantize(quantize(x, cache.dtype), x.dtype)
