"""The step thread's team pinned one thread per CPU while it spans every CPU, and only then."""

import os
import threading

import pytest

from app.engine.runtime.affinity import TeamAffinity


class FakeOS:
    def __init__(self, fail_on: int | None = None) -> None:
        self.affinity: dict[int, set[int]] = {}
        self.fail_on = fail_on

    def set(self, tid: int, cpus: set[int]) -> None:
        if tid == self.fail_on:
            raise OSError(3, "No such process")
        self.affinity[tid] = set(cpus)


def test_a_team_spanning_every_cpu_gets_one_cpu_per_thread_and_fewer_threads_are_let_go():
    fake = FakeOS()
    affinity = TeamAffinity(lambda n: [100 + i for i in range(n)], fake.set, allowed={4, 5, 6})
    affinity.apply(3)
    assert fake.affinity == {100: {4}, 101: {5}, 102: {6}}
    affinity.apply(1)  # the tuner's answer to a busy neighbour: the scheduler may move it away
    assert fake.affinity == {100: {4, 5, 6}, 101: {4, 5, 6}, 102: {4, 5, 6}}
    assert affinity.pinned == []
    affinity.apply(3)
    assert fake.affinity[101] == {5}


def test_fewer_threads_than_cpus_are_never_pinned():
    fake = FakeOS()
    affinity = TeamAffinity(lambda n: list(range(n)), fake.set, allowed={0, 1, 2, 3})
    affinity.apply(2)
    assert fake.affinity == {} and affinity.pinned == []


def test_a_team_the_runtime_staffed_short_is_left_alone():
    fake = FakeOS()
    affinity = TeamAffinity(lambda n: [7], fake.set, allowed={0, 1})
    affinity.apply(2)
    assert fake.affinity == {}


def test_without_the_c_kernels_nothing_is_pinned():
    fake = FakeOS()
    affinity = TeamAffinity(lambda n: None, fake.set, allowed={0, 1})
    affinity.apply(2)
    assert fake.affinity == {} and affinity.pinned == []


def test_one_cpu_turns_it_off():
    assert not TeamAffinity(lambda n: [1], FakeOS().set, allowed={3}).enabled


def test_a_failed_placement_turns_it_off_and_frees_the_threads_it_had_pinned(caplog):
    fake = FakeOS()
    tids = [10, 11]
    affinity = TeamAffinity(lambda n: tids[:n], fake.set, allowed={0, 1})
    affinity.apply(2)
    tids[:] = [10, 12]  # 12 is gone by the time it is placed
    fake.fail_on = 12
    affinity.apply(1)
    affinity.apply(2)
    assert not affinity.enabled
    assert "scheduler places them" in caplog.text
    assert fake.affinity[10] == {0, 1}
    affinity.apply(2)  # off: no more attempts
    assert fake.affinity[10] == {0, 1}


def _on_a_fresh_thread(fn):
    """Run `fn` on its own thread: pinning the test runner's thread would pin every later thread."""
    out: list = []
    errors: list = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return out[0]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two CPUs")
def test_the_real_team_is_pinned_and_let_go():
    from app.kernels.cpu_team import team_tids

    allowed = sorted(os.sched_getaffinity(0))
    if team_tids(2) is None:
        pytest.skip("the C kernels are off here")

    def place():
        affinity = TeamAffinity(team_tids)
        affinity.apply(len(allowed))
        pinned = {tid: os.sched_getaffinity(tid) for tid in affinity.pinned}
        affinity.apply(1)
        freed = [os.sched_getaffinity(tid) for tid in pinned]
        return pinned, freed

    pinned, freed = _on_a_fresh_thread(place)
    assert len(pinned) == len(allowed)
    assert sorted(cpu for cpus in pinned.values() for cpu in cpus) == allowed
    assert all(cpus == set(allowed) for cpus in freed)
    assert os.sched_getaffinity(0) == set(allowed)  # the test runner's own thread untouched


def test_the_apps_tuner_places_the_team_through_its_thread_count():
    import torch

    from app.engine.runtime.threads import ThreadTuner
    from app.kernels.cpu_team import team_tids

    before = torch.get_num_threads()
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    places = team_tids(1) is not None and len(allowed) > 1 and before == len(allowed)

    def tune():
        tuner = ThreadTuner()
        tuner.place_team()
        first = list(tuner.affinity.pinned)
        tuner._apply(1)  # what a won probe of one thread does
        return first, list(tuner.affinity.pinned)

    try:
        first, after_one = _on_a_fresh_thread(tune)
    finally:
        torch.set_num_threads(before)
    assert len(first) == (before if places else 0)
    assert after_one == []
