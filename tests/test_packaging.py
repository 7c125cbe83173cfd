"""The installed package works outside a checkout: a built wheel carries what Tandem reads from
its own folders at run time (the default model's corpus, the kernels' source, the benchmark's
model configs), and the bench finds its configs through the package, not the source tree."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_carries_the_package_data(tmp_path):
    # From a clean copy: a build/ folder left by an earlier build would hide a missing entry.
    source = tmp_path / "source"
    skip = shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".*")
    shutil.copytree(ROOT / "tandem", source / "tandem", ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(source)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("tandem-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in (
        "tandem/models/data/corpus.txt",
        "tandem/ops/csrc/cpu_kernels.cpp",
        "tandem/bench/models/llama-3.1-8b/config.json",
        "tandem/bench/models/llama-3.2-1b/config.json",
    ):
        assert needed in names, f"{needed} is missing from {wheel.name}"
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)


def test_bench_configs_resolve_inside_the_package():
    import tandem
    from tandem.bench.workloads import BLOG_CUDA_MODEL, shipped_model

    path = shipped_model(BLOG_CUDA_MODEL)
    assert path.is_relative_to(Path(tandem.__file__).parent)
