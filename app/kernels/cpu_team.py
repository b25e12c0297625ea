"""The kernel thread ids of the calling thread's OpenMP team (`cpu_team.c`): the threads every C
kernel and torch's parallel ops run on, for the runtime to place on CPUs."""

from __future__ import annotations

import ctypes
import functools

from app.kernels import cpu_build


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return cpu_build.load({"team_tids": [ctypes.c_int, ctypes.c_void_p]}, {"team_tids": ctypes.c_int})


def team_tids(nthreads: int) -> list[int] | None:
    """The ids of a team of `nthreads` started by the calling thread, the caller's first; None
    when the C kernels are off here. Fewer than asked if the OpenMP runtime gave fewer."""
    lib = _library()
    if lib is None:
        return None
    tids = (ctypes.c_int32 * nthreads)()
    size = lib.team_tids(nthreads, tids)
    return [t for t in tids[:size] if t >= 0]
