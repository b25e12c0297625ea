"""The thread-count tuner, state by state: SETTLED watches steps until a probe is due, PROBING runs
the other count and compares, CONFIRMING checks all cores again after fewer threads won, PROBATION
watches all cores after a switch up, OFF has nothing to choose. Then whole runs of the patterns
that shaped it (idle, busy neighbours, the app's own stalls)."""

from __future__ import annotations

import random

import pytest

from app.engine.runtime import threads
from app.engine.runtime.threads import TRANSITIONS, State, ThreadTuner


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def step(tuner: ThreadTuner, clock: Clock, seconds: float, key: int = 1) -> State:
    clock.now += seconds
    tuner.observe(key, seconds)
    return tuner.state


def drive(tuner: ThreadTuner, clock: Clock, step_time: dict[int, float], steps: int, key: int = 1) -> None:
    for _ in range(steps):
        step(tuner, clock, step_time[tuner_threads(tuner)], key)


def tuner_threads(tuner: ThreadTuner) -> int:
    return tuner._applied


def until(tuner: ThreadTuner, clock: Clock, seconds: float, state: State, limit: float = 60.0,
          key: int = 1) -> None:
    """Steps of `seconds` until the tuner is in `state`."""
    start = clock.now
    while tuner.state is not state:
        assert clock.now - start < limit, f"still {tuner.state} after {limit} s"
        step(tuner, clock, seconds, key)


def recorded(tuner: ThreadTuner) -> set[tuple[State, State]]:
    """The (before, after) pairs of every transition the tuner takes from now on."""
    seen: set[tuple[State, State]] = set()
    inner = tuner._next

    def spy(state: State, key: int, seconds: float, now: float) -> State:
        after = inner(state, key, seconds, now)
        seen.add((state, after))
        return after

    tuner._next = spy
    return seen


def settled() -> tuple[ThreadTuner, Clock]:
    """A tuner on both cores that has seen 0.6 s of 10 ms steps, its first probe not yet due."""
    clock = Clock()
    tuner = ThreadTuner(2, clock=clock, set_threads=lambda n: None)
    for _ in range(60):
        assert step(tuner, clock, 0.01) is State.SETTLED
    return tuner, clock


def probing() -> tuple[ThreadTuner, Clock]:
    """A tuner that has seen 10 ms all-core steps and has just started its first one-thread probe."""
    tuner, clock = settled()
    until(tuner, clock, 0.01, State.PROBING)
    assert clock.now >= threads.FIRST_PROBE_S and tuner_threads(tuner) == 1
    return tuner, clock


def confirming() -> tuple[ThreadTuner, Clock]:
    """One thread won its probe (5 ms steps against 10 ms): all cores run again to confirm."""
    tuner, clock = probing()
    until(tuner, clock, 0.005, State.CONFIRMING)
    assert tuner_threads(tuner) == 2 and tuner.current == 2 and tuner.switches == 0
    return tuner, clock


def settled_on_one() -> tuple[ThreadTuner, Clock]:
    """All cores stayed slow (50 ms) after one thread's win: settled on one thread."""
    tuner, clock = confirming()
    assert step(tuner, clock, 0.05) is State.CONFIRMING
    assert step(tuner, clock, 0.05) is State.SETTLED
    assert tuner.current == 1 and tuner_threads(tuner) == 1 and tuner.switches == 1
    return tuner, clock


def on_probation() -> tuple[ThreadTuner, Clock]:
    """From one thread (5 ms steps), a probe of both cores won with 2 ms steps: on probation."""
    tuner, clock = settled_on_one()
    until(tuner, clock, 0.005, State.PROBING)
    assert tuner_threads(tuner) == 2
    until(tuner, clock, 0.002, State.PROBATION)
    assert tuner.current == 2 and tuner.switches == 2
    return tuner, clock


# OFF


def test_off_with_one_core_stays_off_and_never_sets_the_count():
    tuner = ThreadTuner(1, set_threads=lambda n: (_ for _ in ()).throw(AssertionError(n)))
    assert tuner.state is State.OFF and not tuner.enabled
    for _ in range(100):
        tuner.observe(1, 0.01)
    assert tuner.state is State.OFF


# SETTLED


def test_settled_stays_settled_until_the_first_probe_is_due():
    tuner, clock = settled()
    until(tuner, clock, 0.01, State.PROBING)
    assert threads.FIRST_PROBE_S <= clock.now < threads.FIRST_PROBE_S + 0.02


def test_settled_moves_to_probing_only_once_a_pauses_new_steps_cover_the_recent_window() -> None:
    """A reply's first steps come while the app lays out its new message: a probe due while the
    engine was idle waits until the new batch's steps cover RECENT_S."""
    clock, applied = Clock(), []
    tuner = ThreadTuner(2, clock=clock, set_threads=applied.append)
    drive(tuner, clock, {2: 0.005, 1: 0.008}, 100)
    clock.now += 120.0  # idle: every probe is due
    applied.clear()
    start = clock.now
    until(tuner, clock, 0.005, State.PROBING)
    assert clock.now - start >= threads.RECENT_S - 0.01


def test_settled_moves_to_probing_within_seconds_when_all_cores_slow_down():
    """A neighbour arriving is answered at once, not at the backed-off period."""
    clock = Clock()
    tuner = ThreadTuner(2, clock=clock, set_threads=lambda n: None)
    drive(tuner, clock, {2: 0.004, 1: 0.008}, 5_000)  # 20 s idle: probes lost, the period backs off
    assert tuner.current == 2 and tuner._schedule.interval > threads.PROBE_EVERY_S
    start = clock.now
    until(tuner, clock, 0.100, State.PROBING)
    assert clock.now - start < threads.MIN_PROBE_GAP_S + 10 * 0.1


def test_settled_stays_settled_through_a_burst_of_slow_steps_and_probes_when_it_lasts() -> None:
    """A screen layout slows a few steps by tens of milliseconds: the median over RECENT_S does not
    move and the steps add up to less than SLOW_RUN_S, so no probe starts before the periodic one.
    The same slowdown lasting starts one within about RECENT_S."""
    clock, applied = Clock(), []
    tuner = ThreadTuner(2, clock=clock, set_threads=applied.append)
    drive(tuner, clock, {2: 0.005, 1: 0.008}, 5_000)  # 25 s: the periodic probes back off
    applied.clear()
    due = tuner._schedule.next_probe
    while clock.now < due - 1.0:
        for seconds in [0.040] * 3 + [0.005] * 40:  # a 120 ms layout every ~0.3 s
            assert step(tuner, clock, seconds) is State.SETTLED
    assert applied == []
    start = clock.now
    until(tuner, clock, 0.040, State.PROBING)
    assert clock.now - start <= threads.RECENT_S


def test_settled_stays_settled_through_a_replys_first_slow_steps_after_a_pause() -> None:
    """After a pause, the new reply's first steps are slowed by the app laying out its message:
    they are too few to say the machine slowed down, so no probe starts; a lasting slowdown
    still starts one once the steps cover RECENT_S."""
    clock, applied = Clock(), []
    tuner = ThreadTuner(2, clock=clock, set_threads=applied.append)
    drive(tuner, clock, {2: 0.005, 1: 0.008}, 5_000)  # 25 s: the periodic probes back off
    for _ in range(3):  # three replies, each after a pause
        clock.now += 1.5
        applied.clear()
        for seconds in [0.030] * 4 + [0.005] * 100:
            step(tuner, clock, seconds)
        assert applied == [], "a probe started at a reply's start"
    clock.now += 1.5
    start = clock.now
    until(tuner, clock, 0.030, State.PROBING)
    assert clock.now - start <= threads.RECENT_S + 0.05


def test_settled_after_lost_probes_waits_twice_as_long_each_time_up_to_the_maximum():
    clock = Clock()
    tuner = ThreadTuner(2, clock=clock, set_threads=lambda n: None)
    intervals = []
    for _ in range(6):
        until(tuner, clock, {2: 0.004, 1: 0.008}[tuner_threads(tuner)], State.PROBING, limit=200)
        until(tuner, clock, 0.02, State.SETTLED)  # far slower at its first counted step: lost
        intervals.append(tuner._schedule.interval)
    assert intervals[:3] == [2 * threads.PROBE_EVERY_S, 4 * threads.PROBE_EVERY_S, threads.MAX_PROBE_EVERY_S]
    assert set(intervals[3:]) == {threads.MAX_PROBE_EVERY_S} and tuner.switches == 0


def test_settled_on_fewer_threads_moves_to_probing_all_cores_after_the_short_recheck() -> None:
    """A probe of one thread can win against a stall of the app's own on an idle machine: all
    cores are tried again after RECHECK_FEWER_S, not PROBE_EVERY_S, and win back."""
    tuner, clock = settled_on_one()
    switched = clock.now
    until(tuner, clock, 0.080, State.PROBING)
    assert tuner_threads(tuner) == 2
    assert threads.RECHECK_FEWER_S <= clock.now - switched < threads.RECHECK_FEWER_S + 0.1
    until(tuner, clock, 0.040, State.PROBATION)
    assert tuner.current == 2


# PROBING


def test_probing_stays_probing_until_it_has_enough_steps_and_seconds():
    tuner, clock = probing()
    steps = 0
    while step(tuner, clock, 0.005) is State.PROBING:  # faster: runs until PROBE_S is covered
        steps += 1
    assert steps + 1 >= max(threads.PROBE_STEPS, threads.PROBE_S / 0.005)
    assert tuner.state is State.CONFIRMING


def test_probing_moves_to_settled_when_the_batch_size_changes():
    tuner, clock = probing()
    assert step(tuner, clock, 0.001, key=4) is State.SETTLED  # another batch size: not comparable
    assert tuner.current == 2 and tuner_threads(tuner) == 2 and tuner.switches == 0


def test_probing_moves_to_settled_at_a_first_step_only_when_it_is_far_slower():
    tuner, clock = probing()
    assert step(tuner, clock, 0.05) is State.PROBING  # 5x: the first step pays for the switch
    tuner, clock = probing()
    assert step(tuner, clock, 0.2) is State.SETTLED  # 20x: not worth another step
    assert tuner_threads(tuner) == 2


def test_probing_moves_to_settled_at_a_far_slower_second_step():
    tuner, clock = probing()
    step(tuner, clock, 0.05)  # the first probe step pays for the switch: not judged
    assert tuner_threads(tuner) == 1
    assert step(tuner, clock, 0.05) is State.SETTLED  # 5x the steps to beat
    assert tuner_threads(tuner) == 2 and tuner.current == 2


def test_probing_fewer_threads_moves_to_settled_at_a_first_counted_step_somewhat_slower():
    """On an idle machine one thread is only somewhat slower for a small model: a probe that ran
    its five steps cost a reply a fraction of a second each time."""
    tuner, clock = probing()
    step(tuner, clock, 0.016)  # the switch's step
    assert step(tuner, clock, 0.014) is State.SETTLED  # cannot come out 0.85x of the steps to beat
    assert tuner_threads(tuner) == 2 and tuner.current == 2


def test_probing_moves_to_confirming_when_fewer_threads_are_clearly_faster():
    tuner, clock = confirming()
    assert tuner.switches == 0  # nothing decided yet


def test_probing_fewer_threads_no_slower_but_not_by_the_margin_moves_to_settled_and_retries_soon():
    """Fewer threads that came out no slower but not by MIN_GAIN_FEWER are tried again after
    RETRY_S rather than after the doubled period, MAX_RETRIES times in a row."""
    tuner, clock = probing()
    retries = []
    for i in range(threads.MAX_RETRIES + 1):
        until(tuner, clock, 0.0095, State.SETTLED)  # 0.95x of the 10 ms to beat: inconclusive
        assert tuner.current == 2
        schedule = tuner._schedule
        retries.append((schedule.retries, round(schedule.next_probe - schedule.last_probe, 6)))
        if i < threads.MAX_RETRIES:
            until(tuner, clock, 0.01, State.PROBING)
    assert retries == [(1, threads.RETRY_S), (2, threads.RETRY_S), (3, threads.RETRY_S),
                       (3, threads.MAX_PROBE_EVERY_S)]


def test_probing_more_threads_moves_to_probation_when_faster():
    tuner, clock = on_probation()
    assert tuner._probation.until == pytest.approx(clock.now + threads.PROBE_EVERY_S)


def test_probing_more_threads_moves_to_settled_on_fewer_when_they_lose():
    tuner, clock = settled_on_one()
    until(tuner, clock, 0.005, State.PROBING)
    assert step(tuner, clock, 0.012) is State.PROBING  # the switch's step
    assert step(tuner, clock, 0.012) is State.SETTLED  # over 2x the 5 ms to beat
    assert tuner.current == 1 and tuner_threads(tuner) == 1 and tuner.switches == 1


# CONFIRMING


def test_confirming_stays_confirming_until_a_second_of_all_core_steps():
    tuner, clock = confirming()
    start = clock.now
    while step(tuner, clock, 0.008) is State.CONFIRMING:  # slower than the probe, not 2x
        pass
    assert clock.now - start >= threads.CONFIRM_S


def test_confirming_moves_to_settled_on_fewer_threads_at_two_far_slower_steps():
    tuner, clock = settled_on_one()
    assert tuner.switches == 1 and tuner._schedule.interval == threads.RECHECK_FEWER_S


def test_confirming_moves_to_settled_on_fewer_threads_when_a_second_of_steps_is_slower_on_average():
    tuner, clock = confirming()
    until(tuner, clock, 0.008, State.SETTLED)  # the probe's 5 ms is at most 0.85x of them
    assert tuner.current == 1 and tuner.switches == 1 and tuner._schedule.retries == 0


def test_confirming_moves_to_settled_on_all_cores_when_they_are_fast_again_and_retries_soon():
    tuner, clock = confirming()
    # A periodic probe's confirmation counts its baseline's 10 ms steps too: these bring the mean
    # below 5 / 0.85 ms, so one thread's 5 ms is no clear win.
    until(tuner, clock, 0.003, State.SETTLED)
    assert tuner.current == 2 and tuner.switches == 0
    schedule = tuner._schedule
    assert schedule.retries == 1 and schedule.next_probe == schedule.last_probe + threads.RETRY_S


def test_confirming_moves_to_settled_when_the_batch_size_changes():
    tuner, clock = confirming()
    assert step(tuner, clock, 0.05, key=4) is State.SETTLED
    assert tuner.current == 2 and tuner.switches == 0


# PROBATION


def test_probation_moves_to_settled_on_one_thread_at_two_far_slower_steps():
    tuner, clock = on_probation()
    assert step(tuner, clock, 1.5) is State.PROBATION  # one slow all-core step: a layout, maybe
    assert step(tuner, clock, 1.5) is State.SETTLED  # two: all cores turned slow again
    assert tuner.current == 1 and tuner_threads(tuner) == 1 and tuner.switches == 2


def test_probation_stays_on_probation_after_one_slow_step():
    tuner, clock = on_probation()
    for i in range(400):  # 2 s of 2 ms steps and one layout of 1.2 s among them
        assert step(tuner, clock, 1.2 if i == 10 else 0.002) is State.PROBATION


def test_probation_moves_to_settled_on_one_thread_when_a_second_of_steps_is_no_faster():
    """A probe of both cores can catch a stretch of fast steps: on probation, a second of all-core
    steps whose mean (without the slowest one) is no better than one thread's switches back."""
    tuner, clock = on_probation()
    start, i = clock.now, 0
    while tuner.state is State.PROBATION:
        i += 1
        step(tuner, clock, 0.009 if i % 6 == 0 else 0.005)  # never 2x the 5 ms, mean above it
    assert tuner.state is State.SETTLED and tuner.current == 1
    assert clock.now - start < 2 * threads.CONFIRM_S


def test_probation_moves_to_settled_when_its_window_ends_in_a_pause():
    tuner, clock = on_probation()
    clock.now += threads.PROBE_EVERY_S + 1.0  # idle: the engine had nothing to decode
    assert step(tuner, clock, 0.002) is State.SETTLED  # no probe on a single step's window
    assert tuner.current == 2


def test_probation_moves_to_probing_when_its_window_ends_with_the_periodic_probe_due():
    tuner, clock = on_probation()
    start = clock.now
    until(tuner, clock, 0.002, State.PROBING)
    assert clock.now - start > threads.PROBE_EVERY_S and tuner_threads(tuner) == 1


def test_probation_moves_to_probing_on_a_slowdown_and_back_to_probation_after_it():
    """A probation outlives a probe that starts within it, whatever the probe decided."""
    tuner, clock = on_probation()
    seen = recorded(tuner)
    for _ in range(600):  # 1.2 s of 2 ms steps: the best, and MIN_PROBE_GAP_S
        step(tuner, clock, 0.002)
    until(tuner, clock, 0.004, State.PROBING)  # 2x the best: a slowdown
    until(tuner, clock, 0.008, State.PROBATION)  # one thread far slower: lost
    assert tuner.current == 2
    for _ in range(600):
        step(tuner, clock, 0.002)
    until(tuner, clock, 0.004, State.PROBING)
    until(tuner, clock, 0.002, State.CONFIRMING)  # one thread at 2 ms beats 4 ms
    until(tuner, clock, 0.004, State.PROBATION)  # all cores still 4 ms: one thread, on probation
    assert tuner.current == 1 and tuner.switches == 3
    assert {(State.PROBATION, State.PROBING), (State.PROBING, State.PROBATION),
            (State.CONFIRMING, State.PROBATION)} <= seen


def test_settled_slowdown_probes_that_lose_lengthen_the_hold_and_a_win_clears_it():
    clock = Clock()
    tuner = ThreadTuner(2, clock=clock, set_threads=lambda n: None)
    drive(tuner, clock, {2: 0.004, 1: 0.008}, 16_000)  # 64 s: lost probes, the period at its most
    holds, waits = [], []
    for _ in range(5):
        clock.now += 1.0  # a pause: fresh windows
        for _ in range(300):  # the best at 4 ms, and MIN_PROBE_GAP_S
            step(tuner, clock, 0.004)
        start = clock.now
        until(tuner, clock, 0.008, State.PROBING)  # all cores 2x slower: a slowdown
        waits.append(clock.now - start)
        until(tuner, clock, 0.02, State.SETTLED)  # one thread slower still: lost
        holds.append(tuner._schedule.slow_hold)
    assert holds == [threads.SLOW_HOLD_S, 2 * threads.SLOW_HOLD_S, 4 * threads.SLOW_HOLD_S,
                     threads.MAX_SLOW_HOLD_S, threads.MAX_SLOW_HOLD_S]
    assert waits[-1] > threads.MAX_SLOW_HOLD_S > waits[0]
    clock.now += 1.0
    for _ in range(300):
        step(tuner, clock, 0.004)
    until(tuner, clock, 0.008, State.PROBING)
    until(tuner, clock, 0.004, State.CONFIRMING)  # one thread at 4 ms beats 8 ms
    until(tuner, clock, 0.008, State.SETTLED)  # all cores still 8 ms: won
    assert tuner.current == 1 and tuner._schedule.slow_hold == 0.0


# The transition table


def _world(tuner: ThreadTuner, clock: Clock, rng: random.Random, seconds: float) -> None:
    """Stretches of an idle machine, a busy neighbour, an all-core tail, the app's own stalls,
    pauses and batch size changes."""
    regime, left, key, burst = "idle", 0.0, 1, 0
    end = clock.now + seconds
    while clock.now < end:
        if left <= 0:
            regime, left = rng.choice(["idle", "neighbour", "tail", "stalls"]), rng.uniform(0.5, 12)
        if rng.random() < 0.002:
            clock.now += rng.choice([0.6, 3.0])
        if rng.random() < 0.003:
            key = rng.choice([1, 4])
        many = tuner_threads(tuner) == 2
        if regime == "idle":
            s = 0.005 if many else 0.008
        elif regime == "neighbour":
            s = rng.uniform(0.02, 0.1) if many else 0.006
        elif regime == "tail":
            s = (rng.uniform(0.15, 0.3) if rng.random() < 0.1 else 0.025) if many else 0.032
        else:
            burst = burst - 1 if burst else (rng.choice([2, 4, 8]) if rng.random() < 0.04 else 0)
            s = 0.05 if burst else 0.005 if many else 0.008
        left -= s
        step(tuner, clock, s, key)


def test_every_transition_of_the_table_happens_and_no_other():
    seen: set[tuple[State, State]] = set()
    for seed in range(4):
        clock = Clock()
        tuner = ThreadTuner(2, clock=clock, set_threads=lambda n: None)
        transitions = recorded(tuner)
        _world(tuner, clock, random.Random(seed), 60.0)
        seen |= transitions
    off = ThreadTuner(1, set_threads=lambda n: None)
    transitions = recorded(off)
    off.observe(1, 0.01)
    seen |= transitions
    table = {(a, b) for a, targets in TRANSITIONS.items() for b in targets}
    assert seen == table, (seen - table, table - seen)


# Whole runs


def test_idle_machine_stays_settled_on_all_cores_and_a_neighbour_moves_it_to_one_thread():
    clock, applied = Clock(), []
    tuner = ThreadTuner(2, clock=clock, set_threads=applied.append)
    idle = {2: 0.004, 1: 0.008}
    drive(tuner, clock, idle, 10_000)  # 40 s: several probes, each one lost
    assert tuner.current == 2 and tuner_threads(tuner) == 2 and tuner.switches == 0
    assert applied and set(applied) == {1, 2}  # it did try one thread
    busy = {2: 0.050, 1: 0.010}  # a neighbour holds a core: every barrier waits for it
    drive(tuner, clock, busy, 2_000)
    assert tuner.current == 1 and tuner.switches == 1
    drive(tuner, clock, idle, 5_000)  # the neighbour is gone: back to both cores
    assert tuner.current == 2 and tuner.switches == 2


def test_the_apps_own_bursts_never_get_past_confirming():
    """In the app a screen layout holds the GIL and a core for tens of milliseconds: now and then
    two steps in a row are slow at either count. A probe they start finds one thread faster than
    those two steps, but all-core steps right after it are fast again: two threads stay."""
    clock = Clock()
    tuner = ThreadTuner(2, clock=clock, set_threads=lambda n: None)
    for i in range(20_000):  # ~100 s
        burst = i % 25 in (0, 1)
        step(tuner, clock, 0.060 if burst else {2: 0.005, 1: 0.008}[tuner_threads(tuner)])
    assert tuner.current == 2 and tuner.switches == 0


def test_the_apps_slow_stretches_back_off_slowdown_probes_and_a_neighbour_is_still_answered() -> None:
    """The app's UI thread slows a stretch of all-core steps now and then (a layout, a burst of
    frames): each stretch long enough to look like a neighbour started a probe, which lost (one
    thread was slower still) and cost the reply a step. Lost slowdown probes make the next
    slowdown wait longer; a neighbour, slowing every step for as long as it runs, still gets one."""
    clock, applied = Clock(), []
    tuner = ThreadTuner(2, clock=clock, set_threads=applied.append)
    drive(tuner, clock, {2: 0.005, 1: 0.008}, 2_000)  # 10 s idle: a baseline, periodic probes lost
    applied.clear()
    start = clock.now
    while clock.now < start + 30.0:  # every 1.5 s, 0.6 s of all-core steps at 2.5x
        slow = (clock.now - start) % 1.5 < 0.6
        step(tuner, clock, {2: 0.0125 if slow else 0.005, 1: 0.02 if slow else 0.008}[tuner_threads(tuner)])
    assert tuner.current == 2
    probes = applied.count(1)
    assert probes <= 6, probes  # one a stretch (20) without the hold
    start = clock.now
    while tuner.current == 2:
        drive(tuner, clock, {2: 0.100, 1: 0.010}, 1)
    assert clock.now - start < threads.MAX_SLOW_HOLD_S + threads.RECENT_S + 10 * 0.1


def test_all_core_steps_with_a_long_tail_lose_to_one_steady_thread() -> None:
    """Under busy neighbours most all-core steps are about as fast as one thread's, and every few
    a step waits for a descheduled thread: the mean (what sets tokens/s) is what the probe
    compares, so one thread wins although the medians say otherwise."""
    clock = Clock()
    tuner = ThreadTuner(2, clock=clock, set_threads=lambda n: None)
    i = 0
    while clock.now < 30.0 and tuner.current == 2:
        i += 1
        step(tuner, clock, (0.150 if i % 4 == 0 else 0.025) if tuner_threads(tuner) == 2 else 0.036, 4)
    assert tuner.current == 1 and clock.now < 15.0


def _busy_neighbours(tuner: ThreadTuner, clock: Clock, seed: int, seconds: float) -> float:
    """Decode steps of 4 sequences as measured with two `while True` neighbours on 2 cores:
    all-core steps mostly 22-28 ms, one in ten 150-300 ms (a descheduled thread); one thread a
    steady 29-35 ms. Returns the share of the time spent at one thread."""
    rng = random.Random(seed)
    start, at_one = clock.now, 0.0
    while clock.now < start + seconds:
        if tuner_threads(tuner) == 2:
            seconds_step = rng.uniform(0.15, 0.30) if rng.random() < 0.1 else rng.uniform(0.022, 0.028)
        else:
            seconds_step = rng.uniform(0.029, 0.035)
            at_one += seconds_step
        step(tuner, clock, seconds_step, 4)
    return at_one / seconds


def test_busy_neighbours_long_tail_is_found_whichever_steps_the_windows_catch() -> None:
    """The all-core steps' mean (45 ms) loses to one thread's (32 ms), but windows of a fraction of
    a second often hold no slow step. Baselines over BASELINE_S, confirmations that count them,
    inconclusive probes retried soon and a probation judged on its mean keep one thread most of
    the time in every run."""
    shares = []
    for seed in range(10):
        clock = Clock()
        tuner = ThreadTuner(2, clock=clock, set_threads=lambda n: None)
        shares.append(_busy_neighbours(tuner, clock, seed, 30.0))
    assert min(shares) > 0.75 and sum(shares) / len(shares) > 0.8, shares


@pytest.mark.parametrize("seed", [0, 1])
def test_window_median_matches_a_sort_of_the_steps_it_keeps(seed: int) -> None:
    rng = random.Random(seed)
    window, now = threads._Window(threads.RECENT_S), 0.0
    for i in range(3000):
        seconds = rng.choice([0.004, 0.005, rng.uniform(0.001, 0.2)])
        now += seconds + (1.0 if i and i % 700 == 0 else 0.0)  # now and then a pause clears the window
        window.add(now, seconds)
        kept = sorted(s for _, s in window.steps)
        assert window.median() == (kept[(len(kept) - 1) // 2] + kept[len(kept) // 2]) / 2
        assert len(kept) >= min(i % 700 + 1, threads.PROBE_STEPS)
