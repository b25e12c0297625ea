"""The CPU thread count, chosen by measurement while decoding.

Every parallel region of a step ends at a barrier: while another process holds one of the cores,
the step's threads wait for their descheduled partner at each of them, and a 2-thread step can
take 5-20x longer than a 1-thread one. On an idle machine 2 threads are ~2x faster. No waiting
policy serves both (docs/benchmarks.md), so the engine measures: now and then it runs a few
decode steps with the other thread count, and keeps whichever made steps of that batch size
faster. Results do not depend on the count (every kernel on the CPU path computes a row alone)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

PROBE_EVERY_S = 10.0  # how often the other count is tried (a probe costs a few slower steps at worst)
PROBE_STEPS = 5  # steps per side of a comparison: the probe's first one, paying the switch, is not counted
MIN_GAIN = 0.9  # switch when the other count's steps take at most this fraction of the current's


class ThreadTuner:
    """`observe(key, seconds)` after each decode step of a batch of `key` sequences; it sets
    torch's thread count (which the C kernels use too) for the steps that follow."""

    def __init__(self, max_threads: int | None = None, clock: Callable[[], float] = time.monotonic,
                 set_threads: Callable[[int], None] = torch.set_num_threads) -> None:
        self.max_threads = max_threads or torch.get_num_threads()
        self.current = self.max_threads
        self._clock, self._set = clock, set_threads
        self._next_probe = clock() + PROBE_EVERY_S
        self._recent: dict[int, list[float]] = {}  # batch size -> the current count's last step times
        self._probe: tuple[int, int, list[float]] | None = None  # (count, batch size, step times)
        self.switches = 0
        self._applied = self.max_threads

    @property
    def enabled(self) -> bool:
        return self.max_threads > 1

    def observe(self, key: int, seconds: float) -> None:
        if not self.enabled:
            return
        if self._probe is not None:
            self._observe_probe(key, seconds)
            return
        recent = self._recent.setdefault(key, [])
        recent.append(seconds)
        del recent[:-PROBE_STEPS]
        if self._clock() >= self._next_probe and len(recent) == PROBE_STEPS:
            other = 1 if self.current > 1 else self.max_threads
            self._probe = (other, key, [])
            self._apply(other)

    def _observe_probe(self, key: int, seconds: float) -> None:
        other, probe_key, times = self._probe
        if key != probe_key:  # the batch changed under the probe: not comparable, try later
            self._end_probe(keep=False)
            return
        times.append(seconds)
        if len(times) < PROBE_STEPS:
            return
        # Medians on both sides (a best-of against a median favoured whichever count was probed,
        # and a server's own per-token work made one thread look faster than it was).
        self._end_probe(keep=_median(times[1:]) <= MIN_GAIN * _median(self._recent[key]))

    def _end_probe(self, keep: bool) -> None:
        other = self._probe[0]
        self._probe = None
        self._next_probe = self._clock() + PROBE_EVERY_S
        if keep:
            self.current = other
            self._recent.clear()
            self.switches += 1
        else:
            self._apply(self.current)

    def _apply(self, threads: int) -> None:
        if self._applied != threads:
            self._set(threads)
            self._applied = threads


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2
