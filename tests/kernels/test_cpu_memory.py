"""The memory's read floor: `read_pass` through `cpu_memory.read_bandwidth`, and the engine's figure
built on it. Only that each gives a rate is checked, never its size (docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch

from app.engine.runtime.device import copy_bandwidth, memory_bandwidth
from app.kernels import cpu_qgemm
from app.kernels.cpu_memory import read_bandwidth

needs_c = pytest.mark.skipif(cpu_qgemm._library() is None, reason="no C compiler or no AVX2/FMA/F16C here")


@needs_c
@pytest.mark.parametrize("threads", [1, 3])
def test_the_read_loop_gives_a_rate_on_any_thread_count(threads):
    """A share that is not whole 256-byte steps is left out, not read past."""
    assert read_bandwidth(threads, nbytes=(8 << 20) + 192, repeats=1) > 0


def test_the_engine_takes_the_faster_of_the_copy_and_the_read_loop(monkeypatch):
    cpu = torch.device("cpu")
    memory_bandwidth.cache_clear()
    monkeypatch.setattr("app.kernels.cpu_memory.read_bandwidth", lambda threads: None)  # the C kernels off
    assert memory_bandwidth(cpu) == copy_bandwidth(cpu)
    memory_bandwidth.cache_clear()
    monkeypatch.setattr("app.kernels.cpu_qgemm.enabled", lambda: False)  # the GEMMs off: no read loop at all
    monkeypatch.setattr("app.kernels.cpu_memory.read_bandwidth", lambda threads: pytest.fail("measured"))
    assert memory_bandwidth(cpu) == copy_bandwidth(cpu)
    monkeypatch.setattr("app.kernels.cpu_qgemm.enabled", lambda: True)
    memory_bandwidth.cache_clear()
    monkeypatch.setattr("app.kernels.cpu_memory.read_bandwidth", lambda threads: copy_bandwidth(cpu) * 2)
    assert memory_bandwidth(cpu) == copy_bandwidth(cpu) * 2
    memory_bandwidth.cache_clear()
