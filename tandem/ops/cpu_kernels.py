"""Build (once, cached on disk) and load the fused CPU kernels in `csrc/` (`cpu_kernels.cpp`, the
quantized linear layers in `quantized_linear.cpp`, the LoRA deltas in `lora.cpp`, their shared
headers `vectors.h`, `tasks.h` and `experts.h`).

The build is a one-time cost of some tens of seconds on a small machine; the shared library is
kept under the Tandem cache folder, named by a hash of the source, the compiler flags, the torch
version and the CPU's instruction sets, so a later start (or another process) loads it at once
and a different machine never loads a library built for another CPU. `load()` reports how long it
took; a build that fails (no compiler) is logged and the engine keeps the portable path.

`TANDEM_CPU_ISA=avx2` builds the AVX2 code (no AVX-512) on a machine that has AVX-512, so one
machine can check both paths (tests/test_cpu_isa.py); unset, or `native`, builds for this CPU.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("tandem")

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "cpu_kernels.cpp", CSRC / "quantized_linear.cpp", CSRC / "lora.cpp")
# everything the build reads
FILES = (*SOURCES, CSRC / "vectors.h", CSRC / "tasks.h", CSRC / "experts.h")
# The vector code (GCC's 64-byte vectors) compiles to AVX-512, or to pairs of AVX2 registers.
ISA_FLAGS = {"native": ["-march=native"], "avx2": ["-march=x86-64-v3"]}


@dataclass
class KernelBuild:
    """What loading the kernels cost, for the start-up report."""

    available: bool
    seconds: float
    cached: bool  # True when a library built earlier was loaded
    path: Path | None = None
    error: str | None = None


_loaded: KernelBuild | None = None


def cache_root() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem")


def _cpuinfo_line(prefix: str) -> str | None:
    """The first line of /proc/cpuinfo that starts with `prefix`, if any."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(prefix):
                return line
    except OSError:
        pass
    return None


def cpu_flags() -> str:
    return _cpuinfo_line("flags") or platform.processor()


def cpu_name() -> str:
    """The CPU's model name ("AMD EPYC ..."), or "" where /proc/cpuinfo says none."""
    line = _cpuinfo_line("model name")
    return line.split(":", 1)[1].strip() if line else ""


def cflags() -> list[str]:
    """The compiler flags for the instruction sets `TANDEM_CPU_ISA` asks for.

    Where this CPU has no AVX-512, `-march=native` already is an AVX2 build: `avx2` then takes the
    native flags, so it shares the native build (and its cache) instead of building again.
    """
    isa = os.environ.get("TANDEM_CPU_ISA", "native").strip().lower() or "native"
    if isa not in ISA_FLAGS:
        raise ValueError(f"TANDEM_CPU_ISA={isa!r}: expected one of {', '.join(ISA_FLAGS)}")
    cpu = set(cpu_flags().split())
    if isa == "avx2" and not {"avx2", "fma"} <= cpu:
        raise ValueError("TANDEM_CPU_ISA=avx2: this CPU has no AVX2 and FMA")
    if isa == "avx2" and "avx512f" not in cpu:
        isa = "native"
    return ["-O3", *ISA_FLAGS[isa], "-fopenmp"]


def build_name() -> str:
    """The build's name: a hash of everything that changes the library, the flags included."""
    key = hashlib.sha256()
    for file in FILES:
        key.update(file.read_bytes())
    key.update(" ".join(cflags()).encode())
    key.update(torch.__version__.encode())
    key.update(cpu_flags().encode())
    return f"tandem_cpu_kernels_{key.hexdigest()[:16]}"


def loaded() -> bool:
    """Whether the kernels are loaded in this process (by `load()`; nothing is built here)."""
    return _loaded is not None and _loaded.available


def decode_like_tokens() -> int:
    """The longest chunk after a cached context that the loaded kernels attend to as decodes,
    reading the context in place (the bound depends on the build's vector width: csrc); 0
    without the kernels, whose portable ops always gather."""
    return _decode_like_tokens() if loaded() else 0


@functools.cache
def _decode_like_tokens() -> int:
    return int(torch.ops.tandem.decode_like_tokens())


def amx_tiles() -> bool:
    """Whether the loaded kernels multiply quantized weights and float activations on AMX tiles
    (Intel Sapphire Rapids and later, on a kernel that grants the tile state); False without the
    kernels."""
    return loaded() and bool(torch.ops.tandem.amx_tiles())


@contextlib.contextmanager
def using_amx_tiles(use: bool) -> Iterator[None]:
    """Lets the loaded kernels use AMX tiles (where `amx_tiles` can be true) or not, within the
    block: tests and benchmarks run the VNNI kernel on a machine that has both."""
    before = torch.ops.tandem.set_amx_tiles(use)
    try:
        yield
    finally:
        torch.ops.tandem.set_amx_tiles(before)


def release_openmp_threads() -> None:
    """Free the calling thread's OpenMP team, if the kernels are loaded (csrc explains why)."""
    if loaded():
        torch.ops.tandem.release_openmp_threads()


def compile_library(name: str, sources: list[Path], build_dir: Path) -> None:
    """Build (or reuse ninja's build in `build_dir`) and load `sources` as the shared library
    `name`, with this machine's flags (`cflags`); its ops register as the sources declare."""
    from torch.utils import cpp_extension

    cpp_extension.load(
        name=name,
        sources=[str(source) for source in sources],
        extra_cflags=cflags(),
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        is_python_module=False,
    )


def load() -> KernelBuild:
    """Load the kernels, building them first if no cached build fits this machine."""
    global _loaded
    if _loaded is not None:
        return _loaded
    cflags()  # a ValueError here is a wrong TANDEM_CPU_ISA: said, not worked around
    name = build_name()
    build_dir = cache_root() / "kernels" / name
    cached = (build_dir / f"{name}.so").is_file()
    build_dir.mkdir(parents=True, exist_ok=True)
    # Compile copies kept beside the build: the name already fixes the content, and one path for
    # every checkout of the same source keeps ninja's command line (and its cached build) stable.
    for file in FILES:
        copy = build_dir / file.name
        if not copy.is_file():
            staging = copy.with_suffix(f".{os.getpid()}.tmp")
            shutil.copyfile(file, staging)
            os.replace(staging, copy)
    start = time.perf_counter()
    try:
        compile_library(name, [build_dir / file.name for file in SOURCES], build_dir)
    except Exception as exc:  # no compiler, no ninja: the portable path still works
        _loaded = KernelBuild(False, time.perf_counter() - start, False, error=str(exc))
        logger.warning("fused CPU kernels unavailable (%s); using portable ops", exc)
        return _loaded
    seconds = time.perf_counter() - start
    _loaded = KernelBuild(True, seconds, cached, build_dir)
    logger.info(
        "fused CPU kernels %s in %.1f s (%s)",
        "loaded" if cached else "built",
        seconds,
        build_dir,
    )
    return _loaded
