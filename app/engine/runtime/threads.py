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

PROBE_EVERY_S = 10.0  # how often the other count is tried after a probe that switched
MAX_PROBE_EVERY_S = 60.0  # probes that keep losing back off to this interval
FIRST_PROBE_S = 2.0  # the first probe comes soon: a neighbour may be busy from the start
PROBE_STEPS = 5  # steps per side of a comparison: the probe's first one, paying the switch, is not counted
MIN_GAIN = 0.9  # switch when the other count's steps take at most this fraction of the current's
SLOWDOWN = 1.5  # steps this much slower than the best seen at this batch size: probe now, not later
MIN_PROBE_GAP_S = 1.0  # a slowdown probe waits at least this long after the last probe
ABORT = 2.0  # a probe step (past the first) this much slower than the current median ends the probe


class ThreadTuner:
    """`observe(key, seconds)` after each decode step of a batch of `key` sequences; it sets
    torch's thread count (which the C kernels use too) for the steps that follow."""

    def __init__(self, max_threads: int | None = None, clock: Callable[[], float] = time.monotonic,
                 set_threads: Callable[[int], None] = torch.set_num_threads) -> None:
        self.max_threads = max_threads or torch.get_num_threads()
        self.current = self.max_threads
        self._clock, self._set = clock, set_threads
        self._interval = PROBE_EVERY_S
        self._last_probe = clock()
        self._next_probe = self._last_probe + FIRST_PROBE_S
        self._recent: dict[int, list[float]] = {}  # batch size -> the current count's last step times
        self._best: dict[int, float] = {}  # batch size -> the lowest median of those seen at this count
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
        if len(recent) < PROBE_STEPS:
            return
        now, typical = self._clock(), _median(recent)
        best = self._best[key] = min(self._best.get(key, typical), typical)
        # Only all cores slowing down calls for a probe now: a neighbour arrived. One thread slowing
        # down is no sign that more would help; the periodic probe finds the neighbour gone.
        slowed = (self.current == self.max_threads and typical > SLOWDOWN * best
                  and now - self._last_probe >= MIN_PROBE_GAP_S)
        if now >= self._next_probe or slowed:
            other = 1 if self.current > 1 else self.max_threads
            self._probe = (other, key, [])
            self._apply(other)

    def _observe_probe(self, key: int, seconds: float) -> None:
        other, probe_key, times = self._probe
        if key != probe_key:  # the batch changed under the probe: not comparable, try later
            self._end_probe(keep=False)
            return
        times.append(seconds)
        current = _median(self._recent[key])
        if len(times) > 1 and seconds > ABORT * current:  # clearly worse: stop paying for it
            self._end_probe(keep=False)
            return
        if len(times) < PROBE_STEPS:
            return
        # Medians on both sides (a best-of against a median favoured whichever count was probed,
        # and a server's own per-token work made one thread look faster than it was).
        self._end_probe(keep=_median(times[1:]) <= MIN_GAIN * current)

    def _end_probe(self, keep: bool) -> None:
        other = self._probe[0]
        self._probe = None
        self._last_probe = self._clock()
        # A lost probe doubles the wait for the next one (an idle machine stops paying for them).
        self._interval = PROBE_EVERY_S if keep else min(2 * self._interval, MAX_PROBE_EVERY_S)
        self._next_probe = self._last_probe + self._interval
        if keep:
            self.current = other
            self._recent.clear()
            self._best.clear()
            self.switches += 1
        else:
            # The steps before the probe say nothing about the machine now; a slowdown that the
            # other count did not beat becomes the new baseline instead of a probe a second.
            self._recent.clear()
            self._best.clear()
            self._apply(self.current)

    def _apply(self, threads: int) -> None:
        if self._applied != threads:
            self._set(threads)
            self._applied = threads


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2
