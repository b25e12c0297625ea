"""The interpreter settings an in-process engine changes for the whole process, with one owner.

Two of them: a short GIL switch interval (the step thread releases the GIL inside every torch op
and needs it back between ops; a busy UI thread kept it for the default 5 ms each time) and the
long-lived objects (the model, its tokenizer tables, the KV pool, a built screen's widgets) frozen
out of the cyclic collector, whose full collections walked them all holding the GIL whenever
streaming churned enough garbage. Every user (each engine, the app's screen) holds them through
`hold()`; the first hold sets them, the last release undoes them, and a release in between
collects what its holder left behind while the others' objects stay frozen. Torch-free."""

from __future__ import annotations

import gc
import sys
import threading

SWITCH_INTERVAL_S = 0.002

_lock = threading.RLock()  # a finalizer run by gc.collect may release another hold
_holders = 0
_saved_interval: float | None = None  # the interval before the first hold


class Hold:
    """One user's hold on the process settings; `release()` once done (again does nothing)."""

    def __init__(self) -> None:
        global _holders, _saved_interval
        with _lock:
            if _holders == 0:
                _saved_interval = sys.getswitchinterval()
                sys.setswitchinterval(SWITCH_INTERVAL_S)
            _holders += 1
        self._held = True

    def freeze(self) -> None:
        """Collect, then move every object alive now out of the collector's reach (objects made
        later are collected as usual): call it once the holder's long-lived objects are built."""
        with _lock:
            if self._held:
                gc.collect()
                gc.freeze()

    def release(self) -> None:
        global _holders, _saved_interval
        with _lock:
            if not self._held:
                return
            self._held = False
            _holders -= 1
            gc.unfreeze()  # what this holder froze may be garbage now (a closed engine, a model switch)
            if _holders:
                gc.collect()
                gc.freeze()  # what the others hold stays out of reach
            else:
                sys.setswitchinterval(_saved_interval)
                _saved_interval = None

    def __enter__(self) -> "Hold":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def hold() -> Hold:
    """Hold the process settings until the returned `Hold` is released."""
    return Hold()


def holders() -> int:
    """How many holds are live (for tests)."""
    return _holders
