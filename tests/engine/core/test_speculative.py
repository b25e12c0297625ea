"""Speculative decoding: prompt lookup and a draft model give, greedy, the tokens of plain decoding
(batched, chunked, preempted, prefix-cached), rejection sampling keeps the target distribution,
rejected drafts give their blocks back, and bad configs are refused in one line."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from app.engine.core.llm_engine import LLMEngine
from app.engine.core.ngram_proposer import NgramProposer
from app.engine.core.sequence import Sequence
from app.engine.runtime.rejection_sampler import verify
from app.engine.types.errors import LocalbatchError
from app.engine.types.sampling_params import SamplingParams
from app.engine.types.speculative_config import SpeculativeConfig

GREEDY = dict(temperature=0.0, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def make_engine(path, **kw) -> LLMEngine:
    settings = dict(device="cpu", dtype="float32", block_size=4, kv_cache_blocks=2048, max_num_batched_tokens=512)
    settings.update(kw)
    return LLMEngine(str(path), **settings)


def force_drafts(engine: LLMEngine, k: int = 4) -> None:
    """Every decode drafts k tokens (within its room), whatever its acceptance and the batch: the
    verify path on every step, not only where the cost model finds it pays."""
    spec = engine.speculator

    def lookahead(seq: Sequence, num_decodes: int) -> int:
        return max(0, min(k, seq.max_tokens - seq.num_output_tokens - 1, spec.max_model_len - seq.num_tokens))

    engine.scheduler.lookahead = lookahead


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat themselves, so prompt lookup finds continuations."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(4, 250) for _ in range(rng.randint(2, 6))]
        out.append((motif * 12)[: rng.randint(8, 44)] + [rng.randrange(4, 250) for _ in range(rng.randint(0, 4))])
    return out


def run_all(engine: LLMEngine, reqs: list[list[int]], max_tokens: int = 24, **params) -> list[list[int]]:
    seqs = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, **{**GREEDY, **params})) for p in reqs]
    while engine.has_unfinished():
        engine.step()
        for s in seqs:  # a running sequence never holds blocks past its verify positions
            if s.block_tables and not s.is_finished:
                assert len(s.block_tables[0]) <= engine.block_manager.blocks_needed(s.num_tokens)
    return [s.output_token_ids for s in seqs]


@pytest.fixture(scope="module")
def gemma(tiny_gguf_factory):
    return tiny_gguf_factory("gemma3")  # sliding-window groups: rollback frees blocks in every group


@pytest.fixture(scope="module")
def qwen(tiny_gguf_factory):
    return tiny_gguf_factory("qwen2", num_layers=3)


@pytest.fixture(scope="module")
def qwen_draft(tiny_gguf_factory):
    return tiny_gguf_factory("qwen2", num_layers=1, seed=7)  # same tokenizer, other weights


@pytest.fixture(scope="module")
def reference(gemma):
    reqs = prompts(8)
    engine = make_engine(gemma, enable_prefix_caching=False)
    return reqs, [run_all(engine, [p])[0] for p in reqs]


# ---- greedy is exact --------------------------------------------------------------------------
def test_ngram_alone_equals_plain(gemma, reference):
    """One request at a time, drafting as far as the cost model lets it."""
    reqs, alone = reference
    engine = make_engine(gemma, enable_prefix_caching=False, speculative_config=NGRAM)
    assert [run_all(engine, [p])[0] for p in reqs] == alone
    assert engine.speculator.num_draft_tokens > 0 and engine.speculator.num_accepted_tokens > 0
    assert engine.block_manager.num_used_blocks == 0


def test_ngram_batched_equals_plain(gemma, reference):
    reqs, alone = reference
    engine = make_engine(gemma, enable_prefix_caching=False, speculative_config=NGRAM)
    force_drafts(engine)
    assert run_all(engine, reqs) == alone
    assert engine.speculator.num_draft_tokens > 0 and engine.speculator.num_accepted_tokens > 0
    assert engine.block_manager.num_used_blocks == 0


def test_ngram_chunked_preempted_and_cached_equal_plain(gemma, reference):
    reqs, alone = reference
    engine = make_engine(gemma, kv_cache_blocks=100, max_num_batched_tokens=16, speculative_config=NGRAM)
    force_drafts(engine)
    assert run_all(engine, reqs) == alone
    assert engine.scheduler.num_preemptions > 0
    assert run_all(engine, reqs) == alone  # again: prompts and replies now come from the prefix cache
    assert engine.block_manager.hit_rate > 0
    assert engine.block_manager.num_used_blocks == 0


def test_ngram_json_string_config_and_stop_inside_drafts(gemma, reference):
    reqs, alone = reference
    engine = make_engine(gemma, speculative_config='{"method": "ngram", "prompt_lookup_min": 1}')
    force_drafts(engine)
    # A stop token among kept drafts ends the reply there, as without speculation.
    stop = alone[0][5]
    out = run_all(engine, [reqs[0]], stop_token_ids=[stop])[0]
    assert out == alone[0][: alone[0].index(stop) + 1]
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("draft", ["self", "other", "lookup-first"])
def test_draft_model_batched_equals_plain(qwen, qwen_draft, draft):
    reqs = prompts(6, seed=1)
    alone = [run_all(make_engine(qwen), [p])[0] for p in reqs]
    config = {"model": str(qwen if draft == "self" else qwen_draft), "num_speculative_tokens": 3}
    if draft == "lookup-first":  # prompt lookup where it finds a match, the draft model elsewhere
        config.update(prompt_lookup=True, prompt_lookup_min=1)
    engine = make_engine(qwen, speculative_config=config)
    force_drafts(engine, 3)
    assert run_all(engine, reqs) == alone
    spec = engine.speculator
    assert spec.num_draft_tokens > 0
    if draft == "self":  # the target drafting for itself: every draft is kept
        assert spec.num_accepted_tokens == spec.num_draft_tokens
    assert engine.stats().speculative.method == ("ngram+draft" if draft == "lookup-first" else "draft")


def test_draft_model_preempted_equals_plain(qwen, qwen_draft):
    reqs = prompts(8, seed=2)
    alone = [run_all(make_engine(qwen), [p])[0] for p in reqs]
    engine = make_engine(qwen, kv_cache_blocks=36, max_num_batched_tokens=16,
                         speculative_config={"model": str(qwen_draft), "num_speculative_tokens": 3})
    force_drafts(engine, 3)
    assert run_all(engine, reqs) == alone
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_used_blocks == 0


def test_requests_that_cannot_speculate_decode_normally_beside_those_that_do(gemma, reference):
    reqs, alone = reference
    engine = make_engine(gemma, enable_prefix_caching=False, speculative_config=NGRAM)
    seqs = [engine.add_request(p, SamplingParams(max_tokens=24, **GREEDY, repetition_penalty=1.0 + 0.5 * (i % 2)))
            for i, p in enumerate(reqs)]
    assert not any(engine.speculator.lookahead(s, 1) for s in seqs[1::2])  # penalties depend on each token
    force_drafts(engine)
    engine.scheduler.lookahead = lambda seq, n, f=engine.scheduler.lookahead: 0 if seq.params.repetition_penalty != 1 else f(seq, n)
    while engine.has_unfinished():
        engine.step()
    assert [s.output_token_ids for s in seqs][::2] == alone[::2]


def test_logprobs_of_verified_tokens_equal_plain_decoding(gemma, reference):
    reqs, _ = reference
    params = SamplingParams(max_tokens=24, **GREEDY, logprobs=3)
    plain = make_engine(gemma)
    want = []
    for p in reqs[:4]:
        seq = plain.add_request(p, params)
        while plain.has_unfinished():
            plain.step()
        want.append((seq.output_token_ids, seq.logprobs))
    engine = make_engine(gemma, speculative_config=NGRAM)
    force_drafts(engine)
    seqs = [engine.add_request(p, params) for p in reqs[:4]]
    while engine.has_unfinished():
        engine.step()
    assert engine.speculator.num_accepted_tokens > 0
    for seq, (tokens, logprobs) in zip(seqs, want):
        assert seq.output_token_ids == tokens and len(seq.logprobs) == len(tokens)
        for got, ref in zip(seq.logprobs, logprobs):
            assert got.keys() == ref.keys()
            assert got == ref  # bit for bit: a row computes alike in a verify chunk and a decode


def test_logit_bias_applies_to_verified_rows(gemma, reference):
    reqs, _ = reference
    bias = {7: 100.0, 9: 5.0}
    plain = run_all(make_engine(gemma), reqs[:3], logit_bias=bias)
    engine = make_engine(gemma, speculative_config=NGRAM)
    force_drafts(engine)
    assert run_all(engine, reqs[:3], logit_bias=bias) == plain
    assert engine.speculator.num_draft_tokens > 0


def test_big_batches_turn_speculation_off(gemma):
    engine = make_engine(gemma, speculative_config={**NGRAM, "disable_by_batch_size": 2})
    assert engine.speculator.lookahead(Sequence("x", [5] * 9, SamplingParams(), 8), 3) == 0


def test_cost_model_stops_drafting_for_a_sequence_whose_drafts_miss(gemma):
    engine = make_engine(gemma, speculative_config=NGRAM)
    spec = engine.speculator
    seq = Sequence("x", [5] * 9, SamplingParams(max_tokens=100), 100)
    seq.token_ids.append(6)
    assert spec.lookahead(seq, 1) > 0
    for _ in range(6):
        spec.on_verified(seq, 2, 0)
    assert spec.lookahead(seq, 1) == 0
    for _ in range(6):
        spec.on_verified(seq, 4, 4)
    assert spec.lookahead(seq, 1) == 4


# ---- sampling keeps the target distribution ------------------------------------------------------
def _chi2_bound(df: int) -> float:
    return df + 6 * math.sqrt(2 * df)  # far in the tail: fails only on a real difference


def test_rejection_sampler_emits_the_target_distribution():
    torch.manual_seed(0)
    vocab, trials = 6, 6000
    logits = torch.randn(3, vocab) * 1.5
    p = torch.softmax(logits, -1)
    draft = [int(p[0].argmin()), int(p[1].argmax())]  # an unlikely draft, then a likely one
    seq = Sequence("s", [1, 2], SamplingParams(temperature=1.0), 10)
    first, second = Counter(), Counter()
    for _ in range(trials):
        out = verify(logits.clone(), [seq], [draft])[0]
        first[out[0]] += 1
        if len(out) > 1:  # the first draft was kept: the next token follows row 1
            second[out[1]] += 1
    for counts, probs in ((first, p[0]), (second, p[1])):
        n = sum(counts.values())
        chi2 = sum((counts[t] - n * float(probs[t])) ** 2 / (n * float(probs[t])) for t in range(vocab))
        assert chi2 < _chi2_bound(vocab - 1), (counts, probs)


def test_sampled_tokens_match_plain_decoding_in_distribution(qwen):
    """Two tokens after the first, temperature 1: the same frequencies with drafts on every step
    (the target drafting for itself: greedy drafts a sampled row mostly rejects) as without."""
    prompt = prompts(1, seed=3)[0]
    n = 300

    def pairs(spec: bool) -> Counter:
        engine = make_engine(qwen, max_num_seqs=n, max_waiting=n, speculative_config={"model": str(qwen)} if spec else None)
        if spec:
            force_drafts(engine, 2)
        seqs = [engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True, seed=i))
                for i in range(n)]
        while engine.has_unfinished():
            engine.step()
        if spec:
            assert engine.speculator.num_draft_tokens > 0
        return Counter(tuple(s.output_token_ids[1:]) for s in seqs)

    plain, spec = pairs(False), pairs(True)
    # Two-sample chi-square over the outcomes seen at least 5 times in all, the rest pooled.
    keys = [k for k in plain.keys() | spec.keys() if plain[k] + spec[k] >= 5]
    rest = (n - sum(plain[k] for k in keys), n - sum(spec[k] for k in keys))
    cells = [(plain[k], spec[k]) for k in keys] + ([rest] if sum(rest) else [])
    chi2 = sum((a - b) ** 2 / (a + b) for a, b in cells)
    assert chi2 < _chi2_bound(len(cells) - 1), cells


# ---- config and refusals --------------------------------------------------------------------------
@pytest.mark.parametrize("value, message", [
    ("{nope", "not valid JSON"),
    ('["ngram"]', "must be a JSON object"),
    ({"method": "medusa"}, "unknown speculative method"),
    ({"method": "ngram", "k": 3}, "unknown speculative config key"),
    ({"num_speculative_tokens": 0}, "must be a positive integer"),
    ({"num_speculative_tokens": 64}, "too many"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "exceeds prompt_lookup_max"),
    ({"method": "draft_model"}, "needs \"model\""),
    ({"method": "ngram", "model": "x"}, "takes no \"model\""),
    ({"model": "x", "prompt_lookup": "yes"}, "must be true or false"),
])
def test_bad_configs_are_refused_in_one_line(value, message):
    with pytest.raises(LocalbatchError, match=message) as e:
        SpeculativeConfig.parse(value)
    assert "\n" not in str(e.value)


def test_draft_model_with_another_vocabulary_is_refused(qwen, tiny_gguf_factory):
    other = tiny_gguf_factory("qwen2", num_layers=1, vocab_size=400)
    with pytest.raises(LocalbatchError, match="vocabulary of 400 tokens") as e:
        make_engine(qwen, speculative_config={"model": str(other)})
    assert "\n" not in str(e.value)


def test_draft_model_for_a_sliding_window_target_is_refused(gemma, qwen):
    with pytest.raises(LocalbatchError, match="sliding-window"):
        make_engine(gemma, speculative_config={"model": str(qwen)})


def test_ngram_proposer_finds_the_longest_most_recent_match():
    proposer = NgramProposer(1, 3)
    seq = Sequence("x", [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3], SamplingParams(), 10)
    assert proposer.propose(seq, 2) == [7, 8]  # "2 3" last continued with 7 8 ("1 2 3" too, earlier: 9)
    seq.token_ids.extend([7, 8])
    assert proposer.propose(seq, 3) == [5, 2, 3]  # "3 7 8" -> 5 2 3: the index grew with the tokens
    assert proposer.propose(Sequence("y", [4, 5, 6], SamplingParams(), 10), 3) == []
