"""The CPU thread count, chosen by measurement while decoding.

Every parallel region of a step ends at a barrier: while another process holds one of the cores,
the step's threads wait for their descheduled partner at each of them, and a 2-thread step can
take 5-20x longer than a 1-thread one. On an idle machine 2 threads are ~2x faster. No waiting
policy serves both (docs/benchmarks.md), so the engine measures: it runs a few decode steps with
the other thread count soon after start, then now and then (backing off while probes lose), and at
once when all-core steps slow down for a while (the app's UI thread slows a few steps at a time,
so the while grows after each such probe that lost); it keeps whichever count made steps of that
batch size faster (mean step times; a periodic probe against the mean of the last BASELINE_S, since
all-core steps under busy neighbours are mostly fast with a slow one every half second or so), and
drops back to one thread if all-core steps turn slow again soon after a switch up (two far slower in
a row, or a second of them no faster on average), and tries all cores again soon after a switch to
fewer. A probe that finds fewer threads faster is confirmed against a second of fresh all-core steps
before the switch: the app's own UI thread slows a stretch of steps now and then (a screen layout
holds the GIL and a core), and an idle VM drifts, which must not pass for a neighbour that takes a
core all the time. A probe of fewer threads that came out no slower but not by the margin, or won
but was not confirmed, is tried again soon.
Results do not depend on the count (every kernel on the CPU path computes a row alone)."""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable

import torch

from app.engine.runtime.affinity import TeamAffinity
from app.kernels.cpu_team import team_tids

PROBE_EVERY_S = 10.0  # how often the other count is tried after a probe that switched
# ... but all cores again this soon after a switch to fewer: in the app, a reply's first second
# gave all-core steps of 0.15-1.5 s on an idle machine (cause not yet known), which a one-thread
# probe beat; one thread was then 1.6-2x slower until the next probe. A neighbour that stays
# makes each lost probe double the wait, as after any lost probe.
RECHECK_FEWER_S = 2.0
MAX_PROBE_EVERY_S = 60.0  # probes that keep losing back off to this interval
FIRST_PROBE_S = 2.0  # the first probe comes soon: a neighbour may be busy from the start
PROBE_STEPS = 5  # steps per side of a comparison at least: the probe's first one, paying the switch, is not counted
# ... and seconds: the mean step time is what sets tokens/s, and with busy neighbours all-core
# steps are mostly as fast as one thread's with a long tail (a step waiting 100-300 ms for a
# descheduled thread) that a median over five steps never sees.
PROBE_S = 0.2
MIN_GAIN = 0.9  # switch when the other count's steps take at most this fraction of the current's
# ... but to fewer threads only when clearly faster: on an idle machine one thread never is, and a
# noisy stretch of all-core steps (this VM's 20% drift) must not pass for a neighbour.
MIN_GAIN_FEWER = 0.85
SLOWDOWN = 1.5  # steps this much slower than the best seen at this batch size: probe now, not later
# The median is over the current count's steps of the last RECENT_S (PROBE_STEPS at least): the
# app's own UI thread slows a few steps at a time (a screen layout holds the GIL and a core for
# tens of milliseconds), a neighbour every step for as long as it runs.
RECENT_S = 0.5
# A periodic probe must beat the mean of the current count's steps over this long: under busy
# neighbours all-core steps are mostly fast, with a step of 150-300 ms every half second or so,
# and a baseline over RECENT_S that missed one made a steady one-thread probe look slow.
BASELINE_S = 2.0
SLOW_STEP = 3.0  # ... or steps in a row this much slower, adding up to SLOW_RUN_S (a neighbour
SLOW_RUN_S = 0.25  # can make each step take a second: the median cannot wait for those)
MIN_PROBE_GAP_S = 1.0  # a slowdown probe waits at least this long after the last probe
# A slowdown probe that lost (the app's UI thread slowing a stretch of steps, not a neighbour)
# makes the next slowdown wait this long before its probe, doubling with each further loss up to
# MAX_SLOW_HOLD_S; a won probe clears it. A neighbour slows every step for as long as it runs.
SLOW_HOLD_S = 0.5
MAX_SLOW_HOLD_S = 4.0
CONFIRM_S = 1.0  # all-core steps again after fewer threads won: long enough to catch their tail
# Fewer threads that won their probe but not its confirmation, or came out no slower but not by
# the margin, are tried again this soon (up to MAX_RETRIES times in a row) rather than after a
# backed-off period: under busy neighbours the all-core steps' tail comes every half second or so,
# and a window of a second or two can still miss it.
RETRY_S = 2.0
MAX_RETRIES = 3
ABORT = 2.0  # a probe step (past the first) this much slower than the current mean ends the probe
ABORT_FIRST = 10.0
# ... and a probe of fewer threads, which must win by MIN_GAIN_FEWER, ends at its first counted step
# this much slower: on an idle machine one thread is ~1.3-2x slower, and each further probe step
# cost the 1.5B model's replies ~50 ms; a neighbour's slow all-core steps (the baseline) keep a
# steady one-thread probe far below this.
ABORT_FEWER = 1.25


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
        # batch size -> (when, step time) of the current count's steps over the last RECENT_S
        self._recent: dict[int, _Window] = {}
        self._history: dict[int, _Window] = {}  # the same over BASELINE_S (unsorted: read at probes only)
        self._best: dict[int, float] = {}  # batch size -> the lowest median of those seen at this count
        # (count, batch size, its step times, the current count's step time to beat)
        self._probe: tuple[int, int, list[float], float] | None = None
        self._slow_run, self._slow_time = 0, 0.0  # consecutive steps far slower than the best; their total
        self._probation: tuple[float, float] | None = None  # (fewer threads' step time, until)
        self._probation_slow = 0  # consecutive all-core steps far slower than that, on probation
        # all-core steps since the switch up: their total time, count and the slowest one
        self._probation_time, self._probation_steps, self._probation_max = 0.0, 0, 0.0
        # (fewer count, batch size, all-core step times again, the fewer count's mean step time)
        self._confirm: tuple[int, int, list[float], float] | None = None
        self._slowed_since: float | None = None  # when all-core steps began to look slowed down
        self._slow_hold = 0.0  # how long a slowdown must last before its probe (see SLOW_HOLD_S)
        self._slowdown_probe = False  # the probe or confirmation running was started by a slowdown
        self._retries = 0  # inconclusive probes of fewer threads retried soon, in a row
        self._baseline_steps: list[float] = []  # the all-core steps a periodic probe's baseline came from
        self.switches = 0
        self.affinity: TeamAffinity | None = None  # see place_team
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
        if self._confirm is not None:
            self._observe_confirm(key, seconds)
            return
        if self._on_probation(seconds):
            return
        baseline = self._probe_due(key, seconds)
        if baseline is not None:
            other = 1 if self.current > 1 else self.max_threads
            self._probe = (other, key, [], baseline)
            self._apply(other)

    def _probe_due(self, key: int, seconds: float) -> float | None:
        """The step time a probe must beat, when one is due: periodically, or at once when all
        cores slow down (a neighbour arrived)."""
        now = self._clock()
        recent_window = self._recent.setdefault(key, _Window(RECENT_S))
        recent_window.add(now, seconds)
        recent = recent_window.steps
        history = self._history.setdefault(key, _Window(BASELINE_S, keep_sorted=False))
        history.add(now, seconds)
        typical = recent_window.median()
        if len(recent) >= PROBE_STEPS:
            self._best[key] = min(self._best.get(key, typical), typical)
        best = self._best.get(key)
        # Slow steps in a row (not one: a collection pause) that add up say so at once.
        if best is not None and seconds > SLOW_STEP * best:
            self._slow_run, self._slow_time = self._slow_run + 1, self._slow_time + seconds
        else:
            self._slow_run, self._slow_time = 0, 0.0
        slow_run = self._slow_run >= 2 and self._slow_time >= SLOW_RUN_S
        # The median speaks once this batch's steps cover RECENT_S (one step of a second does): a
        # reply's first steps, when the app lays out its new message, are no baseline (a probe
        # they started could run a lone tab's reply on one thread for a stretch).
        covered = now - recent[0][0] + recent[0][1] >= RECENT_S
        # One thread slowing down is no sign that more would help; the periodic probe finds the
        # neighbour gone.
        slowing = (best is not None and self.current == self.max_threads
                   and ((covered and typical > SLOWDOWN * best) or slow_run))
        if not slowing:
            self._slowed_since = None
        elif self._slowed_since is None:
            self._slowed_since = now - seconds
        slowed = (slowing and now - self._last_probe >= MIN_PROBE_GAP_S
                  and now - self._slowed_since >= self._slow_hold)
        periodic = now >= self._next_probe and covered  # after a pause, too, on a covered window
        if periodic or slowed:
            self._slowdown_probe = not periodic
            # A periodic probe's confirmation counts the steps of its baseline too; a slowdown's,
            # only fresh ones (the slow stretch may have been the UI's).
            self._baseline_steps = [s for _, s in history.steps] if periodic else []
            if periodic:
                return _mean(self._baseline_steps)
            return _mean([s for _, s in list(recent)[-2:]] if slow_run else [s for _, s in recent])
        return None

    def _on_probation(self, seconds: float) -> bool:
        """After a switch to more threads, two steps in a row far slower than the fewer threads'
        steps switch back at once: under busy neighbours all-core steps swing between fine and a
        second or more, and a probe may have caught a fine stretch. So does a second of them that
        is no faster on average (their tail: a step of 150-300 ms every half second or so)."""
        if self._probation is None:
            return False
        reference, until = self._probation
        if self._clock() > until:
            self._probation = None
            return False
        self._probation_slow = self._probation_slow + 1 if seconds > ABORT * reference else 0
        if self._probation_slow < 2 and not self._no_faster_on_probation(seconds, reference):
            return False
        self._probation = None
        self._settle(1, won=False)
        return True

    def _no_faster_on_probation(self, seconds: float, reference: float) -> bool:
        """All-core steps since the switch up cover CONFIRM_S without their slowest one (the UI's
        layout, a collection) and take longer on average than fewer threads' `reference` did."""
        self._probation_time += seconds
        self._probation_steps += 1
        self._probation_max = max(self._probation_max, seconds)
        rest = self._probation_time - self._probation_max
        return rest >= CONFIRM_S and rest / (self._probation_steps - 1) > reference

    def _observe_probe(self, key: int, seconds: float) -> None:
        other, probe_key, times, current = self._probe
        if key != probe_key:  # the batch changed under the probe: not comparable, try later
            self._end_probe(keep=False)
            return
        times.append(seconds)
        # Clearly worse: stop paying for it (the first step, which pays for the switch, only when
        # it is far worse).
        abort = ABORT_FIRST if len(times) == 1 else ABORT_FEWER if other < self.current else ABORT
        if seconds > abort * current:
            self._end_probe(keep=False)
            return
        if len(times) < PROBE_STEPS:
            return
        # Means on both sides (a best-of against a median favoured whichever count was probed, and
        # medians missed the long tail of all-core steps under contention); a probe already
        # slower than the current count cannot win and ends early.
        gain = MIN_GAIN_FEWER if other < self.current else MIN_GAIN
        probed = _mean(times[1:])
        if probed <= current and sum(times[1:]) < PROBE_S:
            return
        if probed <= gain * current and other < self.current:
            self._probe = None
            self._confirm = (other, key, [], probed)
            self._apply(self.current)  # all cores again: are they still that slow?
            return
        fewer = other < self.current
        self._end_probe(keep=probed <= gain * current)
        if fewer:  # lost (a win went to its confirmation); no slower, the baseline may have missed the tail
            self._retry_soon(probed <= current)

    def _observe_confirm(self, key: int, seconds: float) -> None:
        """Fewer threads won their probe: all-core steps again, right after it, decide. Two in a
        row far slower than the probe's switch at once (a neighbour, whose steps may take a
        second); otherwise the mean of CONFIRM_S of them (with the baseline's, for a periodic
        probe)."""
        other, confirm_key, times, probed = self._confirm
        if key != confirm_key:
            self._confirm = None
            self._settle(self.current, won=False)
            return
        times.append(seconds)
        slow_pair = len(times) >= 2 and min(times[-2:]) > ABORT * probed
        # A second of them decides however few they are: right after the switch back, under busy
        # neighbours, one all-core step can take a second.
        if slow_pair or sum(times[1:]) >= CONFIRM_S:
            self._confirm = None
            keep = slow_pair or probed <= MIN_GAIN_FEWER * _mean(self._baseline_steps + times[1:])
            self._decide(other, keep, probed)
            self._retry_soon(not keep)

    def _retry_soon(self, inconclusive: bool) -> None:
        """After a probe of fewer threads: when `inconclusive`, the next one in RETRY_S (MAX_RETRIES
        in a row at most); otherwise the count of those starts again."""
        if inconclusive and self._retries < MAX_RETRIES:
            self._retries += 1
            self._next_probe = self._last_probe + RETRY_S
        elif not inconclusive:
            self._retries = 0

    def _end_probe(self, keep: bool) -> None:
        other, reference = self._probe[0], self._probe[3]
        self._probe = None
        self._decide(other, keep, reference)

    def _decide(self, other: int, keep: bool, reference: float) -> None:
        """Switch to `other` threads if `keep` (on probation after a switch up, against the
        `reference` step time of fewer threads), else stay."""
        if keep:
            if other > self.current:
                self._probation = (reference, self._clock() + PROBE_EVERY_S)
            self.switches += 1
        self._settle(other if keep else self.current, won=keep)

    def _settle(self, count: int, won: bool) -> None:
        """Run at `count` from now on. Step times measured before say nothing about the machine
        now (a slowdown the other count did not beat becomes the new baseline instead of a probe
        a second); a lost probe doubles the wait for the next one, so an idle machine stops
        paying for them; a lost slowdown probe lengthens the hold of the next (SLOW_HOLD_S)."""
        if self._slowdown_probe:
            self._slow_hold = 0.0 if won else min(max(2 * self._slow_hold, SLOW_HOLD_S), MAX_SLOW_HOLD_S)
        self._slowdown_probe, self._slowed_since = False, None
        self.current = count
        self._apply(count)
        self._recent.clear()
        self._history.clear()
        self._best.clear()
        self._slow_run, self._slow_time, self._probation_slow = 0, 0.0, 0
        self._probation_time, self._probation_steps, self._probation_max = 0.0, 0, 0.0
        self._last_probe = self._clock()
        if won:
            self._interval = RECHECK_FEWER_S if count < self.max_threads else PROBE_EVERY_S
        else:
            self._interval = min(2 * self._interval, MAX_PROBE_EVERY_S)
        self._next_probe = self._last_probe + self._interval

    def _apply(self, threads: int) -> None:
        if self._applied != threads:
            self._set(threads)
            self._applied = threads
            if self.affinity is not None:
                self.affinity.apply(threads)

    def place_team(self) -> None:
        """From now on, pin each thread of the calling thread's CPU team to a CPU of its own while
        the team spans every CPU (`affinity.py`). Only for a thread of the engine's own that starts
        no threads or processes: they would inherit its CPU."""
        self.affinity = TeamAffinity(team_tids)
        self.affinity.apply(self._applied)


class _Window:
    """The steps of the last `span` seconds, PROBE_STEPS at least (none from before a pause: the
    engine was idle or ran other batches). With `keep_sorted` their times are also kept sorted: the
    median every step is then a bisect, not a sort of the half second's ~100 steps (~40 us a step
    in the app's and serve's step thread)."""

    __slots__ = ("steps", "span", "keep_sorted", "_sorted")

    def __init__(self, span: float, keep_sorted: bool = True) -> None:
        self.steps: deque[tuple[float, float]] = deque()
        self.span, self.keep_sorted = span, keep_sorted
        self._sorted: list[float] = []  # stays empty unless keep_sorted

    def add(self, now: float, seconds: float) -> None:
        steps, ordered = self.steps, self._sorted
        if steps and now - seconds - steps[-1][0] > RECENT_S:
            steps.clear()
            ordered.clear()
        steps.append((now, seconds))
        if self.keep_sorted:
            bisect.insort(ordered, seconds)
        while len(steps) > PROBE_STEPS and now - steps[0][0] > self.span:
            old = steps.popleft()[1]
            if self.keep_sorted:
                del ordered[bisect.bisect_left(ordered, old)]

    def median(self) -> float:
        s = self._sorted
        return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)

