"""Blocks two live requests hold (a forked chat's prompt and its parent's) are reported once."""

from __future__ import annotations

from app.engine.types.sampling_params import SamplingParams
from tests.engine.core.test_engine import GREEDY, make_engine, model_path, prompts  # noqa: F401 - fixture


def test_stats_count_shared_prefix_blocks_once(model_path):  # noqa: F811 - the fixture
    engine = make_engine(model_path)
    prompt = prompts(1, seed=7, lo=20, hi=20)[0]  # 5 blocks of 4
    parent = engine.add_request(prompt, SamplingParams(max_tokens=30, **GREEDY))
    while parent.num_output_tokens < 2:
        engine.step()
    fork = engine.add_request(prompt + [5, 6, 7], SamplingParams(max_tokens=30, **GREEDY))
    engine.step()
    assert fork.num_cached_tokens == 20  # the parent's prompt blocks, not recomputed
    stats = engine.stats()
    by_id = {r.request_id: r for r in stats.requests}
    # The full-attention group shares all 5 blocks; each of the 6 sliding-window groups only the
    # one its window still reads (block 4: positions 16-19, the window of position 24 starts at 17).
    shared = 5 + 6
    assert by_id[parent.request_id].num_shared_blocks == by_id[fork.request_id].num_shared_blocks == shared
    assert stats.num_blocks_shared == shared
    held = sum(r.num_blocks for r in stats.requests) - stats.num_blocks_shared
    assert held == stats.num_blocks_used


def test_same_prompt_at_once_computes_it_once(model_path):  # noqa: F811 - the fixture
    """n > 1 choices arrive together: the second waits for the first's prompt blocks, then shares
    them, and its tokens are those it gets alone."""
    prompt = prompts(1, seed=8, lo=30, hi=30)[0]
    alone = make_engine(model_path, enable_prefix_caching=False)
    solo = alone.add_request(prompt, SamplingParams(max_tokens=6, **GREEDY))
    while alone.has_unfinished():
        alone.step()
    engine = make_engine(model_path, max_num_batched_tokens=16)  # the prompt takes two chunks
    first, second = (engine.add_request(prompt, SamplingParams(max_tokens=6, **GREEDY)) for _ in range(2))
    while engine.has_unfinished():
        engine.step()
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 28  # 7 full blocks of 4, the last token recomputed
    assert first.output_token_ids == second.output_token_ids == solo.output_token_ids
