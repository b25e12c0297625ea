"""The figures every benchmark reports: percentiles, medians, and the engine's step split (time
inside steps against time between them), from an `EngineStats` pair or from `/metrics` counters."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.engine.types.outputs import EngineStats


def percentile(values: Iterable[float], q: float) -> float:
    """The nearest-rank `q` quantile (0 <= q <= 1) of `values`; NaN when there are none."""
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else math.nan


def median(values: Iterable[float]) -> float:
    """The median, NaN when there are no values (a missing figure, not an error)."""
    s = list(values)
    return statistics.median(s) if s else math.nan


def dist_ms(seconds: list[float], quantiles: Iterable[float] = (0.5, 0.99)) -> dict[str, float]:
    """Mean and percentiles of durations in seconds, as milliseconds: {"mean", "p50", "p99"}
    (keys p<100*q>); zeros when there are none, so a report's shape does not change."""
    out = {"mean": round(statistics.fmean(seconds) * 1e3, 2) if seconds else 0.0}
    for q in quantiles:
        out[f"p{round(q * 100):d}"] = round(percentile(seconds, q) * 1e3, 2) if seconds else 0.0
    return out


def paired_ratio(pairs: Iterable[tuple[float, float]]) -> float:
    """The median of the pairs' ratios b / a: how two runs taken seconds apart compare, with the
    machine's drift between pairs cancelled."""
    return median(b / a for a, b in pairs if a)


def _split(steps: float, step_time: float, gaps: float, gap_time: float, missing: float) -> dict[str, float]:
    return {"step_ms": round(1e3 * step_time / steps, 3) if steps else missing,
            "step_gap_us": round(1e6 * gap_time / gaps, 1) if gaps else missing}


def step_split(before: EngineStats, after: EngineStats) -> dict[str, float]:
    """The mean step time (ms) and the mean time between a step and the next while requests were
    unfinished (µs: the host's work between steps; `serve` and the app add their hand-offs to it)."""
    return _split(after.num_steps - before.num_steps, after.total_step_time_s - before.total_step_time_s,
                  after.num_step_gaps - before.num_step_gaps, after.total_step_gap_s - before.total_step_gap_s, 0.0)


def counter_step_split(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """`step_split` from two scrapes of a server's `/metrics` (`parse_metrics` keys); NaN where the
    server does not count steps."""
    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    return _split(delta("steps"), delta("step_time_total"), delta("step_gaps"), delta("step_gap_total"), math.nan)
