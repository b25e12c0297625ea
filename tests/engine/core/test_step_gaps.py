"""The step and between-step time totals (`/metrics`: localbatch:step_gap_seconds_total): the time
after a step that left requests unfinished counts until the next step; idle time never does."""

from __future__ import annotations

import time

from app.engine.types.sampling_params import SamplingParams
from tests.engine.core.test_engine import GREEDY, make_engine, model_path, prompts  # noqa: F401 - fixture


def test_gaps_count_the_time_between_busy_steps_only(model_path):  # noqa: F811 - the fixture
    engine = make_engine(model_path)
    engine.add_request(prompts(1, seed=3)[0], SamplingParams(max_tokens=4, **GREEDY))
    steps = 0
    while engine.has_unfinished():
        if steps:
            time.sleep(0.02)  # the host's work between steps, as a client's hand-off would take
        engine.step()
        steps += 1
    stats = engine.stats()
    assert stats.num_steps == steps and stats.num_step_gaps == steps - 1
    assert 0.02 * (steps - 1) <= stats.total_step_gap_s < 0.02 * (steps - 1) + 0.5
    assert stats.total_step_time_s > 0

    time.sleep(0.05)  # idle: the next request's first step has no gap before it
    engine.add_request(prompts(1, seed=4)[0], SamplingParams(max_tokens=2, **GREEDY))
    engine.step()
    assert engine.stats().num_step_gaps == steps - 1


def test_an_abort_that_empties_the_engine_ends_the_gap(model_path):  # noqa: F811 - the fixture
    engine = make_engine(model_path)
    seq = engine.add_request(prompts(1, seed=5)[0], SamplingParams(max_tokens=50, **GREEDY))
    engine.step()
    engine.abort(seq.request_id)
    time.sleep(0.05)
    engine.add_request(prompts(1, seed=6)[0], SamplingParams(max_tokens=2, **GREEDY))
    engine.step()
    stats = engine.stats()
    assert stats.num_step_gaps == 0 and stats.total_step_gap_s == 0.0
