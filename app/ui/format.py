"""Short human-readable numbers for the panels, and an error as the one line a person reads."""

from __future__ import annotations

from app.engine.types.errors import LocalbatchError


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


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    message = text[0] if text else ""
    if isinstance(error, LocalbatchError) and message:
        return message
    return f"{type(error).__name__}: {message}" if message else type(error).__name__
