"""Zeroed CPU memory on transparent huge pages, for what a decode step reads whole each step: the
packed weights (`cpu_qgemm.consolidate`) and the KV pool (`engine/runtime/kv_pool.py`)."""

from __future__ import annotations

import mmap

HUGE_PAGE = 2 << 20


def huge_page_region(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping of `nbytes` (zero pages, costing RSS only once written), advised
    for transparent huge pages where Linux has them; nothing changes where they are off (`never`).
    Private: a shared anonymous mapping is shmem, whose huge pages are a separate switch."""
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    return region


def read_bandwidth(threads: int, nbytes: int = 1 << 28, repeats: int = 5) -> float | None:
    """Bytes/s of the C kernels' read loop (`read_pass`, cpu_peak.c) over `nbytes` on huge pages,
    `threads` threads, best of `repeats`: the rate a decode step's weights can at best be read at.
    None where the C kernels are off here."""
    import ctypes
    import time

    import torch

    from app.kernels import cpu_build

    lib = cpu_build.load({"read_pass": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]},
                         restypes={"read_pass": ctypes.c_int64})
    if lib is None:
        return None
    region = huge_page_region(nbytes + HUGE_PAGE)
    buf = torch.frombuffer(region, dtype=torch.uint8)
    start = -buf.data_ptr() % HUGE_PAGE
    buf[start : start + nbytes].fill_(1)  # written once: the reads then meet real pages, not the zero page
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        lib.read_pass(buf.data_ptr() + start, nbytes, threads)
        best = min(best, time.perf_counter() - t)
    del buf  # before the mapping it views
    return nbytes / best
