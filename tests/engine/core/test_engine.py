"""Engine invariance and edge cases on a tiny fp32 random-weight model: batched, chunked, packed,
preempted and prefix-cached runs give the same tokens as one request run alone."""

from __future__ import annotations

import random

import pytest

from app.engine.core.llm_engine import LLMEngine
from app.engine.types.errors import QueueFullError, RequestError
from app.engine.types.sampling_params import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
# The tiny Gemma 3 has 7 layers, one of them full attention: its KV cache has 7 groups of one layer,
# so a pool block holds one layer's keys and values, and a token takes up to 7 blocks' worth.
GROUPS = 7
# A pool the 8 reference requests (up to 52 tokens each) overflow once they decode: preemptions.
# Sliding-window groups keep 3 blocks of a decoding sequence, the full one all 13.
PREEMPTING_POOL = 100


def make_engine(path, **kw) -> LLMEngine:
    settings = dict(device="cpu", dtype="float32", block_size=4, kv_cache_blocks=2048, max_num_batched_tokens=512)
    settings.update(kw)
    return LLMEngine(str(path), **settings)


@pytest.fixture(scope="module")
def model_path(tiny_gguf_factory):
    return tiny_gguf_factory("gemma3")  # sliding window 8: long prompts cross it


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 250) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_all(engine: LLMEngine, reqs: list[list[int]], max_tokens: int = 12, **params) -> list[list[int]]:
    seqs = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, **{**GREEDY, **params})) for p in reqs]
    while engine.has_unfinished():
        engine.step()
    return [s.output_token_ids for s in seqs]


def run_alone(engine: LLMEngine, reqs: list[list[int]], max_tokens: int = 12, **params) -> list[list[int]]:
    return [run_all(engine, [p], max_tokens, **params)[0] for p in reqs]


@pytest.fixture(scope="module")
def reference(model_path):
    """Each of 8 prompts run alone, prefix caching off."""
    engine = make_engine(model_path, enable_prefix_caching=False)
    reqs = prompts(8)
    return reqs, run_alone(engine, reqs)


def test_batched_equals_alone(model_path, reference):
    reqs, alone = reference
    engine = make_engine(model_path, enable_prefix_caching=False)
    assert run_all(engine, reqs) == alone


def test_chunked_prefill_equals_alone(model_path, reference):
    reqs, alone = reference
    engine = make_engine(model_path, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert run_all(engine, reqs) == alone
    assert engine.stats().last_num_tokens <= 16


def test_packed_prompts_in_one_step(model_path, reference):
    reqs, alone = reference
    engine = make_engine(model_path, enable_prefix_caching=False)
    seqs = [engine.add_request(p, SamplingParams(max_tokens=12, **GREEDY)) for p in reqs]
    engine.step()
    assert engine.stats().last_batch_size == 8  # all eight prompts in the first step
    assert engine.stats().last_num_tokens == sum(map(len, reqs))
    while engine.has_unfinished():
        engine.step()
    assert [s.output_token_ids for s in seqs] == alone


def test_preempted_sequence_gives_same_tokens(model_path, reference):
    reqs, alone = reference
    engine = make_engine(model_path, kv_cache_blocks=PREEMPTING_POOL, enable_prefix_caching=False)
    assert run_all(engine, reqs) == alone
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == PREEMPTING_POOL


def test_preemption_then_prefix_cache_hit(model_path, reference):
    reqs, alone = reference
    engine = make_engine(model_path, kv_cache_blocks=PREEMPTING_POOL)
    assert run_all(engine, reqs) == alone
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.hit_rate > 0  # recompute found its own blocks still cached


def test_prefix_cache_hit_equals_miss(model_path, reference):
    reqs, alone = reference
    engine = make_engine(model_path)
    first = run_alone(engine, reqs)
    hits_before = engine.block_manager.num_hit_tokens
    second = run_alone(engine, reqs)
    assert first == alone and second == alone
    assert engine.block_manager.num_hit_tokens > hits_before


def test_fully_cached_prompt_of_whole_blocks(model_path):
    engine = make_engine(model_path)
    prompt = prompts(1, seed=5, lo=16, hi=16)[0]  # exactly 4 blocks of 4
    a = run_all(engine, [prompt])
    seq = engine.add_request(prompt, SamplingParams(max_tokens=12, **GREEDY))
    engine.step()
    assert seq.num_cached_tokens == 12  # the last block is recomputed so the last token has logits
    while engine.has_unfinished():
        engine.step()
    assert seq.output_token_ids == a[0]


def test_chunk_ending_on_block_boundary(model_path):
    prompt = prompts(1, seed=6, lo=24, hi=24)[0]
    alone = run_alone(make_engine(model_path, enable_prefix_caching=False), [prompt])
    engine = make_engine(model_path, max_num_batched_tokens=8, enable_prefix_caching=False)
    assert run_all(engine, [prompt]) == alone


def test_shared_system_prompt_across_requests(model_path):
    system = prompts(1, seed=7, lo=20, hi=20)[0]
    reqs = [system + tail for tail in prompts(4, seed=8, lo=2, hi=9)]
    alone = run_alone(make_engine(model_path, enable_prefix_caching=False), reqs)
    engine = make_engine(model_path)
    run_all(engine, reqs[:1])
    assert run_all(engine, reqs[1:]) == alone[1:]
    assert engine.block_manager.hit_rate > 0.3


@pytest.mark.parametrize("when", ["waiting", "prefilling", "decoding"])
def test_abort_frees_blocks(model_path, when):
    engine = make_engine(model_path, max_num_batched_tokens=8, max_num_seqs=1)
    keep = engine.add_request(prompts(1, seed=1)[0], SamplingParams(max_tokens=30, **GREEDY))
    target = engine.add_request(prompts(1, seed=2, lo=30, hi=30)[0], SamplingParams(max_tokens=30, **GREEDY))
    if when != "waiting":
        engine.scheduler.config.max_num_seqs = 2
    for _ in range(50):
        done = (when == "waiting") or (when == "prefilling" and target.num_computed_tokens > 0) or (
            when == "decoding" and target.num_output_tokens > 0)
        if done:
            break
        engine.step()
    if when == "prefilling":
        assert 0 < target.num_computed_tokens < target.num_prompt_tokens
    delta = engine.abort(target.request_id)
    assert delta.finish_reason == "abort"
    assert target.block_table == []
    while engine.has_unfinished():
        engine.step()
    assert keep.finish_reason == "length"
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_no_stall_while_long_prompt_prefills(tiny_gguf_factory):
    long_context = tiny_gguf_factory("gemma3", context_length=4096)
    # The prefill budget off: its chunks follow this machine's step times (test_step_budget covers it).
    engine = make_engine(long_context, max_num_batched_tokens=64, kv_cache_blocks=1024, itl_target_ms=0)
    decoders = [engine.add_request(p, SamplingParams(max_tokens=200, **GREEDY)) for p in prompts(3, seed=9)]
    while not all(s.num_output_tokens for s in decoders):
        engine.step()
    long = engine.add_request([5 + i % 200 for i in range(2000)], SamplingParams(max_tokens=2, **GREEDY))
    steps = 0
    while long.num_output_tokens == 0:
        before = [s.num_output_tokens for s in decoders]
        engine.step()
        steps += 1
        assert [s.num_output_tokens for s in decoders] == [b + 1 for b in before], "a decode was starved"
    assert steps >= 2000 // 64


def test_short_prompt_is_answered_while_a_long_one_is_read(tiny_gguf_factory):
    """A chat's next message does not wait for a pasted file's prompt (long_prefill_token_threshold),
    and its tokens are those it gets alone."""
    long_context = tiny_gguf_factory("gemma3", context_length=4096)
    engine = make_engine(long_context, max_num_batched_tokens=64, kv_cache_blocks=1024)
    file = engine.add_request([5 + i % 200 for i in range(2000)], SamplingParams(max_tokens=2, **GREEDY))
    engine.step()
    question = prompts(1, seed=3, hi=12)[0]
    chat = engine.add_request(question, SamplingParams(max_tokens=3, **GREEDY))
    engine.step()
    assert chat.num_output_tokens == 1 and file.num_output_tokens == 0
    while engine.has_unfinished():
        engine.step()
    assert chat.output_token_ids == run_all(make_engine(long_context, kv_cache_blocks=1024), [question], 3)[0]


def test_rejects_what_can_never_fit(model_path):
    engine = make_engine(model_path, kv_cache_blocks=8 * GROUPS)  # 32 tokens of pool, context 256
    with pytest.raises(RequestError, match="KV pool"):
        engine.add_request(list(range(5, 25)), SamplingParams(max_tokens=20))
    with pytest.raises(RequestError, match="context"):
        engine.add_request(list(range(5, 5 + 300)), SamplingParams(max_tokens=1))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("", SamplingParams())
    with pytest.raises(RequestError, match="out of range"):
        engine.add_request([10**9], SamplingParams())
    assert not engine.has_unfinished() and engine.block_manager.num_free_blocks == 8 * GROUPS


def test_waiting_queue_bound(model_path):
    engine = make_engine(model_path, max_waiting=2)
    for p in prompts(2):
        engine.add_request(p, SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError, match="full"):
        engine.add_request(prompts(1)[0], SamplingParams(max_tokens=2))


def test_seeded_sampling_independent_of_batch(model_path):
    reqs = prompts(4, seed=11)
    params = dict(temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    engine = make_engine(model_path)
    alone = run_alone(engine, reqs[:1], **params)
    together = run_all(engine, reqs, **params)
    assert together[0] == alone[0]
    small = make_engine(model_path, kv_cache_blocks=PREEMPTING_POOL, enable_prefix_caching=False)
    assert run_all(small, reqs, **params)[0] == alone[0]  # and under preemption


def test_stop_token_ids_and_max_tokens(model_path, reference):
    reqs, alone = reference
    engine = make_engine(model_path)
    target = alone[0][3]
    out = run_all(engine, reqs[:1], stop_token_ids=[target])[0]
    assert out == alone[0][: alone[0].index(target) + 1]
    seq = engine.add_request(reqs[0], SamplingParams(max_tokens=3, **GREEDY))
    while engine.has_unfinished():
        engine.step()
    assert seq.finish_reason == "length" and seq.output_token_ids == alone[0][:3]


def test_logprobs_of_sampled_tokens(model_path):
    engine = make_engine(model_path)
    seq = engine.add_request(prompts(1)[0], SamplingParams(max_tokens=4, logprobs=3, **GREEDY))
    while engine.has_unfinished():
        engine.step()
    assert len(seq.logprobs) == 4
    for tok, lp in zip(seq.output_token_ids, seq.logprobs):
        assert tok in lp and lp[tok] == max(lp.values())  # greedy picks the top token


def test_error_in_one_request_fails_only_that_request(model_path, reference):
    reqs, alone = reference
    engine = make_engine(model_path, enable_prefix_caching=False)
    seqs = [engine.add_request(p, SamplingParams(max_tokens=12, **GREEDY)) for p in reqs[:3]]
    bad = seqs[1]
    real_run = engine.worker.runner.run

    def flaky_run(batch):
        if bad in batch.seqs and bad.num_output_tokens >= 2:
            raise RuntimeError("simulated kernel failure")
        return real_run(batch)

    engine.worker.runner.run = flaky_run
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert bad.finish_reason == "error" and "simulated kernel failure" in bad.error
    assert [d.finish_reason for d in deltas if d.request_id == bad.request_id][-1] == "error"
    assert [s.output_token_ids for s in (seqs[0], seqs[2])] == [alone[0], alone[2]]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_stop_string_is_not_emitted_and_stream_matches(model_path):
    engine = make_engine(model_path)
    prompt = "hello world"

    def run(params):
        seq = engine.add_request(prompt, params)
        pieces = []
        while engine.has_unfinished():
            pieces += [d.text for d in engine.step() if d.request_id == seq.request_id]
        return seq, "".join(pieces)

    _, full = run(SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    words = [w for w in full.split() if len(w) >= 2]
    assert len(full) > 10 and words, full
    stop = words[len(words) // 2]
    cut = full.index(stop)
    seq, text = run(SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop, "never-there"]))
    assert text == full[:cut]
    assert seq.finish_reason == "stop"


def test_prompt_logprobs_in_slices_equal_one_slice(model_path, monkeypatch):
    """Prompt-logprob logits are made a slice of rows at a time; slicing (and chunked prefill)
    gives the same tokens and, up to GEMM rounding, the same logprobs."""
    from app.engine.runtime import model_runner

    prompt = prompts(1, seed=12, lo=60, hi=60)[0]

    def run(**kw):
        engine = make_engine(model_path, enable_prefix_caching=False, **kw)
        seq = engine.add_request(prompt, SamplingParams(max_tokens=2, prompt_logprobs=2, **GREEDY))
        while engine.has_unfinished():
            engine.step()
        return seq.prompt_logprobs, seq.output_token_ids

    def same(a, b) -> bool:
        (lps_a, out_a), (lps_b, out_b) = a, b
        return out_a == out_b and len(lps_a) == len(lps_b) and all(
            x == y or (x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-5 for t in x)) for x, y in zip(lps_a, lps_b))

    whole = run()
    assert len(whole[0]) == len(prompt) and whole[0][0] is None
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROB_ROWS", 7)
    assert same(run(), whole)
    assert same(run(max_num_batched_tokens=16), whole)


def test_on_launched_is_called_once_per_model_run_before_its_outputs(model_path, reference):
    """`step(on_launched)` (the GPU's overlap): called once a step runs the model, after the forward
    is queued and before the step's tokens exist; the tokens are the same."""
    reqs, alone = reference
    engine = make_engine(model_path, enable_prefix_caching=False, max_num_batched_tokens=16)
    seqs = [engine.add_request(p, SamplingParams(max_tokens=12, **GREEDY)) for p in reqs[:3]]
    calls, steps = [], 0
    while engine.has_unfinished():
        before = [len(s.output_token_ids) for s in seqs]
        engine.step(on_launched=lambda before=before: calls.append(before == [len(s.output_token_ids) for s in seqs]))
        steps += 1
    assert len(calls) == steps and all(calls)
    assert [s.output_token_ids for s in seqs] == alone[:3]


def test_load_leaves_the_config_as_given_and_decides_in_its_plan(model_path):
    engine = make_engine(model_path, max_num_batched_tokens=None, max_model_len=64)
    assert (engine.config.max_num_batched_tokens, engine.config.long_prefill_token_threshold) == (None, None)
    plan = engine.plan
    assert (plan.max_num_batched_tokens, plan.long_prefill_token_threshold) == (512, 128)  # the CPU's defaults
    assert plan.max_model_len == 64 and plan.setup.device.type == "cpu"
    assert engine.scheduler.config.max_num_batched_tokens == 512
    with pytest.raises(AttributeError):
        plan.max_model_len = 128  # frozen: what load decided stays decided
