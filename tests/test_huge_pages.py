"""Large CPU buffers live in 2 MiB pages where the kernel offers transparent huge pages.

Read back from /proc/self/smaps: the kernel's own account of which pages back an address range.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from tandem.execution.kv_cache import allocate_kv_cache
from tandem.ops import huge_pages

THP_OFFERED = huge_pages.thp_mode() in ("always", "madvise")


def test_thp_mode_reads_the_kernel_setting() -> None:
    assert huge_pages.thp_mode() in ("always", "madvise", "never", None)


def test_the_kv_cache_is_in_huge_pages() -> None:
    # 64 MiB a layer: above glibc's largest mmap threshold (32 MiB), so each is a new mapping
    # (a smaller buffer may reuse heap memory already faulted in small pages, as a real
    # cache of gigabytes never does).
    caches = allocate_kv_cache(2, 8192, 16, 2, 32, torch.float32, torch.device("cpu"))
    for cache in caches:
        assert torch.count_nonzero(cache) == 0  # zeroed as before
        size_kib = cache.untyped_storage().nbytes() // 1024  # 64 MiB
        if THP_OFFERED:
            # All but the partial 2 MiB pages at either end.
            assert huge_pages.huge_kib(cache) >= size_kib - 4096
        else:
            assert not huge_pages.advise(cache)


def test_importing_tandem_puts_torchs_large_buffers_in_huge_pages() -> None:
    """The KV cache is advised even after torch allocated with the setting off; other big
    tensors (weights and their packed copies) get huge pages through torch's allocator."""
    code = textwrap.dedent(
        """
        import os, sys
        os.environ.pop("THP_MEM_ALLOC_ENABLE", None)
        if sys.argv[1] == "off":
            os.environ["THP_MEM_ALLOC_ENABLE"] = "0"
        import tandem, torch
        from tandem.ops.huge_pages import huge_kib
        from tandem.execution.kv_cache import allocate_kv_cache
        weight = torch.ones(4 << 20)  # 16 MiB through torch's allocator
        cache = allocate_kv_cache(1, 1024, 16, 2, 32, torch.float32, torch.device("cpu"))[0]
        for t in (weight, cache):
            print(huge_kib(t))
        """
    )
    for setting in ("default", "off"):
        # With the kernel's "always" every large anonymous mapping gets huge pages anyway.
        weight_expected = setting == "default" or huge_pages.thp_mode() == "always"
        out = subprocess.run(
            [sys.executable, "-c", code, setting], capture_output=True, text=True, check=True
        ).stdout.split()
        weight_kib, cache_kib = int(out[0]), int(out[1])
        if THP_OFFERED:
            assert (weight_kib >= 16384 - 4096) is weight_expected, (setting, weight_kib)
            assert cache_kib >= 8192 - 4096, (setting, cache_kib)
        else:
            assert weight_kib == cache_kib == 0
