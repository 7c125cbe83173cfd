"""How close decode steps came to the memory roofline: the bytes a step must read against the
device's bandwidth.

A decode step reads every weight once (`LlamaModel.weight_bytes`, as the weights are held:
quantized, packed or float) and each request's K and V up to its position
(`StepRecord.kv_bytes`); at the device's bandwidth that takes bytes / bandwidth, so bytes / the
step's device time is the bandwidth the step reached. It is set beside two ceilings: what this
device streams when it only reads (a sum over a buffer far larger than any cache, timed here),
and the vendor's nominal figure where the device is known.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from tandem.metrics import StepRecord

# Vendors' datasheet memory bandwidth (bytes/s), by a part of the device's name; first match wins.
NOMINAL_BANDWIDTH = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12))
STREAM_BYTES = {"cpu": 256 * 2**20, "cuda": 2**30}  # beyond the caches (CPU L3, GPU L2)


@dataclass
class Roofline:
    """The decode steps of a run: what they read and how long the device took."""

    steps: int
    weight_bytes: int  # per step
    kv_bytes: float  # per step, mean
    device_s: float  # per step, mean

    @property
    def bytes_per_step(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def reached_bytes_per_s(self) -> float:
        return self.bytes_per_step / self.device_s

    def fraction_of(self, ceiling: float | None) -> float | None:
        return None if not ceiling else self.reached_bytes_per_s / ceiling


def decode_roofline(records: list[StepRecord], weight_bytes: int | None) -> Roofline | None:
    """The roofline of a run's decode steps: steps that ran one token per request (no prefill
    chunk, no drafts to verify). None without them, or without a weight figure (experts)."""
    decodes = [
        r for r in records
        if not r.skipped and r.num_tokens == r.num_seqs and r.device[1] > r.device[0]
    ]  # fmt: skip
    if not decodes or weight_bytes is None:
        return None
    return Roofline(
        steps=len(decodes),
        weight_bytes=weight_bytes,
        kv_bytes=statistics.fmean(r.kv_bytes for r in decodes),
        device_s=statistics.fmean(r.device[1] - r.device[0] for r in decodes),
    )


def ceilings(device: torch.device, threads: int | None = None) -> tuple[float, float | None]:
    """(streaming, nominal) bandwidth of `device` in bytes/s; a CPU streams on `threads`."""
    return streaming_bandwidth(device, threads), nominal_bandwidth(device)


def nominal_bandwidth(device: torch.device) -> float | None:
    """The datasheet's memory bandwidth of a known GPU, in bytes/s."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for part, bw in NOMINAL_BANDWIDTH if part in name), None)


def streaming_bandwidth(
    device: torch.device, threads: int | None = None, repeats: int = 7
) -> float:
    """What `device` reads per second when it only reads: the median of timed sums over a buffer
    larger than its caches (on a CPU, on `threads` threads; None: torch's current count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        return _timed_sums(device, repeats)
    finally:
        torch.set_num_threads(before)


def _timed_sums(device: torch.device, repeats: int) -> float:
    x = torch.ones(STREAM_BYTES[device.type] // 4, device=device)
    x.sum()  # touch every page first
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            x.sum()
            end.record()
            end.synchronize()  # deliberate: timing a kernel
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            x.sum()
            times.append(time.perf_counter() - begin)
    return x.numel() * 4 / statistics.median(times)
