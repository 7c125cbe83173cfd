"""Linear layers that can run through MKL's pre-packed single-precision GEMM on a CPU.

At decode batch sizes (tens of rows) a GEMM's time goes into streaming the weight matrix, and
MKL's packed format (`cblas_sgemm_pack`, reached through `torch.ops.mkl._mkl_linear`, the op
that inductor's CPU freezing emits) lays the weight out the way its micro-kernel reads it, so
decode-sized GEMMs run faster than through `F.linear` and prefill-sized ones no slower. The
packed copy costs 1.5x the weight's memory on top of the weight itself (the op keeps the
original for its shape checks), which is why it is a CPU float32 choice only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.ops import cpu_kernels

# Up to this many rows (a decode step of that many sequences) the fast path streams the weight
# through the fused kernels' GEMV (csrc: `gemv`, kGemvMaxRows), faster from memory than MKL's.
GEMV_MAX_ROWS = 4
_NO_BIAS = torch.empty(0)

# The M that MKL tunes the packed layout for; any M runs correctly. 128 is as fast as a layout
# for 32 at decode sizes and faster from 64 rows up; layouts for 2048 rows are slow at small M.
PACK_BATCH_HINT = 128


def can_prepack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
    )


def prepack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkl._mkl_reorder_linear_weight(weight, PACK_BATCH_HINT)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, in] @ weight [out, in].T (+ bias), through the packed weight when there is one
    (the fast path), or on that path through the fused GEMV for a few rows."""
    if packed is None:
        return F.linear(x, weight, bias)
    if 1 <= x.shape[0] <= GEMV_MAX_ROWS and cpu_kernels.loaded() and x.stride(-1) == 1:
        return torch.ops.tandem.gemv(x, weight, _NO_BIAS if bias is None else bias)
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.shape[0])


class Linear(nn.Module):
    """nn.Linear's parameters (so checkpoints load unchanged), plus an optional packed weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None

    def prepack(self) -> bool:
        """Pack the weight for MKL where that path exists; True if it did."""
        if can_prepack(self.weight):
            self.packed = prepack(self.weight)
        return self.packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)
