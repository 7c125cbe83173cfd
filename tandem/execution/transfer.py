"""A step's host arrays to the device, by walking its dataclasses: every numpy field becomes a
tensor of the same dataclass, so no list of field names has to be kept in step with the types.

CPU: zero-copy views. CUDA: every int64 array in one copy, every float32 array in another
(`upload(packed)` makes each copy); other fields (ints, flags, host-only lists) are kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

T = TypeVar("T")


def _arrays(obj, out: list[np.ndarray]) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, np.ndarray):
            out.append(value)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            _arrays(value, out)


def _rebuild(obj: T, tensors: dict[int, torch.Tensor]) -> T:
    changes = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, np.ndarray):
            changes[f.name] = tensors[id(value)]
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            changes[f.name] = _rebuild(value, tensors)
    return dataclasses.replace(obj, **changes)


def to_device(obj: T, upload: Callable[[np.ndarray], torch.Tensor] | None) -> T:
    """`obj` with each numpy field replaced by its tensor; `upload` None: CPU views."""
    arrays: list[np.ndarray] = []
    _arrays(obj, arrays)
    tensors: dict[int, torch.Tensor] = {}
    if upload is None:
        for a in arrays:
            tensors[id(a)] = torch.from_numpy(a)
        return _rebuild(obj, tensors)
    for dtype in (np.int64, np.float32):
        group = [a for a in arrays if a.dtype == dtype]
        if not group:
            continue
        packed = upload(np.concatenate([a.reshape(-1) for a in group]))
        for a, t in zip(group, packed.split([a.size for a in group]), strict=True):
            tensors[id(a)] = t.view(a.shape)
    missing = [a.dtype for a in arrays if id(a) not in tensors]
    if missing:
        raise TypeError(f"step arrays must be int64 or float32, got {missing[0]}")
    return _rebuild(obj, tensors)
