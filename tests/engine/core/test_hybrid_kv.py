"""Window-capped KV for sliding-window layers (the hybrid KV cache): the groups a model's layers
form, what a sequence holds, the prefix-cache rule, and that engine outputs are those of the same
engine keeping every token."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from app.engine.core.block_manager import BlockManager
from app.engine.core.scheduler import Scheduler, SchedulerConfig
from app.engine.core.sequence import Sequence
from app.engine.gguf.model_config import ModelConfig
from app.engine.runtime.kv_cache_spec import NULL_BLOCK, KVCacheGroup, KVCacheSpec, kv_cache_spec
from app.engine.types.sampling_params import SamplingParams
from tests.engine.core.test_engine import GREEDY, make_engine, model_path, prompts, run_all, run_alone  # noqa: F401
from tests.engine.core.test_engine import GROUPS as GROUPS_TINY
from tests.engine.core.test_scheduler import check_accounting, fake_step, make_seq

GEMMA3_270M = ModelConfig(
    arch="gemma3", name="gemma3-270m", vocab_size=262144, hidden_size=640, num_layers=18, num_heads=4,
    num_kv_heads=1, head_dim=256, intermediate_size=2048, rms_norm_eps=1e-6, rope_theta=1e6, rope_style="neox",
    max_position=32768, sliding_window=512, sliding_window_pattern=6,
)


def hybrid_manager(num_blocks: int, window: int, block_size: int = 4, sliding_groups: int = 2) -> BlockManager:
    """One full-attention group and `sliding_groups` sliding ones, one layer each."""
    groups = [KVCacheGroup((0,), None)] + [KVCacheGroup((g + 1,), window) for g in range(sliding_groups)]
    return BlockManager(num_blocks, block_size, spec=KVCacheSpec(tuple(groups), block_size))


# ---- groups -----------------------------------------------------------------------------------
def test_gemma3_270m_has_a_full_group_and_five_sliding_groups_of_three_layers():
    spec = kv_cache_spec(GEMMA3_270M, 16)
    assert [g.layers for g in spec.groups] == [
        (5, 11, 17), (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16)
    ]
    assert [g.sliding_window for g in spec.groups] == [None] + [512] * 5
    assert spec.layers_per_block == 3 and spec.is_hybrid
    slots = spec.layer_slots()
    assert (slots[11].group, slots[11].slot) == (0, 1)
    assert (slots[6].group, slots[6].slot) == (2, 2)
    assert len({(s.group, s.slot) for s in slots}) == 18  # one place per layer


def test_uneven_counts_and_single_kinds():
    gemma3_4b = dataclasses.replace(GEMMA3_270M, num_layers=34)  # 5 full, 29 sliding layers
    spec = kv_cache_spec(gemma3_4b, 16)
    assert spec.layers_per_block == 5
    assert [len(g.layers) for g in spec.groups] == [5, 5, 5, 5, 5, 5, 4]
    no_window = dataclasses.replace(GEMMA3_270M, sliding_window=None)
    assert kv_cache_spec(no_window, 16).groups == (KVCacheGroup(tuple(range(18)), None),)
    off = kv_cache_spec(GEMMA3_270M, 16, hybrid=False)
    assert off.groups == (KVCacheGroup(tuple(range(18)), None),) and not off.is_hybrid
    all_sliding = dataclasses.replace(GEMMA3_270M, sliding_window_pattern=0)  # Mistral-style: every layer
    assert kv_cache_spec(all_sliding, 16).groups == (KVCacheGroup(tuple(range(18)), 512),)


def test_how_many_long_sequences_fit():
    """The issue's table: with a fixed pool, Gemma 3 270M sequences of 3,000 and 8,000 tokens."""
    hybrid, flat = kv_cache_spec(GEMMA3_270M, 16), kv_cache_spec(GEMMA3_270M, 16, hybrid=False)
    pool_bytes = 4 << 30
    per_layer_token = 2 * GEMMA3_270M.num_kv_heads * GEMMA3_270M.head_dim * 2  # bf16 K and V

    def fit(spec: KVCacheSpec, tokens: int) -> int:
        blocks = pool_bytes // (per_layer_token * spec.layers_per_block * 16)
        return blocks // spec.blocks_for_tokens(tokens)

    assert fit(hybrid, 3000) / fit(flat, 3000) == pytest.approx(3.2, abs=0.1)
    assert fit(hybrid, 8000) / fit(flat, 8000) == pytest.approx(4.5, abs=0.1)
    assert hybrid.max_tokens(hybrid.blocks_for_tokens(8000)) >= 8000


# ---- block manager ----------------------------------------------------------------------------
def test_sliding_groups_give_back_blocks_behind_the_window():
    bm = hybrid_manager(200, window=8)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=6), bm)
    seq = make_seq("a", 30, max_tokens=20)
    sched.add(seq)
    while not seq.is_finished:
        fake_step(sched)
        if seq.is_finished:
            break
        full, *sliding = seq.block_tables
        first = bm.spec.first_needed_block(bm.groups[1], seq.num_computed_tokens)
        assert NULL_BLOCK not in full
        for table in sliding:
            assert table[:first] == [NULL_BLOCK] * first and NULL_BLOCK not in table[first:]
            assert len(table) - first <= bm.spec.window_blocks(bm.groups[1], chunk=6)
        check_accounting(bm, [seq])
    assert bm.num_free_blocks == 200


def one_prompt_run(num_tokens: int) -> tuple[BlockManager, Scheduler, Sequence]:
    """A manager of window 8 whose cache holds the blocks of one finished `num_tokens` prompt."""
    bm = hybrid_manager(400, window=8)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm)
    first = make_seq("a", num_tokens, max_tokens=1)
    sched.add(first)
    fake_step(sched)
    assert first.is_finished
    return bm, sched, first


def test_a_cached_prefix_needs_the_window_blocks_of_its_sliding_groups():
    bm, _, first = one_prompt_run(40)
    again = make_seq("b", 40, max_tokens=1)
    hit = bm.find_cached_prefix(again)
    assert hit.num_blocks == 9  # (40 - 1) // 4: all but the block of the last token
    # Sliding groups hand over only the blocks the window of position 36 reads (29..35: blocks 7, 8).
    assert [t[:7] for t in hit.tables[1:]] == [[NULL_BLOCK] * 7] * 2 and all(NULL_BLOCK not in t[7:] for t in hit.tables)
    # An evicted block before the window costs nothing...
    forget(bm, group=1, index=3, seq=first)
    assert bm.find_cached_prefix(again).num_blocks == 9
    # ...one inside it shortens the hit to where the window is whole again: 8 blocks need 6 and 7.
    forget(bm, group=2, index=8, seq=first)
    assert bm.find_cached_prefix(again).num_blocks == 8
    forget(bm, group=1, index=6, seq=first)  # now 8 blocks lack block 6, and so do 7 (they need 5, 6)
    assert bm.find_cached_prefix(again).num_blocks == 6  # the window of position 24 reads blocks 4, 5
    forget(bm, group=0, index=2, seq=first)  # a full group's miss cuts everything after it
    assert bm.find_cached_prefix(again).num_blocks == 2


def forget(bm: BlockManager, group: int, index: int, seq: Sequence) -> None:
    """Evict one group's cached block of `seq`'s prompt, as allocation would."""
    del bm.cached[group][bm._prompt_blocks(seq)[index][0]]


def test_admitting_a_hit_revives_only_what_the_window_reads():
    bm, sched, _ = one_prompt_run(40)
    b = make_seq("b", 41, max_tokens=1)  # a's prompt and one more token
    sched.add(b)
    batch = sched.schedule()
    assert batch.num_tokens == [1] and b.num_cached_tokens == 40
    # The full group: a's 10 blocks and one for position 40. Each sliding group: the 2 blocks the
    # window of position 40 reads (33..40: blocks 8, 9) and that same new block.
    assert [sum(b != NULL_BLOCK for b in t) for t in b.block_tables] == [11, 3, 3]
    assert bm.num_used_blocks == 17
    bm.free_seq(b)
    assert bm.num_free_blocks == 400


# ---- property test with window freeing and forks -----------------------------------------------
def test_block_accounting_with_windows_forks_and_preemption():
    """Random arrivals, forks of live sequences, aborts, preemptions, windows of 1 to 12 tokens:
    used + free = total at every step, ref counts match the tables, and every block comes back."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=60, deadline=None)
    @given(
        st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 3), st.booleans(), st.booleans()),
                 min_size=1, max_size=12),
        st.integers(20, 80), st.sampled_from([2, 4]), st.integers(4, 32), st.integers(1, 12),
        st.randoms(use_true_random=False),
    )
    def run(reqs, num_blocks, block_size, budget, window, rnd):
        bm = hybrid_manager(num_blocks, window, block_size)
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_waiting=64), bm)
        limit = bm.spec.max_tokens(num_blocks, budget)
        live, pending = [], list(enumerate(reqs))
        for step in range(500):
            if pending and rnd.random() < 0.5:
                i, (n, m, prefix, fork, abort) = pending.pop(0)
                seq = make_seq(f"r{i}", n, max_tokens=m, base=prefix * 1000)
                parents = [s for s in live if s.num_tokens + n < limit]
                if fork and parents:  # a forked chat: the parent's tokens so far, then its own
                    parent = rnd.choice(parents)
                    seq = make_seq(f"r{i}", 1, max_tokens=m)
                    seq.token_ids = seq.prompt_token_ids = parent.token_ids + [7] * n
                    seq.num_prompt_tokens = len(seq.token_ids)
                if seq.num_tokens + m > limit:
                    continue
                sched.add(seq)
                live.append(seq)
                if abort:
                    seq.abort_at = step + rnd.randint(0, 30)
            for seq in list(live):
                if getattr(seq, "abort_at", None) == step:
                    sched.finish(seq, "abort")
            fake_step(sched)
            live = [s for s in live if not s.is_finished]
            check_accounting(bm, live)
            for seq in live:
                for group, table in zip(bm.groups, seq.block_tables):
                    first = bm.spec.first_needed_block(group, seq.num_computed_tokens)
                    assert NULL_BLOCK not in table[first:]
            if not pending and not live:
                break
        assert not live and not pending, "requests did not finish: the scheduler stalled"
        assert bm.num_free_blocks == num_blocks

    run()


# ---- the engine -------------------------------------------------------------------------------
def test_window_cap_gives_the_tokens_of_keeping_everything(model_path):  # noqa: F811 - the fixture
    """The tiny Gemma 3 (window 8, blocks of 4): prompts of 3-40 tokens cross the window. Batched,
    chunked, prefix-cached and preempted runs with the cap equal runs keeping every token."""
    reqs = prompts(8, seed=21)
    keep_all = run_alone(make_engine(model_path, disable_hybrid_kv_cache_manager=True, enable_prefix_caching=False), reqs)
    batched = make_engine(model_path)
    assert batched.plan.kv_spec.is_hybrid
    assert run_all(batched, reqs, max_tokens=12) == keep_all
    assert run_all(batched, reqs, max_tokens=12) == keep_all  # the prompts again: prefix-cache hits
    assert batched.block_manager.num_hit_tokens > 0
    chunked = make_engine(model_path, max_num_batched_tokens=7)
    assert run_all(chunked, reqs) == keep_all
    tight = make_engine(model_path, kv_cache_blocks=100)
    assert run_all(tight, reqs) == keep_all
    assert tight.scheduler.num_preemptions > 0
    for engine in (batched, chunked, tight):
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_long_sequence_holds_its_window_not_its_length(model_path):  # noqa: F811 - the fixture
    engine = make_engine(model_path)
    seq = engine.add_request(list(range(10, 70)), SamplingParams(max_tokens=40, **GREEDY))
    while seq.num_output_tokens < 30:
        engine.step()
    held = engine.stats().requests[0].num_blocks
    per_group = math.ceil(seq.num_computed_tokens / 4)
    # 1 full group of every block; 6 sliding groups of at most 3 (window 8 with blocks of 4).
    assert per_group + 6 * 2 <= held <= per_group + 6 * 3
    assert engine.stats().num_blocks_used == held
    engine.abort(seq.request_id)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.slow
def test_gemma3_270m_greedy_tokens_with_the_window_cap(embedded_model_path):
    """The real model, fp32: prompts of 600 and 1,500 tokens cross its 512-token window. Batched
    and chunked with the cap, they continue as one by one keeping every token."""
    from app.engine import LLM

    rng = random.Random(0)
    reqs = [[2] + [rng.randrange(1000, 200000) for _ in range(n - 1)] for n in (600, 1500)]
    params = SamplingParams(max_tokens=6, **GREEDY)

    def generate(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
        return [out.token_ids for out in llm.generate(batch, params)]

    common = dict(device="cpu", dtype="float32", kv_cache_blocks=2048)
    keep_all = LLM(str(embedded_model_path), disable_hybrid_kv_cache_manager=True, **common)
    alone = [generate(keep_all, [p])[0] for p in reqs]
    del keep_all
    capped = LLM(str(embedded_model_path), max_num_batched_tokens=384, **common)
    assert generate(capped, reqs) == alone


def test_stats_panel_and_metrics_count_the_real_cost(model_path):  # noqa: F811 - the fixture
    from app.server.prometheus import _engine_lines
    from app.ui.panels import render_kv

    engine = make_engine(model_path, kv_cache_dtype="float32")  # the figures below are fp32's
    idle = engine.stats()
    assert idle.kv_cache_dtype == "float32"
    assert idle.kv_bytes_per_token_past_window * GROUPS_TINY == idle.kv_bytes_per_token  # 1 of 7 layers
    assert idle.kv_cache_tokens == 2048 * 4 // GROUPS_TINY
    assert idle.num_tokens_fit == idle.kv_cache_tokens  # a new sequence grows in every group
    seq = engine.add_request(list(range(10, 70)), SamplingParams(max_tokens=40, **GREEDY))
    for _ in range(3):
        engine.step()
    # Past its window only the full-attention group grows: a token costs one block in 4 tokens.
    stats = engine.stats()
    assert stats.num_tokens_fit == stats.block_size * (stats.num_blocks_total - stats.num_blocks_used)
    panel = render_kv(stats, {}, 40).plain
    assert "float32 · 3.5 KiB/token · 4 tok/block" in panel
    assert "512 B/token past the window" in panel
    assert f"{stats.num_tokens_fit:,} more tokens fit" in panel
    metrics = "\n".join(_engine_lines(stats, {}))
    assert f"localbatch:kv_bytes_per_token {stats.kv_bytes_per_token}" in metrics
    assert f"localbatch:kv_cache_tokens_fit {stats.num_tokens_fit}" in metrics
    engine.abort(seq.request_id)
