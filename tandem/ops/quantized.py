"""Weights kept quantized: the layout the CPU kernels read, its reference, and int8 quantization.

A quantized weight [N, K] is codes with a scale (and, for 4-bit codes, an offset) per row and
block of 32 columns: weight = code * scale + offset. GGUF's Q8_0 (8-bit, float16 scales), Q4_0,
Q4_1 (4-bit, float16 scales and offsets) and Q4_K (4-bit, float32: its scales are products of
two) are all exactly this, and so is per-channel int8 (one float32 scale per row, repeated per
block). 8-bit codes may have a scale per 16 columns instead, two per block (GGUF's Q6_K: float32
products of its sub-blocks' int8 scales and a float16). The kernels (`csrc/quantized_linear.cpp`)
read the rows in groups of 16 and each block's columns in runs of 4 per row, the 16 rows' runs
side by side, so `pack` lays them out that way: with float activations a row's run as one 32-bit
word (4 8-bit codes, or 8 4-bit codes: the low nibbles one run, the high ones the run 16 columns
on), which a shift turns into a column, or which integer dot products take as it is;
`dequantize` is the float32 weight, whose product the kernels reproduce up to float32 rounding
(they scale each block's sum of x * code rather than each code).

With int8 activations (`for_int8_activations`, llama.cpp's numerics) the same bytes are typed as
bytes ("quads"), and the kernels quantize each row of x per block of 32
(`quantize_activations`) and multiply codes by codes in integers: fewer instructions per weight,
at the cost of rounding the activations (`int8_activation_linear` is the reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.ops import cpu_kernels

GROUP_ROWS = 16  # output rows per group (csrc: kGroupRows)
BLOCK_COLS = 32  # input columns per scale (csrc: kBlockCols)
RUN = 4  # the quads layout's columns per row side by side (one 32-bit lane of codes)
QUAD_BYTES = RUN * GROUP_ROWS  # csrc: kQuadBytes


@dataclass
class Blocks:
    """Codes, scales and offsets as the kernels take them (one weight, or a stack of them)."""

    values: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    source: str  # what the codes came from, e.g. "Q4_1", "int8"

    @property
    def nbytes(self) -> int:
        parts = (self.values, self.scales, self.offsets)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def flat(self) -> list[torch.Tensor]:
        """values, scales, offsets (an empty tensor for none), as the kernels take them."""
        return [self.values, self.scales, or_empty(self.offsets)]


@dataclass
class QuantizedWeight(Blocks):
    """Packed codes, scales and offsets of one [out_features, in_features] weight."""

    # values: with float activations words, int32 [G, B, 8, 16] (8-bit) or [G, B, 4, 16]
    # (4-bit), a row's run as one word; with int8 activations the same bytes as quads, int8
    # [G, B, 8, 64] or uint8 [G, B, 4, 64].
    # scales: [G, B, 16] float16 or float32; 8-bit codes with a scale per 16 columns: [G, B, 32],
    # a block's first 16 columns' scales of its 16 rows, then its last 16's.
    # offsets: 4-bit, like scales; 8-bit, None. 4-bit weights without offsets are symmetric
    # (GGUF's Q4_0): weight = (code - 8) * scale, the offset -8 * scale not stored (the kernels
    # make it).

    @property
    def bits(self) -> int:
        return 4 if self.values.shape[2] == BLOCK_COLS // 8 else 8

    @property
    def scale_cols(self) -> int:
        """Columns per scale: 32, or 16 for 8-bit codes with a scale per 16 columns."""
        return BLOCK_COLS * GROUP_ROWS // self.scales.shape[2]

    @property
    def int8_activations(self) -> bool:
        """Whether the kernels quantize activations to int8 for this weight (the quads layout)."""
        return self.values.shape[-1] == QUAD_BYTES

    @property
    def shape(self) -> tuple[int, int]:
        return self.values.shape[0] * GROUP_ROWS, self.values.shape[1] * BLOCK_COLS


@dataclass
class QuantizedExperts(Blocks):
    """One projection of a layer's every expert, each a `QuantizedWeight` of one shape and format,
    stacked: values, scales and offsets with a leading [experts] dimension, as the kernels walk
    them in one task list (`tandem::quantized_experts`)."""

    def __len__(self) -> int:
        return self.values.shape[0]

    def __getitem__(self, e: int) -> QuantizedWeight:
        offsets = None if self.offsets is None else self.offsets[e]
        return QuantizedWeight(self.values[e], self.scales[e], offsets, self.source)

    @classmethod
    def stack(cls, weights: list[QuantizedWeight]) -> QuantizedExperts:
        """Weights of one shape and format, stacked."""
        parts = [[q.values for q in weights], [q.scales for q in weights]]
        offsets = None if weights[0].offsets is None else torch.stack([q.offsets for q in weights])
        return cls(torch.stack(parts[0]), torch.stack(parts[1]), offsets, weights[0].source)

    @classmethod
    def empty_like(cls, experts: int, one: QuantizedWeight) -> QuantizedExperts:
        """Zeros for `experts` weights shaped and typed as `one`, to be filled expert by expert."""
        parts = (one.values, one.scales, one.offsets)
        stacked = [None if t is None else t.new_zeros((experts, *t.shape)) for t in parts]
        return cls(*stacked, one.source)

    @property
    def shape(self) -> tuple[int, int]:
        """Each expert's [out_features, in_features]."""
        return self[0].shape

    @property
    def int8_activations(self) -> bool:
        return self[0].int8_activations


def zero_rows(out_features: int, like: QuantizedWeight) -> QuantizedWeight:
    """Zeros for a weight of `out_features` rows in the format of `like` (a part of it), to be
    filled part by part (`copy_rows`)."""
    groups = out_features // GROUP_ROWS
    parts = (like.values, like.scales, like.offsets)
    whole = [None if t is None else t.new_zeros((groups, *t.shape[1:])) for t in parts]
    return QuantizedWeight(*whole, like.source)


def copy_rows(whole: QuantizedWeight, first_row: int, part: QuantizedWeight) -> None:
    """Copy rows [first_row, first_row + part's rows) of a weight fused from parts (q, k and v;
    gate and up), which must share its format; its source then names each part's, in any load
    order the same (e.g. "Q5_0 as Q8_0 + Q8_0")."""
    same = part.bits == whole.bits and part.values.dtype == whole.values.dtype
    same = same and part.scales.dtype == whole.scales.dtype
    same = same and part.scale_cols == whole.scale_cols
    if not same or (part.offsets is None) != (whole.offsets is None):
        raise ValueError(f"parts of one layer in two formats ({whole.source}, {part.source})")
    whole.source = " + ".join(sorted({*whole.source.split(" + "), part.source}))
    group = first_row // GROUP_ROWS
    for into, piece in zip(whole.flat(), part.flat(), strict=True):
        if piece.numel():
            into.narrow(0, group, piece.shape[0]).copy_(piece)


def can_quantize(out_features: int, in_features: int) -> bool:
    """Whether a weight of this shape fits the layout (whole groups of rows, whole blocks)."""
    return out_features % GROUP_ROWS == 0 and in_features % BLOCK_COLS == 0 and out_features > 0


def pack(
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    source: str,
    keep_offsets: bool = False,
) -> QuantizedWeight:
    """codes [N, K] (int8 for 8-bit, 0..15 as uint8 for 4-bit), scales and offsets [N, K / 32]
    (8-bit codes: or scales [N, K / 16]) -> the kernels' words, for float activations
    (`for_int8_activations` types them as bytes). Offsets that are -8 * scale (Q4_0's) are not
    stored unless `keep_offsets` (a layer fused with parts that have offsets of their own): a
    tenth of a 4-bit weight's bytes, which a one-row step spends its time reading."""
    n, k = codes.shape
    if not can_quantize(n, k):
        raise ValueError(f"a quantized weight needs rows in 16s and columns in 32s, got {n} x {k}")
    groups, blocks = n // GROUP_ROWS, k // BLOCK_COLS
    halves = scales.shape[1] == 2 * blocks  # a scale per 16 columns
    if halves and (codes.dtype != torch.int8 or offsets is not None):
        raise ValueError("a scale per 16 columns is for 8-bit codes without offsets")
    # [G, B, runs, 16 rows, 4 columns]: a row's run of 4 in one 32-bit lane
    runs = codes.reshape(groups, GROUP_ROWS, blocks, BLOCK_COLS // RUN, RUN)
    grouped = runs.permute(0, 2, 3, 1, 4).reshape(groups, blocks, -1, QUAD_BYTES)
    nibbles = codes.dtype == torch.uint8
    if nibbles and not keep_offsets and offsets is not None and torch.equal(offsets, scales * -8):
        offsets = None  # symmetric: the kernels make the offsets from the scales
    if not nibbles:
        values = grouped.to(torch.int8).contiguous()
    else:  # the high nibbles hold the block's second half of 16 columns (runs 4-7)
        half = grouped.shape[2] // 2
        values = (grouped[:, :, :half] | (grouped[:, :, half:] << 4)).contiguous()
    values = values.view(torch.int32)  # words: a row's run of codes as one, [G, B, runs, 16]

    def per_group(t: torch.Tensor) -> torch.Tensor:  # [N, B * h] -> [G, B, h * 16]
        per_block = t.shape[1] // blocks
        grouped = t.reshape(groups, GROUP_ROWS, t.shape[1]).transpose(1, 2)
        return grouped.reshape(groups, blocks, per_block * GROUP_ROWS).contiguous()

    return QuantizedWeight(
        values, per_group(scales), None if offsets is None else per_group(offsets), source
    )


def for_int8_activations(q: QuantizedWeight | QuantizedExperts):
    """The same weight (or experts) laid out for the kernels' integer products (int8
    activations): the words' very bytes, typed as bytes."""
    one = q[0] if isinstance(q, QuantizedExperts) else q
    if one.int8_activations:
        return q
    values = q.values.view(torch.uint8 if one.bits == 4 else torch.int8)
    return type(q)(values, q.scales, q.offsets, q.source)


def unpack(q: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """pack's inverse: codes [N, K], scales and offsets [N, K / 32] (-8 * scale where a
    symmetric 4-bit weight stores none; scales [N, K / 16] where 8-bit codes have one per 16
    columns)."""
    groups, blocks = q.values.shape[:2]
    n, k = q.shape
    nibbles = q.bits == 4
    values = q.values.view(torch.uint8 if nibbles else torch.int8)
    grouped = torch.cat((values & 15, values >> 4), dim=2) if nibbles else values
    runs = grouped.reshape(groups, blocks, BLOCK_COLS // RUN, GROUP_ROWS, RUN)
    codes = runs.permute(0, 3, 1, 2, 4).reshape(n, k)

    def per_row(t: torch.Tensor) -> torch.Tensor:  # per_group's inverse
        per_block = t.shape[2] // GROUP_ROWS
        return t.reshape(groups, blocks * per_block, GROUP_ROWS).transpose(1, 2).reshape(n, -1)

    if nibbles and q.offsets is None:
        return codes, per_row(q.scales), per_row(q.scales) * -8
    return codes, per_row(q.scales), None if q.offsets is None else per_row(q.offsets)


def dequantize(q: QuantizedWeight) -> torch.Tensor:
    """The float32 weight [N, K]: code * scale + offset, rounded once (llama.cpp's values)."""
    return _weights(*unpack(q), q.scale_cols)


def dequantize_rows(q: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """`dequantize(q)[ids]`, reading only those rows' blocks: an embedding kept in its blocks
    looks up a step's tokens without a float copy of the table."""
    groups, rows = ids // GROUP_ROWS, ids % GROUP_ROWS
    nibbles = q.bits == 4
    # A row's run of 4 columns is one 32-bit word of the group's [G, B, runs, 16 rows].
    words = q.values.view(torch.int32)[groups, :, :, rows]  # [T, B, runs]
    codes = words.contiguous().view(torch.uint8 if nibbles else torch.int8)  # [T, B, runs * 4]
    if nibbles:  # the low nibbles are a block's first 16 columns, the high ones its last 16
        codes = torch.cat((codes & 15, codes >> 4), dim=2)

    def of_rows(t: torch.Tensor) -> torch.Tensor:  # [G, B, h * 16] -> [T, B * h]
        return t.view(t.shape[0], -1, GROUP_ROWS)[groups, :, rows]

    scales = of_rows(q.scales)
    symmetric = nibbles and q.offsets is None  # offsets -8 * scale, as `unpack` makes them
    offsets = scales * -8 if symmetric else None if q.offsets is None else of_rows(q.offsets)
    return _weights(codes.reshape(len(ids), -1), scales, offsets, q.scale_cols)


def _weights(
    codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, scale_cols: int
) -> torch.Tensor:
    """code * scale (+ offset) of rows of codes, from their scales and offsets per block: a
    product, then a sum (the kernels' `quantized_rows` rounds alike)."""
    scale = scales.float().repeat_interleave(scale_cols, dim=1)
    if offsets is None:
        return codes.float() * scale
    offset = offsets.float().repeat_interleave(BLOCK_COLS, dim=1)
    return torch.addcmul(offset, codes.float(), scale)


def quantize_int8(weight: torch.Tensor, row_absmax: torch.Tensor | None = None) -> QuantizedWeight:
    """Per-channel (per output row) symmetric int8 of a float weight [N, K]: scale = max|w| / 127,
    code = round(w / scale). `row_absmax` [N] gives max|w| of whole rows this is a slice of (a
    row-parallel shard), so every rank rounds as the unsharded weight would."""
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1) if row_absmax is None else row_absmax.float()
    scale = absmax[:, None] / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    codes = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    scales = scale.expand(-1, w.shape[1] // BLOCK_COLS).contiguous()
    return pack(codes, scales, None, "int8")


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 per row and block of 32 as llama.cpp's Q8_0 rounds it: codes int8 [M, K]
    = nearest-even(x * (127 / max|x|)), steps [M, K / 32] = max|x| / 127, and sums [M, K / 32] =
    step * (the block's sum of codes), which offsets multiply."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK_COLS, BLOCK_COLS)
    amax = blocks.abs().amax(dim=-1)
    # A tensor divided, not a number by a tensor: torch computes 127.0 / t as 127 * (1 / t),
    # which rounds differently from the kernels' (and llama.cpp's) single division.
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inverse[..., None]).to(torch.int8)
    steps = amax / 127.0
    return codes.reshape(m, k), steps, steps * codes.sum(dim=-1, dtype=torch.int32).float()


def int8_activation_linear(
    x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The integer product's reference: per block, (codes . x codes) * scale * step, plus offset *
    the block's activation sum (with a scale per 16 columns, each half's codes times its scale).
    Block products of codes are exact in float32 (|sum| < 2^24)."""
    codes, scales, offsets = unpack(q)
    xq, steps, sums = quantize_activations(x)
    out = torch.zeros(x.shape[0], q.shape[0])
    width = q.scale_cols
    for i in range(q.shape[1] // width):
        b = i * width // BLOCK_COLS
        cols = slice(i * width, (i + 1) * width)
        exact = xq[:, cols].float() @ codes[:, cols].float().T
        out += exact * (scales[:, i].float()[None, :] * steps[:, b, None])
        if offsets is not None:
            out += offsets[:, b].float()[None, :] * sums[:, b, None]
    return out if bias is None else out + bias


def quantized_linear(
    x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias): the fused kernel where it is loaded, else the reference."""
    if cpu_kernels.loaded() and x.device.type == "cpu" and x.dtype == torch.float32:
        x = x if x.stride(-1) == 1 else x.contiguous()
        return torch.ops.tandem.quantized_linear(x, *q.flat(), or_empty(bias))
    if q.int8_activations:
        return int8_activation_linear(x, q, bias)
    return F.linear(x, dequantize(q).to(x.dtype), bias)


def quantized_rows(q: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """`dequantize(q)[ids]`: the kernel where it is loaded (one call a step), else the reference."""
    if cpu_kernels.loaded() and ids.device.type == "cpu":
        return torch.ops.tandem.quantized_rows(*q.flat(), ids)
    return dequantize_rows(q, ids)


def or_empty(t: torch.Tensor | None) -> torch.Tensor:
    """An optional tensor as the kernels take it: an empty tensor for none."""
    return torch.empty(0) if t is None else t
