"""Back the large CPU buffers (weights, the KV cache) with 2 MiB transparent huge pages.

Why: a decode step reads every weight and every running request's K/V. With 4 KiB pages each
4 KiB is a TLB miss, and inside a virtual machine each miss is a two-level page walk
(docs/experiments.md has the measured gain).

Two ways in. PyTorch's CPU allocator advises huge pages for every allocation of 2 MiB or more
when ``THP_MEM_ALLOC_ENABLE=1`` is set before its first allocation: ``import tandem`` sets it
unless the user has set it (``0`` turns it off). That covers weights and their packed copies. The
KV cache, the largest buffer, is also advised here directly, so that it gets huge pages even in a
process where torch allocated before tandem was imported.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), None if unknown."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else None


@functools.cache
def _madvise():
    """libc's madvise, looked up once (the process's own symbols include libc's)."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The address range of `tensor`'s whole storage."""
    start = tensor.untyped_storage().data_ptr()
    return start, start + tensor.untyped_storage().nbytes()


def advise(tensor: torch.Tensor) -> bool:
    """Ask the kernel to back `tensor`'s whole 2 MiB pages with huge pages; True if it agreed.

    Call it before the memory is first written: pages already faulted in stay small until the
    kernel's background collapse gets to them.
    """
    if sys.platform != "linux" or tensor.device.type != "cpu" or thp_mode() in (None, "never"):
        return False
    start, end = _span(tensor)
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if last <= first:
        return False
    return _madvise()(first, last - first, MADV_HUGEPAGE) == 0


def huge_kib(tensor: torch.Tensor) -> int:
    """KiB of `tensor`'s memory that the kernel backs with huge pages (from /proc/self/smaps)."""
    start, end = _span(tensor)
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                head = line.split(maxsplit=1)[0]
                if not head.endswith(":"):  # a mapping's first line: "lo-hi perms ..."
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo < end and hi > start
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1])
    except OSError:
        return 0
    return total


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, in huge pages where it is a CPU buffer big enough to have some."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    tensor = torch.empty(shape, dtype=dtype)
    advise(tensor)
    return tensor.zero_()
