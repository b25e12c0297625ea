"""What /proc/cpuinfo says about the machine's CPU: its model name and its feature flags, read once
per process. The one reader for the C kernels' build check (`kernels.cpu_build`), the kernel
choice's cache key, `localbatch doctor` and the benchmarks' records. Torch-free."""

from __future__ import annotations

import functools

CPUINFO = "/proc/cpuinfo"


@functools.cache
def cpu_model() -> str:
    """The first model name /proc/cpuinfo lists; "" where it lists none (not Linux, or a CPU whose
    kernel names none): callers fall back to `platform`'s names."""
    return _first("model name")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The x86 feature flags /proc/cpuinfo lists; empty where it has none (not Linux, not x86)."""
    return frozenset(_first("flags").split())


def _first(key: str) -> str:
    """The value of the first /proc/cpuinfo line starting with `key`; "" without one (or the file)."""
    try:
        with open(CPUINFO) as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(key)), "")
    except OSError:
        return ""
