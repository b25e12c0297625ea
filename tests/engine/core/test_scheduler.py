"""Block manager + scheduler without a model: accounting, prefix caching, preemption, backpressure."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.engine.core.block_manager import BlockManager
from app.engine.core.scheduler import Scheduler, SchedulerConfig
from app.engine.core.sequence import Sequence, SequenceStatus
from app.engine.runtime.model_runner import StepOutput
from app.engine.types.errors import QueueFullError
from app.engine.types.sampling_params import SamplingParams


def make_seq(rid: str, n_prompt: int, max_tokens: int = 4, base: int = 0, **params) -> Sequence:
    return Sequence(rid, [base + i for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens, **params), max_tokens)


def fake_step(sched: Scheduler, next_token: int = 7) -> list[Sequence]:
    """A step whose forward samples `next_token` wherever it reaches a sequence's end, applied as the
    engine applies a real one. Returns the sequences it finished."""
    batch = sched.schedule()
    sampled = {s.request_id: [next_token] for s, n in zip(batch.seqs, batch.num_tokens)
               if s.num_computed_tokens + n == s.num_tokens}
    return [s for s in sched.update_from_output(batch, StepOutput(sampled, {})) if s.is_finished]


def check_accounting(bm: BlockManager, seqs: list[Sequence]) -> None:
    assert bm.num_used_blocks + bm.num_free_blocks == bm.num_blocks
    held = {}
    for s in seqs:
        for b in bm.held_blocks(s):
            held[b] = held.get(b, 0) + 1
    for block in bm.blocks:
        assert block.ref_count == held.get(block.block_id, 0)
        assert (block.ref_count == 0) == (block.block_id in bm.free)
    assert bm.num_cached_free_blocks == sum(1 for b in bm.free if bm.blocks[b].hash is not None)


def test_decodes_first_then_chunked_prefill():
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=8), bm)
    a = make_seq("a", 3, max_tokens=10)
    sched.add(a)
    fake_step(sched)  # a: prefill done, one token out
    long = make_seq("long", 30, base=100)
    sched.add(long)
    for _ in range(4):
        batch = sched.schedule()
        assert batch.seqs[0] is a and batch.num_tokens[0] == 1  # the decode is never starved
        assert batch.total_tokens <= 8
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(1)
    assert long.num_computed_tokens == 4 * 7


def test_packs_several_prompts_in_one_step():
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm)
    for i, n in enumerate((5, 9, 13)):
        sched.add(make_seq(f"r{i}", n, base=10 * i))
    batch = sched.schedule()
    assert batch.num_tokens == [5, 9, 13]


def test_prefix_cache_hit_keeps_last_token_and_counts():
    bm = BlockManager(32, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm)
    first = make_seq("a", 8, max_tokens=1)  # exactly two full blocks
    sched.add(first)
    fake_step(sched)
    assert first.is_finished and bm.num_cached_free_blocks == 2
    again = make_seq("b", 8, max_tokens=1)
    sched.add(again)
    batch = sched.schedule()
    # Fully cached prompt of k*block_size tokens: the last block is recomputed so logits exist.
    assert again.num_cached_tokens == 4 and batch.num_tokens == [4]
    check_accounting(bm, [again])


def test_shared_prefix_blocks_are_shared_not_copied():
    bm = BlockManager(32, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm)
    a = make_seq("a", 9, max_tokens=5)
    sched.add(a)
    fake_step(sched)
    b = make_seq("b", 9, max_tokens=5)
    sched.add(b)
    sched.schedule()
    assert a.block_table[:2] == b.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    check_accounting(bm, [a, b])


def test_preemption_frees_most_recent_and_requeues_front():
    bm = BlockManager(6, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm)
    a, b = make_seq("a", 8, max_tokens=20), make_seq("b", 8, max_tokens=20, base=50)
    sched.add(a)
    sched.add(b)
    fake_step(sched)  # both prefilled: 4 blocks used, 2 free
    for _ in range(8):
        fake_step(sched)
    assert sched.num_preemptions >= 1
    assert b.status is SequenceStatus.WAITING and sched.waiting[0] is b and b.block_table == []
    assert a.status is SequenceStatus.RUNNING
    check_accounting(bm, [a, b])


def test_backpressure_and_queue_bound():
    bm = BlockManager(4, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_waiting=2), bm)
    big = make_seq("big", 14, max_tokens=2)
    small = make_seq("small", 6, max_tokens=2, base=40)
    sched.add(big)
    sched.add(small)
    with pytest.raises(QueueFullError):
        sched.add(make_seq("third", 2))
    batch = sched.schedule()
    assert batch.seqs == [big]  # small waits: no blocks for it yet
    assert list(sched.waiting) == [small]
    assert sched.waiting_for == "kv"  # the panel says why: the cache, not the queue


def test_waiting_for_the_step_budget_is_waiting_for_a_turn():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, long_prefill_token_threshold=0), BlockManager(64, 4))
    sched.add(make_seq("a", 8))
    sched.add(make_seq("b", 8, base=40))
    sched.schedule()
    assert len(sched.waiting) == 1 and sched.waiting_for == "turn"


def test_max_num_seqs_caps_running():
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=2), bm)
    for i in range(4):
        sched.add(make_seq(f"r{i}", 3, base=i * 10))
    batch = sched.schedule()
    assert len(batch) == 2 and len(sched.waiting) == 2
    assert sched.waiting_for == "seqs"


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 3), st.booleans()),
        min_size=1, max_size=12,
    ),
    st.integers(6, 40),
    st.sampled_from([2, 4, 16]),
    st.integers(4, 64),
    st.randoms(use_true_random=False),
)
def test_block_accounting_property(reqs, num_blocks, block_size, budget, rnd):
    """Random arrivals, lengths, shared prefixes, aborts and preemptions: used + free = total at
    every step, ref counts match the block tables, and every block comes back at the end."""
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_waiting=64), bm)
    pool_tokens = num_blocks * block_size
    pending = [
        make_seq(f"r{i}", n, max_tokens=m, base=prefix * 1000)
        for i, (n, m, prefix, _) in enumerate(reqs)
        if n + m <= pool_tokens
    ]
    abort_at = {s.request_id: rnd.randint(0, 30) for s, r in zip(pending, reqs) if r[3]}
    live: list[Sequence] = []
    for step in range(400):
        if pending and rnd.random() < 0.5:
            seq = pending.pop(0)
            sched.add(seq)
            live.append(seq)
        for seq in list(live):
            if abort_at.get(seq.request_id) == step:
                sched.finish(seq, "abort")
        fake_step(sched)
        live = [s for s in live if not s.is_finished]
        check_accounting(bm, live)
        if not pending and not live:
            break
    assert not live and not pending, "requests did not finish: the scheduler stalled"
    assert bm.num_free_blocks == num_blocks


def test_freed_blocks_without_a_prefix_are_handed_out_first():
    """A block with no reusable prefix goes back to the front of the free list: the next request
    takes it (its pages warm) instead of touching an untouched block of the pool; blocks holding a
    cached prefix still age out from the least recently used end."""
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    a = make_seq("a", 6)
    bm.allocate(a, 6)
    used = list(a.block_tables[0])
    bm.free_seq(a)
    b = make_seq("b", 6, base=100)
    bm.allocate(b, 6)
    assert sorted(b.block_tables[0]) == sorted(used)  # the same two blocks, not blocks 2 and 3
    cached = BlockManager(16, 4)
    c = make_seq("c", 8)
    cached.allocate(c, 8)
    c.num_computed_tokens = 8
    cached.cache_full_blocks(c)
    kept = [bid for bid in c.block_tables[0] if cached.blocks[bid].hash is not None]
    assert len(kept) == 2
    cached.free_seq(c)
    d = make_seq("d", 4, base=200)
    cached.allocate(d, 4)
    assert not set(kept) & set(d.block_tables[0])  # a cached prefix is not the first to go


def test_short_prompt_is_read_beside_a_long_one():
    """A chat's short prompt arriving while a long file is read gets its whole prompt in the next
    step, ahead of the rest of the file and of long prompts queued before it."""
    bm = BlockManager(256, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32, long_prefill_token_threshold=8), bm)
    files = [make_seq(f"file{i}", 100, base=1000 * i) for i in range(3)]
    for f in files:
        sched.add(f)
    fake_step(sched)
    assert files[0].num_computed_tokens == 32 and files[1].status is SequenceStatus.WAITING
    chat = make_seq("chat", 6, base=5000)
    sched.add(chat)  # queued behind two long prompts
    batch = sched.schedule()
    assert batch.seqs[0] is chat and batch.num_tokens[0] == 6
    assert batch.seqs[1:] == [files[0]] and batch.total_tokens == 32


def test_long_prompts_keep_their_order_and_fill_the_step():
    bm = BlockManager(256, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32, long_prefill_token_threshold=8), bm)
    a, b = make_seq("a", 40, base=0), make_seq("b", 40, base=100)
    sched.add(a)
    sched.add(b)
    fake_step(sched)
    batch = sched.schedule()  # a has 8 left: short now, then b fills the rest
    assert batch.seqs == [a, b] and batch.num_tokens == [8, 24]


def test_a_cached_history_makes_a_long_prompt_short():
    """A chat's next turn repeats its history: only the uncached tokens count."""
    bm = BlockManager(256, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32, long_prefill_token_threshold=8), bm)
    history = make_seq("turn1", 40, max_tokens=1)
    sched.add(history)
    while not history.is_finished:
        fake_step(sched)
    file = make_seq("file", 100, base=1000)
    sched.add(file)
    turn2 = Sequence("turn2", list(range(40)) + [7, 900, 901], SamplingParams(max_tokens=4), 4)
    sched.add(turn2)
    batch = sched.schedule()
    assert batch.seqs[0] is turn2 and turn2.num_cached_tokens == 40
    assert batch.seqs[1] is file


def test_threshold_zero_is_first_come_first_served():
    bm = BlockManager(256, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32, long_prefill_token_threshold=0), bm)
    file, chat = make_seq("file", 100), make_seq("chat", 6, base=5000)
    sched.add(file)
    sched.add(chat)
    assert sched.schedule().seqs == [file]
