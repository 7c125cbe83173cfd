"""A step's host arrays to the device, by walking its dataclasses: every numpy field becomes a
tensor of the same dataclass, so no list of field names has to be kept in step with the types.

CPU: zero-copy views. CUDA: every int64 array in one copy, every float32 array in another
(`upload(packed)` makes each copy); other fields (ints, flags, host-only lists) are kept.
This runs once per step (CPU: on the host, as the step is launched; CUDA: as the stream's first
work), so it stays cheap: field names are read once per class, and a dataclass without arrays
is kept as it is.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

T = TypeVar("T")


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _is_instance(value) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _arrays(obj, out: list[np.ndarray]) -> None:
    for name in _field_names(type(obj)):
        value = getattr(obj, name)
        if isinstance(value, np.ndarray):
            out.append(value)
        elif _is_instance(value):
            _arrays(value, out)


def _rebuild(obj: T, tensors: dict[int, torch.Tensor]) -> T:
    """`obj` with its arrays swapped for their tensors: a shallow copy, or `obj` if none."""
    changes = {}
    for name in _field_names(type(obj)):
        value = getattr(obj, name)
        if isinstance(value, np.ndarray):
            changes[name] = tensors[id(value)]
        elif _is_instance(value) and (rebuilt := _rebuild(value, tensors)) is not value:
            changes[name] = rebuilt
    if not changes:
        return obj
    out = copy.copy(obj)
    for name, value in changes.items():
        object.__setattr__(out, name, value)  # frozen dataclasses too
    return out


def to_device(obj: T, upload: Callable[[np.ndarray], torch.Tensor] | None) -> T:
    """`obj` with each numpy field replaced by its tensor; `upload` None: CPU views."""
    arrays: list[np.ndarray] = []
    _arrays(obj, arrays)
    if upload is None:
        return _rebuild(obj, {id(a): torch.from_numpy(a) for a in arrays})
    tensors: dict[int, torch.Tensor] = {}
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
