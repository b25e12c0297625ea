"""Short human-readable numbers for the panels."""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def fmt_rate(x: float | None) -> str:
    """tokens/s: one decimal below 100, none above (the digits panel has a fixed width)."""
    if x is None:
        return "–"
    return f"{x:.1f}" if x < 100 else f"{x:.0f}"


def fmt_seconds(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def fmt_int(n: int) -> str:
    return f"{n:,}"


def fmt_wait(seconds: float) -> str:
    """A wait to the whole second, as people say it: "19 s", "1 min 05 s"."""
    secs = max(round(seconds), 1)
    return f"{secs} s" if secs < 60 else f"{secs // 60} min {secs % 60:02d} s"
