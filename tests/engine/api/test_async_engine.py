"""The engine on its thread, through asyncio and through the real HTTP server, on a tiny model."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from app.engine.api.async_engine import AsyncEngine, _Inbox
from app.engine.api.engine_client import EngineClient
from app.engine.types.errors import RequestError
from app.engine.types.sampling_params import SamplingParams
from tests.support.fake_engine import ServerThread


@pytest.fixture(scope="module")
def engine(tiny_gguf_factory):
    eng = AsyncEngine(str(tiny_gguf_factory("llama", context_length=512)), device="cpu", dtype="float32",
                      kv_cache_blocks=256)
    yield eng
    asyncio.run(eng.aclose())


def wait_idle(engine: AsyncEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.num_blocks_used == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"engine not idle: {engine.stats()}")


async def until_idle(engine: AsyncEngine, timeout: float = 30.0) -> None:
    """wait_idle for a test on the event loop: it keeps running, so a stream left by `break` is
    closed (its abort sent) however many turns of the loop that takes on a loaded machine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.num_blocks_used == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine not idle: {engine.stats()}")


async def collect(engine, prompt, params, request_id=None):
    deltas = [d async for d in engine.stream(prompt, params, request_id=request_id)]
    return deltas


async def test_stream_matches_offline_tokens(engine):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    deltas = await collect(engine, "hello world", params)
    assert deltas[-1].finish_reason == "length"
    ids = [t for d in deltas for t in d.token_ids]
    assert len(ids) == 10 and deltas[-1].num_output_tokens == 10
    assert "".join(d.text for d in deltas) == engine.decode(ids)


async def test_deltas_report_the_prompt_tokens_the_prefix_cache_served(engine):
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = "the cached prefix of a long prompt " * 8
    first = await collect(engine, prompt, params)
    again = await collect(engine, prompt, params)
    n = again[-1].num_prompt_tokens
    assert first[-1].num_cached_tokens < n and 16 <= again[-1].num_cached_tokens < n
    await until_idle(engine)


async def test_concurrent_streams_decode_together(engine):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = await collect(engine, "the world is", params)
    results = await asyncio.gather(*(collect(engine, "the world is", params) for _ in range(8)))
    expected = [t for d in alone for t in d.token_ids]
    for deltas in results:
        assert [t for d in deltas for t in d.token_ids] == expected
    await until_idle(engine)


async def test_bad_request_raises_before_first_delta(engine):
    with pytest.raises(RequestError, match="context"):
        await collect(engine, [5 + i % 300 for i in range(600)], SamplingParams(max_tokens=1))
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=-1)


async def test_breaking_out_aborts_and_frees_blocks(engine):
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    async for delta in engine.stream("hello", params, request_id="gone"):
        if delta.num_output_tokens >= 3:
            break
    await asyncio.sleep(0)
    await until_idle(engine)


async def test_held_deltas_arrive_in_fewer_wake_ups_and_complete(engine, monkeypatch):
    """max_delay_s lets a stream's deltas wait for one hand-off: the first token and the last delta
    come at once, the ones between together, in order, nothing lost; a stream beside it that
    does not wait still gets a hand-off per step."""
    from app.engine.api import async_engine

    handoffs: list[list[str]] = []
    deliver = async_engine._deliver

    def counting(batch):
        handoffs.append([payload.request_id for _, payload in batch])
        deliver(batch)

    monkeypatch.setattr(async_engine, "_deliver", counting)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    alone = await collect(engine, "the world is", params)

    async def held():
        return [d async for d in engine.stream("the world is", params, request_id="held", max_delay_s=60.0)]

    handoffs.clear()
    deltas, prompt_wise = await asyncio.gather(held(), collect(engine, "the world is", params, request_id="eager"))
    ids = [t for d in deltas for t in d.token_ids]
    assert ids == [t for d in alone for t in d.token_ids] == [t for d in prompt_wise for t in d.token_ids]
    assert "".join(d.text for d in deltas) == "".join(d.text for d in alone)
    assert deltas[-1].num_output_tokens == 30 and deltas[-1].finish_reason == "length"
    # The eager stream's 30 steps each woke the loop; the held stream rode along on those.
    assert sum("eager" in h for h in handoffs) >= 30 - 1
    alone_handoffs = len(handoffs)
    handoffs.clear()
    together = await held()
    assert len(handoffs) == 2 < alone_handoffs, handoffs  # the first token, then the rest with the last delta
    # What one hand-off brought reaches the consumer as one delta: one SSE event, one UI update.
    assert [len(d.token_ids) for d in together] == [1, 29] and together[-1].num_output_tokens == 30
    assert "".join(d.text for d in together) == "".join(d.text for d in alone)
    await until_idle(engine)


async def test_deltas_sent_at_the_next_launch_arrive_whole_and_in_order(engine, monkeypatch):
    """As on a GPU: a step's deltas go out once the next step's forward is queued, and at once when
    nothing is left to run; every token arrives, in order, and every stream ends."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = await collect(engine, "the world is", params)
    sent_at_launch = []
    step = engine.engine.step

    def counting(on_launched=None):
        def launched():
            sent_at_launch.append(len(engine._pending))
            on_launched()
        return step(on_launched=launched if on_launched is not None else None)

    monkeypatch.setattr(engine.engine, "step", counting)
    monkeypatch.setattr(engine, "_publish_at_launch", True)
    results = await asyncio.gather(*(collect(engine, "the world is", params) for _ in range(4)))
    expected = [t for d in alone for t in d.token_ids]
    for deltas in results:
        assert [t for d in deltas for t in d.token_ids] == expected
        assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == 24
    assert max(sent_at_launch) >= 1  # some steps' deltas rode on the next launch
    lone = await collect(engine, "the world is", params)  # its last delta: sent with nothing left to launch
    assert [t for d in lone for t in d.token_ids] == expected
    await until_idle(engine)


def test_merged_deltas_keep_everything_of_both():
    from app.engine.types.outputs import StreamDelta

    first = StreamDelta("r", "Hel", [1], logprobs=[{1: -0.1}], num_prompt_tokens=4, num_output_tokens=1)
    last = StreamDelta("r", "lo", [2, 3], "stop", [{2: -0.2}, {3: -0.3}], num_output_tokens=3)
    merged = first.merged(last)
    assert merged == StreamDelta("r", "Hello", [1, 2, 3], "stop", [{1: -0.1}, {2: -0.2}, {3: -0.3}], 4, 3)
    assert first.merged(StreamDelta("r", "", [], "error", error="boom")).error == "boom"
    cached = StreamDelta("r", "a", [1], num_cached_tokens=16)
    assert cached.merged(last).num_cached_tokens == 16 and last.merged(cached).num_cached_tokens == 16


async def test_held_deltas_fall_due(engine):
    """A held delta is handed over once it has waited max_delay_s, also while the engine is busy
    with nothing else to send."""
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    arrivals = []
    async for delta in engine.stream("hello", params, request_id="slow", max_delay_s=0.2):
        arrivals.append((time.monotonic(), delta.num_output_tokens))
        if delta.num_output_tokens >= 3 and len(arrivals) >= 3:
            break
    assert arrivals[1][1] > 1  # the second hand-off came by time, not at the end
    await until_idle(engine)


def test_is_an_engine_client(engine):
    assert isinstance(engine, EngineClient)
    assert (engine.device, engine.dtype, engine.is_remote, engine.stats_source) == ("cpu", "float32", False, "")
    assert engine.max_model_len == 512


def test_stats_snapshot_fields(engine):
    s = engine.stats()
    assert s.num_blocks_total == 256 and s.block_size == 16 and s.kv_bytes_per_token > 0


def test_real_server_openai_client_and_disconnect(engine):
    with ServerThread(engine) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        chat = client.chat.completions.create(
            model=engine.model_name, messages=[{"role": "user", "content": "hello"}], max_tokens=5, temperature=0
        )
        assert chat.choices[0].finish_reason in ("stop", "length")
        assert chat.usage.completion_tokens <= 5
        with httpx.Client(base_url=server.url, timeout=30) as http:
            body = {"model": engine.model_name, "prompt": "hello", "max_tokens": 300, "stream": True, "ignore_eos": True}
            with http.stream("POST", "/v1/completions", json=body) as resp:
                for i, _ in enumerate(resp.iter_lines()):
                    if i >= 3:
                        break  # close mid-way: the server must abort the request
        wait_idle(engine)


async def test_speculation_streams_the_same_tokens_and_switches_off(engine, tiny_gguf_factory):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = [t for d in await collect(engine, "hello world hello world hello", params) for t in d.token_ids]
    assert engine.set_speculation(True) is False  # started without a speculative config
    spec = AsyncEngine(str(tiny_gguf_factory("llama", context_length=512)), device="cpu", dtype="float32",
                       kv_cache_blocks=256, speculative_config={"method": "ngram", "prompt_lookup_min": 1})
    try:
        ids = [t for d in await collect(spec, "hello world hello world hello", params) for t in d.token_ids]
        assert ids == plain
        assert spec.set_speculation(False) is True
        # The step thread is the switch's one writer: it applies it from the inbox and shows it
        # in the next snapshot, which an idle engine takes at once.
        deadline = time.monotonic() + 10
        while spec.stats().speculative.enabled and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert spec.stats().speculative.enabled is False
        ids = [t for d in await collect(spec, "hello world hello world hello", params) for t in d.token_ids]
        assert ids == plain
    finally:
        await spec.aclose()


async def test_inbox_hands_items_over_in_order_and_survives_a_cancelled_get() -> None:
    inbox = _Inbox()
    inbox.put_nowait(1)
    assert await inbox.get() == 1
    waiting = asyncio.ensure_future(inbox.get())
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    inbox.put_nowait(2)  # no waiter left to wake: kept for the next get
    later = asyncio.ensure_future(inbox.get())
    await asyncio.sleep(0)
    inbox.put_nowait(3)
    assert await later == 2
    assert await inbox.get() == 3
    assert not inbox.items


def test_an_adaptive_engine_places_its_own_team_and_not_the_callers_thread(tiny_gguf_factory):
    import os

    import torch

    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    eng = AsyncEngine(str(tiny_gguf_factory("llama", context_length=512)), device="cpu", dtype="float32",
                      kv_cache_blocks=64, adaptive_threads=True)
    try:
        from app.kernels.cpu_team import team_tids

        affinity = eng.engine.thread_tuner.affinity
        assert affinity is not None
        spans_every_cpu = affinity.enabled and torch.get_num_threads() == len(affinity.allowed)
        assert bool(affinity.pinned) == (spans_every_cpu and team_tids(1) is not None)
        if affinity.pinned:
            assert len(affinity.pinned) == torch.get_num_threads()
            assert eng._thread.native_id in affinity.pinned  # the step thread leads its team
            assert len(os.sched_getaffinity(eng._thread.native_id)) == 1
        if before is not None:
            assert os.sched_getaffinity(0) == before
    finally:
        asyncio.run(eng.aclose())
