"""Linear layers over float32 weights packed for the CPU, or over quantized weights
(`quantized.py`: the CPU kernels' blocks; `fp8.py`: e4m3 per channel).

On a CPU in float32 the fast path packs every weight once: into panels of output rows for the
fused kernels' own GEMM (csrc: `gemm`), which multiplies a step of any row count as sums of outer
products (faster than MKL's packed GEMM at every size measured, on AMD Zen 5 in both builds;
Intel is unmeasured: docs/performance.md), with a row's result the same bits whatever the step's
row count. Without the kernels (no compiler) the
weight is packed for MKL's single-precision GEMM instead (`cblas_sgemm_pack`, reached through
`torch.ops.mkl._mkl_linear`), a copy that needs the weight beside it (2.5x the weight's memory),
which is why packing is a CPU float32 choice only. Panels replace the float weight instead
(`Linear.prepack`; a tied embedding's table too): 1x, and `Linear.float_weight` reads it back.
A model's panels lie back to back in one buffer (`panel_arena`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from tandem.ops import cpu_kernels
from tandem.ops.fp8 import Fp8Weight, dequantize_fp8, fp8_linear
from tandem.ops.huge_pages import HUGE_PAGE, advise
from tandem.ops.lora import LoraGroup
from tandem.ops.quantized import (
    QuantizedWeight,
    copy_rows,
    dequantize,
    or_empty,
    quantized_linear,
    zero_rows,
)

# The M that MKL tunes its packed layout for (the fallback without the kernels); any M runs
# correctly. 128 is as fast as a layout for 32 at decode sizes and faster from 64 rows up.
PACK_BATCH_HINT = 128


def can_prepack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return False
    mkl = torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    return cpu_kernels.loaded() or mkl


def can_pack_panels(weight: torch.Tensor) -> bool:
    """Whether `prepack` packs this weight in panels (float32 on a CPU, the kernels loaded)."""
    return cpu_kernels.loaded() and can_prepack(weight)


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """The weight packed for the fused kernels' GEMM (3-D panels) or else for MKL's (2-D)."""
    if cpu_kernels.loaded():
        return pack_panels(weight)
    return torch.ops.mkl._mkl_reorder_linear_weight(weight, PACK_BATCH_HINT)


def panels_shape(out_features: int, in_features: int) -> tuple[int, int, int]:
    width = torch.ops.tandem.gemm_panel_width()
    return -(-out_features // width), in_features, width


def pack_panels(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """weight [out, in] as panels [ceil(out / width), in, width] of `width` output rows (the
    build's vector width x 3), zero past the last row: panels[p, k, j] = weight[p * width + j,
    k], so a panel is read in order, a step of weights for every input k. Into `out` (of
    `panels_shape`) when given."""
    out_features, in_features = weight.shape
    shape = panels_shape(out_features, in_features)
    width = shape[2]
    full, rest = divmod(out_features, width)
    # Copied straight into place: a padded temporary as large as the weight, freed at once,
    # would raise glibc's mmap threshold and put later buffers in reused, small-paged memory.
    if out is None:
        panels = weight.new_zeros(shape)
    else:
        if tuple(out.shape) != shape or out.dtype != weight.dtype:
            raise ValueError(f"panels of {tuple(out.shape)} for a weight packed as {shape}")
        panels = out
    weight = weight.detach()
    panels[:full].transpose(1, 2).copy_(weight[: full * width].view(full, width, in_features))
    if rest:
        panels[full, :, :rest].copy_(weight[full * width :].T)
        if out is not None:
            panels[full, :, rest:].zero_()
    return panels


def panel_arena(shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Uninitialised panels for weights of these [out, in] shapes, back to back in one buffer
    backed by huge pages, in the order given: the order a forward reads them.

    Why: a step of few rows streams every weight once, and one sequential stream in 2 MiB pages
    keeps the memory's prefetchers going from one GEMM into the next, where separate buffers
    under 2 MiB (a small model's every attention output) sat in 4 KiB pages. The pages are
    only touched as each weight is packed into its place, so the weights' peak memory stays
    that of packing them one by one."""
    if not shapes:
        return []
    sizes = [math.prod(panels_shape(*shape)) for shape in shapes]
    arena = torch.empty(sum(sizes) + HUGE_PAGE // 4)
    advise(arena)
    first = (-arena.data_ptr() % HUGE_PAGE) // arena.element_size()  # start on a huge page
    panels = []
    for shape, size in zip(shapes, sizes, strict=True):
        panels.append(arena[first : first + size].view(panels_shape(*shape)))
        first += size
    return panels


def rows_from_panels(panels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """weight[ids] of the weight packed in `panels`: a tied embedding's lookups read its logits'
    panels, its only copy (csrc: `embedding_rows`)."""
    width = panels.shape[2]
    return panels[ids // width, :, ids % width]


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def shape_only(*leading: int) -> nn.Parameter:
    """A weight that holds no values, only its leading sizes: [*leading, 0] (the GEMMs read the
    out features from it; anything that would multiply by it fails on its shape)."""
    return nn.Parameter(torch.empty(*leading, 0), requires_grad=False)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
    quantized: QuantizedWeight | Fp8Weight | None = None,
) -> torch.Tensor:
    """x [M, in] @ weight [out, in].T (+ bias): over the quantized weight when there is one, else
    through the packed weight when there is one (the fast path), else F.linear."""
    if isinstance(quantized, Fp8Weight):
        return fp8_linear(x, quantized, bias)
    if quantized is not None:
        return quantized_linear(x, quantized, bias)
    if packed is None:
        return F.linear(x, weight, bias)
    if packed.dim() == 3:
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:  # a row stride is honoured, a column stride is not
            rows = rows.contiguous()
        out = torch.ops.tandem.gemm(rows, packed, or_empty(bias), weight.shape[0])
        return out.view(*x.shape[:-1], weight.shape[0])
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.shape[0])


@dataclass(frozen=True)
class FewRowsGemm:
    """Another GEMM for the products it `handles` (a decode step's few rows); `gated`, where it
    has one, gives SiLU(gate) * up of a gate/up weight in the same launch."""

    handles: Callable[[torch.Tensor, torch.Tensor], bool]
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    gated: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


class Linear(nn.Module):
    """nn.Linear's parameters (so checkpoints load unchanged), plus an optional packed weight, or
    a quantized weight in place of the float one."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None
        self.quantized: QuantizedWeight | Fp8Weight | None = None
        # A GEMM for inputs of few rows (`LlamaModel.use_few_rows_gemm`), and which it takes.
        self.few_rows_gemm: FewRowsGemm | None = None
        # With LoRA: every adapter slot's weights for this layer (`models/lora.py`).
        self.lora: LoraGroup | None = None

    def drop_dense_weight(self) -> None:
        """Keep no float weight (it is to be loaded quantized): an empty parameter in its place."""
        self.weight = nn.Parameter(torch.empty(0, device=self.weight.device), requires_grad=False)

    def set_quantized(self, q: QuantizedWeight | Fp8Weight) -> None:
        if q.shape != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight {q.shape} for a {self.out_features} x "
                             f"{self.in_features} layer")  # fmt: skip
        self.quantized = q
        self.drop_dense_weight()

    def load_quantized_rows(self, first_row: int, part: QuantizedWeight) -> None:
        """Copy rows [first_row, first_row + part's rows) of the quantized weight (a fused
        projection's part: q, k or v; gate or up); the first part sets the format, and the
        source names each part's, in any load order the same (e.g. "Q5_0 as Q8_0 + Q8_0")."""
        if self.quantized is None:
            self.quantized = zero_rows(self.out_features, part)
        copy_rows(self.quantized, first_row, part)

    def will_pack_panels(self) -> bool:
        """Whether `prepack` packs this layer in panels (a float32 weight, the kernels loaded)."""
        return self.quantized is None and can_pack_panels(self.weight)

    def prepack(self, panels: torch.Tensor | None = None) -> bool:
        """Pack the weight for the CPU GEMMs where they exist (into `panels`, from
        `panel_arena`, when given); True if it did. Panels replace the float weight (kept, it
        would double the weights' memory); MKL's packing needs it."""
        if panels is not None:
            self.packed = pack_panels(self.weight, panels)
            self.weight = shape_only(self.out_features)
        elif self.quantized is None and can_prepack(self.weight):
            self.packed = prepack(self.weight)
            if self.packed.dim() == 3:
                self.weight = shape_only(self.out_features)
        return self.packed is not None or self.quantized is not None

    @property
    def nbytes(self) -> int:
        """Bytes one forward reads of this layer: the weight as it is held (quantized, packed or
        float) and the bias."""
        held = self.packed if self.packed is not None else self.weight
        weight = self.quantized.nbytes if self.quantized is not None else tensor_bytes(held)
        return weight + (tensor_bytes(self.bias) if self.bias is not None else 0)

    def float_weight(self) -> torch.Tensor:
        """The layer's weight [out, in] in float32, however it is held (for inspection)."""
        if isinstance(self.quantized, Fp8Weight):
            return dequantize_fp8(self.quantized)
        if self.quantized is not None:
            return dequantize(self.quantized)
        if self.packed is not None and self.packed.dim() == 3:
            return rows_from_panels(self.packed, torch.arange(self.out_features))
        return self.weight.detach()

    def flat(self) -> list[torch.Tensor]:
        """The five tensors the fused forward reads per linear layer (csrc: LayerWeight): the
        float weight or the quantized values, the packed weight, scales, offsets, bias."""
        packed, bias = or_empty(self.packed), or_empty(self.bias)
        if isinstance(self.quantized, Fp8Weight):
            raise ValueError("the fused forward has no FP8 GEMM")
        if self.quantized is not None:
            values, scales, offsets = self.quantized.flat()
            return [values, packed, scales, offsets, bias]
        return [self.weight, packed, or_empty(None), or_empty(None), bias]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The layer's product (+ `bias` when given: a row-parallel layer adds its own once,
        after the all-reduce), with the step's LoRA deltas where an adapter runs."""
        few = self.few_rows_gemm
        if few is not None and few.handles(x, self.weight):
            out = few.run(x, self.weight, bias)
        else:
            out = linear(x, self.weight, bias, self.packed, self.quantized)
        return out if self.lora is None else self.lora.add_(out, x)

    def silu_and_mul(self, x: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        """SiLU(gate) * up of this gate/up projection of x: in its few-rows GEMM where that has
        a gated form (one launch, the product never stored), else `ops.silu_and_mul` after it."""
        few = self.few_rows_gemm
        fused = few is not None and few.gated is not None and self.bias is None
        fused = fused and not (self.lora is not None and self.lora.in_use)
        if fused and few.handles(x, self.weight):
            return few.gated(x, self.weight)
        return ops.silu_and_mul(self(x))
