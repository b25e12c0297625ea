"""Kernels chosen per shape by measurement, once per machine.

On a bf16 CPU a packed weight (int8, or int4) reads fewer bytes than the bf16 one and wins at one
row, but its kernel scales badly with rows and loses to bf16's from some row count on
(docs/tuning.md). Which is faster at which row count depends on the CPU and the shape, so it is
measured at the first start and kept in the user cache dir, keyed by CPU, torch version, thread
count and shape.

Each call is timed with the weight out of the caches, as a decode step meets it: a model's layers
stream through far more bytes than a last-level cache holds, so every matrix comes from memory.
Timed hot, a 3072 x 576 matrix fits the cache and the dense kernel looks better than it is.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from app.kernels.cpu_info import cpu_model
from app.kernels.settings import LINEAR_KERNEL_ENV, KernelSettings

log = logging.getLogger(__name__)

KERNEL_ENV = LINEAR_KERNEL_ENV  # "packed" (or "int8") | "dense" | "auto" (default), read in `settings`
_ROW_COUNTS = (1, 2, 4, 8, 16, 32, 64)
_REPEATS = 5  # best of: a busy machine only ever makes a call slower
_EVICT_BYTES = 64 << 20  # twice a last-level cache: writing it pushes the weight out
_KEY_VERSION = "cold"  # measurements taken before weights were evicted are not reused
_evict_buffer: torch.Tensor | None = None
PACKED_EVERYWHERE = 1 << 30  # packed_max_rows of a packed kernel that never lost: every row count


class KernelChoice:
    """The packed copy for up to `packed_max_rows` rows, the dense weight above that."""

    def __init__(self, packed_max_rows: int) -> None:
        self.packed_max_rows = packed_max_rows

    def use_packed(self, rows: int) -> bool:
        return rows <= self.packed_max_rows

    def __repr__(self) -> str:
        return f"KernelChoice(packed_max_rows={self.packed_max_rows})"


def choose_packed_rows(packed_fn: Callable[[torch.Tensor], torch.Tensor], dense_fn: Callable[[torch.Tensor], torch.Tensor],
                     shape: tuple[int, int], dtype: torch.dtype, cache_path: Path | None = None,
                     kind: str | None = None, forced: str | None = None) -> KernelChoice:
    """The row counts at which `packed_fn` (a form named `kind`, by default its `name`: "int8" or
    "int4") beats `dense_fn` for a `shape` weight on this machine (input `[rows, shape[1]]`), from the cache or measured now
    (once per machine and shape: the larger the matrix, the longer) and cached. `forced`: the
    setting of `LOCALBATCH_LINEAR_KERNEL` ("packed", "dense"; default read from the environment)."""
    forced = forced or KernelSettings.from_env().linear_kernel
    if forced == "packed":
        return KernelChoice(PACKED_EVERYWHERE)
    if forced == "dense":
        return KernelChoice(0)
    path = cache_path or default_cache_path()
    kind = kind or getattr(packed_fn, "name", "int8")
    key = _machine_key(shape, dtype) + ("" if kind == "int8" else f"|{kind}")
    cached = _read(path).get(key)
    if isinstance(cached, dict) and isinstance(cached.get("packed_max_rows"), int):
        return KernelChoice(cached["packed_max_rows"])
    started = time.perf_counter()
    timings = measure(packed_fn, dense_fn, shape[1], dtype)
    choice = KernelChoice(crossover(timings))
    log.info("%s weight: %s, measured in %.2f s: %s", shape, choice, time.perf_counter() - started, timings)
    _write(path, key, {"packed_max_rows": choice.packed_max_rows, "timings_ms": timings})
    return choice


def measure(packed_fn: Callable, dense_fn: Callable, hidden: int, dtype: torch.dtype,
            row_counts: tuple[int, ...] = _ROW_COUNTS) -> dict[str, list[float]]:
    """{rows: [packed ms, dense ms]} (best of a few runs), stopping once the packed kernel has lost
    twice in a row: its cost only grows with rows from there."""
    out: dict[str, list[float]] = {}
    losses = 0
    for rows in row_counts:
        x = torch.randn(rows, hidden).to(dtype)
        t_packed, t_dense = _best_ms(packed_fn, x), _best_ms(dense_fn, x)
        out[str(rows)] = [round(t_packed, 3), round(t_dense, 3)]
        losses = losses + 1 if t_packed > t_dense else 0
        if losses == 2:
            break
    return out


def crossover(timings: dict[str, list[float]]) -> int:
    """The largest row count up to which the packed kernel was never slower (0: dense everywhere;
    no loss at all: packed at any count, since measuring stops only after losses)."""
    best = 0
    for rows in sorted(timings, key=int):
        t_packed, t_dense = timings[rows]
        if t_packed > t_dense:
            return best
        best = int(rows)
    return PACKED_EVERYWHERE


def default_cache_path() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("localbatch")) / "kernel_choice.json"


def _best_ms(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
    fn(x)  # warm-up: first calls pack weights or allocate
    best = float("inf")
    for _ in range(_REPEATS):
        _evict_caches()
        t = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def _evict_caches() -> None:
    """Write a buffer bigger than the last-level cache, so the next call reads its weight from memory."""
    global _evict_buffer
    if _evict_buffer is None:
        _evict_buffer = torch.empty(_EVICT_BYTES // 4, dtype=torch.float32)
    _evict_buffer.fill_(1.0)


def _machine_key(shape: tuple[int, int], dtype: torch.dtype) -> str:
    cpu = cpu_model() or platform.processor() or platform.machine()  # not Linux: platform's name
    return (f"{cpu}|torch {torch.__version__}|{torch.get_num_threads()} threads|linear {shape[0]}x{shape[1]}|{dtype}"
            f"|{_KEY_VERSION}")


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, key: str, value: dict) -> None:
    """Merge `key` into the cache file; a failure only costs a measurement at the next start."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read(path)
        data[key] = value
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not cache the kernel choice in %s: %s", path, e)
