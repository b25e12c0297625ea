"""A small thread-safe LRU map: compiled grammars shared by the threads that make requests."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LRUCache(Generic[K, V]):
    """Entries weigh `weight(value)` (1 each by default); adding one past `capacity` forgets the
    least recently used until the rest fit. The newest entry always stays, however heavy."""

    def __init__(self, capacity: int, weight: Callable[[V], int] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"an LRU cache needs a capacity >= 1, not {capacity}")
        self.capacity = capacity
        self._weight = weight or (lambda _value: 1)
        self._data: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._total = 0
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            entry = self._data.get(key)
            if entry is None:
                return None
            self._data.move_to_end(key)
            return entry[0]

    def put(self, key: K, value: V) -> None:
        w = self._weight(value)
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._total -= old[1]
            self._data[key] = (value, w)
            self._total += w
            while self._total > self.capacity and len(self._data) > 1:
                _, (_, dropped) = self._data.popitem(last=False)
                self._total -= dropped

    @property
    def total_weight(self) -> int:
        return self._total

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)
