"""GGUF's quantized blocks as codes, scales and offsets (`ops/quantized.py`).

Each format that the CPU kernels run is, per block of 32 weights (Q6_K: of 16), code * scale +
offset:
  Q8_0  34 bytes: scale d (f16), 32 int8 codes                      -> d * q
  Q5_0  22 bytes: d (f16), 4 bytes of fifth bits, 16 bytes of nibbles -> d * (q - 16)
  Q4_0  18 bytes: d (f16), 16 bytes of nibbles (column j low, j + 16 high) -> d * q - 8d
  Q4_1  20 bytes: d, m (f16), nibbles as Q4_0                       -> d * q + m
  Q4_K  144 bytes per 256 (8 blocks): d, dmin (f16), 12 bytes of 6-bit block scales and mins,
        128 bytes of nibbles (a 64-column pair of blocks shares 32 bytes: the first block in the
        low nibbles)                                                -> (d * sc) * q - dmin * m
  Q6_K  210 bytes per 256 (16 blocks of 16): 128 bytes of low nibbles, 64 of high bit pairs, 16
        int8 block scales sc, d (f16)                               -> (d * sc) * (q - 32)
These are llama.cpp's own dequantization formulas (ggml-quants.c): the float32 weights equal the
ones `gguf.quants.dequantize` gives. Q4_K's products of two scales are kept in float32, and so
are Q6_K's, exact there (11 significant bits times 8); the others' scales and offsets are exact
in float16 (8d scales d by a power of two).

The kernels run each format in a layout (`LAYOUTS`): Q5_0's codes q - 16 are int8 codes with
Q8_0's scale, so it runs as Q8_0, exactly. A layer fused from parts in different formats (q, k
and v; gate and up) runs in the widest of their layouts, which holds each part exactly
(`common_layout`): Q8_0's scale is Q6_K's for both halves of its block, Q4_0's offset is -8d, and
float16 is float32. 4-bit and 8-bit parts are not combined: the 8-bit layouts hold no offsets,
and Q4_0's codes would double in bytes (such a layer stays float32).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

NATIVE_TYPES = ("Q8_0", "Q5_0", "Q6_K", "Q4_0", "Q4_1", "Q4_K")
# The layout each type's blocks run in.
LAYOUTS = {"Q8_0": "Q8_0", "Q5_0": "Q8_0", "Q6_K": "Q6_K", "Q4_0": "Q4_0", "Q4_1": "Q4_1",
           "Q4_K": "Q4_K"}  # fmt: skip
# Each layout's code bits and rank among the layouts of as many bits: a higher rank holds every
# lower one exactly.
_WIDTH = {"Q8_0": (8, 0), "Q6_K": (8, 1), "Q4_0": (4, 0), "Q4_1": (4, 1), "Q4_K": (4, 2)}


def common_layout(layouts: Iterable[str | None]) -> str | None:
    """The layout that holds every one of `layouts` exactly (the widest), None if there is none
    (a part not run natively, or 4-bit and 8-bit parts)."""
    found = set(layouts)
    if not found or None in found or len({_WIDTH[name][0] for name in found}) > 1:
        return None
    return max(found, key=lambda name: _WIDTH[name][1])


def split_blocks(
    data: np.ndarray, kind: str, columns: int, layout: str | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Rows of raw blocks (uint8 [rows, bytes]) -> codes [rows, columns] (int8, or 0..15 as
    uint8), scales and offsets [rows, columns / 32] (None for 8-bit codes; Q6_K's scales [rows,
    columns / 16]), in `layout` (its own by default; a wider one, `common_layout`)."""
    own = LAYOUTS.get(kind)
    if own is None:
        raise ValueError(f"{kind} is not one of the natively run types {', '.join(NATIVE_TYPES)}")
    codes, scales, offsets = _own_blocks(data, kind, columns)
    layout = layout or own
    if common_layout((own, layout)) != layout:
        raise ValueError(f"{kind} does not run in {layout}'s layout")
    if layout == "Q6_K" and own == "Q8_0":  # each block's scale for both its halves
        scales = np.repeat(scales.astype(np.float32), 2, axis=1)
    if layout == "Q4_K":  # Q4_0's offsets (-8 * scale) and Q4_1's, in float32
        scales, offsets = scales.astype(np.float32), offsets.astype(np.float32)
    return codes, scales, offsets


def _own_blocks(data: np.ndarray, kind: str, columns: int):
    rows = data.shape[0]
    if kind == "Q8_0":
        blocks = data.reshape(rows, columns // 32, 34)
        scales = blocks[..., :2].copy().view(np.float16)[..., 0]
        return blocks[..., 2:].view(np.int8).reshape(rows, columns), scales, None
    if kind in ("Q4_0", "Q4_1"):
        size = 18 if kind == "Q4_0" else 20
        blocks = data.reshape(rows, columns // 32, size)
        head = blocks[..., : size - 16].copy().view(np.float16)
        scales = head[..., 0]
        offsets = scales * np.float16(-8) if kind == "Q4_0" else head[..., 1]
        return _nibbles(blocks[..., size - 16 :]).reshape(rows, columns), scales, offsets
    if kind == "Q5_0":
        return _q5_0(data, rows, columns)
    if kind == "Q4_K":
        return _q4_k(data, rows, columns)
    return _q6_k(data, rows, columns)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: the low nibbles, then the high ones."""
    return np.concatenate((packed & 15, packed >> 4), axis=-1)


def _q5_0(data: np.ndarray, rows: int, columns: int):
    blocks = data.reshape(rows, columns // 32, 22)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0]
    # Column j's fifth bit is bit j of the little-endian 32-bit word after the scale.
    high = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")
    codes = (_nibbles(blocks[..., 6:]) | (high << 4)).astype(np.int8) - np.int8(16)
    return codes.reshape(rows, columns), scales, None


def _q4_k(data: np.ndarray, rows: int, columns: int):
    supers = data.reshape(rows, columns // 256, 144)
    head = supers[..., :4].copy().view(np.float16)
    d, dmin = head[..., 0].astype(np.float32), head[..., 1].astype(np.float32)
    packed = supers[..., 4:16]
    # Blocks 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); blocks 4-7: bytes 8-11's
    # nibbles below the top 2 bits of bytes 0-3 and 4-7.
    low = packed[..., 8:12]
    sc = np.concatenate((packed[..., 0:4] & 63, (low & 15) | ((packed[..., 0:4] >> 6) << 4)), -1)
    mn = np.concatenate((packed[..., 4:8] & 63, (low >> 4) | ((packed[..., 4:8] >> 6) << 4)), -1)
    scales = (d[..., None] * sc.astype(np.float32)).reshape(rows, columns // 32)
    offsets = -(dmin[..., None] * mn.astype(np.float32)).reshape(rows, columns // 32)
    qs = supers[..., 16:].reshape(rows, columns // 256, 4, 32)
    codes = np.stack((qs & 15, qs >> 4), axis=3)  # [rows, supers, pair, low/high, 32]
    return codes.reshape(rows, columns), scales, offsets


def _q6_k(data: np.ndarray, rows: int, columns: int):
    supers = data.reshape(rows, columns // 256, 210)
    d = supers[..., 208:].copy().view(np.float16).astype(np.float32)  # [rows, supers, 1]
    sc = supers[..., 192:208].view(np.int8).astype(np.float32)
    scales = (d * sc).reshape(rows, columns // 16)
    # Each 128 columns: 64 bytes of nibbles (columns 0-63 low, 64-127 high) and 32 bytes of bit
    # pairs (columns c, c + 32, c + 64, c + 96 in bits 0-1, 2-3, 4-5, 6-7 of byte c).
    low = (supers[..., :128].reshape(rows, -1, 2, 1, 64) >> _shifts(0, 4)) & 15
    pairs = (supers[..., 128:192].reshape(rows, -1, 2, 1, 32) >> _shifts(0, 2, 4, 6)) & 3
    codes = (low.reshape(pairs.shape) | (pairs << 4)).astype(np.int8) - np.int8(32)
    return codes.reshape(rows, columns), scales, None


def _shifts(*bits: int) -> np.ndarray:
    """Shifts along a new axis before the last: [len(bits), 1]."""
    return np.array(bits, np.uint8)[:, None]
