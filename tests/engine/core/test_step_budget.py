"""The prompt-token budget beside running decodes: learned from step times (fed by hand or by a
fake step-time model here, never the machine's clock), sized for the latency target, applied by
the scheduler only while replies are waiting on the step."""

from __future__ import annotations

from app.engine.core import step_budget
from app.engine.core.block_manager import BlockManager
from app.engine.core.scheduler import Scheduler, SchedulerConfig
from app.engine.core.step_budget import PrefillBudget
from tests.engine.core.test_scheduler import fake_step, make_seq


class FixedCap(PrefillBudget):
    """A budget whose cap is fixed: the scheduler's use of it, apart from the model."""

    def __init__(self, tokens: int) -> None:
        super().__init__(tokens)
        self.asked: list[tuple[int, int]] = []

    def cap(self, num_decode_tokens: int, num_seqs: int) -> int:
        self.asked.append((num_decode_tokens, num_seqs))
        return self.max_tokens


def trained(target_s: float | None = None) -> PrefillBudget:
    budget = PrefillBudget(512, target_s, min_chunk=16)
    for _ in range(20):
        budget.observe(4, 0, 0.040)  # decode-only steps: 40 ms
        budget.observe(4, 100, 0.140)  # 100 prompt tokens beside them: 1 ms each
    return budget


def test_without_decodes_the_whole_budget():
    assert PrefillBudget(512).cap(0, 0) == 512
    assert trained().cap(0, 0) == 512  # nothing is waiting on the step: prefill as fast as it goes


def test_unmeasured_decodes_are_measured_before_prompts_join_them():
    """Prompts read beside every step (editors' files) must not leave the decode time unknown,
    which let whole-budget steps stall the replies."""
    budget = PrefillBudget(512)
    budget.observe(0, 512, 0.512)  # a prompt alone: a token costs 1 ms
    assert budget.cap(4, 4) == 0  # a decode-only step first
    budget.observe(4, 0, 0.040)
    assert abs(budget.cap(4, 4) - 40) <= 1
    fresh = PrefillBudget(512, min_chunk=16)
    fresh.observe(4, 0, 0.040)
    assert fresh.cap(4, 4) == 16  # a prompt token not measured yet: a small chunk


def test_decode_time_is_measured_again_while_every_step_is_mixed():
    budget = trained()
    budget.observe(4, 0, 0.040)
    for _ in range(step_budget.DECODE_SAMPLE_STEPS - 1):
        budget.observe(4, 40, 0.080)
        assert budget.cap(4, 4) > 0
    budget.observe(4, 40, 0.080)
    assert budget.cap(4, 4) == 0
    budget.observe(4, 0, 0.050)
    assert budget.cap(4, 4) > 0


def test_default_target_is_two_decode_steps_and_a_chunk_floor():
    assert abs(trained().cap(4, 4) - 40) <= 1  # 2 x 40 ms = 80 ms, 40 for the decodes, 40 x 1 ms
    assert abs(trained(0.3).cap(4, 4) - 260) <= 1
    assert trained(0.045).cap(4, 4) == 16
    assert trained(0).cap(4, 4) == 512  # 0: no latency target
    assert trained(10.0).cap(4, 4) == 512


def test_scheduler_caps_prompt_tokens_only_beside_decodes():
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm, prefill_budget=FixedCap(6))
    a = make_seq("a", 3, max_tokens=50)
    sched.add(a)
    batch = sched.schedule()  # nothing decodes yet: the whole budget
    assert batch.num_tokens == [3] and batch.num_decode_tokens == 0
    a.num_computed_tokens = 3
    a.append_token(1)
    sched.add(make_seq("long", 40, base=100))
    batch = sched.schedule()
    assert batch.num_tokens == [1, 6] and batch.num_decode_tokens == 1
    assert (1, 1) in sched.prefill_budget.asked  # 1 decode row, 1 sequence waiting on the step


def test_a_capped_prompt_still_finishes():
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm, prefill_budget=FixedCap(5))
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
                      prefill_budget=FixedCap(10))
    file = make_seq("file", 200, base=1000)
    sched.add(file)
    assert sched.schedule().num_tokens == [64]  # nothing waits on the step: the whole budget
    file.num_computed_tokens = 64
    chat = make_seq("chat", 6, base=5000)
    sched.add(chat)
    batch = sched.schedule()
    assert batch.seqs == [chat, file] and batch.num_tokens == [6, 4]


def test_decode_time_is_per_count_of_decode_rows():
    budget = trained(0.1)  # 40 ms decode steps of 4 rows, 1 ms a prompt token
    assert abs(budget.cap(4, 4) - 60) <= 1
    assert abs(budget.cap(1, 1) - 60) <= 1  # 1 row not measured: 4 rows' time bounds it
    budget.observe(1, 0, 0.020)
    assert abs(budget.cap(1, 1) - 80) <= 1
    assert abs(budget.cap(8, 8) - 56) <= 1  # above what was measured: 4 more rows at a prompt token's cost


def test_a_stale_decode_time_is_measured_again():
    budget = trained()
    for _ in range(step_budget.STALE_STEPS):
        budget.observe(0, 512, 0.512)  # a long prompt alone, no decodes
    assert budget.cap(4, 4) == 0
    budget.observe(4, 0, 0.040)
    assert budget.cap(4, 4) > 0


def test_a_noisy_prompt_cost_is_planned_at_its_tail():
    steady, noisy = trained(0.1), trained(0.1)
    for i in range(20):
        noisy.observe(4, 100, 0.140 + (0.05 if i % 2 else -0.05))  # 0.5 or 1.5 ms a token, 1 ms on average
    assert abs(noisy.token_s - steady.token_s) < 0.0002
    assert noisy.cap(4, 4) < 0.8 * steady.cap(4, 4)


def fake_step_s(num_decode_tokens: int, num_prefill_tokens: int) -> float:
    """A CPU-like step: a fixed cost, 5 ms a decode row, 2 ms a prompt token."""
    return 0.030 + 0.005 * num_decode_tokens + 0.002 * num_prefill_tokens


def test_steps_beside_decodes_hold_the_target_and_the_prompt_advances():
    """A fake clock: 4 replies decode while a 600-token prompt is read beside them."""
    budget = PrefillBudget(512, 0.1, min_chunk=16)
    budget.observe(0, 600, fake_step_s(0, 600))  # an earlier prompt alone
    left, steps, mixed = 600, 0, []
    while left:
        n = min(budget.cap(4, 4), left)
        seconds = fake_step_s(4, n)
        budget.observe(4, n, seconds)
        if n:
            mixed.append(seconds)
        left -= n
        steps += 1
    assert max(mixed[1:]) <= 0.1 + 1e-9  # the first is the model's guess, a small chunk
    assert steps <= 600 // 16 + 2  # never less than a block a step


def test_below_the_floor_the_chunk_is_a_block():
    """A target a block cannot fit under still reads a block a step: TTFT stays bounded."""
    budget = PrefillBudget(512, 0.06, min_chunk=16)
    budget.observe(0, 100, fake_step_s(0, 100))
    budget.observe(4, 0, fake_step_s(4, 0))  # 50 ms: 10 ms left for 2 ms tokens, 5 of them
    assert budget.cap(4, 4) == 16


def test_chunks_of_a_small_block_are_measured():
    """With 4-token blocks the least chunk is 4 tokens: those steps must still teach the cost."""
    budget = PrefillBudget(64, 0.1, min_chunk=4)
    budget.observe(4, 0, 0.040)
    assert budget.cap(4, 4) == 4
    budget.observe(4, 4, 0.044)
    assert abs(budget.cap(4, 4) - 60) <= 1
