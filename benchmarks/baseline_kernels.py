"""Another checkout's CPU kernels beside this one's, for A/B timings in one process.

`load_baseline(DIR)` builds the kernels of the checkout at DIR (say `git worktree add /tmp/before
HEAD~1`) with this machine's flags, their ops registered under `torch.ops.tandem_baseline` (the
library name rewritten in a copy of the sources), and returns that namespace. Why: on a shared
machine, runs minutes apart differ by more than most kernel changes do, so a change is timed
against the code before it in the same rounds.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch

from tandem.ops import cpu_kernels

NAMESPACE = "tandem_baseline"


def load_baseline(checkout: str):
    """Build and load DIR's kernels; returns `torch.ops.tandem_baseline`."""
    source = Path(checkout) / "tandem" / "ops" / "csrc"
    if not source.is_dir():
        raise SystemExit(f"--baseline {checkout}: no tandem/ops/csrc there")
    build = Path(tempfile.mkdtemp(prefix="tandem-baseline-"))
    for file in source.iterdir():
        if file.is_file():
            shutil.copyfile(file, build / file.name)
    library = build / "cpu_kernels.cpp"
    text = library.read_text()
    for macro in ("TORCH_LIBRARY(", "TORCH_LIBRARY_IMPL("):
        text = text.replace(f"{macro}tandem,", f"{macro}{NAMESPACE},")
    library.write_text(text)
    start = time.perf_counter()
    cpu_kernels.compile_library(f"{NAMESPACE}_kernels", sorted(build.glob("*.cpp")), build)
    print(f"baseline kernels from {source} built in {time.perf_counter() - start:.0f} s")
    return getattr(torch.ops, NAMESPACE)
