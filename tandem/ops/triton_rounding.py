"""PyTorch's roundings inside Triton kernels: one definition for every kernel that rotates, and
for every kernel that takes SiLU(gate) * up.

The rotary embedding is computed as PyTorch computes it in the model's dtype: each product
rounded to that dtype, then their sum. The norms' and rotary's kernels (`triton_elementwise.py`)
and the decode attention that rotates the step's own keys (`triton_attention.py`) share it, so
their keys are bit for bit the same; the SiLU kernel and the gate/up GEMM that ends in SiLU
(`triton_gemm.py`) share `silu_times`.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


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
