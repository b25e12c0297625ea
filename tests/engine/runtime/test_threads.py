"""The thread-count tuner: it tries the other count now and then, on decode steps of one batch
size, and keeps the faster; a probe interrupted by a new batch size changes nothing."""

from __future__ import annotations

import random

from app.engine.runtime import threads
from app.engine.runtime.threads import ThreadTuner


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def drive(tuner: ThreadTuner, clock: Clock, step_time: dict[int, float], steps: int, key: int = 1) -> None:
    for _ in range(steps):
        clock.now += step_time[tuner_threads(tuner)]
        tuner.observe(key, step_time[tuner_threads(tuner)])


def tuner_threads(tuner: ThreadTuner) -> int:
    return tuner._applied


def probing() -> ThreadTuner:
    """A tuner that has seen 10 ms all-core steps and has just started its first one-thread probe."""
    clock = Clock()
    tuner = ThreadTuner(2, clock=clock, set_threads=lambda n: None)
    while tuner_threads(tuner) == 2:
        clock.now += 0.01
        tuner.observe(1, 0.01)
    assert clock.now >= threads.FIRST_PROBE_S
    return tuner


def test_keeps_two_threads_on_an_idle_machine_and_drops_to_one_under_contention():
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


def test_a_probe_interrupted_by_another_batch_size_keeps_the_count():
    tuner = probing()
    tuner.observe(4, 0.001)  # another batch size: not comparable
    assert tuner.current == 2 and tuner_threads(tuner) == 2


def test_one_core_never_probes():
    tuner = ThreadTuner(1, set_threads=lambda n: (_ for _ in ()).throw(AssertionError(n)))
    for _ in range(100):
        tuner.observe(1, 0.01)
    assert not tuner.enabled


def test_a_neighbour_arriving_is_answered_within_seconds_not_at_the_next_period():
    clock, applied = Clock(), []
    tuner = ThreadTuner(2, clock=clock, set_threads=applied.append)
    idle = {2: 0.004, 1: 0.008}
    drive(tuner, clock, idle, 5_000)  # 20 s idle: probes lost, the interval backs off
    assert tuner.current == 2
    start = clock.now
    busy = {2: 0.100, 1: 0.010}
    while tuner.current == 2:
        drive(tuner, clock, busy, 1)
    assert clock.now - start < threads.MIN_PROBE_GAP_S + 10 * 0.1  # not the backed-off period


def test_a_probe_that_is_clearly_worse_ends_after_two_steps():
    tuner = probing()
    tuner.observe(1, 0.05)  # the first probe step pays for the switch: not judged
    assert tuner_threads(tuner) == 1
    tuner.observe(1, 0.05)  # 5x the current median
    assert tuner_threads(tuner) == 2 and tuner.current == 2


def test_a_probe_of_one_thread_that_is_somewhat_slower_ends_at_its_first_counted_step():
    """On an idle machine one thread is only ~1.3-2x slower for a small model: a probe that ran its
    five steps cost a 1.5B model's reply ~0.25 s each time."""
    tuner = probing()
    tuner.observe(1, 0.016)  # the switch's step
    tuner.observe(1, 0.014)  # 1.4x the all-core steps: cannot come out 0.8x of them
    assert tuner_threads(tuner) == 2 and tuner.current == 2


def test_back_to_one_thread_at_once_when_all_cores_turn_slow_after_a_switch():
    clock, applied = Clock(), []
    tuner = ThreadTuner(2, clock=clock, set_threads=applied.append)
    drive(tuner, clock, {2: 0.100, 1: 0.010}, 2_000)  # a neighbour: one thread wins
    assert tuner.current == 1
    while tuner.current == 1:  # a fine stretch: the next probe goes back to two
        drive(tuner, clock, {2: 0.005, 1: 0.010}, 1)
    tuner.observe(1, 1.5)  # one slow all-core step: the UI's layout, maybe
    assert tuner.current == 2
    tuner.observe(1, 1.5)  # two: all-core steps turned pathological again (each barrier waits a slice)
    assert tuner.current == 1 and tuner_threads(tuner) == 1


def test_the_apps_own_bursts_do_not_pass_for_a_neighbour():
    """In the app a screen layout holds the GIL and a core for tens of milliseconds: now and then
    two steps in a row are slow at either count. A probe they start finds one thread faster than
    those two steps, but all-core steps right after it are fast again: two threads stay."""
    clock = Clock()
    tuner = ThreadTuner(2, clock=clock, set_threads=lambda n: None)
    for i in range(20_000):  # ~100 s
        burst = i % 25 in (0, 1)
        seconds = 0.060 if burst else {2: 0.005, 1: 0.008}[tuner_threads(tuner)]
        clock.now += seconds
        tuner.observe(1, seconds)
    assert tuner.current == 2 and tuner.switches == 0


def test_a_burst_of_slow_steps_starts_no_probe_a_lasting_slowdown_does() -> None:
    """A screen layout slows a few steps by tens of milliseconds: the median over RECENT_S does not
    move and the steps add up to less than SLOW_RUN_S, so no probe starts before the periodic one.
    The same slowdown lasting starts one within about RECENT_S."""
    clock, applied = Clock(), []
    tuner = ThreadTuner(2, clock=clock, set_threads=applied.append)
    drive(tuner, clock, {2: 0.005, 1: 0.008}, 5_000)  # 25 s: the periodic probes back off
    applied.clear()
    until = tuner._next_probe
    while clock.now < until - 1.0:
        for seconds in [0.040] * 3 + [0.005] * 40:  # a 120 ms layout every ~0.3 s
            clock.now += seconds
            tuner.observe(1, seconds)
    assert applied == []
    start = clock.now
    while not applied:
        clock.now += 0.040
        tuner.observe(1, 0.040)
    assert clock.now - start <= threads.RECENT_S


def test_all_core_steps_with_a_long_tail_lose_to_one_steady_thread() -> None:
    """Under busy neighbours most all-core steps are about as fast as one thread's, and every few
    a step waits 100-300 ms for a descheduled thread: the mean (what sets tokens/s) is what the
    probe compares, so one thread wins although the medians say otherwise."""
    clock, applied = Clock(), []
    tuner = ThreadTuner(2, clock=clock, set_threads=applied.append)
    i = 0
    while clock.now < 30.0 and tuner.current == 2:
        i += 1
        seconds = (0.150 if i % 4 == 0 else 0.025) if tuner_threads(tuner) == 2 else 0.036
        clock.now += seconds
        tuner.observe(4, seconds)
    assert tuner.current == 1 and clock.now < 15.0


def test_a_periodic_probe_after_an_idle_stretch_waits_for_a_baseline() -> None:
    """A reply's first steps come while the app lays out its new message: a probe due while the
    engine was idle waits until the new batch's steps cover RECENT_S."""
    clock, applied = Clock(), []
    tuner = ThreadTuner(2, clock=clock, set_threads=applied.append)
    drive(tuner, clock, {2: 0.005, 1: 0.008}, 100)
    clock.now += 120.0  # idle: every probe is due
    applied.clear()
    start = clock.now
    while not applied:
        clock.now += 0.005
        tuner.observe(1, 0.005)
    assert clock.now - start >= threads.RECENT_S - 0.01


def test_a_replys_first_slow_steps_after_an_idle_stretch_start_no_probe() -> None:
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
            clock.now += seconds
            tuner.observe(1, seconds)
        assert applied == [], "a probe started at a reply's start"
    clock.now += 1.5
    start = clock.now
    while not applied:
        clock.now += 0.030
        tuner.observe(1, 0.030)
    assert clock.now - start <= threads.RECENT_S + 0.05


def test_slowdown_probes_that_lose_back_off_and_a_neighbour_is_still_answered() -> None:
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
        seconds = {2: 0.0125 if slow else 0.005, 1: 0.02 if slow else 0.008}[tuner_threads(tuner)]
        clock.now += seconds
        tuner.observe(1, seconds)
    assert tuner.current == 2
    probes = applied.count(1)
    assert probes <= 6, probes  # one a stretch (20) before
    start = clock.now
    while tuner.current == 2:
        drive(tuner, clock, {2: 0.100, 1: 0.010}, 1)
    assert clock.now - start < threads.MAX_SLOW_HOLD_S + threads.RECENT_S + 10 * 0.1


def _busy_neighbours(tuner: ThreadTuner, clock: Clock, seed: int, seconds: float) -> float:
    """Decode steps of 4 sequences as measured with two `while True` neighbours on 2 cores:
    all-core steps mostly 22-28 ms, one in ten 150-300 ms (a descheduled thread); one thread a
    steady 29-35 ms. Returns the share of the time spent at one thread."""
    import random

    rng = random.Random(seed)
    start, at_one = clock.now, 0.0
    while clock.now < start + seconds:
        if tuner_threads(tuner) == 2:
            seconds_step = rng.uniform(0.15, 0.30) if rng.random() < 0.1 else rng.uniform(0.022, 0.028)
        else:
            seconds_step = rng.uniform(0.029, 0.035)
            at_one += seconds_step
        clock.now += seconds_step
        tuner.observe(4, seconds_step)
    return at_one / seconds


def test_busy_neighbours_long_tail_is_found_whichever_steps_the_windows_catch() -> None:
    """The all-core steps' mean (45 ms) loses to one thread's (32 ms), but windows of a fraction of
    a second often hold no slow step. Baselines over BASELINE_S, confirmations that count them,
    inconclusive probes retried soon and a probation judged on its mean keep one thread most of
    the time in every run (before: 0.67 of the time on average, 0.01 in the worst of 20)."""
    shares = []
    for seed in range(10):
        clock = Clock()
        tuner = ThreadTuner(2, clock=clock, set_threads=lambda n: None)
        shares.append(_busy_neighbours(tuner, clock, seed, 30.0))
    assert min(shares) > 0.75 and sum(shares) / len(shares) > 0.8, shares


def test_a_switch_back_up_that_is_no_faster_on_average_is_undone_within_seconds() -> None:
    """A probe of both cores caught a stretch of fast steps: on probation, a second of all-core steps
    whose mean (without the slowest one) is no better than one thread's switches back."""
    clock = Clock()
    tuner = ThreadTuner(2, clock=clock, set_threads=lambda n: None)
    tuner.current = 1
    tuner._apply(1)
    tuner._decide(2, True, 0.032)  # as a won probe of two threads does
    assert tuner.current == 2
    start = clock.now
    i = 0
    while tuner.current == 2 and clock.now - start < 10.0:
        i += 1
        seconds = 0.2 if i % 6 == 0 else 0.025  # mean 54 ms, never two slow steps in a row
        clock.now += seconds
        tuner.observe(4, seconds)
    assert clock.now - start < 2 * threads.CONFIRM_S


def test_one_slow_step_on_probation_does_not_undo_the_switch() -> None:
    clock = Clock()
    tuner = ThreadTuner(2, clock=clock, set_threads=lambda n: None)
    tuner.current = 1
    tuner._apply(1)
    tuner._decide(2, True, 0.008)
    for i in range(400):  # 2 s of 5 ms steps and one layout of 1.2 s among them
        seconds = 1.2 if i == 10 else 0.005
        clock.now += seconds
        tuner.observe(1, seconds)
    assert tuner.current == 2


def test_a_switch_to_one_thread_on_an_idle_machine_is_undone_within_seconds() -> None:
    """A probe of one thread that won against a stall of the app's own (a reply's first second) on
    an idle machine: all cores are tried again after RECHECK_FEWER_S, not PROBE_EVERY_S."""
    clock = Clock()
    tuner = ThreadTuner(2, clock=clock, set_threads=lambda n: None)
    tuner._decide(1, True, 0.1)  # as a won and confirmed probe of one thread does
    assert tuner.current == 1
    start = clock.now
    drive(tuner, clock, {2: 0.040, 1: 0.080}, 100)
    assert tuner.current == 2 and clock.now - start < 8.0
    while tuner.current == 2 and clock.now - start < 8.0:
        drive(tuner, clock, {2: 0.040, 1: 0.080}, 1)
    assert tuner.current == 2


def test_window_median_matches_a_sort_of_the_steps_it_keeps() -> None:
    rng = random.Random(0)
    window, now = threads._Window(threads.RECENT_S), 0.0
    for i in range(3000):
        seconds = rng.choice([0.004, 0.005, rng.uniform(0.001, 0.2)])
        now += seconds + (1.0 if i and i % 700 == 0 else 0.0)  # now and then a pause clears the window
        window.add(now, seconds)
        kept = sorted(s for _, s in window.steps)
        assert window.median() == (kept[(len(kept) - 1) // 2] + kept[len(kept) // 2]) / 2
        assert len(kept) >= min(i % 700 + 1, threads.PROBE_STEPS)
