"""The figures every benchmark reports: percentiles, medians, paired ratios and the step split."""

from __future__ import annotations

import math

import pytest

from app.bench.stats import counter_step_split, dist_ms, median, paired_ratio, percentile, step_split
from app.engine.types.outputs import EngineStats


def test_percentile_is_nearest_rank():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 0.0) == 1.0 and percentile(values, 0.5) == 3.0
    assert percentile(values, 0.99) == 5.0 and percentile(values, 1.0) == 5.0  # never past the end
    assert math.isnan(percentile([], 0.5)) and math.isnan(median([]))


def test_dist_ms_keeps_its_shape_when_empty():
    assert dist_ms([0.010, 0.020, 0.030]) == {"mean": 20.0, "p50": 20.0, "p99": 30.0}
    assert dist_ms([]) == {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    assert set(dist_ms([0.1], (0.1, 0.9))) == {"mean", "p10", "p90"}


def test_paired_ratio_is_the_median_of_the_pairs_ratios():
    # The medians of each side (20 and 30) would say 1.5; the pairs say 2.
    assert paired_ratio([(10.0, 20.0), (20.0, 40.0), (30.0, 30.0)]) == 2.0
    assert paired_ratio([(0.0, 5.0), (10.0, 5.0)]) == 0.5  # a side with no figure is left out


def test_step_split_from_engine_stats_and_from_metrics():
    before = EngineStats(num_steps=10, total_step_time_s=0.5, num_step_gaps=8, total_step_gap_s=0.0008)
    after = EngineStats(num_steps=30, total_step_time_s=1.5, num_step_gaps=28, total_step_gap_s=0.0028)
    assert step_split(before, after) == {"step_ms": 50.0, "step_gap_us": 100.0}
    assert step_split(after, after) == {"step_ms": 0.0, "step_gap_us": 0.0}
    scraped = counter_step_split({"steps": 10, "step_time_total": 0.5, "step_gaps": 8, "step_gap_total": 0.0008},
                                 {"steps": 30, "step_time_total": 1.5, "step_gaps": 28, "step_gap_total": 0.0028})
    assert scraped == {"step_ms": 50.0, "step_gap_us": 100.0}
    assert all(math.isnan(v) for v in counter_step_split({}, {}).values())  # a server that does not count steps


@pytest.mark.parametrize("q", [0.25, 0.5, 0.9])
def test_percentile_of_one_value(q):
    assert percentile([7.0], q) == 7.0
