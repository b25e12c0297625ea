"""Each thread of the step thread's CPU team on a CPU of its own, while the team spans every CPU.

Every parallel region of a step ends at a barrier, so the team moves at the pace of its slowest
thread. Another thread of the app waking (the HTTP server's event loop at every token, the UI's
frames) takes a CPU from the team, and the scheduler may also move a team thread onto its
partner's CPU. Pinned, a preempted team thread resumes where it was; measured (docs/benchmarks.md),
streaming got faster and the engine alone did not change.

Only while the team has one thread per CPU the process may use: then pinning decides nothing but
which thread is where. With fewer threads (the tuner's answer to busy neighbours, or a machine
with more CPUs than threads) the team is left to the scheduler, which can move it away from a
neighbour. Only the team's threads are pinned, and only on a thread the engine has to itself
(`AsyncEngine`'s step thread): threads and processes started from a pinned thread inherit its CPU."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

log = logging.getLogger(__name__)


class TeamAffinity:
    """`apply(threads)` on the step thread after each change of its thread count."""

    def __init__(self, team_tids: Callable[[int], list[int] | None],
                 set_affinity: Callable[[int, set[int]], None] | None = None,
                 allowed: set[int] | None = None) -> None:
        linux = hasattr(os, "sched_setaffinity")  # elsewhere there is nothing to place with
        self._team_tids = team_tids
        self._set = set_affinity or (os.sched_setaffinity if linux else None)
        self.allowed = sorted(allowed if allowed is not None else os.sched_getaffinity(0) if linux else ())
        self.pinned: list[int] = []  # thread ids, each on allowed[i]
        self.enabled = self._set is not None and len(self.allowed) > 1

    def apply(self, threads: int) -> None:
        if not self.enabled:
            return
        try:
            if threads == len(self.allowed):
                self._pin(threads)
            else:
                self._unpin()
        except OSError as e:  # a cpuset changed under us, a thread gone: leave it to the scheduler
            log.warning("placing the CPU threads failed (%s); the scheduler places them instead", e)
            self.enabled = False
            self._unpin(quiet=True)

    def _pin(self, threads: int) -> None:
        tids = self._team_tids(threads)
        if not tids or len(tids) != threads:
            self._unpin()
            return
        self.pinned = tids  # before placing: a failure part-way frees those already placed
        for tid, cpu in zip(tids, self.allowed):
            self._set(tid, {cpu})

    def _unpin(self, quiet: bool = False) -> None:
        pinned, self.pinned = self.pinned, []
        for tid in pinned:
            try:
                self._set(tid, set(self.allowed))
            except OSError:
                if not quiet:
                    raise
