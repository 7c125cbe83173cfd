"""PyTorch's roundings inside Triton kernels: one definition for every kernel that rotates, and
for every kernel that takes SiLU(gate) * up.

The rotary embedding is computed as PyTorch computes it in the model's dtype: each product
rounded to that dtype, then their sum. The norms' and rotary's kernels (`triton_elementwise.py`)
and the decode attention that rotates the step's own keys (`triton_attention.py`) share it, so
their keys are bit for bit the same; the SiLU kernel and the gate/up GEMM that ends in SiLU
(`triton_gemm.py`) share `silu_times`. An fp8 KV cache (`kv_quant`) is written by the rotary
kernel and read by the attention kernels with the same e4m3 rounding and scale (`kv_fp8_*`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from tandem.ops.fp8 import FP8_MAX, MIN_SCALE
from tandem.ops.kv_quant import SCALE_BYTES, row_width


@triton.jit
def rounded(x, DTYPE: tl.constexpr):
    """x rounded to the model's dtype, kept in fp32: where PyTorch stores an intermediate."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def rotated(x1, x2, c1, c2, s1, s2):
    """The halves of x*cos + rotate_half(x)*sin, in x's dtype, from x's halves and the halves
    of cos and sin (rounded to that dtype, in fp32)."""
    dtype = x1.dtype
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    out1 = (rounded(a * c1, dtype) + rounded(-b * s1, dtype)).to(dtype)
    out2 = (rounded(b * c2, dtype) + rounded(a * s2, dtype)).to(dtype)
    return out1, out2


@triton.jit
def silu_times(gate, up, LIBDEVICE: tl.constexpr):
    """F.silu(gate) * up in gate's dtype, as PyTorch: SiLU rounded to the dtype, then the
    product. CUDA's accurate expf, as PyTorch's silu (tl.exp is ex2.approx); the interpreter
    has no libdevice."""
    g = gate.to(tl.float32)
    e = libdevice.exp(-g) if LIBDEVICE else tl.exp(-g)
    silu = rounded(tl.div_rn(g, 1.0 + e), gate.dtype)
    return (silu * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def round_to_e4m3(v):
    """v (float32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, still float32:
    the step is 2^(exponent - 3) (2^-9 below 2^-6, e4m3's subnormals), and adding and taking
    away 1.5 * 2^23 rounds |v| / step (below 16) to an integer as float32 addition rounds; the
    sign is put back after, so a negative value that rounds to zero is -0 as in PyTorch. The
    conversion that follows is then exact: Triton's interpreter rounds some values across a
    power of two wrongly by itself."""
    bits = v.to(tl.int32, bitcast=True)
    magnitude = tl.abs(v)
    exponent = ((bits >> 23) & 0xFF) - 127
    step_bits = (tl.maximum(exponent, -6) - 3 + 127) << 23
    step = step_bits.to(tl.float32, bitcast=True)
    rounded = ((magnitude / step + 12582912.0) - 12582912.0) * step
    return tl.where(bits < 0, -rounded, rounded)  # the sign bit: -0 included


_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)


@triton.jit
def kv_fp8_scale(amax):
    """A cache row's float32 scale from its largest magnitude, as `kv_quant.quantize` takes it."""
    return tl.maximum(tl.div_rn(amax, _FP8_MAX), _MIN_SCALE)


@triton.jit
def kv_fp8_codes(x, scale):
    """x (float32) over its row's scale as e4m3 codes (float8e4nv): `kv_quant.quantize`'s bits."""
    return round_to_e4m3(tl.clamp(tl.div_rn(x, scale), -_FP8_MAX, _FP8_MAX)).to(tl.float8e4nv)


@triton.jit
def kv_fp8_values(codes, scale, DTYPE: tl.constexpr):
    """e4m3 codes read back as `kv_quant.dequantize` does: code * scale in float32, then DTYPE."""
    return (codes.to(tl.float32) * scale).to(DTYPE)


def check_cache(cache: torch.Tensor, head_dim: int) -> None:
    """A cache the Triton kernels read and write: the model's dtype with rows of `head_dim`, or
    fp8 (`kv_quant`): uint8 rows of head_dim codes and a scale, 4-byte aligned for its load."""
    if cache.dtype == torch.int8:
        raise ValueError("an int8 KV cache is the CPU's; CUDA's one-byte cache is fp8")
    if cache.dtype == torch.uint8 and head_dim % SCALE_BYTES:
        raise ValueError(f"an fp8 KV cache needs a head_dim in 4s, not {head_dim}")
    starts = (cache.data_ptr(), *cache.stride()[:-1])  # where its rows start, in bytes
    if cache.dtype == torch.uint8 and any(start % SCALE_BYTES for start in starts):
        raise ValueError("an fp8 KV cache's rows must start 4-byte aligned")
    if cache.shape[-1] != row_width(head_dim, cache.dtype):
        raise ValueError(f"cache rows of {cache.shape[-1]} do not hold heads of {head_dim}")
