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
