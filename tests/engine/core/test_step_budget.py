"""The prompt-token budget beside running decodes: learned from step times, sized for the latency
target, applied by the scheduler only while replies are waiting on the step."""

from __future__ import annotations

from app.engine.core import step_budget
from app.engine.core.block_manager import BlockManager
from app.engine.core.scheduler import Scheduler, SchedulerConfig
from app.engine.core.step_budget import PrefillBudget
from tests.engine.core.test_scheduler import fake_step, make_seq


def trained(target_s: float | None = None) -> PrefillBudget:
    budget = PrefillBudget(512, target_s)
    for _ in range(20):
        budget.observe(4, 0, 0.040)  # decode-only steps: 40 ms
        budget.observe(4, 100, 0.140)  # 100 prompt tokens beside them: 1 ms each
    return budget


def test_without_decodes_the_whole_budget():
    assert PrefillBudget(512).cap(0) == 512
    assert trained().cap(0) == 512  # nothing is waiting on the step: prefill as fast as it goes


def test_unmeasured_decodes_are_measured_before_prompts_join_them():
    """Prompts read beside every step (editors' files) must not leave the decode time unknown,
    which let whole-budget steps stall the replies."""
    budget = PrefillBudget(512)
    budget.observe(0, 512, 0.512)  # a prompt alone: a token costs 1 ms
    assert budget.cap(4) == 0  # a decode-only step first
    budget.observe(4, 0, 0.040)
    assert abs(budget.cap(4) - 40) <= 1
    fresh = PrefillBudget(512)
    fresh.observe(4, 0, 0.040)
    assert fresh.cap(4) == step_budget.MIN_CHUNK  # a prompt token not measured yet: a small chunk


def test_decode_time_is_measured_again_while_every_step_is_mixed():
    budget = trained()
    budget.observe(4, 0, 0.040)
    for _ in range(step_budget.DECODE_SAMPLE_STEPS - 1):
        budget.observe(4, 40, 0.080)
        assert budget.cap(4) > 0
    budget.observe(4, 40, 0.080)
    assert budget.cap(4) == 0
    budget.observe(4, 0, 0.050)
    assert budget.cap(4) > 0


def test_default_target_is_two_decode_steps_and_a_chunk_floor():
    assert abs(trained().cap(4) - 40) <= 1  # 2 x 40 ms = 80 ms, 40 for the decodes, 40 x 1 ms
    assert abs(trained(0.3).cap(4) - 260) <= 1
    assert trained(0.045).cap(4) == step_budget.MIN_CHUNK
    assert trained(0).cap(4) == 512  # 0: no latency target
    assert trained(10.0).cap(4) == 512


def test_scheduler_caps_prompt_tokens_only_beside_decodes():
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm, prefill_cap=lambda num_decodes: 6)
    a = make_seq("a", 3, max_tokens=50)
    sched.add(a)
    batch = sched.schedule()  # nothing decodes yet: the whole budget
    assert batch.num_tokens == [3] and batch.num_decode_tokens == 0
    a.num_computed_tokens = 3
    a.append_token(1)
    sched.add(make_seq("long", 40, base=100))
    batch = sched.schedule()
    assert batch.num_tokens == [1, 6] and batch.num_decode_tokens == 1


def test_a_capped_prompt_still_finishes():
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm, prefill_cap=lambda num_decodes: 5)
    a, long = make_seq("a", 3, max_tokens=30), make_seq("long", 40, max_tokens=2, base=100)
    sched.add(a)
    fake_step(sched)
    sched.add(long)
    steps = 0
    while long.num_output_tokens == 0:
        fake_step(sched)
        steps += 1
    assert steps == 8  # 40 tokens, 5 a step


def test_a_short_prompt_caps_the_long_ones_beside_it():
    """A chat's message arriving while no reply streams still gets a short step: long prompts get
    what the cap leaves beside it, not the whole budget."""
    bm = BlockManager(128, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, long_prefill_token_threshold=8), bm,
                      prefill_cap=lambda num_decodes: 10)
    file = make_seq("file", 200, base=1000)
    sched.add(file)
    assert sched.schedule().num_tokens == [64]  # nothing waits on the step: the whole budget
    file.num_computed_tokens = 64
    chat = make_seq("chat", 6, base=5000)
    sched.add(chat)
    batch = sched.schedule()
    assert batch.seqs == [chat, file] and batch.num_tokens == [6, 4]
