"""The KV disk tier: blocks written by one engine are read back by a new engine over the same
directory and give the tokens of recomputing them; files that fail a check are removed, never used;
the budget, the eviction order, the write queue and a full disk; two writers on one directory."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
import zlib

import pytest

from app.engine.core.kv_disk_store import HEADER, RESCAN_EVERY, VERSION, KVDiskStore
from app.engine.types.batch import ScheduledBatch
from app.engine.types.sampling_params import SamplingParams
from tests.engine.core.test_engine import GREEDY, PREEMPTING_POOL, make_engine, prompts, run_alone

PAYLOAD = 1000


def digest(i: int) -> bytes:
    return i.to_bytes(32, "little")


def put(store: KVDiskStore, i: int, fill: int = 7, n: int = PAYLOAD) -> None:
    assert store.wants(digest(i), n)
    store.put(digest(i), memoryview(bytes([fill % 256]) * n))


def whole(path) -> bool:
    data = path.read_bytes()
    *_, length, crc = HEADER.unpack_from(data)
    return len(data) == HEADER.size + length and zlib.crc32(data[HEADER.size :]) == crc


def files(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(".kvb"))


# ---- the store ----------------------------------------------------------------------------------
def test_round_trip_and_a_second_put_is_not_wanted(tmp_path):
    store = KVDiskStore(tmp_path, 1 << 20, b"model A")
    put(store, 1, fill=3)
    store.flush()
    assert store.get(digest(1)) == bytes([3]) * PAYLOAD
    assert not store.wants(digest(1), PAYLOAD)  # on disk already
    assert store.get(digest(2)) is None
    c = store.counters()
    assert (c.blocks_written, c.blocks_read) == (1, 1)
    assert c.bytes_written == c.bytes_read == HEADER.size + PAYLOAD


def _one_file(tmp_path, namespace: bytes = b"model A"):
    store = KVDiskStore(tmp_path, 1 << 20, namespace)
    put(store, 1)
    store.close()
    (name,) = files(tmp_path)
    return tmp_path / name


@pytest.mark.parametrize("damage", ["truncated", "bit flipped", "empty", "bad magic"])
def test_a_damaged_file_is_removed_and_never_used(tmp_path, damage):
    path = _one_file(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) - 10]
    elif damage == "bit flipped":
        data[HEADER.size + 123] ^= 0x10
    elif damage == "empty":
        data = bytearray()
    else:
        data[0:4] = b"XXXX"
    path.write_bytes(bytes(data))
    store = KVDiskStore(tmp_path, 1 << 20, b"model A")  # a restart
    assert store.contains(digest(1))
    assert store.get(digest(1)) is None
    assert not path.exists()
    assert store.counters().files_rejected == 1
    assert not store.contains(digest(1))


def test_another_models_file_under_this_name_is_removed(tmp_path):
    theirs = _one_file(tmp_path, b"model B")
    store = KVDiskStore(tmp_path, 1 << 20, b"model A")
    ours = tmp_path / store._name(store._key(digest(1)))
    theirs.rename(ours)  # same name, another namespace inside
    assert store.get(digest(1)) is None
    assert not ours.exists()


def test_half_written_files_of_a_dead_writer_are_removed_at_start(tmp_path):
    dead = tmp_path / ".tmp-999999999-0-abc.kvb"  # no such pid
    dead.write_bytes(b"LBKV partial")
    live = tmp_path / f".tmp-{os.getpid()}-0-def.kvb"  # a write in flight in this process
    live.write_bytes(b"LBKV partial")
    KVDiskStore(tmp_path, 1 << 20, b"model A")
    assert not dead.exists() and live.exists()


def test_budget_evicts_least_recently_used_first(tmp_path):
    size = HEADER.size + PAYLOAD
    store = KVDiskStore(tmp_path, 4 * size, b"model A")
    for i in range(4):
        put(store, i)
        store.flush()
        os.utime(tmp_path / store._name(store._key(digest(i))), (1000 + i, 1000 + i))
    assert store.get(digest(0)) is not None  # used now: newest
    put(store, 4)
    store.flush()
    # Over budget: down to 90% of it, oldest last use first (1, then 2).
    on_disk = {i for i in range(5) if (tmp_path / store._name(store._key(digest(i)))).exists()}
    assert on_disk == {0, 3, 4}
    assert store.bytes_on_disk <= 4 * size
    assert store.counters().files_evicted == 2


def test_a_full_queue_drops_the_block(tmp_path):
    store = KVDiskStore(tmp_path, 1 << 20, b"model A", max_queued_bytes=2 * PAYLOAD)
    store._queued_bytes = 2 * PAYLOAD  # the writer is behind
    assert not store.wants(digest(1), PAYLOAD)
    assert store.counters().blocks_dropped == 1


def test_a_full_disk_turns_the_tier_off(tmp_path, monkeypatch, caplog):
    store = KVDiskStore(tmp_path, 1 << 20, b"model A")
    real_open = open

    def full(path, mode="r", *a, **kw):
        if "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr("builtins.open", full)
    put(store, 1)
    store.flush()
    assert not store.enabled and "full" in store.reason
    assert not store.wants(digest(2), PAYLOAD)
    assert files(tmp_path) == [] and not [n for n in os.listdir(tmp_path) if n.startswith(".tmp")]
    assert sum("KV disk tier off" in r.message for r in caplog.records) == 1


def test_an_unusable_directory_leaves_the_tier_off(tmp_path):
    (tmp_path / "file").write_text("x")
    store = KVDiskStore(tmp_path / "file" / "kv", 1 << 20, b"model A")
    assert not store.enabled and "cannot use" in store.reason
    store.flush()
    store.close()


def test_two_writers_share_a_directory_and_the_budget(tmp_path):
    size = HEADER.size + PAYLOAD
    a = KVDiskStore(tmp_path, 6 * size, b"model A")
    b = KVDiskStore(tmp_path, 6 * size, b"model A")
    for i in range(10):
        put(a, i, fill=i)
        put(b, 100 + i, fill=i)
        a.flush()
        b.flush()
    assert len(files(tmp_path)) * size <= 6 * size
    # Each reads what the other wrote (and a file the other evicted is a miss, not an error).
    assert b.get(digest(9)) == bytes([9]) * PAYLOAD
    assert a.get(digest(109)) == bytes([9]) * PAYLOAD
    for i in range(10):
        a.get(digest(100 + i))
    assert a.counters().files_rejected == 0


# ---- the engine ---------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["gemma3", "qwen2"])
def tiny(request, tiny_gguf_factory):
    return tiny_gguf_factory(request.param)


def long_prompts() -> list[list[int]]:
    return prompts(3, seed=5, lo=30, hi=60)


def restart_run(path, directory, **kw) -> tuple[list[list[int]], object, list]:
    """Run the prompts in one engine with the tier on, then in a new engine over the same directory."""
    first = make_engine(path, kv_disk_cache_dir=str(directory), kv_disk_cache_bytes=1 << 26, **kw)
    run_alone(first, long_prompts())
    first.block_manager.disk.close()
    second = make_engine(path, kv_disk_cache_dir=str(directory), kv_disk_cache_bytes=1 << 26, **kw)
    seqs = []
    for p in long_prompts():
        seqs.append(second.add_request(p, SamplingParams(max_tokens=12, **GREEDY)))
        while second.has_unfinished():
            second.step()
    return [s.output_token_ids for s in seqs], second, seqs


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_restart_restores_blocks_and_gives_the_same_tokens(tiny, tmp_path, kv):
    off = run_alone(make_engine(tiny, kv_cache_dtype=kv), long_prompts())
    tokens, engine, seqs = restart_run(tiny, tmp_path, kv_cache_dtype=kv)
    assert tokens == off
    disk = engine.stats().kv_disk
    assert disk.enabled and disk.num_blocks_read > 0 and disk.bytes_read > 0
    assert all(s.num_disk_cached_tokens > 0 for s in seqs)
    assert disk.num_tokens_restored == sum(s.num_disk_cached_tokens for s in seqs)
    assert all(s.num_disk_cached_tokens <= s.num_cached_tokens for s in seqs)


def test_damaged_files_after_a_restart_are_recomputed(tiny, tmp_path):
    off = run_alone(make_engine(tiny), long_prompts())
    first = make_engine(tiny, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_bytes=1 << 26)
    run_alone(first, long_prompts())
    first.block_manager.disk.close()
    names = files(tmp_path)
    for k, name in enumerate(names):  # every file damaged: each is removed, nothing is used
        path = tmp_path / name
        data = bytearray(path.read_bytes())
        if k % 2:
            data[-1] ^= 1
        else:
            data = data[: HEADER.size + 5]
        path.write_bytes(bytes(data))
    second = make_engine(tiny, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_bytes=1 << 26)
    assert run_alone(second, long_prompts()) == off
    disk = second.stats().kv_disk
    assert disk.num_blocks_read == 0 and disk.num_files_rejected >= 1
    second.block_manager.disk.flush()
    assert files(tmp_path) and all(whole(tmp_path / n) for n in files(tmp_path))  # recomputed, rewritten


def test_another_kv_dtype_does_not_read_the_blocks(tiny, tmp_path):
    first = make_engine(tiny, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_bytes=1 << 26)
    run_alone(first, long_prompts()[:1])
    first.block_manager.disk.close()
    second = make_engine(tiny, kv_cache_dtype="int8", kv_disk_cache_dir=str(tmp_path), kv_disk_cache_bytes=1 << 26)
    run_alone(second, long_prompts()[:1])
    assert second.stats().kv_disk.num_blocks_read == 0


def test_off_by_default_and_with_zero_bytes(tiny):
    engine = make_engine(tiny)
    assert engine.block_manager.disk is not None and not engine.block_manager.disk.enabled
    assert "0" in engine.stats().kv_disk.reason


def test_an_evicted_prefix_comes_back_from_disk_in_the_same_engine(tiny, tmp_path):
    """A pool too small to keep the first prompt cached once others ran: its blocks are read back."""
    reqs = long_prompts()
    plain = make_engine(tiny)
    off = run_alone(plain, reqs + reqs[:1])
    pool = 20 * plain.plan.kv_spec.num_groups  # one sequence's blocks (72 tokens of 4) and a few
    engine = make_engine(tiny, kv_cache_blocks=pool, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_bytes=1 << 26)
    out = []
    for p in reqs + reqs[:1]:
        out += run_alone(engine, [p])
        engine.block_manager.disk.flush()
    assert out == off
    assert engine.stats().kv_disk.num_blocks_read > 0


def test_speculative_decoding_over_restored_blocks(tiny, tmp_path):
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    reqs = [p * 2 for p in long_prompts()]  # repeats: prompt lookup finds drafts
    off = run_alone(make_engine(tiny, speculative_config=spec), reqs)
    first = make_engine(tiny, speculative_config=spec, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_bytes=1 << 26)
    assert run_alone(first, reqs) == off
    first.block_manager.disk.close()
    second = make_engine(tiny, speculative_config=spec, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_bytes=1 << 26)
    assert run_alone(second, reqs) == off
    assert second.stats().kv_disk.num_blocks_read > 0


def test_preempted_sequences_under_the_tier(tiny, tmp_path):
    """A pool the requests overflow once they decode: preempted ones are readmitted over the tier's
    blocks (from memory or disk, as the pool allows) with the same tokens."""
    reqs = prompts(8)
    plain = make_engine(tiny)
    off = run_alone(plain, reqs)
    pool = PREEMPTING_POOL if plain.plan.kv_spec.num_groups > 1 else 30
    engine = make_engine(tiny, kv_cache_blocks=pool, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_bytes=1 << 26)
    seqs = [engine.add_request(p, SamplingParams(max_tokens=12, **GREEDY)) for p in reqs]
    while engine.has_unfinished():
        engine.step()
        engine.block_manager.disk.flush()  # written before the preemption that needs them
    assert [s.output_token_ids for s in seqs] == off
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.kv_disk.num_blocks_written > 0


# ---- what shows it ------------------------------------------------------------------------------
def test_metrics_and_the_kv_panel_show_the_tier():
    from app.engine.types.outputs import DiskTierStats, EngineStats
    from app.server.prometheus import ServerMetrics
    from app.ui.panels import disk_tier_line, render_kv

    disk = DiskTierStats(enabled=True, budget_bytes=4 << 30, bytes_on_disk=117 << 20, num_blocks_read=220,
                         num_tokens_restored=3520, bytes_read=115 << 20, bytes_written=117 << 20)
    stats = EngineStats(num_blocks_total=100, kv_disk=disk)
    text = ServerMetrics().render(stats, "m")
    assert 'localbatch:kv_disk_cache_hits_total{model_name="m"} 220' in text
    assert 'localbatch:kv_disk_cache_restored_tokens_total{model_name="m"} 3520' in text
    assert f'localbatch:kv_disk_cache_read_bytes_total{{model_name="m"}} {115 << 20}' in text
    assert "3,520 tok restored" in disk_tier_line(disk)
    assert "disk tier" in render_kv(stats, {}, 40).plain
    full = DiskTierStats(enabled=False, reason="the disk is full (/x)", budget_bytes=1)
    assert disk_tier_line(full) == "disk tier off: the disk is full (/x)"
    unset = EngineStats(num_blocks_total=100, kv_disk=DiskTierStats(enabled=False, reason="0"))
    assert "disk tier" not in render_kv(unset, {}, 40).plain  # not configured: no line


@pytest.mark.slow
def test_real_model_restart_gives_the_same_tokens(embedded_model_path, tmp_path):
    """Gemma 3 270M (sliding-window groups) with a prompt past its 512-token window, int8 KV."""
    from app.engine.core.llm_engine import LLMEngine

    text = "def f(x):\n    return x * 2\n" * 60
    prompt = [{"role": "user", "content": text + "\nWhat does f do?"}]
    settings = dict(device="cpu", dtype="float32", kv_cache_dtype="int8", kv_cache_blocks=512)
    assert not any(tmp_path.iterdir())

    def run(engine):
        seq = engine.add_request(prompt, SamplingParams(max_tokens=8, **GREEDY))
        while engine.has_unfinished():
            engine.step()
        return seq

    tier = dict(settings, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_bytes=1 << 30)
    first = LLMEngine(str(embedded_model_path), **tier)  # an empty directory: every token computed
    off = run(first).output_token_ids
    first.block_manager.disk.close()
    seq = run(LLMEngine(str(embedded_model_path), **tier))
    assert seq.output_token_ids == off
    assert seq.num_prompt_tokens > 600 and seq.num_disk_cached_tokens >= seq.num_prompt_tokens - 16


# ---- reads off the step thread ------------------------------------------------------------------
def gated_reads(engine) -> threading.Event:
    """Make `engine`'s disk reads wait for the returned event: a slow disk."""
    store = engine.block_manager.disk.store
    gate = threading.Event()
    real = store.read_into

    def slow(digest, out):
        assert gate.wait(30), "the test never opened the gate"
        return real(digest, out)

    store.read_into = slow
    return gate


def written(path, directory, reqs) -> None:
    first = make_engine(path, kv_disk_cache_dir=str(directory), kv_disk_cache_bytes=1 << 26)
    run_alone(first, reqs)
    first.close()


def test_other_sequences_keep_stepping_while_a_read_is_pending(tiny, tmp_path):
    other, restored = prompts(2, seed=9, lo=30, hi=40)
    off = run_alone(make_engine(tiny), [other, restored], max_tokens=20)
    written(tiny, tmp_path, [restored])
    engine = make_engine(tiny, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_bytes=1 << 26)
    gate = gated_reads(engine)
    a = engine.add_request(other, SamplingParams(max_tokens=20, **GREEDY))
    while not a.num_output_tokens:
        engine.step()
    b = engine.add_request(restored, SamplingParams(max_tokens=20, **GREEDY))
    before = a.num_output_tokens
    for _ in range(5):  # the read waits on the disk; the step thread does not
        engine.step()
    assert a.num_output_tokens == before + 5
    assert b.disk_read is not None and b.num_computed_tokens == 0 and engine.block_manager.num_pending_reads == 1
    gate.set()
    while engine.has_unfinished():
        engine.step()
    assert [a.output_token_ids, b.output_token_ids] == off
    assert b.num_disk_cached_tokens > 0 and engine.stats().kv_disk.num_blocks_read > 0


def test_a_request_aborted_while_its_read_is_pending_gives_the_blocks_back(tiny, tmp_path):
    (restored,) = long_prompts()[:1]
    written(tiny, tmp_path, [restored])
    engine = make_engine(tiny, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_bytes=1 << 26)
    gate = gated_reads(engine)
    seq = engine.add_request(restored, SamplingParams(max_tokens=4, **GREEDY))
    engine.step()
    bm = engine.block_manager
    assert bm.num_pending_reads == 1 and bm.num_free_blocks < bm.num_blocks
    engine.abort(seq.request_id)
    gate.set()
    bm.finish_reads()
    assert bm.num_pending_reads == 0 and bm.num_free_blocks == bm.num_blocks
    assert bm.num_cached_free_blocks > 0  # what was read stays cached
    assert run_alone(engine, [restored], max_tokens=4) == run_alone(make_engine(tiny), [restored], max_tokens=4)


def test_a_preempted_sequence_evicted_from_memory_comes_back_from_disk(tiny, tmp_path):
    """Preempted mid-decode, its blocks then evicted from the pool: readmitted over the blocks the
    tier wrote (prompt and output so far), with the tokens of a run never preempted."""
    (prompt,) = long_prompts()[:1]
    off = run_alone(make_engine(tiny), [prompt], max_tokens=16)
    engine = make_engine(tiny, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_bytes=1 << 26)
    seq = engine.add_request(prompt, SamplingParams(max_tokens=16, **GREEDY))
    while seq.num_output_tokens < 8:
        engine.step()
    bm, sched = engine.block_manager, engine.scheduler
    bm.disk.flush()
    sched._preempt(seq, ScheduledBatch())
    taken = [bm._take_free_block() for _ in range(bm.num_free_blocks)]  # other work took every free block
    for block_id in taken:
        bm._release(block_id)
    assert bm.num_cached_free_blocks == 0
    while engine.has_unfinished():
        engine.step()
    assert seq.output_token_ids == off[0]
    assert seq.num_preemptions == 1 and seq.num_disk_cached_tokens > 0
    assert bm.disk.stats().num_blocks_read * bm.block_size > seq.num_prompt_tokens  # output blocks too


# ---- processes ----------------------------------------------------------------------------------
_WRITER = """
import sys
from app.engine.core.kv_disk_store import KVDiskStore
store = KVDiskStore(sys.argv[1], 1 << 30, b"model A")
i = 0
while True:
    if store.wants(i.to_bytes(32, "little"), 200_000):
        store.put(i.to_bytes(32, "little"), memoryview(bytes([i % 256]) * 200_000))
    i += 1
    if i == 20:
        print("writing", flush=True)
"""


def test_kill_9_while_writing_leaves_nothing_a_restart_uses_damaged(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                            cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.stdout.readline() == b"writing\n"
    deadline = time.monotonic() + 30
    while len(files(tmp_path)) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    names = [n for n in files(tmp_path) if not n.startswith(".tmp")]  # whole files the writer renamed
    assert names
    store = KVDiskStore(tmp_path, 1 << 30, b"model A")  # the restart
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp")]  # the dead writer's half-files
    good = [i for i in range(20000) if store.contains(digest(i)) and store.get(digest(i)) == bytes([i % 256]) * 200_000]
    assert len(good) == len(names) and store.counters().files_rejected == 0


def test_two_processes_write_and_read_one_directory(tmp_path):
    code = ("import sys\nfrom app.engine.core.kv_disk_store import KVDiskStore\n"
            "s = KVDiskStore(sys.argv[1], 1 << 30, b'model A')\n"
            "for i in range(int(sys.argv[2]), int(sys.argv[2]) + 30):\n"
            "    s.put(i.to_bytes(32, 'little'), memoryview(bytes([i % 256]) * 5000))\n"
            "s.close()\n")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(start)], env=env) for start in (0, 15)]
    assert [p.wait() for p in procs] == [0, 0]
    store = KVDiskStore(tmp_path, 1 << 30, b"model A")
    assert all(store.get(digest(i)) == bytes([i % 256]) * 5000 for i in range(45))  # the overlap written twice
    assert len(files(tmp_path)) == 45 and store.counters().files_rejected == 0


def test_the_budget_holds_under_concurrent_writers(tmp_path):
    size = HEADER.size + PAYLOAD
    budget = 64 * size
    stores = [KVDiskStore(tmp_path, budget, b"model A") for _ in range(3)]

    def write(k: int) -> None:
        for i in range(100):
            put(stores[k], 1000 * k + i, fill=i)

    threads = [threading.Thread(target=write, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in stores:
        s.flush()
    # Each writer sees the others' files within RESCAN_EVERY of the budget it writes itself.
    assert len(files(tmp_path)) * size <= budget * (1 + 3 * RESCAN_EVERY)
    assert all(whole(tmp_path / n) for n in files(tmp_path))


def test_another_format_version_is_removed(tmp_path):
    path = _one_file(tmp_path)
    data = bytearray(path.read_bytes())
    data[4:8] = (VERSION + 1).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    store = KVDiskStore(tmp_path, 1 << 20, b"model A")
    assert store.get(digest(1)) is None and not path.exists()


def test_clearing_the_cache_waits_for_queued_writes_and_says_what_went(tiny, tmp_path):
    engine = make_engine(tiny, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_bytes=1 << 26)
    run_alone(engine, long_prompts()[:1])
    message = engine.clear_kv_disk_cache()
    assert message.startswith("Cleared the KV disk cache: ") and " files, " in message
    assert files(tmp_path) == []
    assert make_engine(tiny).clear_kv_disk_cache().startswith("The KV disk cache is off (")


async def test_the_async_engine_clears_through_its_inbox(tiny, tmp_path):
    from app.engine.api.async_engine import AsyncEngine

    engine = AsyncEngine(str(tiny), device="cpu", dtype="float32", block_size=4, kv_cache_blocks=2048,
                         kv_disk_cache_dir=str(tmp_path), kv_disk_cache_bytes=1 << 26)
    try:
        [_ async for _ in engine.stream(long_prompts()[0], SamplingParams(max_tokens=2, **GREEDY))]
        assert (await engine.clear_kv_disk_cache()).startswith("Cleared the KV disk cache: ")
        assert files(tmp_path) == []
    finally:
        await engine.aclose()
