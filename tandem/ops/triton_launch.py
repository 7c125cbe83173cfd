"""How a CUDA step's Triton kernels are launched: with programmatic dependent launch (PDL).

Why: replayed from a CUDA graph, a decode step still leaves the device idle about a microsecond
at each of its ~360 kernel boundaries (docs/performance.md, H200). Launched with PDL (Hopper and
later), a kernel's programs are started while the kernel before it is still running; each one
first waits at `griddepcontrol.wait` until that kernel has finished and its writes are visible,
so the launch overlaps the previous kernel's tail instead of following it. Every kernel launched
so waits before it reads or writes memory: the order of memory effects is the stream's. Each
kernel lets the next one launch once all of its programs have stored their results.
`TANDEM_PDL=0` launches every kernel in stream order, to measure what PDL changes.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_PLAIN = {"PDL": False}  # launched in stream order


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """A PDL-launched kernel's first statement: the previous kernel's writes become visible."""
    if PDL:
        gdc_wait()


@triton.jit
def let_next_kernel_launch(PDL: tl.constexpr):
    """A kernel's last statement: the next one may launch once every program got here. (At the
    start instead, the next kernel's programs would wait on SMs the running kernel needs.)"""
    if PDL:
        gdc_launch_dependents()


def pdl_options(device: torch.device) -> dict:
    """A kernel's launch options on `device`: its `PDL` constexpr, and Triton's `launch_pdl`
    where the GPU has PDL (compute capability 9.0 or later)."""
    if device.type != "cuda" or INTERPRETED:
        return _PLAIN
    return _cuda_options(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=8)
def _cuda_options(index: int) -> dict:
    if os.environ.get("TANDEM_PDL", "1") == "0" or torch.version.hip is not None:
        return _PLAIN  # switched off, or a ROCm GPU (its capability numbers are not NVIDIA's)
    if torch.cuda.get_device_capability(index)[0] < 9:
        return _PLAIN
    return {"PDL": True, "launch_pdl": True}
