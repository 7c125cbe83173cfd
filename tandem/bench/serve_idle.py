"""The server's device idle fraction during a load, read from Tandem's /metrics gauge: what the
host's share of each step costs the device once every stream is busy."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from tandem.bench.serve_client import RequestResult, metrics_text, side_session

IDLE_GAUGE = "tandem_device_idle_fraction"
GAUGE_WINDOW_S = 1.0  # the gauge summarises the latest ~1 s window with work

Reading = tuple[float, list[float]]  # (perf_counter time, the gauge's samples)


def idle_samples(text: str) -> list[float]:
    """Every sample of the idle gauge, whatever its labels (one per engine)."""
    values = []
    for line in text.splitlines():
        if line.startswith(IDLE_GAUGE + "{"):
            values.append(float(line.rpartition("}")[2].split()[0]))
        elif line.startswith(IDLE_GAUGE + " "):
            values.append(float(line[len(IDLE_GAUGE) :].split()[0]))
    return values


async def watch_idle_gauge(url: str, readings: list[Reading]) -> None:
    """Reads /metrics every second into `readings` until cancelled."""
    async with side_session() as client:
        while True:
            text = await metrics_text(client, url)
            if text is not None:
                readings.append((time.perf_counter(), idle_samples(text)))
            await asyncio.sleep(1.0)


def steady_idle(
    results: Sequence[RequestResult], readings: Sequence[Reading], streams: int
) -> list[float]:
    """The gauge samples read while every stream was busy decoding: from when the first wave's
    last first token arrived (plus the gauge's window, so no reading covers the ramp-up) until
    the queue emptied (the last request started)."""
    first_wave = sorted(results, key=lambda r: r.start)[:streams]
    if not results or any(r.ttft is None for r in first_wave):
        return []
    steady_from = max(r.start + r.ttft for r in first_wave) + GAUGE_WINDOW_S
    steady_until = max(r.start for r in results)
    return [v for t, values in readings if steady_from <= t <= steady_until for v in values]
