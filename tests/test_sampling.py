"""The batched sampler on hand-made logits: filters, penalties, seeds, logprobs; and parameter checks."""

from __future__ import annotations

import math

import pytest
import torch

from app.engine.errors import RequestError
from app.engine.sampling import Sampler
from app.engine.sampling_params import SamplingParams
from app.engine.sequence import Sequence

V = 50


def seq(rid: str = "r", prompt=(1, 2, 3), output=(), **params) -> Sequence:
    s = Sequence(rid, list(prompt), SamplingParams(**params), 100)
    s.token_ids += list(output)
    return s


def draws(logits: torch.Tensor, n: int, **params) -> list[int]:
    sampler = Sampler(V)
    out = []
    for i in range(n):
        tokens, _ = sampler(logits.unsqueeze(0), [seq(seed=i, **params)])
        out.append(tokens[0])
    return out


def test_greedy_is_argmax():
    logits = torch.randn(3, V)
    tokens, _ = Sampler(V)(logits, [seq(temperature=0.0) for _ in range(3)])
    assert tokens == logits.argmax(-1).tolist()


def test_temperature_sampling_follows_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0] + [-30.0] * (V - 3))
    got = draws(logits, 1500, temperature=1.0)
    probs = torch.softmax(logits, -1)[:3]
    for t in range(3):
        assert abs(got.count(t) / len(got) - probs[t].item()) < 0.04
    assert set(got) <= {0, 1, 2}


def test_top_k_top_p_min_p_restrict_candidates():
    logits = torch.linspace(3.0, -3.0, V)  # token 0 most likely, descending
    assert set(draws(logits, 300, temperature=5.0, top_k=3)) <= {0, 1, 2}
    probs = torch.softmax(logits / 5.0, -1)
    cum = probs.cumsum(0)
    smallest = int((cum < 0.5).sum()) + 1  # the smallest prefix reaching 0.5
    assert set(draws(logits, 300, temperature=5.0, top_p=0.5)) <= set(range(smallest))
    keep = {i for i in range(V) if probs[i] >= 0.9 * probs[0]}
    assert set(draws(logits, 300, temperature=5.0, min_p=0.9)) <= keep
    assert draws(logits, 20, temperature=5.0, top_p=1e-6) == [0] * 20  # the top token always stays


def test_rows_with_different_settings_do_not_interact():
    logits = torch.randn(2, V)
    sampler = Sampler(V)
    alone, _ = sampler(logits[1:], [seq(seed=7, temperature=0.8, top_k=5)])
    together, _ = sampler(logits, [seq(temperature=0.0), seq(seed=7, temperature=0.8, top_k=5)])
    assert together[1] == alone[0] and together[0] == logits[0].argmax().item()


def test_seed_is_reproducible_and_position_dependent():
    logits = torch.zeros(1, V)
    sampler = Sampler(V)
    a = [sampler(logits, [seq(seed=123, temperature=1.0, output=[5] * k)])[0][0] for k in range(10)]
    b = [sampler(logits, [seq(seed=123, temperature=1.0, output=[5] * k)])[0][0] for k in range(10)]
    c = [sampler(logits, [seq(seed=124, temperature=1.0, output=[5] * k)])[0][0] for k in range(10)]
    assert a == b and a != c and len(set(a)) > 1


def test_repetition_presence_frequency_penalties():
    logits = torch.zeros(1, V)
    logits[0, 1] = 2.0  # in the prompt
    logits[0, 4] = 2.0  # generated twice
    logits[0, 6] = -1.0  # in the prompt, negative
    s = seq(prompt=(1, 6), output=(4, 4), repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = Sampler(V)._apply_penalties(logits, [s])[0]
    assert out[1].item() == pytest.approx(1.0)  # 2 / 2
    assert out[6].item() == pytest.approx(-2.0)  # -1 * 2
    assert out[4].item() == pytest.approx(2.0 / 2.0 - 0.5 - 0.25 * 2)
    assert out[0].item() == 0.0 and logits[0, 1] == 2.0  # untouched, input not modified


def test_logprobs_from_raw_logits_include_sampled_token():
    logits = torch.randn(1, V)
    s = seq(temperature=0.0, logprobs=3, repetition_penalty=1.5, output=(logits.argmax().item(),))
    tokens, lps = Sampler(V)(logits, [s])
    raw = torch.log_softmax(logits[0], -1)
    assert tokens[0] in lps[0] and len(lps[0]) in (3, 4)
    for tok, lp in lps[0].items():
        assert lp == pytest.approx(raw[tok].item(), abs=1e-6)
    only, lps0 = Sampler(V)(logits, [seq(temperature=0.0, logprobs=0)])
    assert list(lps0[0]) == only


@pytest.mark.parametrize(
    "field,value",
    [("temperature", -0.1), ("temperature", math.nan), ("top_p", 0.0), ("top_p", 1.5), ("max_tokens", 0),
     ("n", 0), ("min_p", 2.0), ("max_tokens", True), ("logprobs", 50), ("seed", "x"), ("stop_token_ids", [-1])],
)
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(RequestError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field and field in str(err.value)


def test_stop_string_becomes_list():
    assert SamplingParams(stop="END").stop == ["END"]
