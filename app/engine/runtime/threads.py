"""The CPU thread count, chosen by measurement while decoding.

Every parallel region of a step ends at a barrier: while another process holds one of the cores,
the step's threads wait for their descheduled partner at each of them, and an all-core step can
take many times longer than a one-thread one; on an idle machine all cores are faster. No waiting
policy serves both (docs/benchmarks.md), so the engine measures: it tries the other count now and
then, and keeps whichever made decode steps of that batch size faster (mean step times: under
busy neighbours all-core steps are mostly fast, with a far slower one every so often, and that
tail, which short windows miss, sets tokens/s). Results do not depend on the count (every kernel
on the CPU path computes a row alone). The figures behind each constant are in docs/tuning.md.

`ThreadTuner` is a state machine (`State`); every observed step goes through one transition,
`ThreadTuner._next`:

    SETTLED     runs `current` threads and watches their steps for a probe to come due
    PROBING     runs the other count for a few steps and compares mean step times
    CONFIRMING  fewer threads won their probe: all cores again, right after it, decide
    PROBATION   SETTLED on all cores for PROBE_EVERY_S after a switch up, ready to switch back
    OFF         one CPU: nothing to choose

    SETTLED, PROBATION -> PROBING     a probe is due: periodically (soon after start, then backing
                                      off while probes lose), or at once when all-core steps have
                                      slowed down for longer than the slowdown hold (a neighbour)
    PROBATION -> SETTLED              its window is over, or all-core steps turned slow again: two
                                      far slower than fewer threads' in a row, or a second of them
                                      no faster on average (back to one thread)
    PROBING -> CONFIRMING             fewer threads won by MIN_GAIN_FEWER
    PROBING -> SETTLED or PROBATION   more threads won (PROBATION), or the probe lost, ended early
                                      as clearly worse, or its batch size changed
    CONFIRMING -> SETTLED or PROBATION  all-core steps were still slow (switch to fewer) or were not
                                      (stay), or the batch size changed (stay)
    any state -> itself               not decided yet

A probation outlives a probe that starts within it: after that probe, whatever it decided, the
tuner is back on PROBATION until its window ends (hence the PROBATION after a CONFIRMING).

Two rules of SETTLED and PROBATION pace the probes rather than handle steps differently, so they
are timers of `_Schedule`, not states: the retry (a probe of fewer threads that came out no slower
but not by the margin, or won but was not confirmed, comes again after RETRY_S, MAX_RETRIES in a
row) and the slowdown hold (a lost slowdown probe makes the next slowdown wait SLOW_HOLD_S before
its probe, doubling per loss, cleared by a win)."""

from __future__ import annotations

import bisect
import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from app.engine.runtime.affinity import TeamAffinity
from app.kernels.cpu_team import team_tids

# When probes come.
FIRST_PROBE_S = 2.0  # the first probe comes soon: a neighbour may be busy from the start
PROBE_EVERY_S = 10.0  # the period after a switch up, and its probation: each probe costs steps
RECHECK_FEWER_S = 2.0  # all cores again soon after a switch to fewer: an app stall can win one
MAX_PROBE_EVERY_S = 60.0  # lost probes double the period up to this: an idle machine stops paying
RETRY_S = 2.0  # an inconclusive probe of fewer threads comes again soon: a window can miss the tail
MAX_RETRIES = 3  # ... this many times in a row at most, so an idle machine does not pay for them

# How long a probe runs and what wins it.
PROBE_STEPS = 5  # steps a side at least; the first probe step pays for the switch: not counted
PROBE_S = 0.2  # ... and seconds a side: means set tokens/s, and a few steps miss the tail
MIN_GAIN = 0.9  # more threads win when their mean step takes at most this share of the current's
MIN_GAIN_FEWER = 0.85  # fewer threads must win clearly: an idle machine's drift is no neighbour
ABORT = 2.0  # far slower: ends a probe at one step past its first; a confirmation, probation at two
ABORT_FIRST = 10.0  # ... the first probe step only when this much slower: it pays for the switch
ABORT_FEWER = 1.25  # ... for fewer threads, which cannot win from here: each step costs the reply

# When all cores look slowed down (a neighbour arrived): probe now, not at the period.
RECENT_S = 0.5  # the slowdown median's window: outlasts the app's own stalls, not a neighbour's
SLOWDOWN = 1.5  # that median this much above the best seen at the batch size is a slowdown
SLOW_STEP = 3.0  # ... and so are steps in a row this much above the best
SLOW_RUN_S = 0.25  # ... adding up to this: a neighbour's steps can be too slow to fill the median
MIN_PROBE_GAP_S = 1.0  # a slowdown probe waits this long after the last probe: each costs steps
SLOW_HOLD_S = 0.5  # a lost slowdown probe makes the next slowdown last this long first (doubling)
MAX_SLOW_HOLD_S = 4.0  # ... up to this: a neighbour, slowing every step, is still answered soon
BASELINE_S = 2.0  # a periodic probe beats the mean over this long: long enough to hold the tail

# Checks after a decision.
CONFIRM_S = 1.0  # the all-core steps a confirmation or probation judges: enough to catch the tail


class State(enum.Enum):
    """Where a `ThreadTuner` is; the module docstring has the transitions."""

    OFF = "off"
    SETTLED = "settled"
    PROBING = "probing"
    CONFIRMING = "confirming"
    PROBATION = "probation"


# The transition table: the states `ThreadTuner._next` may go to from each.
TRANSITIONS: dict[State, frozenset[State]] = {
    State.OFF: frozenset({State.OFF}),
    State.SETTLED: frozenset({State.SETTLED, State.PROBING}),
    State.PROBATION: frozenset({State.PROBATION, State.SETTLED, State.PROBING}),
    State.PROBING: frozenset({State.PROBING, State.CONFIRMING, State.SETTLED, State.PROBATION}),
    State.CONFIRMING: frozenset({State.CONFIRMING, State.SETTLED, State.PROBATION}),
}


@dataclass(slots=True)
class _Schedule:
    """When the next probe may come."""

    last_probe: float  # when the tuner last settled (a probe, a confirmation or a probation ended)
    next_probe: float  # when the periodic one is due
    interval: float = PROBE_EVERY_S  # the period: doubled per lost probe, reset by a won one
    retries: int = 0  # inconclusive probes of fewer threads retried soon, in a row
    slow_hold: float = 0.0  # how long a slowdown must last before its probe


@dataclass(slots=True)
class _Watch:
    """The current count's steps since it was settled: windows and the slowdown being watched."""

    recent: dict[int, _Window] = field(default_factory=dict)  # batch size -> its last RECENT_S
    history: dict[int, _Window] = field(default_factory=dict)  # ... its last BASELINE_S (unsorted)
    best: dict[int, float] = field(default_factory=dict)  # batch size -> the lowest median seen
    slow_run: int = 0  # steps in a row far slower than the best (SLOW_STEP)
    slow_time: float = 0.0  # ... their total
    slowed_since: float | None = None  # when all-core steps began to look slowed down


@dataclass(slots=True)
class _Trial:
    """PROBING: `threads` on trial against the current count's `to_beat` step time; then, when
    fewer threads won, CONFIRMING: all cores again, against the probe's mean `probed`."""

    threads: int
    key: int  # the batch size measured
    to_beat: float
    slowdown: bool  # started by a slowdown (else periodic)
    baseline: list[float]  # a periodic probe's baseline steps, which its confirmation counts too
    times: list[float] = field(default_factory=list)  # this phase's step times
    probed: float = 0.0


@dataclass(slots=True)
class _Probation:
    """All cores after a switch up, against fewer threads' `reference` step time, until `until`
    (whatever a probe started within it decides: see the module docstring)."""

    reference: float
    until: float
    slow: int = 0  # all-core steps in a row far slower than the reference
    time: float = 0.0  # all-core steps since the switch up (or since a probe within): their total,
    steps: int = 0  # ... count
    slowest: float = 0.0  # ... and the slowest one

    def restart(self) -> None:
        self.slow, self.time, self.steps, self.slowest = 0, 0.0, 0, 0.0

    def failed(self, seconds: float) -> bool:
        """Two steps in a row far slower than the reference: under busy neighbours all-core steps
        swing between fine and very slow, and the probe may have caught a fine stretch. Or steps
        that cover CONFIRM_S without their slowest one (a layout, a collection) and are no faster
        on average than the reference: their tail."""
        self.slow = self.slow + 1 if seconds > ABORT * self.reference else 0
        if self.slow >= 2:
            return True
        self.time += seconds
        self.steps += 1
        self.slowest = max(self.slowest, seconds)
        rest = self.time - self.slowest
        return rest >= CONFIRM_S and rest / (self.steps - 1) > self.reference


class ThreadTuner:
    """`observe(key, seconds)` after each decode step of a batch of `key` sequences; it sets
    torch's thread count (which the C kernels use too) for the steps that follow."""

    def __init__(self, max_threads: int | None = None, clock: Callable[[], float] = time.monotonic,
                 set_threads: Callable[[int], None] = torch.set_num_threads) -> None:
        self.max_threads = max_threads or torch.get_num_threads()
        self.current = self.max_threads
        self.state = State.SETTLED if self.enabled else State.OFF
        self._clock, self._set = clock, set_threads
        now = clock()
        self._schedule = _Schedule(last_probe=now, next_probe=now + FIRST_PROBE_S)
        self._watch = _Watch()
        self._trial: _Trial | None = None  # while PROBING or CONFIRMING
        self._probation: _Probation | None = None  # while on PROBATION (and a probe started within)
        self.switches = 0
        self.affinity: TeamAffinity | None = None  # see place_team
        self._applied = self.max_threads

    @property
    def enabled(self) -> bool:
        return self.max_threads > 1

    def observe(self, key: int, seconds: float) -> None:
        self.state = self._next(self.state, key, seconds, self._clock())

    def _next(self, state: State, key: int, seconds: float, now: float) -> State:
        """The one transition: the state after a decode step of `key` sequences that took
        `seconds` and ended at `now` (TRANSITIONS lists where each state may go)."""
        if state is State.PROBING:
            return self._probing(key, seconds, now)
        if state is State.CONFIRMING:
            return self._confirming(key, seconds, now)
        if state is State.PROBATION:
            if now > self._probation.until:
                self._probation, state = None, State.SETTLED  # and this step is SETTLED's
            elif self._probation.failed(seconds):
                self._probation = None
                return self._settle(now, 1, won=False, slowdown=False)
        elif state is State.OFF:
            return state
        trial = self._due_probe(key, seconds, now)
        if trial is None:
            return state
        self._trial = trial
        self._apply(trial.threads)
        return State.PROBING

    def _due_probe(self, key: int, seconds: float, now: float) -> _Trial | None:
        """SETTLED and PROBATION: the probe to start, when one is due: periodically, or at once when
        all cores slow down (a neighbour arrived)."""
        watch, schedule = self._watch, self._schedule
        recent_window = watch.recent.get(key)
        if recent_window is None:
            recent_window = watch.recent[key] = _Window(RECENT_S)
        recent_window.add(now, seconds)
        recent = recent_window.steps
        history = watch.history.get(key)
        if history is None:
            history = watch.history[key] = _Window(BASELINE_S, keep_sorted=False)
        history.add(now, seconds)
        typical = recent_window.median()
        if len(recent) >= PROBE_STEPS:
            watch.best[key] = min(watch.best.get(key, typical), typical)
        best = watch.best.get(key)
        # Slow steps in a row (not one: a collection pause) that add up say so at once.
        if best is not None and seconds > SLOW_STEP * best:
            watch.slow_run, watch.slow_time = watch.slow_run + 1, watch.slow_time + seconds
        else:
            watch.slow_run, watch.slow_time = 0, 0.0
        slow_run = watch.slow_run >= 2 and watch.slow_time >= SLOW_RUN_S
        # The median speaks once this batch's steps cover RECENT_S (one long step does): a reply's
        # first steps, while the app lays out its new message, are no baseline.
        covered = now - recent[0][0] + recent[0][1] >= RECENT_S
        # One thread slowing down is no sign that more would help; the periodic probe finds the
        # neighbour gone.
        slowing = (best is not None and self.current == self.max_threads
                   and ((covered and typical > SLOWDOWN * best) or slow_run))
        if not slowing:
            watch.slowed_since = None
        elif watch.slowed_since is None:
            watch.slowed_since = now - seconds
        slowed = (slowing and now - schedule.last_probe >= MIN_PROBE_GAP_S
                  and now - watch.slowed_since >= schedule.slow_hold)
        periodic = now >= schedule.next_probe and covered  # after a pause, too, on a covered window
        if not (periodic or slowed):
            return None
        other = 1 if self.current > 1 else self.max_threads
        if periodic:
            # Its confirmation counts the baseline's steps too; a slowdown's only fresh ones (the
            # slow stretch may have been the app's own).
            baseline = [s for _, s in history.steps]
            return _Trial(other, key, _mean(baseline), slowdown=False, baseline=baseline)
        steps = list(recent)[-2:] if slow_run else recent
        return _Trial(other, key, _mean([s for _, s in steps]), slowdown=True, baseline=[])

    def _probing(self, key: int, seconds: float, now: float) -> State:
        trial = self._trial
        if key != trial.key:  # the batch changed under the probe: not comparable, try later
            return self._end(now, trial, keep=False, reference=trial.to_beat)
        times = trial.times
        times.append(seconds)
        fewer = trial.threads < self.current
        # Clearly worse: stop paying for it (the first step, which pays for the switch, only when
        # it is far worse).
        abort = ABORT_FIRST if len(times) == 1 else ABORT_FEWER if fewer else ABORT
        if seconds > abort * trial.to_beat:
            return self._end(now, trial, keep=False, reference=trial.to_beat)
        if len(times) < PROBE_STEPS:
            return State.PROBING
        # Means on both sides (medians missed the long tail of all-core steps under contention); a
        # probe already slower than the current count cannot win and ends early.
        probed = _mean(times[1:])
        if probed <= trial.to_beat and sum(times[1:]) < PROBE_S:
            return State.PROBING
        won = probed <= (MIN_GAIN_FEWER if fewer else MIN_GAIN) * trial.to_beat
        if won and fewer:
            trial.times, trial.probed = [], probed
            self._apply(self.current)  # all cores again: are they still that slow?
            return State.CONFIRMING
        state = self._end(now, trial, keep=won, reference=trial.to_beat)
        if fewer:  # lost; no slower, the baseline may have missed the tail
            self._retry_soon(inconclusive=probed <= trial.to_beat)
        return state

    def _confirming(self, key: int, seconds: float, now: float) -> State:
        """Two all-core steps in a row far slower than the probe's switch at once (a neighbour,
        whose steps may take a second); otherwise the mean of CONFIRM_S of them (with the
        baseline's, for a periodic probe) decides, however few they are."""
        trial = self._trial
        if key != trial.key:
            self._trial = None
            return self._settle(now, self.current, won=False, slowdown=trial.slowdown)
        times = trial.times
        times.append(seconds)
        slow_pair = len(times) >= 2 and min(times[-2:]) > ABORT * trial.probed
        if not slow_pair and sum(times[1:]) < CONFIRM_S:
            return State.CONFIRMING
        keep = slow_pair or trial.probed <= MIN_GAIN_FEWER * _mean(trial.baseline + times[1:])
        state = self._end(now, trial, keep=keep, reference=trial.probed)
        self._retry_soon(inconclusive=not keep)
        return state

    def _retry_soon(self, inconclusive: bool) -> None:
        """After a probe of fewer threads: when `inconclusive`, the next one in RETRY_S (MAX_RETRIES
        in a row at most); otherwise the count of those starts again."""
        schedule = self._schedule
        if inconclusive and schedule.retries < MAX_RETRIES:
            schedule.retries += 1
            schedule.next_probe = schedule.last_probe + RETRY_S
        elif not inconclusive:
            schedule.retries = 0

    def _end(self, now: float, trial: _Trial, keep: bool, reference: float) -> State:
        """The trial is over: switch to its count if `keep` (on probation after a switch up,
        against fewer threads' `reference` step time), else stay."""
        self._trial = None
        if keep:
            if trial.threads > self.current:
                self._probation = _Probation(reference, now + PROBE_EVERY_S)
            self.switches += 1
        return self._settle(now, trial.threads if keep else self.current, won=keep,
                            slowdown=trial.slowdown)

    def _settle(self, now: float, count: int, won: bool, slowdown: bool) -> State:
        """Run at `count` from now on. Step times measured before say nothing about the machine
        now (a slowdown the other count did not beat becomes the new baseline instead of a probe
        a second); a lost probe doubles the wait for the next one, so an idle machine stops
        paying for them; a lost slowdown probe lengthens the hold of the next (SLOW_HOLD_S)."""
        schedule = self._schedule
        if slowdown:
            schedule.slow_hold = (0.0 if won else
                                  min(max(2 * schedule.slow_hold, SLOW_HOLD_S), MAX_SLOW_HOLD_S))
        self.current = count
        self._apply(count)
        self._watch = _Watch()
        if self._probation is not None:
            self._probation.restart()
        schedule.last_probe = now
        if won:
            schedule.interval = RECHECK_FEWER_S if count < self.max_threads else PROBE_EVERY_S
        else:
            schedule.interval = min(2 * schedule.interval, MAX_PROBE_EVERY_S)
        schedule.next_probe = now + schedule.interval
        return State.SETTLED if self._probation is None else State.PROBATION

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
    median every step is then a bisect, not a sort of the window's steps."""

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
