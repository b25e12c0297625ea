"""The process settings an engine changes have one owner: the first hold sets them, the last
release restores them, and releases in between keep the others' objects frozen."""

from __future__ import annotations

import gc
import sys

from app.engine.api import process_settings


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_last_release_restores_the_interval_and_unfreezes() -> None:
    before = sys.getswitchinterval()
    first = process_settings.hold()
    second = process_settings.hold()
    try:
        assert sys.getswitchinterval() == process_settings.SWITCH_INTERVAL_S
        first.freeze()
        assert gc.get_freeze_count() > 0
        first.release()
        first.release()  # again: nothing more
        assert process_settings.holders() == 1
        assert gc.get_freeze_count() > 0  # the second holder's objects stay frozen
        assert sys.getswitchinterval() == process_settings.SWITCH_INTERVAL_S
    finally:
        second.release()
    assert process_settings.holders() == 0
    assert sys.getswitchinterval() == before
    assert gc.get_freeze_count() == 0


def test_a_release_collects_what_its_holder_left_behind() -> None:
    import weakref

    other = process_settings.hold()
    try:
        with process_settings.hold() as mine:
            garbage = _Cycle()
            ref = weakref.ref(garbage)
            mine.freeze()
            del garbage
            gc.collect()
            assert ref() is not None  # frozen: out of the collector's reach
        assert ref() is None  # the release collected it, though `other` still holds
    finally:
        other.release()
