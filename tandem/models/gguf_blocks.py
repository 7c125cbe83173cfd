"""GGUF's quantized blocks as codes, scales and offsets per 32 columns (`ops/quantized.py`).

Each format that the CPU kernels run is, per block of 32 weights, code * scale + offset:
  Q8_0  34 bytes: scale d (f16), 32 int8 codes                      -> d * q
  Q4_0  18 bytes: d (f16), 16 bytes of nibbles (column j low, j + 16 high) -> d * q - 8d
  Q4_1  20 bytes: d, m (f16), nibbles as Q4_0                       -> d * q + m
  Q4_K  144 bytes per 256 (8 blocks): d, dmin (f16), 12 bytes of 6-bit block scales and mins,
        128 bytes of nibbles (a 64-column pair of blocks shares 32 bytes: the first block in the
        low nibbles)                                                -> (d * sc) * q - dmin * m
These are llama.cpp's own dequantization formulas (ggml-quants.c): the float32 weights equal the
ones `gguf.quants.dequantize` gives. Q4_K's products of two scales are kept in float32; the
others' scales and offsets are exact in float16 (8d scales d by a power of two).
"""

from __future__ import annotations

import numpy as np

NATIVE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")


def split_blocks(
    data: np.ndarray, kind: str, columns: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Rows of raw blocks (uint8 [rows, bytes]) -> codes [rows, columns] (int8, or 0..15 as
    uint8), scales and offsets [rows, columns / 32] (None for Q8_0)."""
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
    if kind == "Q4_K":
        return _q4_k(data, rows, columns)
    raise ValueError(f"{kind} is not one of the natively run types {', '.join(NATIVE_TYPES)}")


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: the low nibbles, then the high ones."""
    return np.concatenate((packed & 15, packed >> 4), axis=-1)


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
