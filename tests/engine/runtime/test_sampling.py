"""The batched sampler on hand-made logits (no model): greedy, the sampled distribution, top-k /
top-p / min-p, penalties, per-request seeds, logprobs; and SamplingParams validation."""

from __future__ import annotations

import math

import pytest
import torch

from app.engine.core.sequence import Sequence
from app.engine.runtime.sampler import (
    Sampler,
    apply_logit_bias,
    apply_penalties,
    sampling_probs,
    top_logprobs,
)
from app.engine.types.errors import RequestError
from app.engine.types.sampling_params import SamplingParams

V = 50
# Distinct, well-spread logits: no two candidates tie and no prefix mass sits near a tested top_p.
LOGITS = torch.linspace(2.5, -2.5, V)[torch.randperm(V, generator=torch.Generator().manual_seed(0))]


def seq(prompt=(1, 2, 3), output=(), rid: str = "r", **params) -> Sequence:
    s = Sequence(rid, list(prompt), SamplingParams(**params), 100)
    for t in output:
        s.append_token(t)
    return s


def kept(probs_row: torch.Tensor) -> set[int]:
    return set(probs_row.nonzero().flatten().tolist())


def ranked(logits: torch.Tensor) -> list[int]:
    return logits.argsort(descending=True).tolist()


def seeded_draws(logits: torch.Tensor, n: int, **params) -> list[int]:
    """n draws from one distribution: n rows of one batch, seeds 0..n-1 (deterministic)."""
    seqs = [seq(seed=i, **params) for i in range(n)]
    tokens, _ = Sampler(V)(logits.expand(n, -1), seqs)
    return tokens


def chi_square(counts: list[int], probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom, pooling the bins expected under 5 counts."""
    n = sum(counts)
    stat, dof, pool_obs, pool_exp = 0.0, -1, 0, 0.0
    for obs, p in zip(counts, probs.tolist()):
        if n * p < 5:
            pool_obs, pool_exp = pool_obs + obs, pool_exp + n * p
            continue
        stat, dof = stat + (obs - n * p) ** 2 / (n * p), dof + 1
    if pool_exp > 0:
        stat, dof = stat + (pool_obs - pool_exp) ** 2 / pool_exp, dof + 1
    return stat, dof


# --- greedy and the sampled distribution ---


def test_greedy_is_argmax():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1))
    tokens, logprobs = Sampler(V)(logits, [seq(temperature=0.0, seed=s) for s in (None, 1, 2, None)])
    assert tokens == logits.argmax(-1).tolist()
    assert logprobs == [None] * 4


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-6])
def test_near_zero_temperature_is_greedy(temperature):
    # Dividing by such a temperature overflows to inf (NaN probabilities); vLLM treats it as greedy.
    logits = LOGITS.expand(3, -1).clone()
    logits[1] = -logits[1]
    tokens, _ = Sampler(V)(logits, [seq(temperature=temperature, seed=i) for i in range(3)])
    assert tokens == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
def test_sampling_follows_softmax(temperature):
    n = 4000
    tokens = seeded_draws(LOGITS, n, temperature=temperature)
    counts = torch.bincount(torch.tensor(tokens), minlength=V).tolist()
    stat, dof = chi_square(counts, torch.softmax(LOGITS.double() / temperature, -1))
    # Mean dof, sd sqrt(2 dof): 5 sd above the mean is a clear miss, not noise.
    assert stat < dof + 5 * math.sqrt(2 * dof), (stat, dof)


def test_unseeded_sampling_follows_softmax():
    n = 4000
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        tokens, _ = Sampler(V)(LOGITS.expand(n, -1), [seq(temperature=1.0) for _ in range(n)])
    counts = torch.bincount(torch.tensor(tokens), minlength=V).tolist()
    stat, dof = chi_square(counts, torch.softmax(LOGITS.double(), -1))
    assert stat < dof + 5 * math.sqrt(2 * dof), (stat, dof)


def test_unseeded_rows_draw_valid_tokens():
    logits = LOGITS.expand(64, -1)
    tokens, _ = Sampler(V)(logits, [seq(temperature=1.2, top_k=5) for _ in range(64)])
    assert set(tokens) <= set(ranked(LOGITS)[:5])
    assert len(set(tokens)) > 1


def test_temperature_scales_logits():
    for t in (0.5, 1.0, 2.0):
        probs = sampling_probs(LOGITS.unsqueeze(0), [seq(temperature=t)])[0]
        torch.testing.assert_close(probs, torch.softmax(LOGITS / t, -1))


def test_empty_batch():
    assert Sampler(V)(torch.empty(0, V), []) == ([], [])


# --- top-k / top-p / min-p ---


@pytest.mark.parametrize("k", [1, 2, 7, V - 1, V, V + 10])
def test_top_k_keeps_exactly_k(k):
    probs = sampling_probs(LOGITS.unsqueeze(0), [seq(top_k=k)])[0]
    top = ranked(LOGITS)[: min(k, V)]
    assert kept(probs) == set(top)
    torch.testing.assert_close(probs[top], torch.softmax(LOGITS[top], -1))


@pytest.mark.parametrize("k", [0, -1])
def test_top_k_disabled(k):
    probs = sampling_probs(LOGITS.unsqueeze(0), [seq(top_k=k)])[0]
    assert kept(probs) == set(range(V))


def smallest_prefix(probs: torch.Tensor, p: float) -> set[int]:
    order = probs.double().argsort(descending=True).tolist()
    mass = 0.0
    for i, t in enumerate(order):
        mass += probs[t].item()
        if mass >= p:
            return set(order[: i + 1])
    return set(order)


@pytest.mark.parametrize("p", [1e-6, 0.05, 0.3, 0.5, 0.9, 0.99])
def test_top_p_keeps_smallest_prefix_reaching_p(p):
    probs = sampling_probs(LOGITS.unsqueeze(0), [seq(top_p=p)])[0]
    expected = smallest_prefix(torch.softmax(LOGITS.double(), -1), p)
    assert kept(probs) == expected
    assert ranked(LOGITS)[0] in expected  # the top token always stays


def test_top_p_one_keeps_every_token_next_to_other_rows():
    # The top token holds all of fp32's mass; the tail (e^-30 each) must survive top_p=1 even when
    # another row of the batch runs the top-p pass.
    peaked = torch.zeros(V)
    peaked[3] = 30.0
    logits = torch.stack([peaked, LOGITS])
    probs = sampling_probs(logits, [seq(top_p=1.0), seq(top_p=0.5)])
    assert kept(probs[0]) == set(range(V))


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 0.9, 1.0])
def test_min_p_is_relative_to_the_top_probability(min_p):
    probs = sampling_probs(LOGITS.unsqueeze(0), [seq(min_p=min_p)])[0]
    full = torch.softmax(LOGITS, -1)
    assert kept(probs) == {t for t in range(V) if full[t] >= min_p * full.max()}


def test_filters_combine_in_order():
    k, p, min_p, t = 12, 0.8, 0.5, 0.9
    probs = sampling_probs(LOGITS.unsqueeze(0), [seq(temperature=t, top_k=k, top_p=p, min_p=min_p)])[0]
    # Expected: temperature, then top-k, top-p over the renormalised top-k, then min-p.
    top = ranked(LOGITS)[:k]
    renorm = torch.zeros(V, dtype=torch.double)
    renorm[top] = torch.softmax(LOGITS[top].double() / t, -1)
    prefix = smallest_prefix(renorm, p)
    expected = {i for i in prefix if renorm[i] >= min_p * renorm.max()}
    assert kept(probs) == expected
    assert 1 < len(expected) < len(prefix) < k  # every filter did something


def test_sampled_tokens_stay_in_the_kept_set():
    cases = [{"top_k": 4}, {"top_p": 0.4}, {"min_p": 0.5}, {"top_k": 6, "top_p": 0.6, "min_p": 0.3}]
    for params in cases:
        allowed = kept(sampling_probs(LOGITS.unsqueeze(0), [seq(temperature=1.5, **params)])[0])
        tokens = set(seeded_draws(LOGITS, 500, temperature=1.5, **params))
        assert tokens == allowed, params  # all reachable ones show up in 500 draws, nothing else


def test_rows_with_different_settings_do_not_affect_each_other():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(2)) * 2
    params = [
        {"temperature": 0.0},
        {"temperature": 0.8, "top_k": 3, "seed": 11},
        {"temperature": 1.3, "top_p": 0.7, "seed": 12},
        {"temperature": 1.0, "min_p": 0.2, "repetition_penalty": 1.3, "seed": 13},
        {"temperature": 1.0, "seed": 14},
    ]
    seqs = [seq(prompt=(i, i + 1), output=(i + 2,), rid=str(i), **p) for i, p in enumerate(params)]
    batch_probs = sampling_probs(apply_penalties(logits, seqs), seqs)
    batch_tokens, _ = Sampler(V)(logits, seqs)
    for i, s in enumerate(seqs):
        alone = sampling_probs(apply_penalties(logits[i : i + 1], [s]), [s])[0]
        torch.testing.assert_close(batch_probs[i], alone, rtol=0, atol=1e-7)
        assert Sampler(V)(logits[i : i + 1], [s])[0] == [batch_tokens[i]]


# --- penalties (vLLM semantics) ---


def test_repetition_penalty_covers_prompt_and_output():
    logits = torch.zeros(1, V)
    logits[0, [1, 6, 4, 9, 20]] = torch.tensor([2.0, -1.0, 3.0, -2.0, 5.0])
    s = seq(prompt=(1, 6, 1, 1), output=(4, 9, 4), repetition_penalty=2.0)
    out = apply_penalties(logits, [s])[0]
    assert out[1].item() == 1.0  # positive, in the prompt (three times, penalised once): divided
    assert out[6].item() == -2.0  # negative, in the prompt: multiplied
    assert out[4].item() == 1.5 and out[9].item() == -4.0  # the same for output tokens
    assert out[20].item() == 5.0 and out[0].item() == 0.0  # unseen tokens untouched
    assert logits[0, 1].item() == 2.0  # the input is not modified


def test_repetition_penalty_below_one_favours_seen_tokens():
    logits = torch.zeros(1, V)
    logits[0, [5, 7]] = torch.tensor([1.0, -1.0])
    out = apply_penalties(logits, [seq(prompt=(5, 7), repetition_penalty=0.5)])[0]
    assert out[5].item() == 2.0 and out[7].item() == -0.5


def test_presence_and_frequency_penalties_cover_output_only():
    logits = torch.zeros(1, V)
    s = seq(prompt=(1, 2, 2), output=(4, 4, 4, 8), presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [s])[0]
    assert out[4].item() == pytest.approx(-0.5 - 3 * 0.25)
    assert out[8].item() == pytest.approx(-0.5 - 0.25)
    assert out[1].item() == 0.0 and out[2].item() == 0.0  # prompt tokens are not penalised
    negative = apply_penalties(logits, [seq(output=(4, 4), presence_penalty=-1.0, frequency_penalty=-0.5)])[0]
    assert negative[4].item() == pytest.approx(2.0)  # negative penalties encourage repeats


def test_penalties_combine_and_change_the_greedy_choice():
    logits = torch.zeros(1, V)
    logits[0, [4, 9]] = torch.tensor([3.0, 2.5])
    s = seq(prompt=(1,), output=(4, 4), temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.5)
    assert apply_penalties(logits, [s])[0, 4].item() == pytest.approx(3.0 / 1.2 - 2 * 0.5)
    assert Sampler(V)(logits, [s])[0] == [9]
    assert Sampler(V)(logits, [seq(output=(4, 4), temperature=0.0)])[0] == [4]


def test_penalties_only_touch_their_own_row():
    logits = torch.ones(2, V)
    seqs = [seq(prompt=(3,), output=(5,), repetition_penalty=2.0, presence_penalty=1.0), seq(prompt=(3,), output=(5,))]
    out = apply_penalties(logits, seqs)
    assert torch.equal(out[1], logits[1])
    assert apply_penalties(logits, [seqs[1]]) is logits  # no penalty: no copy


def test_extreme_settings_still_give_valid_tokens():
    logits = LOGITS.expand(4, -1)
    seen = (ranked(LOGITS)[5], ranked(LOGITS)[30])
    seqs = [
        seq(prompt=seen, repetition_penalty=5e-324, temperature=1.0, seed=1),  # divides by 0 in fp32: inf
        seq(prompt=tuple(range(V)), repetition_penalty=1e300, temperature=1.0, seed=2),  # every logit +-inf or 0
        seq(temperature=1e-4, seed=3),
        seq(temperature=1e6, seed=4),  # infinite temperature is rejected by SamplingParams
    ]
    tokens, _ = Sampler(V)(logits, seqs)
    assert all(0 <= t < V for t in tokens)
    assert tokens[0] == seen[0]  # the positive seen logit became +inf
    assert tokens[2] == ranked(LOGITS)[0]


# --- seeds ---


def test_same_seed_and_position_give_the_same_token_in_any_batch():
    logits = torch.zeros(1, V)  # uniform: any batch effect would show in the tokens

    def batch(order: list[int], extra: int) -> dict[str, int]:
        pairs = [(1, 0), (2, 0), (1, 3), (99, 5)]  # (seed, output position)
        rows = [seq(output=(7,) * pos, rid=f"s{seed}p{pos}", seed=seed) for seed, pos in pairs]
        rows = [rows[i] for i in order] + [seq(rid=f"x{i}", temperature=0.5, top_k=3) for i in range(extra)]
        tokens, _ = Sampler(V)(logits.expand(len(rows), -1), rows)
        return {s.request_id: t for s, t in zip(rows, tokens) if s.request_id.startswith("s")}

    reference = batch([0, 1, 2, 3], 0)
    assert batch([3, 1, 0, 2], 0) == reference
    assert batch([2, 0], 5) == {k: reference[k] for k in ("s1p3", "s1p0")}
    assert batch([1, 3, 0, 2], 17) == reference


def test_seed_stream_depends_on_position_and_seed():
    logits = torch.zeros(1, V)
    sampler = Sampler(V)

    def stream(seed: int) -> list[int]:
        return [sampler(logits, [seq(output=(5,) * pos, seed=seed)])[0][0] for pos in range(12)]

    a = stream(123)
    assert stream(123) == a  # reproducible (and a recomputed / preempted request gets the same)
    assert len(set(a)) > 3  # positions draw fresh noise
    assert stream(124) != a
    assert len({tuple(stream(s)) for s in range(8)}) == 8


@pytest.mark.parametrize("seed", [0, -1, 2**63 - 1, -(2**63), 2**80])
def test_any_integer_seed_is_usable(seed):
    tokens = [Sampler(V)(LOGITS.unsqueeze(0), [seq(seed=seed)])[0][0] for _ in range(2)]
    assert tokens[0] == tokens[1] and 0 <= tokens[0] < V


def test_unseeded_rows_do_not_disturb_seeded_ones():
    logits = torch.zeros(3, V)
    seeded = seq(seed=5)
    ref = Sampler(V)(logits[:1], [seeded])[0][0]
    for _ in range(5):
        tokens, _ = Sampler(V)(logits, [seq(), seeded, seq()])
        assert tokens[1] == ref


# --- logprobs ---


def test_logprobs_are_raw_log_softmax_and_include_the_sampled_token():
    logits = LOGITS.unsqueeze(0)
    best = ranked(LOGITS)[0]
    # The penalty pushes the raw favourite down so the sampled token is outside the raw top-2.
    s = seq(prompt=(best,), repetition_penalty=1e9, temperature=0.0, logprobs=2)
    tokens, lps = Sampler(V)(logits, [s])
    raw = torch.log_softmax(LOGITS, -1)
    assert tokens[0] == ranked(LOGITS)[1]
    assert set(lps[0]) == {best, ranked(LOGITS)[1]}  # in the top 2 already: no extra entry
    s3 = seq(prompt=tuple(ranked(LOGITS)[:3]), repetition_penalty=1e9, temperature=0.0, logprobs=2)
    tokens3, lps3 = Sampler(V)(logits, [s3])
    assert list(lps3[0]) == [*ranked(LOGITS)[:2], tokens3[0]]  # top-2 in order, then the sampled one
    for tok, lp in lps3[0].items():
        assert lp == pytest.approx(raw[tok].item(), abs=1e-6)


def test_logprobs_ignore_temperature_and_filters():
    n = 20
    params = {"temperature": 2.0, "top_k": 3, "min_p": 0.1, "presence_penalty": 1.0, "logprobs": 5}
    seqs = [seq(output=(1,), seed=i, **params) for i in range(n)]
    tokens, lps = Sampler(V)(LOGITS.expand(n, -1), seqs)
    raw = torch.log_softmax(LOGITS, -1)
    for tok, lp in zip(tokens, lps):
        assert tok in lp and len(lp) == 5
        assert all(v == pytest.approx(raw[t].item(), abs=1e-6) for t, v in lp.items())


def test_logprobs_zero_gives_only_the_sampled_token():
    seqs = [seq(temperature=1.0, seed=i, logprobs=0) for i in range(10)] + [seq(seed=1)]
    tokens, lps = Sampler(V)(LOGITS.expand(11, -1), seqs)
    raw = torch.log_softmax(LOGITS, -1)
    for tok, lp in zip(tokens[:10], lps[:10]):
        assert lp == {tok: pytest.approx(raw[tok].item(), abs=1e-6)}
    assert lps[10] is None


def test_logprobs_larger_than_the_vocab():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    tokens, lps = Sampler(3)(logits, [seq(prompt=(0,), temperature=0.0, logprobs=20)])
    assert tokens == [2] and list(lps[0]) == [2, 1, 0]


def test_top_logprobs_without_a_token():
    row = torch.log_softmax(LOGITS, -1)
    assert list(top_logprobs(row, 3, None)) == ranked(LOGITS)[:3]
    assert top_logprobs(row, 0, None) == {}


# --- logit_bias ---


def test_logit_bias_forces_and_bans_tokens_in_its_own_rows_only():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3))
    favourite = int(logits[1].argmax())
    seqs = [seq(temperature=0.0, logit_bias={7: 100.0}), seq(temperature=0.0, logit_bias={favourite: -100.0}),
            seq(temperature=0.0)]
    tokens, _ = Sampler(V)(logits, seqs)
    assert tokens[0] == 7
    assert tokens[1] != favourite and tokens[1] == int(logits[1].clone().index_fill_(0, torch.tensor([favourite]), -1e9).argmax())
    assert tokens[2] == int(logits[2].argmax())


def test_logit_bias_adds_to_a_copy_and_leaves_unbiased_rows_alone():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(4))
    seqs = [seq(logit_bias={3: 2.5, 9: -1.0}), seq()]
    out = apply_logit_bias(logits, seqs)
    expected = logits.clone()
    expected[0, 3] += 2.5
    expected[0, 9] -= 1.0
    assert torch.equal(out, expected) and out is not logits
    assert apply_logit_bias(logits, [seq(), seq()]) is logits


def test_logit_bias_forces_a_sampled_token_and_logprobs_stay_unbiased():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(5))
    tokens, logprobs = Sampler(V)(logits, [seq(temperature=0.8, seed=1, logit_bias={11: 100}, logprobs=0)])
    assert tokens == [11]
    assert logprobs[0][11] == pytest.approx(float(torch.log_softmax(logits[0], -1)[11]))


# --- SamplingParams ---


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1), ("temperature", math.nan), ("temperature", "1"), ("temperature", True),
        ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.2), ("top_p", math.nan),
        ("top_k", 1.5), ("top_k", True),
        ("min_p", -0.1), ("min_p", 1.1), ("min_p", math.nan),
        ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.nan),
        ("presence_penalty", 2.5), ("presence_penalty", -2.1),
        ("frequency_penalty", 3.0), ("frequency_penalty", math.nan),
        ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 1.5), ("max_tokens", True),
        ("n", 0), ("n", 2.0), ("n", True),
        ("seed", "x"), ("seed", 1.5), ("seed", False),
        ("logprobs", -1), ("logprobs", 21), ("logprobs", True),
        ("prompt_logprobs", 21), ("prompt_logprobs", -1),
        ("stop_token_ids", [-1]), ("stop_token_ids", [1, True]), ("stop_token_ids", [2.0]),
        ("logit_bias", {1: 100.5}), ("logit_bias", {1: -101}), ("logit_bias", {1: math.nan}), ("logit_bias", {-1: 1}),
        ("logit_bias", {"x": 1}), ("logit_bias", {1.5: 1}), ("logit_bias", [1]), ("logit_bias", {1: "2"}),
        ("json_schema", 5), ("json_schema", " "), ("json_object", "yes"), ("json_object", 1),
        ("regex", ""), ("regex", 3), ("grammar", ["root ::= x"]), ("structural_tag", 1.0),
    ],
)
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(RequestError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field and field in str(err.value)


def test_valid_edge_values_are_accepted():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=1, min_p=1.0, max_tokens=1, n=1, logprobs=20, prompt_logprobs=0)
    SamplingParams(max_tokens=None, seed=-5, presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=0.01)
    assert SamplingParams(top_k=-1).top_k == 0 and SamplingParams(top_k=None).top_k == 0


def test_logit_bias_keys_may_be_decimal_strings():
    assert SamplingParams(logit_bias={"50": 1.5, 7: -100, " 3": 0}).logit_bias == {50: 1.5, 7: -100, 3: 0}
    assert SamplingParams(logit_bias={}).logit_bias == {}


@pytest.mark.parametrize("first,second", [("json_schema", "regex"), ("json_object", "grammar"),
                                          ("regex", "structural_tag"), ("json_schema", "json_object")])
def test_at_most_one_constraint(first, second):
    values = {"json_schema": {"type": "object"}, "json_object": True, "regex": "a+", "grammar": 'root ::= "a"',
              "structural_tag": {"type": "structural_tag"}}
    with pytest.raises(RequestError) as err:
        SamplingParams(**{first: values[first], second: values[second]})
    assert err.value.param == second and first in str(err.value) and second in str(err.value)
    assert SamplingParams(**{first: values[first]}).constraint_field == first
    assert SamplingParams(json_object=False, regex="a").constraint_field == "regex"
    assert SamplingParams().constraint_field is None


def test_stop_normalisation():
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(stop=["a", "", "b"]).stop == ["a", "b"]
    assert SamplingParams(stop="").stop == [] and SamplingParams(stop=None).stop == []
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_greedy_flag():
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams(temperature=0.5).greedy


@pytest.mark.parametrize(
    "kwargs,param",
    [({"top_k": -5}, "top_k"), ({"temperature": float("inf")}, "temperature"), ({"stop": 5}, "stop"),
     ({"stop": ["a", 3]}, "stop"), ({"stop_token_ids": 5}, "stop_token_ids"), ({"top_k": "5"}, "top_k")],
)
def test_malformed_types_are_request_errors(kwargs, param):
    with pytest.raises(RequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


def test_shortlist_filter_equals_full_sort():
    """Top-k/top-p over the best-1024 shortlist give exactly the full-vocabulary sort's result,
    including rows whose top-p set needs the full sort and rows that filter nothing."""
    from app.engine.runtime.sampler import _top_k_top_p, _top_k_top_p_sorted

    vocab = 5000
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, vocab, generator=gen) * torch.tensor([[4.0], [1.0], [0.2], [3.0], [2.0], [1.0]])
    settings = [dict(top_p=0.9), dict(top_p=0.5, top_k=40), dict(top_p=0.95), dict(top_k=2000), dict(), dict(top_p=0.3)]
    seqs = [Sequence(f"r{i}", [1], SamplingParams(temperature=1.0, **kw), 10) for i, kw in enumerate(settings)]
    got = _top_k_top_p(logits, seqs)
    ks = torch.tensor([s.params.top_k if 0 < s.params.top_k < vocab else vocab for s in seqs])
    ps = torch.tensor([s.params.top_p if s.params.top_p < 1 else float("inf") for s in seqs])
    want = _top_k_top_p_sorted(logits, ks, ps)
    want[4] = logits[4]
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert torch.equal(got[torch.isfinite(got)], want[torch.isfinite(want)])
    # Without the flat row (which needs the full sort) the shortlist path is taken: same answer.
    sharp = [0, 1, 3, 4, 5]
    got2 = _top_k_top_p(logits[sharp], [seqs[i] for i in sharp])
    assert torch.equal(torch.isfinite(got2), torch.isfinite(want[sharp]))
