"""Anonymous memory on transparent huge pages, for the large CPU buffers a step streams through
(the packed weights, the KV pool)."""

from __future__ import annotations

import mmap

HUGE_PAGE = 2 << 20


def anonymous_mapping(nbytes: int) -> mmap.mmap:
    """`nbytes` of zeroed private memory, advised for transparent huge pages where Linux has them.

    On 4 KiB pages a stream over scattered memory takes a TLB miss every page and the hardware
    prefetcher stops at each page boundary (docs/tuning.md). The pages are mapped on first touch, so
    a large mapping costs no memory until used. Private: a shared anonymous mapping is shmem, whose
    huge pages are a separate switch (off by default)."""
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    return region
