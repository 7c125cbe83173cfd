"""Linear layers that can run through MKL's pre-packed single-precision GEMM on a CPU, or over
quantized weights (`quantized.py`).

MKL's packed format (`cblas_sgemm_pack`, reached through `torch.ops.mkl._mkl_linear`, the op
that inductor's CPU freezing emits) lays the weight out the way its micro-kernel reads it, so
prefill-sized GEMMs run faster than through `F.linear`. Decode-sized ones (up to
`SMALL_GEMM_MAX_ROWS` rows) go through the fused kernels' own GEMM instead, faster than MKL's
at those sizes. The packed copy costs 1.5x the weight's memory on top of the weight itself (the
op keeps the original for its shape checks), which is why it is a CPU float32 choice only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.ops import cpu_kernels
from tandem.ops.quantized import GROUP_ROWS, QuantizedWeight, or_empty, quantized_linear

# Up to this many rows (a decode step of that many sequences) the fast path multiplies through
# the fused kernels' own GEMM (csrc: `small_gemm`, kSmallGemmMaxRows): up to 8 rows it streams
# the weights faster than MKL's packed GEMM, above that its register tiles compute faster.
SMALL_GEMM_MAX_ROWS = 256

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
    quantized: QuantizedWeight | None = None,
) -> torch.Tensor:
    """x [M, in] @ weight [out, in].T (+ bias): over the quantized weight when there is one, else
    through the packed weight when there is one (the fast path), or on that path through the
    fused kernels' GEMM for decode-sized steps."""
    if quantized is not None:
        return quantized_linear(x, quantized, bias)
    if packed is None:
        return F.linear(x, weight, bias)
    if 1 <= x.shape[0] <= SMALL_GEMM_MAX_ROWS and cpu_kernels.loaded() and x.stride(-1) == 1:
        return torch.ops.tandem.small_gemm(x, weight, or_empty(bias))
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.shape[0])


class Linear(nn.Module):
    """nn.Linear's parameters (so checkpoints load unchanged), plus an optional packed weight, or
    a quantized weight in place of the float one."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None
        self.quantized: QuantizedWeight | None = None

    def drop_dense_weight(self) -> None:
        """Keep no float weight (it is to be loaded quantized): an empty parameter in its place."""
        self.weight = nn.Parameter(torch.empty(0, device=self.weight.device), requires_grad=False)

    def set_quantized(self, q: QuantizedWeight) -> None:
        if q.shape != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight {q.shape} for a {self.out_features} x "
                             f"{self.in_features} layer")  # fmt: skip
        self.quantized = q
        self.drop_dense_weight()

    def load_quantized_rows(self, first_row: int, part: QuantizedWeight) -> None:
        """Copy rows [first_row, first_row + part's rows) of the quantized weight (a fused
        projection's part: q, k or v; gate or up); the first part sets the format."""
        if self.quantized is None:
            groups = self.out_features // GROUP_ROWS
            whole = [None if t is None else t.new_zeros((groups, *t.shape[1:])) for t in
                     (part.values, part.scales, part.offsets)]  # fmt: skip
            self.quantized = QuantizedWeight(*whole, part.source)
        q = self.quantized
        if part.values.dtype != q.values.dtype or part.scales.dtype != q.scales.dtype:
            raise ValueError(f"parts of one layer in two formats ({q.source}, {part.source})")
        group = first_row // GROUP_ROWS
        for whole, piece in zip(q.flat(), part.flat(), strict=True):
            if piece.numel():
                whole.narrow(0, group, piece.shape[0]).copy_(piece)

    def prepack(self) -> bool:
        """Pack the weight for MKL where that path exists; True if it did."""
        if self.quantized is None and can_prepack(self.weight):
            self.packed = prepack(self.weight)
        return self.packed is not None or self.quantized is not None

    def flat(self) -> list[torch.Tensor]:
        """The five tensors the fused forward reads per linear layer (csrc: LayerWeight): the
        float weight or the quantized values, MKL's packed weight, scales, offsets, bias."""
        packed, bias = or_empty(self.packed), or_empty(self.bias)
        if self.quantized is not None:
            values, scales, offsets = self.quantized.flat()
            return [values, packed, scales, offsets, bias]
        return [self.weight, packed, or_empty(None), or_empty(None), bias]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed, self.quantized)
