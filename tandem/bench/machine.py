"""The machine a figure was measured on, said beside the figure: CPU, cores this process may
use, memory, versions, and how busy it was (a shared machine's load swings every engine's speed).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def core_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def machine_info() -> dict[str, Any]:
    import torch
    import transformers

    import tandem

    try:
        mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        mem_kib = 0
    return {
        "cpu": cpu_name(),
        "cpus_usable": core_count(),
        "memory_gib": round(mem_kib / 1024**2, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tandem": getattr(tandem, "__version__", "?"),
        "load_avg_at_start": os.getloadavg(),
    }
